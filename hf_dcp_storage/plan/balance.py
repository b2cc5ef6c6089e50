"""Who does each task of a save's finishing work: tasks spread over the ranks by bytes.

A task (a gathered part, a file to merge) costs its rank twice its size: its bytes come in,
then go up again. The ranks already move bytes of their own (``load``), so tasks go where the
load is least. Two ways, both deterministic and pure:

- ``assign`` without nodes: largest task first to the least-loaded rank (greedy, a heap step per
  task): the busiest rank ends within one task of the mean. Merges (one task per file) and
  saves whose nodes are unknown use it.
- ``assign`` with ``prefer`` (the node holding most of each task's bytes): every rank filled
  towards one level, each node's tasks kept on its own ranks as far as its ranks have room below
  that level (``fill_near``), numpy throughout: at 405B over 8,192 ranks that is 660,000 tasks,
  which a heap step per task took 5 s to give out.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["assign", "fill_near", "level"]


def assign(
    sizes: Sequence[int],
    load: Sequence[int],
    prefer: Sequence[int] | None = None,
    per_node: int = 1,
) -> list[int]:
    """The rank that does each task of ``sizes`` bytes, given the bytes ``load[r]`` rank ``r``
    already moves; a task counts twice its size (read, then written again).

    Without ``prefer``: largest task first, to the least-loaded rank (ties to the lower rank),
    which keeps the busiest rank within one task of the mean; O(T log T + T log N).
    With ``prefer[t]``, the node (``per_node`` consecutive ranks) that holds most of task
    ``t``'s bytes (``-1``: none): ``fill_near``.
    """
    if prefer is not None:
        return fill_near(
            np.asarray(sizes, dtype=np.int64),
            np.asarray(load, dtype=np.int64),
            np.asarray(prefer, dtype=np.int64),
            per_node,
        ).tolist()
    loads = [int(b) for b in load]
    heap = [(b, r) for r, b in enumerate(loads)]
    heapq.heapify(heap)
    out = [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: -sizes[t]):
        bytes_so_far, rank = heapq.heappop(heap)
        out[t] = rank
        heapq.heappush(heap, (bytes_so_far + 2 * int(sizes[t]), rank))
    return out


def level(load: np.ndarray, total: float) -> float:
    """The water level ``h`` at which ranks of ``load`` bytes take ``total`` more bytes, each
    filled up to ``h`` (``sum(max(0, h - load)) == total``)."""
    lows = np.sort(load.astype(np.float64))
    k = np.arange(1, len(lows) + 1)
    h = (total + np.cumsum(lows)) / k  # the level were the k least-loaded ranks to take it all
    nxt = np.append(lows[1:], np.inf)
    return float(h[np.argmax(h <= nxt)])


def fill_near(
    sizes: np.ndarray,
    load: np.ndarray,
    prefer: np.ndarray,
    per_node: int,
    cost: np.ndarray | None = None,
) -> np.ndarray:
    """The rank of each task (int64 ``[T]``), every rank filled towards one level ``h``
    (``level``: where ranks of ``load`` bytes take every task, each counted twice its size plus
    its ``cost``, bytes' worth of its fixed work: a gathered part's pieces, ``plan/gather.py``).

    1. Each node's tasks (``prefer``), heaviest first, stay on its ranks while they fit below
       ``h`` (a task fits when its middle does): their bytes do not leave the node.
    2. The rest (tasks of no node, a node's tasks past its room) fill every rank's room left
       below ``h``, heaviest first.

    Each fill gives a rank the tasks whose middles fall in its room, so a rank that takes tasks
    ends within a task or two of ``h``, and a rank already above ``h`` takes none. Ranks are
    filled least-loaded first (ties: the lower rank). Deterministic; numpy, O(T log T + N log N).
    """
    out = np.zeros(len(sizes), dtype=np.int64)
    if not len(sizes):
        return out
    weight = 2 * sizes.astype(np.float64)
    if cost is not None:
        weight += cost
    world = len(load)
    room = np.maximum(0.0, level(load, float(weight.sum())) - load)
    node = np.arange(world) // max(1, per_node)
    nodes = int(node[-1]) + 1
    rank_order = np.lexsort((np.arange(world), load, node))  # by node, then least-loaded first
    node_room = np.bincount(node, weights=room, minlength=nodes)
    # 1: within each node, the tasks heaviest first, each at the middle of its weight.
    near = np.flatnonzero((prefer >= 0) & (prefer < nodes))
    near = near[np.lexsort((near, -weight[near], prefer[near]))]
    w = weight[near]
    by_node = prefer[near]
    ends = np.cumsum(w)
    firsts = np.searchsorted(by_node, np.arange(nodes))  # each node's first task in ``near``
    before = np.concatenate(([0.0], ends))[firsts][by_node]  # the node's bytes before its first
    middle = ends - w / 2 - before
    keep = middle < node_room[by_node]
    node_base = np.concatenate(([0.0], np.cumsum(node_room)))[:-1]
    bounds = np.cumsum(room[rank_order])
    at = np.searchsorted(bounds, (node_base[by_node] + middle)[keep], side="left")
    out[near[keep]] = rank_order[np.minimum(at, world - 1)]
    # 2: the rest, over the room every rank has left.
    taken = np.bincount(out[near[keep]], weights=w[keep], minlength=world)
    left = np.maximum(0.0, room - taken)
    rest = np.concatenate((near[~keep], np.flatnonzero((prefer < 0) | (prefer >= nodes))))
    if len(rest):
        rest = rest[np.lexsort((rest, -weight[rest]))]
        order = np.lexsort((np.arange(world), load + taken))
        w = weight[rest]
        bounds = np.cumsum(left[order])
        at = np.searchsorted(bounds, np.cumsum(w) - w / 2, side="left")
        out[rest] = order[np.minimum(at, world - 1)]
    return out
