"""Where a gathered stretch of a file is cut into parts: at the bytes one node holds, so that a
part that is all one node's is gathered on that node (``plan/gather.py`` gives it to one of the
node's ranks) and crosses between hosts only once, on its way to the store.

At a thousand FSDP ranks every rank's run of a tensor is under S3's 5 MiB part minimum, but the
8 ranks of a node together often hold 5 MiB or more of it, side by side (consecutive ranks hold
consecutive rows). Cut evenly, a gathered part straddles nodes and most of its bytes come from
other hosts; cut at the nodes' runs, only what is still too small for a part of its own (a
node's run under the minimum) is gathered across hosts. Pure: ``free_cuts``, numpy over a whole
file, where the store has no part minimum; ``node_cuts``, a Python step per big node run of a
stretch, where it has one.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NodeRuns", "even_cuts", "free_cuts", "node_cuts"]


class NodeRuns:
    """A file's byte runs joined by node: ``start``, ``end``, ``node`` (int64, file order;
    ``-1``: bytes of several ranks interleaved, a column-sharded tensor's)."""

    def __init__(self, starts: np.ndarray, nbytes: np.ndarray, nodes: np.ndarray) -> None:
        new = np.ones(len(starts), dtype=bool)
        new[1:] = (nodes[1:] != nodes[:-1]) | (nodes[1:] < 0)
        heads = np.flatnonzero(new)
        ends = starts + nbytes
        self.start = starts[heads]
        self.end = ends[np.concatenate((heads[1:] - 1, [len(starts) - 1]))] if len(heads) else ends
        self.node = nodes[heads]


def even_cuts(a: int, b: int, target: int) -> np.ndarray:
    """Edges cutting ``[a, b)`` into about ``target``-byte parts (one at least)."""
    count = max(1, (b - a) // target)
    return a + (b - a) * np.arange(count + 1, dtype=np.int64) // count


def node_cuts(
    a: int, b: int, runs: NodeRuns, min_part: int, node_min: int, target: int, last: bool
) -> list[np.ndarray]:
    """Edges cutting the gathered stretch ``[a, b)`` into parts (each array: consecutive parts):
    every node's run of at least ``node_min`` bytes in it (clipped to it) is parts of its own,
    about ``target`` bytes; the bytes between are cut evenly, each part at least ``min_part``
    (a gap under it takes the front of the node run after it, or the whole run where too little
    would be left; a short end joins the part before it unless ``last``: the file's end)."""
    lo = int(np.searchsorted(runs.end, a, side="right"))
    hi = int(np.searchsorted(runs.start, b))
    s = np.maximum(runs.start[lo:hi], a)
    e = np.minimum(runs.end[lo:hi], b)
    big = np.flatnonzero((runs.node[lo:hi] >= 0) & (e - s >= max(node_min, min_part)))
    out: list[np.ndarray] = []
    pos = a
    for i in big.tolist():
        start, end = int(s[i]), int(e[i])
        gap = start - pos
        if gap >= min_part:
            out.append(even_cuts(pos, start, target))
        elif gap:
            need = min_part - gap
            if end - start - need < min_part:
                continue  # too little would be left: gathered with what comes after
            out.append(np.array([pos, start + need], dtype=np.int64))
            start += need
        out.append(even_cuts(start, end, target))
        pos = end
    if pos < b:
        if b - pos >= min_part or last or not out:
            out.append(even_cuts(pos, b, target))
        else:
            out[-1] = np.concatenate((out[-1][:-1], [b]))  # too short alone: the part before grows
    return out


def free_cuts(
    header_len: int,
    size: int,
    own: tuple[np.ndarray, np.ndarray, np.ndarray],
    nodes: NodeRuns | None,
    node_min: int,
    rank_part: int,
    target: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A whole file's parts where the store has no part minimum (GCS, Azure), numpy over all
    runs at once: ``(start, end, rank, header)`` per part, rank ``-1`` gathered. ``own``: the
    ranks' own runs ``(start, end, rank)`` (sorted), each cut into parts of about ``rank_part``;
    the stretches between them cut at ``nodes``' runs of at least ``node_min`` (clipped to the
    stretch) and evenly into parts of about ``target``; the header alone in front of the first
    own run goes in front of its first part. The same parts, in the same order, as
    ``plan/parts.py``'s step-by-step cut with no minimum."""
    own_start, own_end, own_rank = own
    points = [np.array([0, size], dtype=np.int64), own_start, own_end]
    if nodes is not None and len(nodes.start):
        lo = np.concatenate(([0], own_end))
        hi = np.concatenate((own_start, [size]))
        lo, hi = lo[hi > lo], hi[hi > lo]
        first = np.searchsorted(nodes.end, lo, side="right")
        count = np.maximum(np.searchsorted(nodes.start, hi) - first, 0)
        gap = np.repeat(np.arange(len(lo)), count)
        idx = np.arange(len(gap)) - np.repeat(np.cumsum(count) - count, count) + first[gap]
        s = np.maximum(nodes.start[idx], lo[gap])
        e = np.minimum(nodes.end[idx], hi[gap])
        big = (nodes.node[idx] >= 0) & (e - s >= node_min)
        points += [s[big], e[big]]
    pts = np.unique(np.concatenate(points))
    lo, hi = pts[:-1], pts[1:]
    head = bool(header_len > 0 and len(own_start) and own_start[0] == header_len)
    if head:
        lo, hi = lo[1:], hi[1:]  # [0, header_len): the header, sent with the first own part
    i = np.maximum(np.searchsorted(own_start, lo, side="right") - 1, 0)
    is_own = (lo < own_end[i]) & (lo >= own_start[i]) if len(own_start) else np.zeros(len(lo), bool)
    rank = np.where(is_own, own_rank[i] if len(own_start) else -1, -1)
    n = hi - lo
    count = np.where(is_own, -(-n // rank_part), np.maximum(1, n // target))
    at = np.repeat(np.arange(len(n)), count)
    k = np.arange(len(at)) - np.repeat(np.cumsum(count) - count, count)
    start = lo[at] + n[at] * k // count[at]
    end = lo[at] + n[at] * (k + 1) // count[at]
    header = np.zeros(len(start), dtype=bool)
    if head and len(start):
        header[0] = True
    return start, end, rank[at].astype(np.int64), header
