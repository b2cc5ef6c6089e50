"""Who assembles what once every rank has staged: the finishing work of a save, spread by bytes.

Where the store has no positioned writes, some bytes of the consolidated files can only be put
in place after every rank has staged its own: on S3 the multipart parts that mix several ranks'
small runs (``GatherPart``), on other stores whole files merged from the ranks' staged objects.
With a thousand FSDP ranks every run is small, so that is nearly every byte of the checkpoint;
left to the coordinator it is the failure seen elsewhere, one process moving the whole
checkpoint while the others idle. Here the coordinator hands each piece of that work (a task)
to one rank: largest task first, to the rank with the fewest bytes so far, counting the bytes
each rank already uploads of its own. Every rank does its tasks at the end of ``write_data``,
after all ranks have staged (``_arrival.py``). Pure planning: no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._merge import StagedPiece
from ._s3parts import GatherPart

__all__ = ["GatherTask", "MergeTask", "Source", "assign", "gather_sources"]

# One piece of a gathered part, in file order: literal bytes (the file's header, which the
# coordinator knows), or ``(rank, offset, nbytes)``: a range of that rank's staged object.
Source = bytes | tuple[int, int, int]


@dataclass(frozen=True)
class GatherTask:
    """(S3) Assemble part ``number`` of file ``file`` from ``sources`` and upload it."""

    file: int
    number: int
    sources: tuple[Source, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(s) if isinstance(s, bytes) else s[2] for s in self.sources)


@dataclass(frozen=True)
class MergeTask:
    """(other stores) Write file ``file`` whole: ``header``, then the staged runs of ``pieces``;
    ``nbytes`` is the file's size."""

    file: int
    header: bytes
    nbytes: int
    pieces: tuple[StagedPiece, ...]


def assign(sizes: Sequence[int], load: Sequence[int]) -> list[int]:
    """The rank that does each task of ``sizes`` bytes, given the bytes ``load[r]`` rank ``r``
    already moves: largest task first, to the least-loaded rank (ties to the lower rank); a task
    counts twice its size (read, then written again). Deterministic; O(T log T + T log N).

    Greedy largest-first keeps the busiest rank within one task of the mean, and tasks are
    small (a gathered part is ~5 MiB; a merged file at most ``max_shard_size``).
    """
    heap = [(int(b), r) for r, b in enumerate(load)]
    heapq.heapify(heap)
    out = [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: -sizes[t]):
        bytes_so_far, rank = heapq.heappop(heap)
        out[t] = rank
        heapq.heappush(heap, (bytes_so_far + 2 * sizes[t], rank))
    return out


def gather_sources(part: GatherPart, header: bytes, locate: Callable[[int, int, int], list[tuple[int, int]]]) -> tuple[Source, ...]:
    """Where the bytes of ``part`` sit: header slices, and ``(rank, offset, nbytes)`` ranges of
    the ranks' staged objects, from ``locate(rank, start, end)`` (a ``StagedIndex`` lookup)."""
    out: list[Source] = []
    for rank, start, end in part.pieces:
        if rank is None:
            out.append(header[start:end])
        else:
            out.extend((rank, offset, n) for offset, n in locate(rank, start, end))
    return tuple(out)
