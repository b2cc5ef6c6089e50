"""Save plans as arrays: what every save's ranks send the coordinator instead of write items.

DCP gathers every rank's write items on the coordinator as Python objects (about 2 KiB each,
most of the gather spent in Python's garbage collector) and checks every pair of chunks of a
tensor for overlap. At thousands of ranks that alone costs minutes and tens of GiB on the
coordinator (``benchmarks/results/2026-11_scale-cpu-2core.md``). The coordinator needs, per
chunk, only its key, offsets and sizes: to check that the chunks tile each tensor, to choose a
writer for replicated chunks and, on stores without positioned writes, to place every chunk
(``plan/placed.py``). So a rank sends its key table once, compressed, and its chunks as one integer
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

from ..format.header import NAME_TO_DTYPE, dtype_name
from .layout import Layout, TensorSpec
from .packed import packed_array

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
    if not len(rows) or (rows.max() < 2**31 and rows.min() >= -(2**31)):
        rows = rows.astype(np.int32)  # half the bytes gathered; dims beyond 2**31 stay int64
    return LocalChunks(zlib.compress(raw, 1), rows)


@dataclass
class GlobalChunks:
    """Every rank's chunks on the coordinator, one row per chunk, ranks in order.

    ``key`` indexes ``specs``; ``offsets``/``sizes`` are padded with zeros past each key's ndim.
    Rank ``r``'s chunks are rows ``rank_start[r]:rank_start[r + 1]``, in its plan's order.
    ``rank`` and ``key`` are int32, and so are ``offsets``/``sizes`` when every chunk ends
    below 2**31 (ten million rows at 405B over 8,192 ranks: half the coordinator's memory);
    arithmetic that can exceed that (products, byte offsets) is done in int64.
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
    small = all(local.rows.dtype == np.int32 for local in locals_)
    key = np.empty(total, dtype=np.int32)
    offsets = np.zeros((total, width), dtype=np.int32 if small else np.int64)
    sizes = np.zeros((total, width), dtype=np.int32 if small else np.int64)
    for r, local in enumerate(locals_):
        a, b = rank_start[r], rank_start[r + 1]
        if a == b:
            continue
        nd = (local.rows.shape[1] - 1) // 2
        key[a:b] = table_keys[table_of_rank[r]][local.rows[:, 0]]
        offsets[a:b, :nd] = local.rows[:, 1 : 1 + nd]
        sizes[a:b, :nd] = local.rows[:, 1 + nd :]
    # An end past 2**31 (checked after a cheap bound): sums of int32 offsets and sizes would wrap.
    if small and total and int(offsets.max()) + int(sizes.max()) >= 2**31 and any(int((offsets[:, d].astype(np.int64) + sizes[:, d]).max()) >= 2**31 for d in range(width)):
        offsets, sizes = offsets.astype(np.int64), sizes.astype(np.int64)
    rank = np.repeat(np.arange(len(locals_), dtype=np.int32), counts)
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
    landing on the lowest one. Linear in chunks when each key's chunks come in order (ranks in
    mesh order: every DTensor layout) and tile it band by band (:func:`_bands_tile`); a key's
    chunks out of order are sorted, and a key that fails the band check is checked exactly by a
    sweep over its first dimension.

    Raises:
        ValueError: a chunk outside its tensor, or a key whose chunks leave a gap or overlap,
            naming the key, its shape and a chunk involved.
    """
    n, width = g.offsets.shape
    ndim = g.ndim
    shapes = np.zeros((len(g.specs), width), dtype=np.int64)
    for i, spec in enumerate(g.specs):
        shapes[i, : len(spec.shape)] = spec.shape
    itemsize = np.array([spec.dtype.itemsize for spec in g.specs], dtype=np.int64)
    order, key, rank = _by_key(g)
    bounds = np.searchsorted(key, np.arange(len(g.specs) + 1, dtype=key.dtype))  # same dtype: no int64 copy of key
    # np.take: several times faster than fancy indexing for rows of a 2-D array.
    offsets, sizes = np.take(g.offsets, order, axis=0), np.take(g.sizes, order, axis=0)
    # Chunks outside their tensor: the smallest value, and each key's largest end per dimension
    # (a column at a time: these arrays have millions of rows).
    present = np.flatnonzero(bounds[1:] > bounds[:-1])
    outside = n > 0 and (int(offsets.min()) < 0 or int(sizes.min()) < 0)
    for d in range(width if n else 0):
        outside = outside or bool((np.maximum.reduceat(offsets[:, d] + sizes[:, d], bounds[present]) > shapes[present, d]).any())
    if outside:
        bad = np.flatnonzero(((g.offsets < 0) | (g.sizes < 0) | (g.offsets + g.sizes > shapes[g.key])).any(axis=1))
        raise ValueError(f"{_describe(g, int(bad[0]))} lies outside the tensor; every chunk must lie within its global shape")
    # Equal chunks must be neighbours: each key's rows sorted by offsets, then sizes. Ranks list
    # a key's chunks in that order already for DTensor layouts; only keys out of order are sorted.
    later, equal = _against_previous([*offsets.T, *sizes.T])
    same_key = key[1:] == key[:-1]
    unsorted = np.unique(key[1:][same_key & ~(later | equal)]).tolist()
    for k in unsorted:
        a, b = bounds[k], bounds[k + 1]
        o = np.lexsort((*sizes[a:b].T[::-1], *offsets[a:b].T[::-1]))
        order[a:b], rank[a:b], offsets[a:b], sizes[a:b] = order[a:b][o], rank[a:b][o], offsets[a:b][o], sizes[a:b][o]
        later[a : b - 1], equal[a : b - 1] = _against_previous([*offsets[a:b].T, *sizes[a:b].T])  # this key's pairs only
    same = np.zeros(n, dtype=bool)
    same[1:] = same_key & equal
    del later, equal, same_key
    nd = ndim.astype(np.int8)[key]
    nbytes = itemsize[key]  # times each real dimension's size: the chunk's bytes
    for d in range(width):
        nbytes *= sizes[:, d] if d < ndim.min(initial=width) else np.where(nd > d, sizes[:, d], 1)
    covering = np.flatnonzero(~same & (nbytes > 0))  # one row per distinct chunk; empty ones cover nothing
    key_c = key[covering]
    suspect = _bands_tile(key_c, offsets, sizes, covering, nd[covering], shapes)
    del nd
    suspect |= (np.bincount(key_c, minlength=len(g.specs)) == 0) & (shapes.prod(axis=1, where=np.arange(width) < ndim[:, None]) > 0)
    by_key = np.searchsorted(key_c, np.arange(len(g.specs) + 1, dtype=key_c.dtype))
    for k in np.flatnonzero(suspect).tolist():
        rows = covering[by_key[k] : by_key[k + 1]]
        _check_key(g, k, order[rows], offsets[rows, : ndim[k]], sizes[rows, : ndim[k]], shapes[k, : ndim[k]])
    del offsets, sizes, covering, key_c
    return _dedup(g, order, key, rank, same, nbytes)


def _by_key(g: GlobalChunks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows grouped by key, each key's rows in rank order (a stable sort by key), and their
    keys and ranks. Where every rank sent the same table and a chunk of each of its keys (FSDP,
    FSDP x TP: every rank holds every key, in state-dict order), the rows are a ranks x keys
    matrix and this its transpose, made without a sort; else a radix sort for small key ids."""
    world = len(g.rank_start) - 1
    if len(g.table_keys) == 1 and len(g.key) == world * len(g.table_keys[0]):
        keys = g.table_keys[0]  # each rank's rows: one per table row, in table order
        by_key = np.argsort(keys, kind="stable")
        order = (by_key[:, None] + len(keys) * np.arange(world, dtype=np.int64)[None, :]).ravel()
        return order, np.repeat(keys[by_key].astype(np.int32), world), np.tile(np.arange(world, dtype=np.int32), len(keys))
    order = np.argsort(g.key.astype(np.int16 if len(g.specs) < 2**15 else np.int64), kind="stable")
    return order, g.key[order], g.rank[order]


def _against_previous(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per row after the first: whether it is lexicographically after, or equal to, the row
    before it (``columns`` in order of precedence)."""
    n = len(columns[0]) if columns else 0
    later, equal = np.zeros(max(n - 1, 0), dtype=bool), np.ones(max(n - 1, 0), dtype=bool)
    for c in columns:
        later |= equal & (c[1:] > c[:-1])
        equal &= c[1:] == c[:-1]
    return later, equal


def _bands_tile(key: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, rows: np.ndarray, nd: np.ndarray, shapes: np.ndarray) -> np.ndarray:
    """Per key, whether its distinct non-empty chunks, ``rows`` of ``offsets``/``sizes``
    (grouped by ``key``, each key's sorted by offsets then sizes; ``nd`` their keys' ndim) might
    not tile it: ``False`` proves they do.

    They do when, dimension after dimension, the chunks sharing their extent in the earlier
    dimensions (a band) split the next one into intervals that follow each other from 0 to its
    end: then each band is cut exactly by the next dimension's intervals, down to single chunks.
    Every grid (DTensor sharding) passes; other tilings and every gap or overlap are left to the
    exact check. Linear: a few comparisons per chunk and dimension, a dimension at a time."""
    m = len(rows)
    suspect = np.zeros(len(shapes), dtype=bool)
    if not m:
        return suspect
    new = np.ones(m, dtype=bool)  # first row of its band
    new[1:] = key[1:] != key[:-1]
    last = np.ones(m, dtype=bool)  # last row of its band
    bad = np.zeros(m, dtype=bool)
    for d in range(offsets.shape[1]):
        o, s = offsets[:, d][rows], sizes[:, d][rows]
        if not o.any() and (s == shapes[key, d]).all():
            continue  # every chunk whole in this dimension (FSDP's dim 1): it cuts no band
        stays = np.zeros(m, dtype=bool)  # the same interval as the row before
        stays[1:] = (o[1:] == o[:-1]) & (s[1:] == s[:-1])
        follows = np.zeros(m, dtype=bool)  # the interval right after the row before's
        follows[1:] = o[1:] == o[:-1] + s[:-1]
        last[:-1] = new[1:]
        ok = np.where(new, o == 0, stays | follows) & (~last | (o + s == shapes[key, d]))
        active = nd > d
        bad |= active & ~ok
        new |= active & ~stays
    suspect[key[bad]] = True
    return suspect


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
        pairs = np.unique(offsets[:, d].astype(np.int64) * (int(shape[d]) + 1) + sizes[:, d])
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


def _dedup(g: GlobalChunks, order: np.ndarray, key: np.ndarray, rank: np.ndarray, same: np.ndarray, nbytes: np.ndarray) -> Dedup:
    """Rows ``order`` (of ``key``s and ``rank``s, equal chunks neighbours, ``same``: equal to
    the row before) with their ``nbytes``: one writer per group of equal chunks, the least
    loaded holder, group after group."""
    world = len(g.rank_start) - 1
    if not same.any():  # nothing replicated (FSDP alone): every rank writes all it holds
        return Dedup(np.empty(0, dtype=np.int64), np.bincount(rank, weights=nbytes, minlength=world).astype(np.int64))
    group = np.cumsum(~same) - 1  # distinct-chunk number of each sorted row
    size = np.bincount(group)[group]
    lone = size == 1
    loads = np.bincount(rank[lone], weights=nbytes[lone], minlength=world).astype(np.int64)
    # Several holders of an empty chunk (a short last shard): the first keeps it, writing nothing.
    empty_dup = ~lone & (nbytes == 0)
    dropped_empty = order[empty_dup & same]
    shared = np.flatnonzero(~lone & ~empty_dup)
    if not len(shared):
        return Dedup(np.sort(dropped_empty), loads)
    ranks, row_bytes, sizes = rank[shared], nbytes[shared], size[shared]
    keep = np.zeros(len(shared), dtype=bool)
    # A key's replicated chunks at once where their holders are all different ranks (each TP
    # group holds its own rows): no group's choice changes another's loads, so this is the
    # group-after-group greedy, without a Python step per holder (two million at 405B over
    # 1,024 x 8 ranks). Holders come in rank order: the first least loaded is the lowest rank.
    waves = np.flatnonzero(np.diff(key[shared], prepend=-1)).tolist() + [len(shared)]
    for a, b in zip(waves, waves[1:]):
        r, n = ranks[a:b], int(sizes[a])
        if (sizes[a:b] == n).all() and int(np.bincount(r).max()) == 1:
            best = a + np.arange(0, b - a, n) + np.argmin(loads[r].reshape(-1, n), axis=1)
            loads[ranks[best]] += row_bytes[best]
            keep[best] = True
            continue
        _greedy(ranks[a:b].tolist(), row_bytes[a:b].tolist(), np.flatnonzero(np.diff(group[shared[a:b]], prepend=-1)).tolist() + [b - a], loads, keep[a:b])
    return Dedup(np.sort(np.concatenate((order[shared[~keep]], dropped_empty))), loads)


def _greedy(ranks: list[int], row_bytes: list[int], starts: list[int], loads: np.ndarray, keep: np.ndarray) -> None:
    """Group after group (rows ``starts[i]:starts[i + 1]``), the least loaded holder (the lowest
    such rank) keeps its row: ``loads`` and ``keep`` are updated in place."""
    load = {r: int(loads[r]) for r in set(ranks)}
    for a, b in zip(starts, starts[1:]):
        best, low = a, load[ranks[a]]
        for i in range(a + 1, b):
            if load[ranks[i]] < low:
                best, low = i, load[ranks[i]]
        load[ranks[best]] += row_bytes[best]
        keep[best] = True
    for r, v in load.items():
        loads[r] = v


def table_plans(g: GlobalChunks, layout: Layout, dedup: Dedup) -> list[TablePlan]:
    """(coordinator) Each rank's :class:`TablePlan`. Ranks sending the same table share its
    ``file``/``start`` arrays, so the coordinator holds and packs them once."""
    file_of = np.array([layout.file_of[s.key] for s in g.specs], dtype=np.int32)
    start_of = np.array([layout.tensor_start[s.key] for s in g.specs], dtype=np.int64)
    per_table = [(packed_array(file_of[keys]), packed_array(start_of[keys])) for keys in g.table_keys]  # packed once, sent in many plans
    skip_rank = g.rank[dedup.dropped]
    bounds = np.searchsorted(skip_rank, np.arange(len(g.table_of_rank) + 1, dtype=skip_rank.dtype))
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
