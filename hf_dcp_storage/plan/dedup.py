"""One writer for every chunk that several ranks hold (replicated tensors), on the coordinator:
the holder that writes the fewest bytes so far, so replicated tensors spread over the ranks
(:func:`dedup`, :class:`Dedup`). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from .chunks import GlobalChunks

__all__ = ["Dedup", "dedup"]


@dataclass(frozen=True)
class Dedup:
    """Outcome of :func:`dedup` (and ``check_and_dedup``): chunks not to write (global rows,
    ascending: another rank writes the same chunk) and the bytes each rank writes."""

    dropped: np.ndarray
    bytes_per_rank: np.ndarray


def dedup(
    g: GlobalChunks,
    order: np.ndarray,
    key: np.ndarray,
    rank: np.ndarray,
    same: np.ndarray,
    nbytes: np.ndarray,
) -> Dedup:
    """Rows ``order`` (of ``key``s and ``rank``s, equal chunks neighbours, ``same``: equal to
    the row before) with their ``nbytes``: one writer per group of equal chunks, the least
    loaded holder, group after group."""
    world = len(g.rank_start) - 1
    if not same.any():  # nothing replicated (FSDP alone): every rank writes all it holds
        return Dedup(
            np.empty(0, dtype=np.int64),
            np.bincount(rank, weights=nbytes, minlength=world).astype(np.int64),
        )
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
    waves = [*np.flatnonzero(np.diff(key[shared], prepend=-1)).tolist(), len(shared)]
    for a, b in pairwise(waves):
        r, n = ranks[a:b], int(sizes[a])
        if (sizes[a:b] == n).all() and int(np.bincount(r).max()) == 1:
            best = a + np.arange(0, b - a, n) + np.argmin(loads[r].reshape(-1, n), axis=1)
            loads[ranks[best]] += row_bytes[best]
            keep[best] = True
            continue
        _greedy(
            ranks[a:b].tolist(),
            row_bytes[a:b].tolist(),
            [*np.flatnonzero(np.diff(group[shared[a:b]], prepend=-1)).tolist(), b - a],
            loads,
            keep[a:b],
        )
    return Dedup(np.sort(np.concatenate((order[shared[~keep]], dropped_empty))), loads)


def _greedy(
    ranks: list[int], row_bytes: list[int], starts: list[int], loads: np.ndarray, keep: np.ndarray
) -> None:
    """Group after group (rows ``starts[i]:starts[i + 1]``), the least loaded holder (the lowest
    such rank) keeps its row: ``loads`` and ``keep`` are updated in place."""
    load = {r: int(loads[r]) for r in set(ranks)}
    for a, b in pairwise(starts):
        best, low = a, load[ranks[a]]
        for i in range(a + 1, b):
            if load[ranks[i]] < low:
                best, low = i, load[ranks[i]]
        load[ranks[best]] += row_bytes[best]
        keep[best] = True
    for r, v in load.items():
        loads[r] = v
