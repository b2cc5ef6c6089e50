"""An S3 save's multipart parts, and the gathering tasks of its mixed parts, from its placed chunks.

The coordinator plans every file's parts from the byte runs the chunks make in it
(``_s3parts.plan_file_parts``) and, for each gathered part, where its bytes sit in the ranks'
staged objects, given out to the ranks by bytes, each rank's share one ``_spread.GatherTasks``.
A column-sharded tensor makes one run per row per rank (161 M runs at 405B over 1,024 x 8
ranks): such a tensor is one run of mixed ranks here, always gathered, and its chunks are named
whole in the tasks, so nothing is ever done per row on the coordinator. Everything else is numpy
over the chunks, a Python step per part where parts are cut and per rank where shares are made.

What the ranks do agrees by construction: a rank routes each byte run it writes into one of its
own parts or into its staged object of the file (``_s3parts.route_run``), chunk after chunk in
output order (``writer._in_write_order``), so its staged bytes of a file are, in that order, the
bytes of its chunks not in its parts: a column-sharded chunk whole, a row-sharded one in the
pieces the parts leave. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._layout import Layout
from ._placed import PlacedChunks, key_strides, stable_order, staged_offsets
from ._s3parts import GatherPart, RankPart, gather_part_bytes, plan_file_parts
from ._spread import GatherTasks, assign, file_tensors

__all__ = ["S3Plan", "plan_s3"]


@dataclass(frozen=True)
class S3Plan:
    """Every file's parts (``parts[f]``, numbered from 1 in file order) and each rank's share of
    the gathered ones (``tasks[rank]``, in file order)."""

    parts: list[list[RankPart | GatherPart]]
    tasks: list[GatherTasks]


def plan_s3(placed: PlacedChunks, layout: Layout, world: int) -> S3Plan:
    """(coordinator) Plan an S3 save's parts and gathering tasks, spread over ``world`` ranks by
    bytes (``_spread.assign``, counting the bytes each rank uploads of its own). Pure.

    Raises:
        ValueError: a file needs more than S3's 10,000 parts.
    """
    strided = _strided(placed)
    nfiles = len(layout.files)
    file_base = np.concatenate(([0], np.cumsum([f.size for f in layout.files], dtype=np.int64)))

    # Byte runs in file order: a row-sharded chunk is one; a column-sharded tensor one, rank -1.
    row = np.flatnonzero(~strided & (placed.nbytes > 0))
    mixed_keys = np.flatnonzero(np.bincount(placed.key[strided], minlength=len(placed.key_names)))
    key_bytes = np.array([np.prod(s[: n]) for s, n in zip(placed.shape[mixed_keys].tolist(), placed.ndim[mixed_keys].tolist(), strict=True)], dtype=np.int64) * placed.itemsize[mixed_keys]
    run_file = np.concatenate((placed.file[row], placed.key_file[mixed_keys]))
    run_start = np.concatenate((placed.start[row], placed.tensor_start[mixed_keys]))
    run_bytes = np.concatenate((placed.nbytes[row], key_bytes))
    run_rank = np.concatenate((placed.rank[row], np.full(len(mixed_keys), -1, dtype=np.int64)))
    order = _file_order(run_file, run_start, np.concatenate((placed.key[row], mixed_keys)), placed, file_base)
    run_file, run_start, run_bytes, run_rank = run_file[order], run_start[order], run_bytes[order], run_rank[order]
    del order
    # Neighbouring runs of one rank join (a rank's small tensors side by side, a one-rank save).
    new = np.ones(len(run_file), dtype=bool)
    new[1:] = (run_file[1:] != run_file[:-1]) | (run_rank[1:] != run_rank[:-1]) | (run_rank[1:] < 0)
    heads = np.flatnonzero(new)
    run_file, run_start, run_rank = run_file[heads], run_start[heads], run_rank[heads]
    run_bytes = np.add.reduceat(run_bytes, heads) if len(heads) else run_bytes[:0]
    bounds = np.searchsorted(run_file, np.arange(nfiles + 1))
    gather_part = gather_part_bytes(int(placed.nbytes.sum()), world)
    parts = []
    for f, plan in enumerate(layout.files):
        a, b = bounds[f], bounds[f + 1]
        parts.append(plan_file_parts(len(plan.header), plan.size, run_start[a:b], run_bytes[a:b], run_rank[a:b], gather_part=gather_part))
    del run_file, run_start, run_bytes, run_rank  # a row per chunk: freed before the tasks' arrays
    return S3Plan(parts, _gather_tasks(placed, layout, parts, strided, file_base, world))


def _file_order(file: np.ndarray, start: np.ndarray, key: np.ndarray, placed: PlacedChunks, file_base: np.ndarray) -> np.ndarray:
    """The order of runs (chunks of ``key``s, listed rank after rank) in output order: by key in
    output order (a radix sort), which puts them in order already when each key's chunks come
    rank after rank in output order (row shards: FSDP); else a full sort."""
    key_at = file_base[placed.key_file] + placed.tensor_start
    key_ordinal = np.empty(len(key_at), dtype=np.int64)
    key_ordinal[np.argsort(key_at, kind="stable")] = np.arange(len(key_at))
    order = stable_order(key_ordinal[key])
    position = file_base[file] + start
    if len(order) > 1 and not (position[order][1:] > position[order][:-1]).all():
        order = np.argsort(position, kind="stable")
    return order


def _strided(placed: PlacedChunks) -> np.ndarray:
    """Per chunk: whether its tensor has a chunk of several runs (a column shard), so the whole
    tensor is gathered. A chunk is several runs when it is cut in some dimension and holds more
    than one index of an earlier one; a column at a time, from the last dimension."""
    several = np.zeros(len(placed.key), dtype=bool)
    cut_after = np.zeros(len(placed.key), dtype=bool)  # not whole in some later dimension
    for d in range(placed.offsets.shape[1] - 1, -1, -1):
        size = placed.sizes[:, d]
        several |= cut_after & (size != 1)
        cut_after |= size != placed.shape[:, d][placed.key]  # padded dims: 0 == 0, whole
    several &= placed.nbytes > 0
    mixed = np.zeros(len(placed.shape), dtype=bool)
    mixed[placed.key[several]] = True
    return mixed[placed.key]


def _gather_tasks(placed: PlacedChunks, layout: Layout, parts: list[list[RankPart | GatherPart]], strided: np.ndarray, file_base: np.ndarray, world: int) -> list[GatherTasks]:
    """Each rank's gathered parts, with what each holds: the header's bytes in it, the staged
    pieces of row-sharded chunks in it, and the column-sharded chunks that reach into it.

    The parts are given out first, so that every row is put straight where it ends up (rank
    after rank, part after part) and each rank's share is a slice: a row-sharded chunk's pieces
    are several hundred MiB at 405B over 8,192 ranks, and a second copy of them would be the
    coordinator's largest allocation."""
    flat = [p for ps in parts for p in ps]
    # Parts as arrays, in global byte order (file after file).
    p_file = np.repeat(np.arange(len(parts)), [len(ps) for ps in parts])
    p_start = np.array([p.start for p in flat], dtype=np.int64)
    p_end = np.array([p.end for p in flat], dtype=np.int64)
    p_lo, p_hi = p_start + file_base[p_file], p_end + file_base[p_file]
    p_gather = np.array([isinstance(p, GatherPart) for p in flat], dtype=bool)
    gathered = np.flatnonzero(p_gather)
    # Who gathers each part; its slot: its place among all gathered parts, rank after rank.
    rank_of = np.array(assign((p_end - p_start)[gathered].tolist(), placed.bytes_per_rank(world).tolist()), dtype=np.int64)
    by_rank = np.argsort(rank_of, kind="stable")
    slot = np.full(len(flat), -1, dtype=np.int64)
    slot[gathered[by_rank]] = np.arange(len(gathered))
    rank_at = np.searchsorted(rank_of[by_rank], np.arange(world + 1))
    in_file, tensors = file_tensors(layout, placed.key_names)
    width = placed.offsets.shape[1]
    # Each chunk in the order its rank stages (placed order), cut where parts begin: a
    # row-sharded chunk into its pieces per part, a column-sharded one whole (all staged).
    lo = file_base[placed.file] + placed.start
    hi = lo + placed.nbytes
    first = np.searchsorted(p_lo, lo, side="right") - 1
    # The part of a chunk's last byte: its first part's, but for the few chunks that reach past it.
    last = first.copy()
    beyond = np.flatnonzero(hi > p_hi[np.minimum(first, len(p_hi) - 1)])
    last[beyond] = np.searchsorted(p_lo, hi[beyond], side="left") - 1
    count = np.where(placed.nbytes > 0, np.where(strided, 1, last - first + 1), 0)
    del last, beyond
    chunk = np.repeat(np.arange(len(lo)), count)
    part = first[chunk] + (np.arange(len(chunk)) - np.repeat(np.cumsum(count) - count, count))
    del count
    col = strided[chunk]
    in_part = np.minimum(part, len(p_lo) - 1)  # a column-sharded chunk's ``part`` means nothing
    staged = col | p_gather[in_part]
    if not staged.all():  # at thousands of ranks every byte is gathered: no copies then
        chunk, part, in_part, col = chunk[staged], part[staged], in_part[staged], col[staged]
    a = np.where(col, lo[chunk], np.maximum(lo[chunk], p_lo[in_part]))
    nbytes = np.where(col, hi[chunk], np.minimum(hi[chunk], p_hi[in_part])) - a
    del in_part, hi, lo
    offset = staged_offsets(placed.rank[chunk], placed.file[chunk], nbytes)
    # What the column-sharded chunks need below, so that the rest can go first.
    cols = np.flatnonzero(col)
    c, c_offset = chunk[cols], offset[cols]
    c_first = first[c]
    del first, cols
    # Row-sharded pieces, rows (rank, file offset, staged offset, bytes), by slot of their part.
    rows = None if not col.any() else np.flatnonzero(~col)

    def row_sharded(x: np.ndarray) -> np.ndarray:
        return x if rows is None else x[rows]

    rc = row_sharded(chunk)
    row_slot = slot[row_sharded(part)]
    del part, chunk
    by_slot = stable_order(row_slot)
    piece_at = np.searchsorted(row_slot[by_slot], np.arange(len(gathered) + 1))
    del row_slot
    pieces = np.empty((len(by_slot), 4), dtype=np.int64)
    pieces[:, 0] = placed.rank[rc][by_slot]
    pieces[:, 1] = (row_sharded(a) - file_base[placed.file[rc]])[by_slot]
    pieces[:, 2] = row_sharded(offset)[by_slot]
    pieces[:, 3] = row_sharded(nbytes)[by_slot]
    del rc, by_slot, a, nbytes, offset
    # Column-sharded chunks: every gathered part their first to last byte reaches.
    extent_hi = _last_byte(placed, c) + file_base[placed.file[c]] + 1
    c_last = c_first.copy()
    beyond = np.flatnonzero(extent_hi > p_hi[c_first])
    c_last[beyond] = np.searchsorted(p_lo, extent_hi[beyond], side="left") - 1
    c_count = c_last - c_first + 1
    del c_last, beyond, extent_hi
    which = np.repeat(np.arange(len(c)), c_count)
    c_slot = slot[c_first[which] + (np.arange(len(which)) - np.repeat(np.cumsum(c_count) - c_count, c_count))]
    which, c_slot = which[c_slot >= 0], c_slot[c_slot >= 0]
    o = stable_order(c_slot)
    which, c_slot = which[o], c_slot[o]
    strided_at = np.searchsorted(c_slot, np.arange(len(gathered) + 1))
    cc = c[which]
    col_rows = np.empty((len(cc), 3 + 2 * width), dtype=np.int64)
    col_rows[:, 0] = placed.rank[cc]
    col_rows[:, 1] = in_file[placed.key[cc]]
    col_rows[:, 2] = c_offset[which]
    col_rows[:, 3 : 3 + width] = np.take(placed.offsets, cc, axis=0)
    col_rows[:, 3 + width :] = np.take(placed.sizes, cc, axis=0)
    del cc, which, c, c_offset
    # Each rank's share: slices of the arrays above.
    order = gathered[by_rank]
    table = np.stack((p_file[order], np.array([flat[j].number for j in order.tolist()], dtype=np.int64), p_start[order], p_end[order]), axis=1)
    headers = [f.header for f in layout.files]
    heads = {int(slot[j]): headers[p_file[j]][p_start[j] : p_end[j]] for j in gathered[p_start[gathered] < np.array([len(h) for h in headers], dtype=np.int64)[p_file[gathered]]].tolist()}
    names = (strided_at[1:] > strided_at[:-1]).tolist()
    out = []
    for r in range(world):
        i, j = int(rank_at[r]), int(rank_at[r + 1])
        pa, pb, ca, cb = piece_at[i], piece_at[j], strided_at[i], strided_at[j]
        files = {int(table[k, 0]) for k in range(i, j) if names[k]} if cb > ca else set()
        out.append(
            GatherTasks(
                table[i:j], piece_at[i : j + 1] - pa, pieces[pa:pb], strided_at[i : j + 1] - ca, col_rows[ca:cb],
                {k - i: heads[k] for k in range(i, j) if k in heads}, {f: tensors[f] for f in sorted(files)}, width,
            )
        )
    return out


def _last_byte(placed: PlacedChunks, c: np.ndarray) -> np.ndarray:
    """Offset in its file of each chunk's last byte: a column at a time, each key's strides from
    a small table (zero past its ndim, where offsets and sizes are zero too)."""
    strides = key_strides(placed.shape, placed.ndim)
    key = placed.key[c]
    element = np.zeros(len(c), dtype=np.int64)
    for d in range(placed.offsets.shape[1]):
        element += (placed.offsets[:, d][c] + placed.sizes[:, d][c] - 1) * strides[:, d][key]
    return placed.tensor_start[key] + (element + 1) * placed.itemsize[key] - 1
