"""Bounded-memory views of a tensor chunk: slabs along dim 0, as raw little-endian bytes.

Both the writer and the reader walk a chunk slab by slab, so extra memory per thread is at
most one slab (a cast or a non-contiguous source needs a copy), whatever the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

__all__ = ["SLAB_BYTES", "as_bytes", "slab_bounds", "sub_chunk"]

# Large enough that per-call overhead vanishes next to memcpy/pwrite, small enough that a few
# threads' worth stays well under the 128 MiB extra-memory budget per rank.
SLAB_BYTES = 16 << 20


def slab_bounds(
    sizes: Sequence[int], itemsize: int, slab_bytes: int = SLAB_BYTES
) -> Iterator[tuple[int, int]]:
    """``[r0, r1)`` ranges over dim 0 of a chunk of ``sizes``, each about ``slab_bytes``.

    A 0-dim chunk is one slab ``(0, 1)``; an empty chunk has none. A single dim-0 row larger than
    ``slab_bytes`` is still one slab (rows are the unit).
    """
    if not sizes:
        yield 0, 1
        return
    if math.prod(sizes) == 0:
        return
    row = math.prod(sizes[1:]) * itemsize
    step = max(1, slab_bytes // max(row, 1))
    for r0 in range(0, sizes[0], step):
        yield r0, min(sizes[0], r0 + step)


def sub_chunk(
    offsets: Sequence[int], sizes: Sequence[int], r0: int, r1: int
) -> tuple[list[int], list[int]]:
    """Global offsets and sizes of rows ``[r0, r1)`` of a chunk."""
    if not sizes:
        return [], []
    return [offsets[0] + r0, *offsets[1:]], [r1 - r0, *sizes[1:]]


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as a flat byte view, copying only if it is not a contiguous CPU tensor.

    The returned view keeps the (possibly copied) storage alive.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().data.cast("B")
