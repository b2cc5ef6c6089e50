"""Save plans as arrays: what every save's ranks send the coordinator instead of write items.

DCP gathers every rank's write items on the coordinator as Python objects (about 2 KiB each,
most of the gather spent in Python's garbage collector) and checks every pair of chunks of a
tensor for overlap. At thousands of ranks that alone costs minutes and tens of GiB on the
coordinator (``benchmarks/results/2026-11_scale-cpu-2core.md``). The coordinator needs, per
chunk, only its key, offsets and sizes: to check that the chunks tile each tensor, to choose a
writer for replicated chunks and, on stores without positioned writes, to place every chunk
(``_placed.py``). So a rank sends its key table once, compressed, and its chunks as one integer
array (:class:`LocalChunks`), keeps its write items to itself, and receives, per row of its
table, where the key's data starts (:class:`TablePlan`).

Pure: no I/O, no process group. The coordinator calls :func:`gather`, :func:`check_and_dedup`
and :func:`table_plans`; each rank calls :func:`encode_local`.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.planner import WriteItem

from ._header import NAME_TO_DTYPE, dtype_name
from ._layout import Layout, TensorSpec

__all__ = ["LocalChunks", "GlobalChunks", "Dedup", "TablePlan", "encode_local", "gather", "check_and_dedup", "table_plans", "xor_shares"]


@dataclass(frozen=True)
class LocalChunks:
    """``SavePlan.storage_data`` of a rank's local plan: its chunks, one row per write item in
    plan order, instead of the items themselves.

    ``table`` is zlib-compressed JSON ``[[key, dtype name, shape], ...]`` in the order the rank
    first meets each key; ranks holding the same keys send byte-identical tables, so the
    coordinator decodes each distinct table once. ``rows`` is ``int64 [items, 1 + 2 * ndim]``:
    table row, then the chunk's offsets and sizes, zero-padded to the rank's largest ``ndim``
    (``int32`` when every value fits).
    """

    table: bytes
    rows: np.ndarray


@dataclass(frozen=True)
class TablePlan:
    """What the coordinator sends back (inside the rank's ``storage_data``): for each row of the
    rank's table, the output file and the absolute offset of the key's data in it; and the
    rank's write items (by position in its plan) that another rank writes instead."""

    file: np.ndarray  # int32 [table rows]
    start: np.ndarray  # int64 [table rows]
    skip: np.ndarray  # int64 [items skipped], ascending


def encode_local(items: Sequence[WriteItem]) -> LocalChunks:
    """(each rank) The compact form of this rank's tensor write items, in their order.

    Raises:
        ValueError: an item without tensor data, an unsupported dtype, or one key with two
            dtypes or shapes on this rank.
    """
    index: dict[str, int] = {}
    table: list[tuple[str, str, tuple[int, ...]]] = []
    ndim = max((len(item.tensor_data.size) for item in items if item.tensor_data is not None), default=0)
    pad = [0] * ndim
    flat: list[int] = []  # rows built as one Python list: numpy element writes cost ~1 µs each
    for item in items:
        td = item.tensor_data
        if td is None:
            raise ValueError(f"{item.index.fqn!r} is not a tensor; only tensors can be planned as chunks")
        key, shape = item.index.fqn, tuple(td.size)
        row = index.get(key)
        if row is None:
            row = index[key] = len(table)
            table.append((key, dtype_name(td.properties.dtype, key=key), shape))
        elif table[row][2] != shape or NAME_TO_DTYPE[table[row][1]] != td.properties.dtype:
            raise ValueError(f"key {key!r} is planned as {table[row][1:]} and as {(td.properties.dtype, shape)} on one rank")
        gap = pad[len(shape) :]
        flat.append(row)
        flat.extend(td.chunk.offsets)
        flat.extend(gap)
        flat.extend(td.chunk.sizes)
        flat.extend(gap)
    rows = np.array(flat, dtype=np.int64).reshape(len(items), 1 + 2 * ndim)
    raw = json.dumps([[k, d, list(s)] for k, d, s in table], separators=(",", ":")).encode()
    if not len(rows) or rows.max() < 2**31:
        rows = rows.astype(np.int32)  # half the bytes gathered; dims beyond 2**31 stay int64
    return LocalChunks(zlib.compress(raw, 1), rows)


@dataclass
class GlobalChunks:
    """Every rank's chunks on the coordinator, one row per chunk, ranks in order.

    ``key`` indexes ``specs``; ``offsets``/``sizes`` are padded with zeros past each key's ndim.
    Rank ``r``'s chunks are rows ``rank_start[r]:rank_start[r + 1]``, in its plan's order.
    ``table_keys[t]`` maps the rows of distinct table ``t`` to keys; rank ``r`` sent table
    ``table_of_rank[r]``.
    """

    specs: list[TensorSpec]
    table_keys: list[np.ndarray]
    table_of_rank: np.ndarray
    rank_start: np.ndarray
    rank: np.ndarray
    key: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    @property
    def ndim(self) -> np.ndarray:
        """Each key's number of dimensions."""
        return np.array([len(s.shape) for s in self.specs], dtype=np.int64)


def gather(locals_: Sequence[LocalChunks]) -> GlobalChunks:
    """(coordinator) Join every rank's chunks; keys ordered as rank 0 lists them, then keys
    first seen on rank 1, and so on.

    Raises:
        ValueError: a key with a different dtype or global shape on two ranks.
    """
    distinct: dict[bytes, int] = {}
    tables: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = []
    table_of_rank = np.empty(len(locals_), dtype=np.int64)
    for r, local in enumerate(locals_):
        t = distinct.get(local.table)
        if t is None:
            t = distinct[local.table] = len(tables)
            tables.append([(k, NAME_TO_DTYPE[d], tuple(s)) for k, d, s in json.loads(zlib.decompress(local.table))])
        table_of_rank[r] = t
    specs: dict[str, TensorSpec] = {}
    for table in tables:
        for key, dtype, shape in table:
            spec = TensorSpec(key, dtype, shape)
            prev = specs.setdefault(key, spec)
            if prev != spec:
                raise ValueError(
                    f"key {key!r} is {prev.dtype}{list(prev.shape)} on one rank and {dtype}{list(shape)} "
                    f"on another; every rank must hold the same global tensor"
                )
    position = {key: i for i, key in enumerate(specs)}
    table_keys = [np.array([position[k] for k, _, _ in table], dtype=np.int64) for table in tables]
    counts = np.array([len(local.rows) for local in locals_], dtype=np.int64)
    rank_start = np.concatenate(([0], np.cumsum(counts)))
    total, width = int(rank_start[-1]), max((len(s.shape) for s in specs.values()), default=0)
    key = np.empty(total, dtype=np.int64)
    offsets = np.zeros((total, width), dtype=np.int64)
    sizes = np.zeros((total, width), dtype=np.int64)
    for r, local in enumerate(locals_):
        a, b = rank_start[r], rank_start[r + 1]
        if a == b:
            continue
        nd = (local.rows.shape[1] - 1) // 2
        key[a:b] = table_keys[table_of_rank[r]][local.rows[:, 0]]
        offsets[a:b, :nd] = local.rows[:, 1 : 1 + nd]
        sizes[a:b, :nd] = local.rows[:, 1 + nd :]
    rank = np.repeat(np.arange(len(locals_), dtype=np.int64), counts)
    return GlobalChunks(list(specs.values()), table_keys, table_of_rank, rank_start, rank, key, offsets, sizes)


@dataclass(frozen=True)
class Dedup:
    """Outcome of :func:`check_and_dedup`: chunks not to write (global rows, ascending: another
    rank writes the same chunk) and the bytes each rank writes."""

    dropped: np.ndarray
    bytes_per_rank: np.ndarray


def check_and_dedup(g: GlobalChunks) -> Dedup:
    """(coordinator) Check that each key's chunks tile its tensor exactly once, and pick one
    writer for every chunk that several ranks hold (replicated tensors).

    A replicated chunk goes to the holder that writes the fewest bytes so far, counting first
    every rank's unreplicated chunks, so replicated tensors spread over the ranks instead of
    landing on the lowest one. Linear in chunks for grid shardings (every DTensor layout); a key
    whose chunks are not a grid is checked by a sweep over its first dimension.

    Raises:
        ValueError: a chunk outside its tensor, or a key whose chunks leave a gap or overlap,
            naming the key, its shape and a chunk involved.
    """
    ndim = g.ndim
    shapes = np.zeros((len(g.specs), g.offsets.shape[1]), dtype=np.int64)
    for i, spec in enumerate(g.specs):
        shapes[i, : len(spec.shape)] = spec.shape
    itemsize = np.array([spec.dtype.itemsize for spec in g.specs], dtype=np.int64)
    bad = np.flatnonzero(((g.offsets < 0) | (g.sizes < 0) | (g.offsets + g.sizes > shapes[g.key])).any(axis=1))
    if len(bad):
        raise ValueError(f"{_describe(g, int(bad[0]))} lies outside the tensor; every chunk must lie within its global shape")
    real_dim = np.arange(g.sizes.shape[1]) < ndim[g.key][:, None]
    volume = np.where(real_dim, g.sizes, 1).prod(axis=1)
    # Rows grouped by key (a radix sort for small key ids), then each key's rows sorted by
    # offsets and sizes so that equal chunks become neighbours: a sort of N short ones, where
    # one lexsort of all rows over every column costs several times more.
    by_key = np.argsort(g.key.astype(np.int16 if len(g.specs) < 2**15 else np.int64), kind="stable")
    bounds = np.searchsorted(g.key[by_key], np.arange(len(g.specs) + 1))
    orders, sames = [], []
    for k, spec in enumerate(g.specs):
        rows = by_key[bounds[k] : bounds[k + 1]]
        nd = int(ndim[k])
        offsets, sizes = g.offsets[rows, :nd], g.sizes[rows, :nd]
        if nd and len(rows) > 1:
            o = np.lexsort((*sizes.T[::-1], *offsets.T[::-1]))
            rows, offsets, sizes = rows[o], offsets[o], sizes[o]
        same = np.zeros(len(rows), dtype=bool)
        same[1:] = (offsets[1:] == offsets[:-1]).all(axis=1) & (sizes[1:] == sizes[:-1]).all(axis=1)
        covering = ~same & (volume[rows] > 0)  # one row per distinct chunk; empty chunks cover nothing
        _check_key(g, k, rows[covering], offsets[covering], sizes[covering], shapes[k, :nd])
        orders.append(rows)
        sames.append(same)
    order = np.concatenate(orders) if orders else np.empty(0, dtype=np.int64)
    same = np.concatenate(sames) if sames else np.empty(0, dtype=bool)
    return _dedup(g, order, same, volume * itemsize[g.key])


def _check_key(g: GlobalChunks, k: int, rows: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, shape: np.ndarray) -> None:
    """Key ``k``'s distinct non-empty chunks must cover its tensor exactly once."""
    spec = g.specs[k]
    if len(rows) == 0 and math.prod(spec.shape) == 0:
        return
    if len(rows) and _is_grid(offsets, sizes, shape):
        return
    boxes = list(zip(map(tuple, offsets.tolist()), map(tuple, sizes.tolist()), strict=True))
    if not _tiles(boxes, tuple(spec.shape)):
        example = f"; one of its {len(rows)} distinct chunks: {_describe(g, int(rows[0]))}" if len(rows) else ""
        raise ValueError(
            f"the chunks of {spec.key!r} {list(spec.shape)} do not cover it exactly once (a gap or an "
            f"overlap){example}. Every element must be saved by exactly one rank's shard"
        )


def _is_grid(offsets: np.ndarray, sizes: np.ndarray, shape: np.ndarray) -> bool:
    """Whether distinct boxes are exactly the cells of a grid that partitions ``shape``: then
    they tile it. Each dimension's distinct intervals must partition it, and the boxes must be
    as many as the grid's cells (distinct boxes made of grid intervals are distinct cells)."""
    cells = 1
    for d in range(len(shape)):
        pairs = np.unique(offsets[:, d] * (int(shape[d]) + 1) + sizes[:, d])
        starts, lengths = np.divmod(pairs, int(shape[d]) + 1)
        if starts[0] != 0 or starts[-1] + lengths[-1] != shape[d] or (starts[1:] != starts[:-1] + lengths[:-1]).any():
            return False
        cells *= len(pairs)
    return cells == len(offsets)


def _tiles(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]) -> bool:
    """Exact check, any boxes: cut the first dimension at every box edge; in each slab the boxes
    spanning it must tile the remaining dimensions (recursively)."""
    if not shape:
        return len(boxes) == 1
    if shape[0] == 0:
        return not boxes
    cuts = sorted({0, shape[0], *(o[0] for o, _ in boxes), *(o[0] + s[0] for o, s in boxes)})
    for a, b in zip(cuts, cuts[1:]):
        spanning = [(o[1:], s[1:]) for o, s in boxes if o[0] <= a and b <= o[0] + s[0]]
        if not _tiles(spanning, shape[1:]):
            return False
    return True


def _dedup(g: GlobalChunks, order: np.ndarray, same: np.ndarray, nbytes: np.ndarray) -> Dedup:
    group = np.cumsum(~same) - 1  # distinct-chunk number of each sorted row
    size = np.bincount(group)
    lone = order[size[group] == 1]
    loads = np.bincount(g.rank[lone], weights=nbytes[lone], minlength=len(g.rank_start) - 1).astype(np.int64)
    # Several holders of an empty chunk (a short last shard): the first keeps it, writing nothing.
    empty_dup = (size[group] > 1) & (nbytes[order] == 0)
    dropped_empty = order[empty_dup & same]
    shared = (size[group] > 1) & ~empty_dup
    if not shared.any():
        return Dedup(np.sort(dropped_empty), loads)
    rows = order[shared].tolist()
    ranks = g.rank[order[shared]].tolist()
    starts = np.flatnonzero(np.diff(group[shared], prepend=-1)).tolist() + [len(rows)]
    load = loads.tolist()
    dropped: list[int] = []
    for a, b in zip(starts, starts[1:]):
        best = min(range(a, b), key=lambda i: (load[ranks[i]], ranks[i]))
        load[ranks[best]] += int(nbytes[rows[best]])
        dropped.extend(rows[i] for i in range(a, b) if i != best)
    return Dedup(np.sort(np.concatenate((np.array(dropped, dtype=np.int64), dropped_empty))), np.array(load, dtype=np.int64))


def table_plans(g: GlobalChunks, layout: Layout, dedup: Dedup) -> list[TablePlan]:
    """(coordinator) Each rank's :class:`TablePlan`. Ranks sending the same table share its
    ``file``/``start`` arrays, so the coordinator holds them once."""
    file_of = np.array([layout.file_of[s.key] for s in g.specs], dtype=np.int32)
    start_of = np.array([layout.tensor_start[s.key] for s in g.specs], dtype=np.int64)
    per_table = [(file_of[keys], start_of[keys]) for keys in g.table_keys]
    skip_rank = g.rank[dedup.dropped]
    bounds = np.searchsorted(skip_rank, np.arange(len(g.table_of_rank) + 1))
    empty = np.empty(0, dtype=np.int64)
    plans = []
    for r, t in enumerate(g.table_of_rank.tolist()):
        a, b = bounds[r], bounds[r + 1]
        skip = dedup.dropped[a:b] - g.rank_start[r] if b > a else empty
        plans.append(TablePlan(per_table[t][0], per_table[t][1], skip))
    return plans


def _describe(g: GlobalChunks, row: int) -> str:
    spec = g.specs[int(g.key[row])]
    nd = len(spec.shape)
    return (
        f"rank {int(g.rank[row])}'s chunk of {spec.key!r} {list(spec.shape)} at offsets "
        f"{g.offsets[row, :nd].tolist()} with sizes {g.sizes[row, :nd].tolist()}"
    )


def xor_shares(g_keys: Sequence[np.ndarray], table_of_rank: np.ndarray, shares: Sequence[tuple[np.ndarray, np.ndarray]], n_keys: int) -> np.ndarray:
    """(coordinator) Each key's CRC32: the XOR of every rank's shares. ``shares[r]`` is rank
    r's ``(table rows, crc shares)``; ``g_keys``/``table_of_rank`` as in :class:`GlobalChunks`."""
    out = np.zeros(n_keys, dtype=np.uint64)
    for r, (rows, crcs) in enumerate(shares):
        if len(rows):
            np.bitwise_xor.at(out, g_keys[int(table_of_rank[r])][rows], crcs.astype(np.uint64))
    return out
