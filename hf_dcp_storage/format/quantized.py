"""Dequantization of the quantized weights HF checkpoints ship, vectorized, for any slice, and
FP8 block-wise quantization of a shard:

* **FP8 block-wise** (DeepSeek-V3/R1): a ``float8_e4m3fn`` weight ``[rows, cols]`` and its
  ``weight_scale_inv`` ``[ceil(rows / b), ceil(cols / b)]`` (``b``: ``weight_block_size``, 128);
  each element is ``float32(w) * scale_inv[i // b, j // b]``, then cast to the target dtype.
* **MXFP4** (gpt-oss): ``*_blocks`` ``[..., G, B]`` uint8, two FP4 (E2M1) values a byte, low
  nibble first, and ``*_scales`` ``[..., G]`` uint8, a power-of-two exponent biased by 127 (E8M0);
  group ``g`` dequantizes to ``2 * B`` values ``fp4 * 2 ** (scale - 127)``.

Both give the values PyTorch's ``QuantizedHuggingFaceStorageReader`` gives, bit for bit (the same
operations in the same dtypes), with a Python step per block row where it takes one per 128 x 128
block (FP8), and from a slice's own scale blocks (``fp8_scale_blocks``, ``mxfp4_groups``): a
rank reads and dequantizes only the blocks its slice touches. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "FP4_VALUES",
    "FP8_AMAX_FLOOR",
    "FP8_MAX",
    "fp8_block_amax",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "fp8_block_quantize_with",
    "fp8_scale_blocks",
    "fp8_scale_inv",
    "mxfp4_dequantize",
    "mxfp4_groups",
]

# E2M1: the 16 values of a nibble (sign bit 3).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


# float8_e4m3fn's largest value, and the least block amax quantization divides by (as DeepGEMM's
# and vLLM's block casts clamp it): an all-zero block gets a finite scale and stays zero.
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4

# Integer dtypes that view a float dtype's (or a pair's) bits, by size in bytes.
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def fp8_scale_blocks(
    offsets: Sequence[int], lengths: Sequence[int], block: int | Sequence[int]
) -> tuple[slice, slice]:
    """The rows and columns of ``weight_scale_inv`` that the weight slice at ``offsets`` of
    ``lengths`` (2-D) needs; ``block``: rows x columns a scale covers (one int: square)."""
    (r0, c0), (nr, nc) = offsets, lengths
    br, bc = _pair(block)
    return (
        slice(r0 // br, (r0 + max(nr, 1) - 1) // br + 1),
        slice(c0 // bc, (c0 + max(nc, 1) - 1) // bc + 1),
    )


def _pair(block: int | Sequence[int]) -> tuple[int, int]:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def _block_rows(r0: int, nr: int, br: int) -> Iterator[tuple[int, int, int]]:
    """``(i, a, b)`` for each block row a slice of ``nr`` rows from global row ``r0`` crosses:
    its index ``i`` among the slice's block rows and the slice's rows ``[a, b)`` in it."""
    starts = [0, *range(br - r0 % br, nr, br)]
    yield from ((i, a, b) for i, (a, b) in enumerate(zip(starts, [*starts[1:], nr], strict=True)))


@functools.cache
def _codes(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 codes of a float8 ``dtype``."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)


def fp8_block_dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    offsets: Sequence[int],
    *,
    block: int | Sequence[int] = 128,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slice ``weight`` (FP8, 2-D, its first element at ``offsets`` of the full weight)
    dequantized into ``dtype``; ``scale_inv``: the scale blocks it needs (``fp8_scale_blocks``),
    not the whole scale tensor; ``block``: rows x columns a scale covers. Written into ``out``
    where given (a CPU tensor of ``dtype`` and the slice's shape), else into a new tensor.

    Within a block every element is ``dtype(float32(code) * float32(scale))`` of its 8-bit code,
    so each block's 256 results are computed once (the reader's operations, hence its bits) and
    the elements looked up: one indexed copy per element (``index_select``), a Python step per
    block row. ~1 G elements/s on one thread, 4-5x converting every element to float32 as
    torch's reader does (whose float8 conversion alone is ~0.2 G/s here).

    Raises:
        ValueError: ``weight`` is not 2-D, or ``scale_inv`` does not cover it.
    """
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(
            f"FP8 block-wise weights and scales are 2-D; got {list(weight.shape)} and "
            f"{list(scale_inv.shape)}"
        )
    (br, bc), (r0, c0) = _pair(block), offsets
    nr, nc = weight.shape
    need = fp8_scale_blocks((0, c0 % bc), (r0 % br + nr, nc), (br, bc))
    if nr and nc and (need[0].stop > scale_inv.shape[0] or need[1].stop > scale_inv.shape[1]):
        raise ValueError(
            f"weight_scale_inv blocks {list(scale_inv.shape)} do not cover the weight slice "
            f"{list(weight.shape)} at {list(offsets)} in {br} x {bc} blocks"
        )
    direct = out is not None and out.is_contiguous() and out.dtype == dtype
    result = out if direct else torch.empty(nr, nc, dtype=dtype)
    assert result is not None
    if nr and nc:
        _fp8_lookup(weight, scale_inv, (r0 % br, c0 % bc), (br, bc), result)
    if out is not None and not direct:
        out.copy_(result)
        return out
    return result


def _fp8_lookup(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    skip: tuple[int, int],
    block: tuple[int, int],
    result: torch.Tensor,
) -> None:
    (br, bc), (nr, nc) = block, weight.shape
    codes = _codes(weight.dtype)
    as_int = _INT_OF_SIZE[result.element_size()]
    res = result.view(as_int)
    stored = weight.contiguous().view(torch.uint8)
    # Each column's offset into the block row's tables: 256 entries per block column.
    first = torch.div(torch.arange(skip[1], skip[1] + nc), bc, rounding_mode="floor")
    column_base = (first * 256).to(torch.int32)
    index = torch.empty(min(br, nr), nc, dtype=torch.int32)
    for i, a, b in _block_rows(skip[0], nr, br):
        # The reader's math for all 256 codes of each block of the row: float32 times the
        # scale (promoted to float32 where narrower), cast to the dtype.
        scales = scale_inv[i, : int(first[-1]) + 1, None].to(torch.float32)
        tables = (scales * codes).to(result.dtype).view(as_int).reshape(-1)
        torch.add(stored[a:b], column_base, out=index[: b - a])
        torch.index_select(tables, 0, index[: b - a].view(-1), out=res[a:b].view(-1))


def mxfp4_groups(start: int, length: int, per_group: int) -> tuple[slice, int]:
    """The groups of an MXFP4 tensor that dequantized elements ``[start, start + length)`` of
    its last dimension lie in (``per_group``: ``2 * B`` values a group), and where ``start``
    falls in the first of them."""
    first = start // per_group
    last = (start + max(length, 1) - 1) // per_group + 1
    return slice(first, last), start - first * per_group


def mxfp4_dequantize(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``blocks`` ``[..., G, B]`` (uint8) with their ``scales`` ``[..., G]`` (uint8, E8M0)
    dequantized into ``[..., G * 2 * B]`` of ``dtype``: into ``out`` where given (a contiguous
    CPU tensor of ``dtype`` and that shape), else into a new tensor.

    Raises:
        ValueError: the scales' shape is not the blocks' less their last dimension.
    """
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 scales {list(scales.shape)} do not match blocks {list(blocks.shape)} (one "
            "scale a group)"
        )
    *prefix, groups, width = blocks.shape
    # One lookup per byte: (scale, byte) -> its two values, both already scaled; the table's
    # 65,536 pairs come from the reader's own operations (the E2M1 values in ``dtype``, then
    # ``ldexp`` into ``dtype``), so each element has the reader's bits.
    table = _mxfp4_table(dtype)
    index = torch.mul(scales.to(torch.int32), 256).unsqueeze(-1).add(blocks)  # [..., G, B]
    shape = (*prefix, groups * 2 * width)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out is {list(out.shape)} {out.dtype}; MXFP4 blocks {list(blocks.shape)} need a "
            f"contiguous {list(shape)} of {dtype}"
        )
    pairs = out.view(_INT_OF_SIZE[2 * out.element_size()]).view(-1)
    torch.index_select(table, 0, index.view(-1), out=pairs)
    return out


@functools.cache
def _mxfp4_table(dtype: torch.dtype) -> torch.Tensor:
    """``[scale * 256 + byte] -> (low value, high value)`` in ``dtype``, as one integer each."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    byte = torch.arange(256)
    pairs = torch.stack([lut[byte & 0x0F], lut[byte >> 4]], dim=-1)  # [256, 2]
    exponents = torch.arange(256, dtype=torch.int32).sub(127).view(256, 1, 1)
    table = torch.empty(256, 256, 2, dtype=dtype)
    torch.ldexp(pairs.expand(256, 256, 2), exponents, out=table)
    pair_int = _INT_OF_SIZE[2 * table.element_size()]
    return table.view(pair_int).reshape(-1)


def fp8_block_amax(
    chunk: torch.Tensor, offsets: Sequence[int], block: int | Sequence[int] = 128
) -> torch.Tensor:
    """The largest ``|x|`` (float32) of each block the 2-D ``chunk`` at ``offsets`` touches
    (``fp8_scale_blocks``' rows and columns): over the chunk's own elements only, so partial
    for a block the chunk cuts; the max of the parts is the block's. A block row at a time."""
    (br, bc), (r0, c0), (nr, nc) = _pair(block), offsets, chunk.shape
    rows, cols = fp8_scale_blocks(offsets, chunk.shape, (br, bc))
    amax = torch.zeros(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.float32)
    if not nr or not nc:
        return amax
    skip = c0 % bc
    padded = torch.zeros(min(br, nr), amax.shape[1] * bc, dtype=torch.float32)
    for i, a, b in _block_rows(r0, nr, br):
        padded[: b - a, skip : skip + nc] = chunk[a:b].abs()
        amax[i] = padded[: b - a].view(b - a, -1, bc).amax(dim=(0, 2))
        padded[: b - a, skip : skip + nc] = 0
    return amax


def fp8_block_quantize_with(
    chunk: torch.Tensor,
    amax: torch.Tensor,
    offsets: Sequence[int],
    block: int | Sequence[int] = 128,
) -> torch.Tensor:
    """The 2-D ``chunk`` at ``offsets`` quantized to ``float8_e4m3fn`` with its blocks' ``amax``
    (those it touches, ``fp8_block_amax``'s shape, each the whole block's): ``x * (448 / amax)``
    in float32, then the cast; ``amax`` floored at ``FP8_AMAX_FLOOR`` (a zero block stays
    zero). Every element depends on its value and its block's amax alone, so ranks quantizing
    their shards with agreed amaxes give the bits of one process quantizing the whole tensor."""
    (br, bc), (r0, c0), (nr, nc) = _pair(block), offsets, chunk.shape
    factor = FP8_MAX / amax.clamp(min=FP8_AMAX_FLOOR)
    out = torch.empty(nr, nc, dtype=torch.float8_e4m3fn)
    skip = c0 % bc
    for i, a, b in _block_rows(r0, nr, br):
        row = factor[i].repeat_interleave(bc)[skip : skip + nc]
        out[a:b] = chunk[a:b].to(torch.float32) * row
    return out


def fp8_block_quantize(
    weight: torch.Tensor, block: int | Sequence[int] = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's block-wise FP8 quantization of a whole 2-D weight, as DeepSeek-V3's
    checkpoints hold it: ``(float8_e4m3fn weight, float32 weight_scale_inv)``, ``scale_inv`` of
    each block its ``max(amax, FP8_AMAX_FLOOR) / 448``, so that ``w * scale_inv`` is the weight
    again (``fp8_block_dequantize``)."""
    amax = fp8_block_amax(weight, (0, 0), block)
    return fp8_block_quantize_with(weight, amax, (0, 0), block), fp8_scale_inv(amax)


def fp8_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """The ``weight_scale_inv`` of blocks of ``amax``."""
    return amax.clamp(min=FP8_AMAX_FLOOR) / FP8_MAX
