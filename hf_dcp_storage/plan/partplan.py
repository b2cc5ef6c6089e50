"""A part store's save (S3, GCS, Azure): every file's parts and the gathering tasks of its
mixed parts, from its placed chunks.

The coordinator plans every file's parts from the byte runs the chunks make in it
(``plan/parts.plan_file_parts``) and, for each gathered part, where its bytes sit in the ranks'
staged objects, given out to the ranks by bytes, each rank's share one ``plan/spread.py``
``GatherTasks``. A column-sharded tensor makes one run per row per rank (161 M runs at 405B over
1,024 x 8 ranks): such a tensor is one run of mixed ranks here, always gathered, and its chunks are
named whole in the tasks, so nothing is ever done per row on the coordinator. Everything else is
numpy over the chunks, an object per part and a Python step per rank where shares are made.

What the ranks do agrees by construction: a rank routes each byte run it writes into one of its own
parts or into its staged object of the file (``plan/parts.route_run``), chunk after chunk in output
order (``stores/base.py``'s ``in_write_order``), so its staged bytes of a file are, in that order,
the bytes of its chunks not in its parts: a column-sharded chunk whole, a row-sharded one in the
pieces the parts leave. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .layout import Layout
from .parts import S3_RULES, GatherPart, PartRules, RankPart, gather_part_bytes, plan_file_parts
from .placed import PlacedChunks, key_strides, stable_order
from .spread import GatherTasks, assign, file_tensors

__all__ = ["PartPlan", "PartsRankPlan", "parts_rank_plans", "plan_parts"]


@dataclass(frozen=True)
class PartPlan:
    """Every file's parts (``parts[f]``, numbered from 1 in file order) and each rank's share of
    the gathered ones (``tasks[rank]``, in file order)."""

    parts: list[list[RankPart | GatherPart]]
    tasks: list[GatherTasks]


@dataclass(frozen=True)
class PartsRankPlan:
    """What a rank of a part store's save is told besides its place in the layout: the parts it
    uploads of its own, and (S3) the multipart uploads it sends parts to (of its own or
    gathered)."""

    # file index -> upload id, of the files this rank sends parts to (a failing rank aborts the
    # rest from the save record)
    uploads: Mapping[int, str]
    parts: Mapping[int, tuple[RankPart, ...]]  # file index -> this rank's parts, by start
    headers: Mapping[int, bytes]  # file index -> header, where this rank's part carries it


def parts_rank_plans(
    layout: Layout,
    parts: Sequence[Sequence[RankPart | GatherPart]],
    uploads: Mapping[int, str],
    tasks: Sequence[GatherTasks],
) -> list[PartsRankPlan]:
    """(coordinator) Each rank's ``PartsRankPlan``: its own parts by file (one pass over all parts,
    not one per rank), the headers its parts carry, and only the uploads it sends parts to (all
    of them in every plan were a quarter of what the coordinator sent at 8,192 ranks). Pure."""
    own: dict[int, dict[int, list[RankPart]]] = {}
    for f, file_parts in enumerate(parts):
        for p in file_parts:
            if isinstance(p, RankPart):
                own.setdefault(p.rank, {}).setdefault(f, []).append(p)
    out = []
    for rank, mine in enumerate(tasks):
        by_file = {f: tuple(ps) for f, ps in own.get(rank, {}).items()}
        headers = {
            f: layout.files[f].header for f, ps in by_file.items() if any(p.header for p in ps)
        }
        sends = set(by_file) | set(mine.parts[:, 0].tolist())
        out.append(
            PartsRankPlan({f: uploads[f] for f in sorted(sends) if f in uploads}, by_file, headers)
        )
    return out


def plan_parts(
    placed: PlacedChunks, layout: Layout, world: int, rules: PartRules = S3_RULES
) -> PartPlan:
    """(coordinator) Plan a part store's save: its parts and gathering tasks, spread over ``world``
    ranks by bytes (``plan/spread.assign``, counting the bytes each rank uploads of its own). Pure.
    ``rules``: the store's part rules (GCS and Azure plan their parts here too, with theirs).

    Raises:
        ValueError: a file needs more than ``rules.max_parts`` parts (S3's 10,000).
    """
    strided = _strided(placed)
    file_base = np.concatenate(([0], np.cumsum([f.size for f in layout.files], dtype=np.int64)))
    position = (
        file_base[placed.file] + placed.start
    )  # of each chunk's first byte, in all files' bytes
    # Byte runs: a row-sharded chunk is one; a column-sharded tensor one, of rank -1.
    row = np.flatnonzero(~strided & (placed.nbytes > 0))
    mixed_keys = np.flatnonzero(np.bincount(placed.key[strided], minlength=len(placed.key_names)))
    key_bytes = (
        np.array(
            [
                np.prod(s[:n])
                for s, n in zip(
                    placed.shape[mixed_keys].tolist(), placed.ndim[mixed_keys].tolist(), strict=True
                )
            ],
            dtype=np.int64,
        )
        * placed.itemsize[mixed_keys]
    )
    # A run's chunk in ``placed``; a column-sharded tensor's ``-1 - m``, ``m`` its place in
    # ``mixed_keys``.
    run_chunk = np.concatenate((row, -1 - np.arange(len(mixed_keys))))
    order, start = _file_order(
        np.concatenate(
            (
                position[row],
                file_base[placed.key_file[mixed_keys]] + placed.tensor_start[mixed_keys],
            )
        ),
        np.concatenate((placed.key[row], mixed_keys)),
        placed,
        file_base,
    )
    chunk = run_chunk[order]
    del order, run_chunk, row
    # The rest of each run from its chunk (a gather per column: chunks listed rank after rank
    # come here key after key), then a mixed tensor's (where ``chunk`` counts from the end).
    runs = _Runs(start, placed.nbytes[chunk], placed.rank[chunk], (placed.staged - position)[chunk])
    mixed = np.flatnonzero(chunk < 0)
    runs.nbytes[mixed], runs.rank[mixed] = key_bytes[-1 - chunk[mixed]], -1
    del chunk, mixed
    bounds = np.searchsorted(runs.start, file_base)
    gather_part = gather_part_bytes(int(placed.nbytes.sum()), world, rules.min_part)
    parts = []
    for f, plan in enumerate(layout.files):
        a, b = bounds[f], bounds[f + 1]
        parts.append(
            plan_file_parts(
                len(plan.header),
                plan.size,
                *_joined(runs.start[a:b] - file_base[f], runs.nbytes[a:b], runs.rank[a:b]),
                min_part=rules.min_part,
                rank_part=rules.rank_part,
                gather_part=gather_part,
                max_parts=rules.max_parts,
            )
        )
    return PartPlan(
        parts, _gather_tasks(placed, layout, parts, strided, runs, position, file_base, world)
    )


@dataclass(frozen=True)
class _Runs:
    """The save's byte runs in output order, all files' bytes end to end: where each starts, its
    bytes, its rank (``-1``: a column-sharded tensor, one run) and, of a row-sharded chunk, its
    offset in its rank's staged object less its start, were the rank to stage it whole."""

    start: np.ndarray
    nbytes: np.ndarray
    rank: np.ndarray
    staged: np.ndarray


def _joined(
    start: np.ndarray, nbytes: np.ndarray, rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One file's runs with neighbouring runs of one rank joined (a rank's small tensors side by
    side, a one-rank save), as ``plan_file_parts`` takes them."""
    new = np.ones(len(start), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (rank[1:] < 0)
    heads = np.flatnonzero(new)
    if len(heads) == len(start):
        return start, nbytes, rank
    return start[heads], np.add.reduceat(nbytes, heads), rank[heads]


def _file_order(
    start: np.ndarray, key: np.ndarray, placed: PlacedChunks, file_base: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The order of runs (chunks of ``key``s, listed rank after rank; ``start`` in all files'
    bytes) in output order, and their starts in it: by key in output order (a radix sort),
    which puts them in order already when each key's chunks come rank after rank in output
    order (row shards: FSDP); else a full sort."""
    key_at = file_base[placed.key_file] + placed.tensor_start
    key_ordinal = np.empty(len(key_at), dtype=np.int64)
    key_ordinal[np.argsort(key_at, kind="stable")] = np.arange(len(key_at))
    order = stable_order(key_ordinal[key])
    ordered = start[order]
    if len(order) > 1 and not (ordered[1:] > ordered[:-1]).all():
        order = np.argsort(start, kind="stable")
        ordered = start[order]
    return order, ordered


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


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The indices ``lo[0]:hi[0]``, then ``lo[1]:hi[1]``, ... in one array."""
    n = hi - lo
    return np.arange(int(n.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(n) - n), n)


def _gather_tasks(
    placed: PlacedChunks,
    layout: Layout,
    parts: list[list[RankPart | GatherPart]],
    strided: np.ndarray,
    runs: _Runs,
    position: np.ndarray,
    file_base: np.ndarray,
    world: int,
) -> list[GatherTasks]:
    """Each rank's gathered parts, with what each holds: the header's bytes in it, the staged
    pieces of row-sharded chunks in it, and the column-sharded chunks that reach into it.

    The parts are given out first and taken rank after rank (their slots); the runs and the
    column-sharded chunks, in output order, are searched once per part (a part's runs are a
    range of them), so every row is built straight where it ends up and each rank's share is a
    slice: nothing is searched per chunk, and only the column-sharded chunks are sorted (by
    key, a radix sort; FSDP x TP lists them in order). Where a rank uploads parts of its own, its
    staged object lacks their bytes, so its later staged offsets in that file move down."""
    flat = [p for ps in parts for p in ps]
    # Parts as arrays, in output order (file after file).
    p_file = np.repeat(np.arange(len(parts)), [len(ps) for ps in parts])
    p_start = np.array([p.start for p in flat], dtype=np.int64)
    p_end = np.array([p.end for p in flat], dtype=np.int64)
    p_lo, p_hi = p_start + file_base[p_file], p_end + file_base[p_file]
    p_gather = np.array([isinstance(p, GatherPart) for p in flat], dtype=bool)
    gathered = np.flatnonzero(p_gather)
    # Who gathers each part; the gathered parts rank after rank (a part's slot: its place there).
    rank_of = np.array(
        assign((p_end - p_start)[gathered].tolist(), placed.bytes_per_rank(world).tolist()),
        dtype=np.int64,
    )
    by_rank = np.argsort(rank_of, kind="stable")
    rank_at = np.searchsorted(rank_of[by_rank], np.arange(world + 1))
    in_file, tensors = file_tensors(layout, placed.key_names)
    width = placed.offsets.shape[1]
    # Row-sharded pieces: each gathered part's runs (in slot order), the first and last cut to
    # the part. ``runs`` without the column-sharded tensors, where there are any.
    row = np.flatnonzero(runs.rank >= 0) if (runs.rank < 0).any() else slice(None)
    start, rank, staged = runs.start[row], runs.rank[row], runs.staged[row]
    end = start + runs.nbytes[row]
    del row
    order = gathered[by_rank]
    lo, hi = p_lo[order], p_hi[order]
    take, counts = _reaching(start, end, lo, hi)
    piece_at = np.concatenate(([0], np.cumsum(counts)))
    some = np.flatnonzero(counts)
    a, b = start[take], end[take]
    a[piece_at[some]] = np.maximum(a[piece_at[some]], lo[some])
    b[piece_at[some + 1] - 1] = np.minimum(b[piece_at[some + 1] - 1], hi[some])
    del some, end
    pieces = np.empty((len(take), 4), dtype=np.int64, order="F")  # written a column at a time
    pieces[:, 0] = rank[take]
    pieces[:, 2] = staged[take] + a  # the piece's staged offset, were its rank to stage every byte
    pieces[:, 3] = b - a
    del b
    a -= np.repeat(file_base[p_file[order]], counts)
    pieces[:, 1] = a
    del take, start, rank, staged, a
    # Column-sharded chunks (each staged whole), in output order by first byte: every gathered
    # part between their first and last byte.
    c = np.flatnonzero(strided & (placed.nbytes > 0))
    c_order, c_lo = _file_order(position[c], placed.key[c], placed, file_base)
    c = c[c_order]
    del c_order
    # Their columns gathered once in this order (the jumps), then taken part by part (ranges).
    c_key, c_offsets, c_sizes = (
        placed.key[c],
        np.take(placed.offsets, c, axis=0),
        np.take(placed.sizes, c, axis=0),
    )
    c_take, c_counts = _reaching(
        c_lo,
        _last_byte(placed, c_key, c_offsets, c_sizes) + file_base[placed.key_file[c_key]] + 1,
        lo,
        hi,
    )
    strided_at = np.concatenate(([0], np.cumsum(c_counts)))
    del c_lo, lo, hi
    col_rows = np.empty((len(c_take), 3 + 2 * width), dtype=np.int64, order="F")
    col_rows[:, 0] = placed.rank[c][c_take]
    col_rows[:, 1] = in_file[c_key][c_take]
    col_rows[:, 2] = placed.staged[c][c_take]
    for d in range(width):
        col_rows[:, 3 + d], col_rows[:, 3 + width + d] = (
            c_offsets[:, d][c_take],
            c_sizes[:, d][c_take],
        )
    del c, c_key, c_offsets, c_sizes, c_take
    own = np.flatnonzero(~p_gather)
    if len(own):  # a rank stages none of its own parts' bytes: its later staged bytes move down
        before = _own_bytes_before(
            own,
            np.array([flat[j].rank for j in own.tolist()], dtype=np.int64),
            p_end - p_start,
            np.searchsorted(p_file, p_file),
        )
        pieces[:, 2] -= before(pieces[:, 0], np.repeat(order, counts))
        col_rows[:, 2] -= before(col_rows[:, 0], np.repeat(order, c_counts))
    del own, counts, c_counts
    if len(col_rows) and int(col_rows.min()) >= 0 and int(col_rows.max()) < 2**31:
        col_rows = col_rows.astype(
            np.int32, order="C"
        )  # half the bytes sent (staged offsets fit at thousands of ranks)
    # Each rank's share: slices of the arrays above.
    table = np.stack(
        (
            p_file[order],
            np.array([flat[j].number for j in order.tolist()], dtype=np.int64),
            p_start[order],
            p_end[order],
        ),
        axis=1,
    )
    headers = [f.header for f in layout.files]
    in_header = np.flatnonzero(
        p_start[order] < np.array([len(h) for h in headers], dtype=np.int64)[p_file[order]]
    )
    heads = {
        k: headers[p_file[j]][p_start[j] : p_end[j]]
        for k, j in zip(in_header.tolist(), order[in_header].tolist(), strict=True)
    }
    names = (strided_at[1:] > strided_at[:-1]).tolist()
    out = []
    for r in range(world):
        i, j = int(rank_at[r]), int(rank_at[r + 1])
        pa, pb, ca, cb = piece_at[i], piece_at[j], strided_at[i], strided_at[j]
        files = {int(table[k, 0]) for k in range(i, j) if names[k]} if cb > ca else set()
        out.append(
            GatherTasks(
                table[i:j],
                piece_at[i : j + 1] - pa,
                pieces[pa:pb],
                strided_at[i : j + 1] - ca,
                col_rows[ca:cb],
                {k - i: heads[k] for k in range(i, j) if k in heads},
                {f: tensors[f] for f in sorted(files)},
                width,
            )
        )
    return out


def _reaching(
    lo: np.ndarray, hi: np.ndarray, part_lo: np.ndarray, part_hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The items (byte ranges ``[lo, hi)``, sorted by ``lo``) that reach into each part
    ``[part_lo, part_hi)``, part after part, and how many per part. Where the ``hi`` are sorted
    too (disjoint runs; a grid's chunks) a part's items are a range; else the ranges by the
    running maximum of ``hi`` hold them, and the rest are dropped."""
    sorted_hi = len(hi) < 2 or bool((hi[1:] >= hi[:-1]).all())
    reach = hi if sorted_hi else np.maximum.accumulate(hi)
    first, stop = np.searchsorted(reach, part_lo, side="right"), np.searchsorted(lo, part_hi)
    take, counts = _ranges(first, stop), stop - first
    if not sorted_hi:
        part = np.repeat(np.arange(len(part_lo)), counts)
        keep = hi[take] > part_lo[part]
        take, counts = take[keep], np.bincount(part[keep], minlength=len(part_lo))
    return take, counts


def _own_bytes_before(
    own: np.ndarray, own_rank: np.ndarray, nbytes: np.ndarray, file_first: np.ndarray
) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``before(rank, part)``: the bytes of ``rank``'s own parts (indices ``own``, of ranks
    ``own_rank``; ``nbytes`` and the first part of its file per part) that come before part
    ``part`` in its file, which its rank does not stage."""
    span = len(nbytes)
    key = own_rank * span + own
    order = np.argsort(key, kind="stable")
    key = key[order]
    cum = np.concatenate(([0], np.cumsum(nbytes[own][order])))

    def before(rank: np.ndarray, part: np.ndarray) -> np.ndarray:
        return (
            cum[np.searchsorted(key, rank * span + part)]
            - cum[np.searchsorted(key, rank * span + file_first[part])]
        )

    return before


def _last_byte(
    placed: PlacedChunks, key: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
) -> np.ndarray:
    """Offset in its file of the last byte of each chunk (of ``key``, at ``offsets`` with
    ``sizes``): a column at a time, each key's strides from a small table (zero past its ndim,
    where offsets and sizes are zero too)."""
    strides = key_strides(placed.shape, placed.ndim)
    element = np.zeros(len(key), dtype=np.int64)
    for d in range(offsets.shape[1]):
        element += (offsets[:, d] + sizes[:, d] - 1) * strides[:, d][key]
    return placed.tensor_start[key] + (element + 1) * placed.itemsize[key] - 1
