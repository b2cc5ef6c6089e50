"""Pure planning of the part stores' consolidated files: parts that the ranks fill directly.

On an object store that assembles a file from parts server-side (S3's multipart uploads, GCS's
compose, Azure's block lists) a consolidated file's parts are cut so that most of them hold
bytes of a single rank: that rank uploads them itself, straight from its tensors, and they never
pass through any other process nor get copied afterwards (``RankPart``). A store may want every
part but the last to hold a minimum (S3: 5 MiB; ``PartRules``), so byte runs too small for
that (norms, biases, the header, a rank's share of a small tensor) are staged by their ranks and
gathered into parts, each by the rank the coordinator gives it to (``GatherPart``,
``plan/spread.py``); a short gather in front of a big run takes that run's first bytes to reach
the minimum. The coordinator has the server assemble the file once every part is in.

Both sides run the same pure code: the coordinator plans the parts (``plan_file_parts``) and every
rank routes each byte run it writes either into one of its parts or into its staged object
(``route_run``), in a processing order both sides reproduce, so the coordinator knows where each
staged byte is without being told, and can tell the rank that gathers it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .fileparts import FileParts, GatherPart, RankPart
from .nodecuts import NodeRuns, even_cuts, free_cuts, node_cuts

__all__ = [
    "GATHER_PART_BYTES",
    "MAX_PARTS",
    "MAX_PART_BYTES",
    "MIN_PART_BYTES",
    "NODE_PART_BYTES",
    "RANK_PART_BYTES",
    "S3_RULES",
    "FileParts",
    "GatherPart",
    "PartRules",
    "RankPart",
    "gather_part_bytes",
    "plan_file_parts",
    "route_run",
]

# S3's multipart rules (the strictest of the part stores, and the default): every part but the
# last holds 5 MiB to 5 GiB; at most 10,000 parts. 5 MiB is also the least a gathered part holds
# on every store (``gather_part_bytes``).
MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
MAX_PARTS = 10_000
# Size of the parts a rank uploads (a long run is cut into parts about this big): a few of them
# in flight per rank stay well inside the memory budget; grown only for the part-count limit.
RANK_PART_BYTES = 16 << 20
# The least run of a node's ranks (side by side) that is a part of its own, gathered within the
# node, where the store has no minimum part size (GCS, Azure): at 8,192 ranks, 8 a node, a 405B
# model's attention runs are 512 KiB a node, so their bytes cross between hosts once; smaller
# runs (norms, KV projections: ~1 % of the bytes) would cost a request each, and are gathered.
NODE_PART_BYTES = 64 << 10
# Largest size of the gathered parts (each one task for one rank: fetch the staged ranges,
# upload): up to 3x fewer tasks and uploads than at the 5 MiB minimum (48,000 instead of 155,000
# at 405B). ``gather_part_bytes`` picks the size per save.
GATHER_PART_BYTES = 16 << 20


@dataclass(frozen=True)
class PartRules:
    """What a store's server-side assembly allows: every part but the last holds at least
    ``min_part`` bytes, a file has at most ``max_parts`` parts; ``rank_part``: the size of the parts
    a rank cuts its long runs into; ``own_part``: the least run a rank sends as a part of its own
    (at least ``min_part``; ``0``: ``min_part``); ``node_part``: the least run of one node's ranks
    (side by side) that is a part of its own, gathered within the node (at least ``min_part``;
    ``0``: the least own run). S3's multipart rules (``S3_RULES``); GCS (compose) and Azure
    (block lists) have no minimum, so their nodes send short runs of their own
    (``plan/gcsplan.py``, ``plan/azureplan.py``)."""

    min_part: int = MIN_PART_BYTES
    max_parts: int = MAX_PARTS
    rank_part: int = RANK_PART_BYTES
    own_part: int = 0
    node_part: int = 0

    @property
    def own_min(self) -> int:
        """The least run a rank sends as its own part under these rules."""
        return max(self.min_part, self.own_part, 1)


S3_RULES = PartRules()


def gather_part_bytes(total: int, world: int, min_part: int = MIN_PART_BYTES) -> int:
    """Size of a save's gathered parts: small enough that the work spreads evenly, as large as
    that allows (fewer tasks, fewer requests). Ranks' loads end within one task of each other
    (``plan/balance.assign``) and a task counts twice its size, so with every byte gathered the
    busiest rank moves at most ``1 + 2 * part / (3 * share)`` times the mean (``share``: a rank's
    own bytes, ``total / world``); a part of 3/40 of the share keeps that under 1.05 (1.1 where the
    parts go to the nodes holding them: two tasks, ``plan/balance.fill_near``). Between S3's
    5 MiB minimum (a store's ``min_part``, where it has a smaller one) and ``GATHER_PART_BYTES``."""
    return int(
        min(GATHER_PART_BYTES, max(MIN_PART_BYTES, min_part, 3 * total // (40 * max(1, world))))
    )


def plan_file_parts(
    header_len: int,
    size: int,
    run_starts: np.ndarray,
    run_bytes: np.ndarray,
    run_ranks: np.ndarray,
    *,
    min_part: int = MIN_PART_BYTES,
    rank_part: int = RANK_PART_BYTES,
    gather_part: int = GATHER_PART_BYTES,
    max_parts: int = MAX_PARTS,
    own_part: int = 0,
    run_nodes: np.ndarray | None = None,
    node_part: int = 0,
) -> FileParts:
    """Cut a file of ``size`` bytes into multipart parts: ranks' own parts wherever a run allows.

    The runs (arrays, in file order after a ``header_len``-byte header, tiling the rest of the
    file) are maximal: two neighbours never have the same rank; rank ``-1`` marks bytes of
    several ranks interleaved (a column-sharded tensor), which are always gathered. A run of at
    least ``min_part`` bytes becomes its rank's parts of about ``rank_part`` bytes; the bytes
    between such runs are cut evenly into gathered parts of about ``gather_part`` bytes, at
    least ``min_part`` (but the file's last part); a gap under ``min_part`` before a big run
    takes that run's first bytes to reach it, or, if too little would be left, the whole run. A
    gathered part whose bytes (the header aside) all belong to one rank is that rank's to send.
    Pure; the parts as arrays (``FileParts``); a Python step per big run where the store has a
    minimum, numpy per run and per part, so a file of a million small runs costs little.

    ``own_part`` (at least ``min_part``): the least run that is its rank's own part. Where the
    file would need more than ``max_parts`` parts so (GCS and Azure, whose ranks send short runs),
    that least run is raised just enough for the file to fit (``_fitting_own_min``): the
    smallest runs are gathered, the rest stay their ranks' own.

    ``run_nodes`` (the node of each run's rank, ``-1`` for mixed runs): the gathered stretches
    are cut at the nodes' runs (``plan/nodecuts.py``), so a node's run of at least ``node_part``
    (``0``: the least own run) is gathered on its node alone; where that would make too many
    parts, they are cut evenly.

    Raises:
        ValueError: the runs do not tile the file, or the file needs more than ``max_parts`` parts
            (S3: 10,000).
    """
    rules = (min_part, rank_part, gather_part, max_parts, own_part)
    runs = (header_len, size, run_starts, run_bytes, run_ranks)
    if run_nodes is not None:
        nodes = NodeRuns(run_starts, run_bytes, run_nodes)
        try:
            return _cut_file(*runs, *rules, nodes, node_part)
        except ValueError:  # too many parts cut at the nodes' runs: cut evenly
            pass
    return _cut_file(*runs, *rules, None, 0)


def _cut_file(
    header_len: int,
    size: int,
    run_starts: np.ndarray,
    run_bytes: np.ndarray,
    run_ranks: np.ndarray,
    min_part: int,
    rank_part: int,
    gather_part: int,
    max_parts: int,
    own_part: int,
    nodes: NodeRuns | None,
    node_part: int,
    vectorized: bool = True,
) -> FileParts:
    """``plan_file_parts``, the gathered stretches cut at ``nodes``' runs where given; with no
    part minimum all at once (``plan/nodecuts.free_cuts``) unless not ``vectorized`` (a step per
    own run, as with a minimum: the tests compare the two)."""
    ends = run_starts + run_bytes
    if len(run_starts) and (
        run_starts[0] != header_len or (run_starts[1:] != ends[:-1]).any() or ends[-1] != size
    ):
        raise ValueError(
            f"byte runs of a {size}-byte file with a {header_len}-byte header do not tile it"
        )
    if not len(run_starts) and size != header_len:
        raise ValueError(f"no byte runs for the {size - header_len} data bytes of the file")
    # Both part sizes grow for a huge file so that each kind stays under half the part limit.
    rank_part = max(rank_part, 2 * min_part, -(-size // (max_parts // 2)))
    gather_target = max(min_part, gather_part, -(-size // (max_parts // 2)))
    segments: list[
        tuple[np.ndarray, int, bool]
    ] = []  # (edges, rank or -1 gathered, header in front)

    def gather(a: int, b: int) -> None:
        if nodes is None:
            segments.append((even_cuts(a, b, gather_target), -1, False))
            return
        cuts = node_cuts(a, b, nodes, min_part, node_part or own_min, gather_target, b == size)
        segments.extend((edges, -1, False) for edges in cuts)

    own_min = _fitting_own_min(
        header_len,
        size,
        run_starts,
        run_bytes,
        run_ranks,
        max(min_part, own_part, 1),
        rank_part,
        gather_target,
        max_parts,
    )
    own = np.flatnonzero((run_bytes >= own_min) & (run_ranks >= 0))
    if min_part <= 1 and vectorized:  # no minimum: no run borrows from another, all at once
        mine = (run_starts[own], ends[own], run_ranks[own])
        node_min = node_part or own_min
        cut = free_cuts(header_len, size, mine, nodes, node_min, rank_part, gather_target)
        return _numbered(header_len, run_starts, ends, run_ranks, max_parts, *cut)
    pos = 0  # bytes before pos have their parts
    for i in own.tolist():
        s, n, r = int(run_starts[i]), int(run_bytes[i]), int(run_ranks[i])
        gap, head = s - pos, False
        if gap and pos == 0 and gap == header_len:
            head = True  # only the header before: the rank sends it in front of its bytes
        elif gap >= min_part:
            gather(pos, s)
        elif gap:
            need = min_part - gap
            if n - need < min_part:
                continue  # too little would be left for a part of its own: all gathered
            segments.append((np.array([pos, s + need], dtype=np.int64), -1, False))
            s, n = s + need, n - need
        count = -(-n // rank_part)
        segments.append((s + n * np.arange(count + 1, dtype=np.int64) // count, r, head))
        pos = int(ends[i])
    if pos < size:
        gather(pos, size)
    if not segments:
        return FileParts(*(np.empty(0, dtype=np.int64),) * 3, np.empty(0, dtype=bool))
    start = np.concatenate([e[:-1] for e, _, _ in segments])
    end = np.concatenate([e[1:] for e, _, _ in segments])
    rank = np.concatenate([np.full(len(e) - 1, r, dtype=np.int64) for e, r, _ in segments])
    header = np.zeros(len(start), dtype=bool)
    header[np.cumsum([0] + [len(e) - 1 for e, _, _ in segments[:-1]])] = [h for _, _, h in segments]
    return _numbered(header_len, run_starts, ends, run_ranks, max_parts, start, end, rank, header)


def _numbered(
    header_len: int,
    run_starts: np.ndarray,
    ends: np.ndarray,
    run_ranks: np.ndarray,
    max_parts: int,
    start: np.ndarray,
    end: np.ndarray,
    rank: np.ndarray,
    header: np.ndarray,
) -> FileParts:
    """The cut parts (arrays in file order) checked against the part limit, as ``FileParts``;
    a gathered part of one rank's bytes becomes that rank's.

    Raises:
        ValueError: more than ``max_parts`` parts.
    """
    if len(start) > max_parts:
        raise ValueError(
            f"the file needs {len(start)} parts, over the store's limit of {max_parts}; lower "
            "max_shard_size"
        )
    # A gathered part of one rank's bytes (the header aside): that rank sends it, nothing staged.
    if len(run_starts):
        at = np.maximum(start, header_len)
        run = np.maximum(np.searchsorted(run_starts, at, side="right") - 1, 0)
        one = (
            (rank < 0)
            & (at < end)
            & (run_starts[run] <= at)
            & (run_ranks[run] >= 0)
            & (ends[run] >= end)
        )
        header |= one & (start == 0) & (header_len > 0)
        rank = np.where(one, run_ranks[run], rank)
        start = np.where(one, at, start)
    return FileParts(start, end, rank, header)


def _part_count(
    header_len: int,
    size: int,
    starts: np.ndarray,
    nbytes: np.ndarray,
    rank_part: int,
    gather_target: int,
) -> int:
    """At most how many parts ``plan_file_parts`` cuts a file into whose own runs are
    ``starts``/``nbytes`` (sorted, disjoint): each run's rank parts and each gap's gathered
    ones (a gap under the minimum borrowing from its run only lowers the count)."""
    ends = starts + nbytes
    gaps = np.concatenate((starts, [size])) - np.concatenate(([0], ends))
    if len(starts) and gaps[0] == header_len:
        gaps[0] = 0  # only the header before the first run: it goes in front of that run
    gaps = gaps[gaps > 0]
    own = int((-(-nbytes // rank_part)).sum())
    return own + int(np.maximum(1, gaps // gather_target).sum())


def _fitting_own_min(
    header_len: int,
    size: int,
    starts: np.ndarray,
    nbytes: np.ndarray,
    ranks: np.ndarray,
    own_min: int,
    rank_part: int,
    gather_target: int,
    max_parts: int,
) -> int:
    """The least own run, from ``own_min`` up, for which the file fits in ``max_parts`` parts:
    a binary search over the runs' sizes (the count falls as the least own run rises), numpy
    per step."""
    own = (ranks >= 0) & (nbytes >= own_min)

    def fits(least: int) -> bool:
        keep = own & (nbytes >= least)
        return (
            _part_count(header_len, size, starts[keep], nbytes[keep], rank_part, gather_target)
            <= max_parts
        )

    if fits(own_min):
        return own_min
    sizes = np.unique(nbytes[own])
    lo, hi = 0, len(sizes)  # sizes[hi]: fits (hi == len: no own part at all)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(int(sizes[mid]) + 1):
            hi = mid
        else:
            lo = mid + 1
    return int(sizes[min(lo, len(sizes) - 1)]) + 1


def route_run(
    start: int, n: int, part_starts: Sequence[int], parts: Sequence[RankPart]
) -> Iterator[tuple[int, int, RankPart | None]]:
    """Split the file run ``[start, start + n)`` into ``(start, nbytes, part)`` pieces: the piece
    lies in one of ``parts`` (a rank's own, sorted by start; ``part_starts`` their starts), or,
    with ``part`` ``None``, between them (a staged piece). Pure."""
    end = start + n
    while start < end:
        i = bisect.bisect_right(part_starts, start) - 1
        if i >= 0 and start < parts[i].end:
            take = min(end, parts[i].end) - start
            yield start, take, parts[i]
        else:
            nxt = part_starts[i + 1] if i + 1 < len(parts) else end
            take = min(end, nxt) - start
            yield start, take, None
        start += take
