"""Each rank's share of a part store's gathered parts (``GatherTasks``), with where every byte of
them sits: in the file's header, in the ranks' staged objects (``plan/partplan.py`` plans the
parts and the save's byte runs, and calls ``gather_tasks``).

Built in six steps, each numpy over all parts at once: the parts as arrays (1), given out to the
ranks by bytes (2); for each gathered part, the staged pieces of row-sharded chunks in it (3) and
the column-sharded chunks that reach into it (4); the staged offsets moved down by the bytes each
rank uploads of its own instead of staging them (5); each rank's share cut out (6). Every row is
built where it ends up (the gathered parts rank after rank), so a share is a slice and nothing is
searched per chunk. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .balance import assign, fill_near
from .fileparts import FileParts, Part
from .layout import Layout
from .placed import PlacedChunks, key_strides, stable_order
from .spread import GatherTasks, file_tensors

__all__ = ["PIECE_BYTES", "Runs", "file_order", "gather_tasks"]

# What a gathered part's piece (one rank's run in it) costs its gathering rank besides its bytes,
# in bytes' worth: a message to receive, or a ranged read of a staged object. Without it, parts
# of thousands of pieces and few bytes (a norm over 8,192 ranks: 4 bytes a rank) cost nothing
# and pile up on one rank: 280,000 pieces on one rank of a 405B save over 8,192 ranks.
PIECE_BYTES = 16 << 10

# A file's ``(tensor_start, shape, itemsize)`` per tensor, as ``GatherTasks.tensors`` holds them.
_Tensors = tuple[tuple[int, tuple[int, ...], int], ...]


@dataclass(frozen=True)
class Runs:
    """The save's byte runs in output order, all files' bytes end to end: where each starts, its
    bytes, its rank (``-1``: a column-sharded tensor, one run) and, of a row-sharded chunk, its
    offset in its rank's staged object less its start, were the rank to stage it whole. All
    ``[r]``; ``start``, ``nbytes`` and ``staged`` int64."""

    start: np.ndarray
    nbytes: np.ndarray
    rank: np.ndarray
    staged: np.ndarray


def gather_tasks(
    placed: PlacedChunks,
    layout: Layout,
    parts: Sequence[Sequence[Part]],
    strided: np.ndarray,
    runs: Runs,
    position: np.ndarray,
    file_base: np.ndarray,
    world: int,
    per_node: int = 1,
) -> list[GatherTasks]:
    """(coordinator) Each rank's gathered parts, with what each holds: the header's bytes in it,
    the staged pieces of row-sharded chunks in it, and the column-sharded chunks that reach into
    it; ``tasks[rank]``, in file order.

    ``parts``: every file's parts, in file order; ``strided``: per chunk of ``placed``, whether
    its tensor is column-sharded; ``runs``: the save's byte runs; ``position``: each chunk's first
    byte and ``file_base``: each file's (int64 ``[files + 1]``, the total last), in all files'
    bytes. Where a rank uploads parts of its own, its staged object lacks their bytes, so its
    later staged offsets in that file move down. ``per_node``: ranks a node (consecutive
    ranks); a gathered part goes to a rank of the node that holds most of its bytes where its
    ranks have room (``plan/balance.fill_near``)."""
    table = _part_table(parts, file_base)
    slots = _slots(table, placed.bytes_per_rank(world), world, runs, per_node)
    lo, hi = table.lo[slots.order], table.hi[slots.order]
    pieces = _row_pieces(runs, lo, hi, file_base[table.file[slots.order]])
    in_file, tensors = file_tensors(layout, placed.key_names)
    columns = _column_chunks(placed, strided, position, file_base, in_file, lo, hi)
    _unstage_own_parts(table, slots.order, pieces, columns)
    columns = _Rows(_narrowed(columns.rows), columns.at)
    headers = [f.header for f in layout.files]
    return _shares(table, slots, pieces, columns, headers, tensors, placed.offsets.shape[1])


@dataclass(frozen=True)
class _PartTable:
    """Every file's parts as int64 arrays ``[n]``, in output order (file after file, by start):
    ``file``, ``number``, ``start`` and ``end`` (in the file), ``lo`` and ``hi`` (the same in all
    files' bytes), and ``rank``: the rank of a ``RankPart``, ``-1`` for a ``GatherPart``."""

    file: np.ndarray
    number: np.ndarray
    start: np.ndarray
    end: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    rank: np.ndarray


@dataclass(frozen=True)
class _Slots:
    """The gathered parts rank after rank, each rank's in file order (a part's slot: its place
    here): ``order`` (int64 ``[g]``), the part of each slot as an index of ``_PartTable``; rank
    ``r`` gathers slots ``rank_at[r]:rank_at[r + 1]`` (int64 ``[world + 1]``)."""

    order: np.ndarray
    rank_at: np.ndarray


@dataclass(frozen=True)
class _Rows:
    """Rows per slot: slot ``k``'s are ``rows[at[k]:at[k + 1]]`` (``at``: int64 ``[g + 1]``);
    column 0 is a rank, column 2 an offset in that rank's staged object of the part's file."""

    rows: np.ndarray
    at: np.ndarray


def _part_table(file_parts: Sequence[Sequence[Part]], file_base: np.ndarray) -> _PartTable:
    """Step 1: ``file_parts`` (every file's, in file order; ``FileParts`` already, where the
    coordinator planned them) as a ``_PartTable``; ``file_base``: each file's first byte in all
    files' bytes."""
    parts = [FileParts.of(ps) for ps in file_parts]
    counts = [len(ps) for ps in parts]
    file = np.repeat(np.arange(len(parts)), counts)
    start = np.concatenate([ps.start for ps in parts] + [np.empty(0, np.int64)])
    end = np.concatenate([ps.end for ps in parts] + [np.empty(0, np.int64)])
    return _PartTable(
        file,
        np.concatenate([np.arange(1, n + 1, dtype=np.int64) for n in counts] + [file[:0]]),
        start,
        end,
        start + file_base[file],
        end + file_base[file],
        np.concatenate([ps.rank for ps in parts] + [np.empty(0, np.int64)]),
    )


def _slots(
    table: _PartTable, load: np.ndarray, world: int, runs: Runs | None = None, per_node: int = 1
) -> _Slots:
    """Step 2: who gathers each gathered part (``plan/balance.py``, by bytes, ``load[r]``: the
    bytes rank ``r`` uploads of its own; with nodes of ``per_node`` ranks, a rank of the node
    holding most of the part's bytes where its ranks have room: ``fill_near``), and the slots
    that makes."""
    gathered = np.flatnonzero(table.rank < 0)
    if per_node > 1 and runs is not None:
        lo, hi = table.lo[gathered], table.hi[gathered]
        prefer = _best_nodes(runs, lo, hi, per_node)
        cost = PIECE_BYTES * _piece_counts(runs, lo, hi)
        rank_of = fill_near((table.end - table.start)[gathered], load, prefer, per_node, cost)
    else:  # no nodes known: by load alone, the busiest within one part of the idlest
        sizes = (table.end - table.start)[gathered].tolist()
        rank_of = np.array(assign(sizes, load.tolist()), dtype=np.int64)
    by_rank = np.argsort(rank_of, kind="stable")
    return _Slots(gathered[by_rank], np.searchsorted(rank_of[by_rank], np.arange(world + 1)))


def _piece_counts(runs: Runs, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per part ``[lo, hi)`` (sorted, disjoint): how many row-sharded runs reach into it, each a
    piece its gathering rank receives (a message, or a ranged read of a staged object)."""
    keep = runs.rank >= 0
    start = runs.start[keep]
    return np.searchsorted(start, hi) - np.searchsorted(start + runs.nbytes[keep], lo, "right")


def _best_nodes(runs: Runs, lo: np.ndarray, hi: np.ndarray, per_node: int) -> np.ndarray:
    """Per part ``[lo, hi)`` (in all files' bytes, sorted, disjoint): the node holding most of
    its row-sharded bytes (``-1``: none, e.g. only a column-sharded tensor's; between nodes
    that hold as much, the part's index picks one). Neighbouring runs of one node are joined
    first (at 8,192 ranks, 8 a node: 8x fewer rows)."""
    keep = np.flatnonzero(runs.rank >= 0)
    start, end = runs.start[keep], runs.start[keep] + runs.nbytes[keep]
    node = runs.rank[keep] // per_node
    new = np.ones(len(keep), dtype=bool)
    new[1:] = (node[1:] != node[:-1]) | (start[1:] != end[:-1])
    heads = np.flatnonzero(new)
    start, node = start[heads], node[heads]
    end = end[np.concatenate((heads[1:] - 1, [len(keep) - 1]))] if len(heads) else end[:0]
    take, counts = _reaching(start, end, lo, hi)
    part = np.repeat(np.arange(len(lo)), counts)
    held = np.minimum(end[take], hi[part]) - np.maximum(start[take], lo[part])
    best = np.full(len(lo), -1, dtype=np.int64)
    if len(take):
        # Per part (its rows side by side), the rows holding the most bytes; between several
        # (a norm's part: every node holds a few bytes of it) the part's number picks one, so
        # such parts go to many nodes, not all to the first.
        some = np.flatnonzero(counts)
        most = np.maximum.reduceat(held, np.cumsum(counts)[some] - counts[some])
        top = np.flatnonzero(held == np.repeat(most, counts[some]))
        first = np.flatnonzero(np.concatenate(([True], part[top][1:] != part[top][:-1])))
        ties = np.diff(np.append(first, len(top)))
        pick = top[first + part[top[first]] % ties]
        best[part[pick]] = node[take[pick]]
    return best


def _row_pieces(runs: Runs, lo: np.ndarray, hi: np.ndarray, base: np.ndarray) -> _Rows:
    """Step 3: the staged pieces of row-sharded chunks in each slot's part (bytes ``[lo, hi)`` in
    all files' bytes, its file's first byte at ``base``; int64 ``[g]`` each): the runs of a rank
    that reach into the part, the first and the last cut to it. Int64 rows ``(rank,
    file_offset, staged_offset, nbytes)``, Fortran order (written a column at a time); the staged
    offset as if the rank staged every byte of the file (step 5 moves it)."""
    # The column-sharded tensors' runs dropped, where there are any (else no copy).
    keep = np.flatnonzero(runs.rank >= 0) if (runs.rank < 0).any() else slice(None)
    start = runs.start[keep]
    end = start + runs.nbytes[keep]
    take, counts = _reaching(start, end, lo, hi)
    a, b = start[take], end[take]
    del start, end  # a run per chunk: millions at scale, not needed past here
    at = np.concatenate(([0], np.cumsum(counts)))
    some = np.flatnonzero(counts)
    a[at[some]] = np.maximum(a[at[some]], lo[some])
    b[at[some + 1] - 1] = np.minimum(b[at[some + 1] - 1], hi[some])
    run = take if isinstance(keep, slice) else keep[take]  # indices into ``runs``
    rows = np.empty((len(take), 4), dtype=np.int64, order="F")
    rows[:, 0] = runs.rank[run]
    # Written straight into the columns (``out``): no temporary the size of the rows.
    np.subtract(a, np.repeat(base, counts), out=rows[:, 1])
    np.add(runs.staged[run], a, out=rows[:, 2])
    np.subtract(b, a, out=rows[:, 3])
    return _Rows(rows, at)


def _column_chunks(
    placed: PlacedChunks,
    strided: np.ndarray,
    position: np.ndarray,
    file_base: np.ndarray,
    in_file: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
) -> _Rows:
    """Step 4: the column-sharded chunks (``strided``, per chunk of ``placed``; each staged
    whole) that reach into each slot's part ``[lo, hi)``: every part between a chunk's first and
    last byte (in all files' bytes: ``position``, ``file_base``), whose runs in it the gathering
    rank works out itself. Int64 rows ``(rank, tensor, staged_offset, offsets, sizes)``, Fortran
    order: ``tensor`` the key's index among its file's tensors (``in_file``, per key), offsets
    and sizes zero-padded to ``placed.offsets``' width; the staged offset as if the rank staged
    every byte of the file (step 5 moves it)."""
    c = np.flatnonzero(strided & (placed.nbytes > 0))
    order, first = file_order(position[c], placed.key[c], placed, file_base)
    c = c[order]
    # Their columns gathered once in output order (the jumps), then taken part by part (ranges).
    key = placed.key[c]
    offsets, sizes = np.take(placed.offsets, c, axis=0), np.take(placed.sizes, c, axis=0)
    last = _last_byte(placed, key, offsets, sizes) + file_base[placed.key_file[key]]
    take, counts = _reaching(first, last + 1, lo, hi)
    del order, first, last  # one per column-sharded chunk: gone before the rows are made
    width = placed.offsets.shape[1]
    rows = np.empty((len(take), 3 + 2 * width), dtype=np.int64, order="F")
    rows[:, 0] = placed.rank[c][take]
    rows[:, 1] = in_file[key[take]]
    rows[:, 2] = placed.staged[c][take]
    for d in range(width):
        rows[:, 3 + d], rows[:, 3 + width + d] = offsets[take, d], sizes[take, d]
    return _Rows(rows, np.concatenate(([0], np.cumsum(counts))))


def _unstage_own_parts(table: _PartTable, order: np.ndarray, *tables: _Rows) -> None:
    """Step 5, in place: each row's staged offset (column 2; the row's part is ``order[k]`` for
    slot ``k``) less the bytes of its rank's own parts before that part in its file, which the
    rank uploads itself and does not stage."""
    own = np.flatnonzero(table.rank >= 0)
    if not len(own):
        return
    before = _own_bytes_before(
        own, table.rank[own], table.end - table.start, np.searchsorted(table.file, table.file)
    )
    for t in tables:
        t.rows[:, 2] -= before(t.rows[:, 0], np.repeat(order, np.diff(t.at)))


def _narrowed(rows: np.ndarray) -> np.ndarray:
    """``rows`` as int32 in C order where every value fits (half the bytes sent: staged offsets
    fit at thousands of ranks), else as they are."""
    if len(rows) and int(rows.min()) >= 0 and int(rows.max()) < 2**31:
        return rows.astype(np.int32, order="C")
    return rows


def _shares(
    table: _PartTable,
    slots: _Slots,
    pieces: _Rows,
    columns: _Rows,
    headers: Sequence[bytes],
    tensors: Sequence[_Tensors],
    width: int,
) -> list[GatherTasks]:
    """Step 6: each rank's ``GatherTasks``, slices of the slots' arrays: its parts ``(file,
    number, start, end)``, their ``pieces`` and ``columns``, the header's bytes (``headers``,
    per file) in those that start inside it, and ``tensors`` (per file) of the files whose
    column-sharded chunks it names."""
    order = slots.order
    file, start, end = table.file[order], table.start[order], table.end[order]
    parts = np.stack((file, table.number[order], start, end), axis=1)
    in_header = np.flatnonzero(start < np.array([len(h) for h in headers], dtype=np.int64)[file])
    heads = {
        k: headers[f][a:b]
        for k, f, a, b in zip(
            in_header.tolist(),
            file[in_header].tolist(),
            start[in_header].tolist(),
            end[in_header].tolist(),
            strict=True,
        )
    }
    names = (columns.at[1:] > columns.at[:-1]).tolist()
    out = []
    for r in range(len(slots.rank_at) - 1):
        i, j = int(slots.rank_at[r]), int(slots.rank_at[r + 1])
        pa, pb, ca, cb = pieces.at[i], pieces.at[j], columns.at[i], columns.at[j]
        files = {int(parts[k, 0]) for k in range(i, j) if names[k]} if cb > ca else set()
        out.append(
            GatherTasks(
                parts[i:j],
                pieces.at[i : j + 1] - pa,
                pieces.rows[pa:pb],
                columns.at[i : j + 1] - ca,
                columns.rows[ca:cb],
                {k - i: heads[k] for k in range(i, j) if k in heads},
                {f: tensors[f] for f in sorted(files)},
                width,
            )
        )
    return out


def file_order(
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


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The indices ``lo[0]:hi[0]``, then ``lo[1]:hi[1]``, ... in one array."""
    n = hi - lo
    return np.arange(int(n.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(n) - n), n)


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
