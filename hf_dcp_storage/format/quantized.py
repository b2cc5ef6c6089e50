"""Dequantization of the quantized weights HF checkpoints ship, vectorized, for any slice:

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
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "FP4_VALUES",
    "fp8_block_dequantize",
    "fp8_scale_blocks",
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
    the elements looked up: one indexed copy per element (``np.take``, which releases the GIL),
    a Python step per block row. ~0.8 G elements/s on one thread, 4-5x converting every element
    to float32 as torch's reader does (whose float8 conversion alone is ~0.2 G/s here).

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
    codes = torch.arange(256, dtype=torch.uint8).view(weight.dtype).to(torch.float32)
    as_int = _INT_OF_SIZE[result.element_size()]
    res = result.view(as_int).numpy()
    stored = weight.contiguous().view(torch.uint8).numpy()
    # Each column's offset into the block row's tables: 256 entries per block column.
    blocks_across = scale_inv.shape[1]
    index_dtype = np.uint16 if blocks_across * 256 <= 1 << 16 else np.int64
    first = (skip[1] + np.arange(nc)) // bc
    column_base = (first * 256).astype(index_dtype)
    index = np.empty((min(br, nr), nc), dtype=index_dtype)
    starts = [0, *range(br - skip[0], nr, br)]  # each block row's first row in the slice
    for i, (a, b) in enumerate(zip(starts, [*starts[1:], nr], strict=True)):
        # The reader's math for all 256 codes of each block of the row: float32 times the
        # scale (promoted to float32 where narrower), cast to the dtype.
        tables = (scale_inv[i, : first[-1] + 1, None].to(torch.float32) * codes).to(result.dtype)
        np.add(stored[a:b], column_base, out=index[: b - a], dtype=index_dtype)
        flat = tables.view(as_int).numpy().reshape(-1)
        np.take(flat, index[: b - a], out=res[a:b], mode="clip")  # in range; "raise" buffers


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
    pair_int = _INT_OF_SIZE[2 * torch.empty((), dtype=dtype).element_size()]
    rows = np.multiply(scales.contiguous().numpy(), 256, dtype=np.uint16)  # a group's table
    index = np.add(blocks.contiguous().numpy(), rows[..., None], dtype=np.uint16)
    shape = (*prefix, groups * 2 * width)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out is {list(out.shape)} {out.dtype}; MXFP4 blocks {list(blocks.shape)} need a "
            f"contiguous {list(shape)} of {dtype}"
        )
    # mode="clip": every index is in range, and "raise" would buffer the whole output first.
    view = out.view(pair_int).view(*prefix, groups, width).numpy()
    np.take(table, index, out=view, mode="clip")
    return out


@functools.cache
def _mxfp4_table(dtype: torch.dtype) -> np.ndarray:
    """``[scale * 256 + byte] -> (low value, high value)`` in ``dtype``, as one integer each."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    byte = torch.arange(256)
    pairs = torch.stack([lut[byte & 0x0F], lut[byte >> 4]], dim=-1)  # [256, 2]
    exponents = torch.arange(256, dtype=torch.int32).sub(127).view(256, 1, 1)
    table = torch.empty(256, 256, 2, dtype=dtype)
    torch.ldexp(pairs.expand(256, 256, 2), exponents, out=table)
    pair_int = _INT_OF_SIZE[2 * table.element_size()]
    return table.view(pair_int).reshape(-1).numpy()
