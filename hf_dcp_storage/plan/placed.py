"""Every written chunk of a save, placed in its output file, as arrays (coordinator side).

Saves to stores without positioned writes need, per chunk, more than compact direct saves do:
the file it lands in, where its first byte goes, and where it sits in its rank's staged object
of that file, so that the ranks given the finishing work (``plan/spread.py``) can find every
byte. At thousands of ranks there are millions of chunks, so this is numpy over one row per
chunk, never a Python step per chunk.

A rank writes (stages) its chunks of a file in output order: by the chunk's first byte in the
file (``io/items.py``'s ``in_write_order`` sorts the same way), so where each chunk starts in
the rank's staged object follows from the sizes of its earlier chunks. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan

from ..format.geometry import element_size
from .chunks import GlobalChunks, chunk_bytes, encode_local, gather
from .dedup import Dedup
from .layout import Layout

__all__ = [
    "PlacedChunks",
    "key_strides",
    "place_chunks",
    "place_items",
    "stable_order",
    "staged_offsets",
]


@dataclass(frozen=True)
class PlacedChunks:
    """The chunks that are written (one writer each), sorted by ``(rank, file, start)``: the
    order each rank writes them.

    Per chunk: ``rank``; ``key`` (index into ``key_names``); ``file``;
    ``start``, the absolute offset of its first byte in the file; ``nbytes``; ``offsets`` and
    ``sizes`` (zero-padded past the key's ndim); ``staged``, its offset in the rank's staged
    object of the file when the rank stages all of it. Per key: ``shape`` (padded),
    ``itemsize``, ``tensor_start``, ``key_file`` and ``ndim``. ``rank``, ``key`` and ``file``
    are int32, and ``offsets``/``sizes`` where every value fits (millions of rows at thousands
    of ranks: hundreds of MiB less); byte offsets are int64.
    """

    key_names: tuple[str, ...]

    rank: np.ndarray
    key: np.ndarray
    file: np.ndarray
    start: np.ndarray
    nbytes: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    staged: np.ndarray
    shape: np.ndarray
    itemsize: np.ndarray
    tensor_start: np.ndarray
    key_file: np.ndarray
    ndim: np.ndarray

    def bytes_per_rank(self, world: int) -> np.ndarray:
        """Bytes each rank writes of its own."""
        return np.bincount(self.rank, weights=self.nbytes, minlength=world).astype(np.int64)


def place_chunks(g: GlobalChunks, dedup: Dedup, layout: Layout) -> PlacedChunks:
    """(coordinator) The chunks ``dedup`` keeps, placed by ``layout``; linear, but for a sort
    when some rank lists its chunks out of output order."""
    keep = np.ones(len(g.key), dtype=bool)
    keep[dedup.dropped] = False
    rows = np.flatnonzero(keep)
    shape, ndim = g.shapes(), g.ndim
    itemsize = np.array([element_size(s.dtype) for s in g.specs], dtype=np.int64)
    tensor_start = np.array([layout.tensor_start[s.key] for s in g.specs], dtype=np.int64)
    file_of = np.array([layout.file_of[s.key] for s in g.specs], dtype=np.int64)
    key, rank = g.key[rows], g.rank[rows]
    # np.take: faster than fancy indexing for 2-D rows.
    offsets, sizes = np.take(g.offsets, rows, axis=0), np.take(g.sizes, rows, axis=0)
    nbytes = chunk_bytes(g, key, ndim.astype(np.int8)[key], sizes)
    start = (
        tensor_start[key] + _first_element(offsets, key_strides(shape, ndim), key) * itemsize[key]
    )
    file = file_of[key]
    order = _output_order(rank, file, start, layout)
    if order is not None:
        rank, key, file, start, nbytes = (
            rank[order],
            key[order],
            file[order],
            start[order],
            nbytes[order],
        )
        offsets, sizes = np.take(offsets, order, axis=0), np.take(sizes, order, axis=0)
    staged = staged_offsets(rank, file, nbytes)
    rank, key, file = (
        rank.astype(np.int32, copy=False),
        key.astype(np.int32, copy=False),
        file.astype(np.int32),
    )
    # All >= 0 here.
    if offsets.dtype != np.int32 and (not len(offsets) or int((offsets + sizes).max()) < 2**31):
        offsets, sizes = offsets.astype(np.int32), sizes.astype(np.int32)
    names = tuple(spec.key for spec in g.specs)
    return PlacedChunks(
        names,
        rank,
        key,
        file,
        start,
        nbytes,
        offsets,
        sizes,
        staged,
        shape,
        itemsize,
        tensor_start,
        file_of,
        ndim,
    )


def _first_element(offsets: np.ndarray, strides: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Each chunk's first element in its tensor, row-major (``strides`` per key), a column at
    a time in int64 (offsets may be int32)."""
    element = np.zeros(len(key), dtype=np.int64)
    for d in range(offsets.shape[1]):
        element += offsets[:, d] * strides[:, d][key]
    return element


def _output_order(
    rank: np.ndarray, file: np.ndarray, start: np.ndarray, layout: Layout
) -> np.ndarray | None:
    """The chunks sorted by (rank, file, start), or ``None`` where they are so already: one
    int64 sort key where it fits, else a lexsort."""
    file_base = np.concatenate(([0], np.cumsum([f.size for f in layout.files], dtype=np.int64)))
    position = file_base[file] + start
    span = int(file_base[-1]) + 1
    if len(rank) and (int(rank.max()) + 1) * span < 2**62:
        sort_key = rank.astype(np.int64) * span + position
        # A rank lists its keys as the layout orders them (DCP keeps state-dict order): usually
        # sorted already.
        if (sort_key[1:] >= sort_key[:-1]).all():
            return None
        return np.argsort(sort_key, kind="stable")
    return np.lexsort((position, rank))


def place_items(layout: Layout, plans: Sequence[SavePlan]) -> PlacedChunks:
    """(coordinator) The same from each rank's write items, all of which are written (as a
    save's rank records list them, when an interrupted save is finished)."""
    g = gather([encode_local(plan.items) for plan in plans])
    return place_chunks(
        g, Dedup(np.empty(0, dtype=np.int64), np.zeros(len(plans), dtype=np.int64)), layout
    )


def key_strides(shape: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Row-major element strides of each key (``shape`` padded, ``ndim`` per key); zero past its
    ndim, where chunks' offsets and sizes are zero too."""
    strides = np.zeros_like(shape)
    for k, (dims, nd) in enumerate(zip(shape.tolist(), ndim.tolist(), strict=True)):
        step = 1
        for d in range(nd - 1, -1, -1):
            strides[k, d] = step
            step *= dims[d]
    return strides


def staged_offsets(rank: np.ndarray, file: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums of ``nbytes`` within each run of equal ``(rank, file)``."""
    before = np.cumsum(nbytes) - nbytes
    new = np.ones(len(rank), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (file[1:] != file[:-1])
    heads = np.flatnonzero(new)
    return before - np.repeat(before[heads], np.diff(heads, append=len(rank)))


def stable_order(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` for non-negative integers, fast for values under
    2**32 (part numbers, key ordinals): one or two 16-bit radix passes, where numpy sorts int64
    by comparisons (about a second for ten million)."""
    if not len(values):
        return np.empty(0, dtype=np.int64)
    top = int(values.max())
    if int(values.min()) < 0 or top >= 2**32:
        return np.argsort(values, kind="stable")
    if top < 2**16:
        return np.argsort(values.astype(np.uint16), kind="stable")
    low = np.argsort((values & 0xFFFF).astype(np.uint16), kind="stable")
    return low[np.argsort((values[low] >> 16).astype(np.uint16), kind="stable")]
