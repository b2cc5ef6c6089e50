"""Save plans as arrays: what every save's ranks send the coordinator instead of write items.

DCP gathers every rank's write items on the coordinator as Python objects (about 2 KiB each,
most of the gather spent in Python's garbage collector) and checks every pair of chunks of a
tensor for overlap. At thousands of ranks that alone costs minutes and tens of GiB on the
coordinator (``benchmarks/results/scale-cpu-2core.md``). The coordinator needs, per
chunk, only its key, offsets and sizes: to check that the chunks tile each tensor, to choose a
writer for replicated chunks and, on stores without positioned writes, to place every chunk
(``plan/placed.py``). So a rank sends its key table once, compressed, and its chunks as one integer
array (:class:`LocalChunks`), keeps its write items to itself, and receives, per row of its
table, where the key's data starts (:class:`TablePlan`).

Pure: no I/O, no process group. The coordinator calls :func:`gather`, :func:`check_and_dedup`
and :func:`table_plans`; each rank calls :func:`encode_local`. The wire forms and their join are
``plan/chunks.py``, the tiling check ``plan/tiling.py``, the choice of writers ``plan/dedup.py``;
this module puts them together, and is where the writer and the tests import them from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .chunks import GlobalChunks, LocalChunks, chunk_bytes, encode_local, gather
from .dedup import Dedup, dedup
from .fp8export import EXPORT_KEYS
from .layout import Layout, plan_layout
from .packed import packed_array
from .placed import PlacedChunks, place_chunks
from .tiling import against_previous, check_inside, check_tiling

__all__ = [
    "Dedup",
    "GlobalChunks",
    "LocalChunks",
    "TablePlan",
    "check_and_dedup",
    "encode_local",
    "gather",
    "plan_save",
    "planner_data_to_send",
    "table_plans",
    "xor_shares",
]


@dataclass(frozen=True)
class TablePlan:
    """What the coordinator sends back (inside the rank's ``storage_data``): for each row of the
    rank's table, the output file and the absolute offset of the key's data in it; and the
    rank's write items (by position in its plan) that another rank writes instead."""

    file: np.ndarray  # int32 [table rows]
    start: np.ndarray  # int64 [table rows]
    skip: np.ndarray  # int64 [items skipped], ascending


def check_and_dedup(g: GlobalChunks) -> Dedup:
    """(coordinator) Check that each key's chunks tile its tensor exactly once, and pick one
    writer for every chunk that several ranks hold (replicated tensors).

    A replicated chunk goes to the holder that writes the fewest bytes so far, counting first
    every rank's unreplicated chunks, so replicated tensors spread over the ranks instead of
    landing on the lowest one. Linear in chunks when each key's chunks come in order (ranks in
    mesh order: every DTensor layout) and tile it band by band (``plan/tiling.py``); a key's
    chunks out of order are sorted, and a key that fails the band check is checked exactly by a
    sweep over its first dimension.

    Raises:
        ValueError: a chunk outside its tensor, or a key whose chunks leave a gap or overlap,
            naming the key, its shape and a chunk involved.
    """
    shapes = g.shapes()
    order, key, rank = _by_key(g)
    bounds = np.searchsorted(key, np.arange(len(g.specs) + 1, dtype=key.dtype))  # key's dtype
    # np.take: several times faster than fancy indexing for rows of a 2-D array.
    offsets, sizes = np.take(g.offsets, order, axis=0), np.take(g.sizes, order, axis=0)
    check_inside(g, offsets, sizes, bounds, shapes)
    same = _equal_neighbours(key, bounds, order, rank, offsets, sizes)
    nd = g.ndim.astype(np.int8)[key]
    nbytes = chunk_bytes(g, key, nd, sizes)
    check_tiling(g, key, order, offsets, sizes, nd, shapes, ~same & (nbytes > 0))
    del offsets, sizes, nd  # millions of rows each, not needed by the choice of writers
    return dedup(g, order, key, rank, same, nbytes)


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
        return (
            order,
            np.repeat(keys[by_key].astype(np.int32), world),
            np.tile(np.arange(world, dtype=np.int32), len(keys)),
        )
    order = np.argsort(g.key.astype(np.int16 if len(g.specs) < 2**15 else np.int64), kind="stable")
    return order, g.key[order], g.rank[order]


def _equal_neighbours(
    key: np.ndarray,
    bounds: np.ndarray,
    order: np.ndarray,
    rank: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
) -> np.ndarray:
    """Per row (grouped by ``key``, key ``k``'s rows ``bounds[k]:bounds[k + 1]``): whether it
    is the same chunk as the row before. Equal chunks must be neighbours: each key's rows sorted
    by offsets, then sizes. Ranks list a key's chunks in that order already for DTensor
    layouts; only keys out of order are sorted (``order``, ``rank``, ``offsets`` and ``sizes``
    in place)."""
    later, equal = against_previous([*offsets.T, *sizes.T])
    same_key = key[1:] == key[:-1]
    unsorted = np.unique(key[1:][same_key & ~(later | equal)]).tolist()
    for k in unsorted:
        a, b = bounds[k], bounds[k + 1]
        o = np.lexsort((*sizes[a:b].T[::-1], *offsets[a:b].T[::-1]))
        order[a:b], rank[a:b] = order[a:b][o], rank[a:b][o]
        offsets[a:b], sizes[a:b] = offsets[a:b][o], sizes[a:b][o]
        # This key's pairs only.
        later[a : b - 1], equal[a : b - 1] = against_previous([*offsets[a:b].T, *sizes[a:b].T])
    same = np.zeros(len(key), dtype=bool)
    same[1:] = same_key & equal
    return same


def table_plans(g: GlobalChunks, layout: Layout, dedup: Dedup) -> list[TablePlan]:
    """(coordinator) Each rank's :class:`TablePlan`. Ranks sending the same table share its
    ``file``/``start`` arrays, so the coordinator holds and packs them once."""
    file_of = np.array([layout.file_of[s.key] for s in g.specs], dtype=np.int32)
    start_of = np.array([layout.tensor_start[s.key] for s in g.specs], dtype=np.int64)
    per_table = [
        (packed_array(file_of[keys]), packed_array(start_of[keys])) for keys in g.table_keys
    ]  # packed once, sent in many plans
    skip_rank = g.rank[dedup.dropped]
    bounds = np.searchsorted(skip_rank, np.arange(len(g.table_of_rank) + 1, dtype=skip_rank.dtype))
    empty = np.empty(0, dtype=np.int64)
    plans = []
    for r, t in enumerate(g.table_of_rank.tolist()):
        a, b = bounds[r], bounds[r + 1]
        skip = dedup.dropped[a:b] - g.rank_start[r] if b > a else empty
        plans.append(TablePlan(per_table[t][0], per_table[t][1], skip))
    return plans


def xor_shares(
    g_keys: Sequence[np.ndarray],
    table_of_rank: np.ndarray,
    shares: Sequence[tuple[np.ndarray, np.ndarray]],
    n_keys: int,
) -> np.ndarray:
    """(coordinator) Each key's CRC32: the XOR of every rank's shares. ``shares[r]`` is rank
    r's ``(table rows, crc shares)``; ``g_keys``/``table_of_rank`` as in :class:`GlobalChunks`."""
    out = np.zeros(n_keys, dtype=np.uint64)
    for r, (rows, crcs) in enumerate(shares):
        if len(rows):
            np.bitwise_xor.at(out, g_keys[int(table_of_rank[r])][rows], crcs.astype(np.uint64))
    return out


@dataclass(frozen=True)
class SavePlanned:
    """The coordinator's plan of a save from every rank's compact local plan: the layout, each
    rank's table plan, the key tables (``(table_keys, table_of_rank)``, what ``finish`` combines
    the CRC32s with) and, for stores that want it, every chunk placed in its rank's staged
    objects."""

    layout: Layout
    tables: list[TablePlan]
    key_tables: tuple[list[np.ndarray], np.ndarray]
    placed: PlacedChunks | None


def plan_save(
    chunks: Sequence[LocalChunks],
    *,
    max_shard_bytes: int,
    fqn_to_index_mapping: dict[str, int] | None,
    placement: bool,
    file_name: str | None = None,
) -> SavePlanned:
    """(coordinator) Gather the ranks' chunks, check that each tensor's chunks tile it (one
    writer per replicated chunk), plan the layout and each rank's table plan; ``placement``:
    also place every chunk (``plan/placed.py``). Pure.

    Raises:
        ValueError: chunks that do not tile their tensor, or a bad layout option.
    """
    g = gather(chunks)
    dedup = check_and_dedup(g)
    layout = plan_layout(
        g.specs,
        max_shard_bytes=max_shard_bytes,
        fqn_to_index_mapping=fqn_to_index_mapping,
        file_name=file_name,
    )
    tables = table_plans(g, layout, dedup)
    placed = place_chunks(g, dedup, layout) if placement else None
    return SavePlanned(layout, tables, (g.table_keys, g.table_of_rank), placed)


def planner_data_to_send(planner_data: Any) -> Any:
    """(each rank) What of a local plan's ``planner_data`` DCP gathers: DCP's flattening map of a
    flat state dict (each key to itself) says nothing, and from thousands of ranks it would cost
    the coordinator GiBs, so it goes only where some key maps elsewhere; an FP8 export's own
    entries (``plan/fp8export.py``) always go."""
    if not isinstance(planner_data, Mapping):
        return planner_data
    paths = {k: v for k, v in planner_data.items() if k not in EXPORT_KEYS}
    if all(tuple(path) == (key,) for key, path in paths.items()):
        return {k: v for k, v in planner_data.items() if k in EXPORT_KEYS}
    return planner_data
