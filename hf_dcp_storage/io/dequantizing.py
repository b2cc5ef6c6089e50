"""A load's quantized tensors: their scales read once per rank, and each slab of a weight read as
stored and dequantized into its destination (``reading.read_items`` calls ``Dequantizer``).

A rank reads the scales of the quantized weights its plan touches, whole, in one batch before the
weights (``reading.read_scales``: 4 bytes of scale per 16,384 bytes of FP8 weight at 128 x
128; one coalesced request per file on an object store), and keeps them for the load. A weight's
slab is then read raw, only the blocks (FP8) or groups (MXFP4) its region touches, and dequantized
from the scale blocks of those alone (``format/quantized.py``), on the I/O threads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..format.quantized import (
    fp8_block_dequantize,
    fp8_scale_blocks,
    mxfp4_dequantize,
    mxfp4_groups,
)
from ..format.quantscheme import Quantized

__all__ = ["Dequantizer"]


class Dequantizer:
    """One quantized weight of a load: ``quant`` (how), its whole ``scales`` and the ``dtype`` it
    dequantizes into (as PyTorch's reader's ``target_dtype``: the math's result is cast to it,
    then copied into each destination, converting again where that differs)."""

    def __init__(self, quant: Quantized, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.quant, self.scales, self.dtype = quant, scales, dtype

    def stored_region(
        self, offsets: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """The region of the stored tensor that the dequantized region at ``offsets`` of
        ``sizes`` comes from: the same (FP8), or the whole groups its last dimension lies in."""
        if self.quant.kind == "fp8_block":
            return list(offsets), list(sizes)
        per_group = self.quant.block[1]
        groups, _ = mxfp4_groups(offsets[-1], sizes[-1], per_group)
        return (
            [*offsets[:-1], groups.start, 0],
            [*sizes[:-1], groups.stop - groups.start, per_group // 2],
        )

    def finish(
        self, raw: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], dest: torch.Tensor
    ) -> None:
        """Dequantize ``raw`` (the stored region of ``stored_region(offsets, sizes)``) into
        ``dest`` (of ``sizes``)."""
        if not math.prod(sizes):
            return
        if self.quant.kind == "fp8_block":
            rows, cols = fp8_scale_blocks(offsets, sizes, self.quant.block)
            scales = self.scales[rows, cols]
            direct = self._direct(dest)
            out = dest if direct else None
            out = fp8_block_dequantize(
                raw, scales, offsets, block=self.quant.block, dtype=self.dtype, out=out
            )
            if not direct:
                dest.copy_(out)
            return
        groups, skip = mxfp4_groups(offsets[-1], sizes[-1], self.quant.block[1])
        region = [slice(o, o + n) for o, n in zip(offsets[:-1], sizes[:-1], strict=True)]
        region.append(groups)
        scales = self.scales[tuple(region)]
        if skip == 0 and raw.shape[-2] * raw.shape[-1] * 2 == sizes[-1] and self._direct(dest):
            mxfp4_dequantize(raw, scales, dtype=self.dtype, out=dest)  # whole groups, in place
            return
        values = mxfp4_dequantize(raw, scales, dtype=self.dtype)
        dest.copy_(values[..., skip : skip + sizes[-1]])

    def _direct(self, dest: torch.Tensor) -> bool:
        """Whether values can be written straight into ``dest``."""
        return dest.dtype == self.dtype and dest.is_cpu and dest.is_contiguous()
