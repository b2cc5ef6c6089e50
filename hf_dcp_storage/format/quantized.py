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

from collections.abc import Sequence

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
    where given (a CPU tensor of ``dtype`` and the slice's shape, any strides), else a new tensor.
    A Python step per block row (28 for a 3,584-row slice; torch's reader takes one per block,
    448 there), 2.5-3.5x the reader's throughput on one thread.

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
    if out is None:
        out = torch.empty(nr, nc, dtype=dtype)
    if not nr or not nc:
        return out
    # A block row at a time: its scales spread along the columns as one row vector that
    # broadcasts over the block's rows (no scale per element is ever materialised). float32(w)
    # times the scale (promoted to float32 where it is narrower), then the cast: the operations
    # of torch's reader, elementwise, so the same bits.
    skip = c0 % bc
    starts = [0, *range(br - r0 % br, nr, br)]  # each block row's first row in the slice
    for i, (a, b) in enumerate(zip(starts, [*starts[1:], nr], strict=True)):
        row = scale_inv[i].repeat_interleave(bc)[skip : skip + nc]
        out[a:b] = weight[a:b].to(torch.float32) * row
    return out


def mxfp4_groups(start: int, length: int, per_group: int) -> tuple[slice, int]:
    """The groups of an MXFP4 tensor that dequantized elements ``[start, start + length)`` of
    its last dimension lie in (``per_group``: ``2 * B`` values a group), and where ``start``
    falls in the first of them."""
    first = start // per_group
    last = (start + max(length, 1) - 1) // per_group + 1
    return slice(first, last), start - first * per_group


def mxfp4_dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``blocks`` ``[..., G, B]`` (uint8) with their ``scales`` ``[..., G]`` (uint8, E8M0)
    dequantized into ``[..., G * 2 * B]`` of ``dtype``.

    Raises:
        ValueError: the scales' shape is not the blocks' less their last dimension.
    """
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 scales {list(scales.shape)} do not match blocks {list(blocks.shape)} (one "
            "scale a group)"
        )
    *prefix, groups, width = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*prefix, groups, 2 * width, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1), out=out)
    return out.reshape(*prefix, groups * 2 * width)
