"""Where a tensor's bytes lie: bytes per element, and the contiguous byte runs of a chunk (an
offset and size per dimension) inside its row-major tensor. Pure arithmetic, shared by the save
and load planning, the writer's slabs and the tools."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

__all__ = ["chunk_runs", "chunk_runs_array", "element_size"]


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (no tensor is made: planning calls this per chunk)."""
    return dtype.itemsize


def chunk_runs(
    shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], itemsize: int
) -> Iterator[tuple[int, int, int]]:
    """Contiguous byte runs of a chunk inside its row-major global tensor.

    Yields ``(tensor_byte_offset, chunk_byte_offset, nbytes)`` in ascending order of both
    offsets, where ``chunk_byte_offset`` indexes the chunk's own row-major bytes. A row shard
    (``Shard(0)``) is one run; a column shard of a matrix is one run per row.
    """
    if any(s == 0 for s in sizes):
        return
    if not shape:
        yield 0, 0, itemsize
        return
    k, strides, run, base = _run_geometry(shape, offsets, sizes, itemsize)
    outer = [range(n) for n in sizes[:k]]
    outer_strides = [s * itemsize for s in strides[:k]]
    chunk_pos = 0
    for idx in _product(outer):
        yield base + sum(i * s for i, s in zip(idx, outer_strides, strict=True)), chunk_pos, run
        chunk_pos += run


def chunk_runs_array(
    shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], itemsize: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """``chunk_runs`` as arrays: ``(tensor_byte_offsets, chunk_byte_offsets, run_bytes)``, every
    run being ``run_bytes`` long (int64 arrays, ascending; empty for an empty chunk)."""
    if any(s == 0 for s in sizes):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 0
    if not shape:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), itemsize
    k, strides, run, base = _run_geometry(shape, offsets, sizes, itemsize)
    starts = np.array([base], dtype=np.int64)
    for d in range(k):  # row-major over the outer dims: the runs' order
        starts = (
            starts[:, None] + np.arange(sizes[d], dtype=np.int64) * (strides[d] * itemsize)
        ).ravel()
    return starts, np.arange(len(starts), dtype=np.int64) * run, run


def _run_geometry(
    shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], itemsize: int
) -> tuple[int, list[int], int, int]:
    """``(k, strides, run_bytes, first_byte)`` of a non-empty chunk of a tensor of 1+ dims: ``k``
    is the outermost dim of the longest suffix the chunk covers fully (plus one partial dim), so
    its runs are indexed by its dims before ``k``; ``strides`` in elements."""
    ndim = len(shape)
    k = ndim - 1
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return (
        k,
        strides,
        sizes[k] * strides[k] * itemsize,
        sum(o * s for o, s in zip(offsets, strides, strict=True)) * itemsize,
    )


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    """``itertools.product`` that yields lazily even for many rows (it never materialises)."""
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head, *tail)
