"""A file's multipart parts: the two kinds of part, and a file's parts as arrays.

A rank's own part (``RankPart``) holds bytes of that rank alone, which it uploads itself; a
gathered part (``GatherPart``) mixes several ranks' staged bytes and one rank assembles it
(``plan/spread.py``). The coordinator plans a file's parts as arrays and keeps them so
(``FileParts``): at 405B over 8,192 ranks, GCS and Azure saves have 661,000 parts, and an
object per part costs the coordinator seconds it does not need to spend; a part becomes an
object only where code takes it one at a time (a rank's own parts, a store's listing). Pure.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

__all__ = ["FileParts", "GatherPart", "Part", "RankPart"]


@dataclass(frozen=True)
class RankPart:
    """Part ``number``: file bytes ``[start, end)``, all held by ``rank``, which uploads them.

    With ``header`` the part starts with the file's header (bytes ``[0, start)``), which the
    rank gets in its plan: a file whose first data run is big needs no gathered first part.
    """

    number: int
    rank: int
    start: int
    end: int
    header: bool = False

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class GatherPart:
    """Part ``number``: file bytes ``[start, end)`` (the header's among them, if ``start`` is 0),
    staged by several ranks and assembled by one (``plan/spread.GatherTask``)."""

    number: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


Part = RankPart | GatherPart


class FileParts(Sequence[Part]):
    """One file's parts, numbered from 1 in file order, as int64 arrays ``[n]``: ``start`` and
    ``end`` (in the file), ``rank`` (the uploading rank of a ``RankPart``; ``-1``: gathered) and
    bool ``header`` (a ``RankPart`` that carries the file's header in front). Indexing gives the
    part as an object; equal to any sequence of the same parts (a list of objects included)."""

    __slots__ = ("end", "header", "rank", "start")

    def __init__(
        self, start: np.ndarray, end: np.ndarray, rank: np.ndarray, header: np.ndarray
    ) -> None:
        self.start = np.asarray(start, dtype=np.int64)
        self.end = np.asarray(end, dtype=np.int64)
        self.rank = np.asarray(rank, dtype=np.int64)
        self.header = np.asarray(header, dtype=bool)

    @classmethod
    def of(cls, parts: Sequence[Part]) -> FileParts:
        """``parts`` (objects, numbered 1..n in order) as ``FileParts``; itself if it is one."""
        if isinstance(parts, FileParts):
            return parts
        return cls(
            np.array([p.start for p in parts], dtype=np.int64),
            np.array([p.end for p in parts], dtype=np.int64),
            np.array([p.rank if isinstance(p, RankPart) else -1 for p in parts], np.int64),
            np.array([isinstance(p, RankPart) and p.header for p in parts], dtype=bool),
        )

    @property
    def nbytes(self) -> np.ndarray:
        """Each part's bytes."""
        return self.end - self.start

    def __len__(self) -> int:
        return len(self.start)

    @overload
    def __getitem__(self, i: int) -> Part: ...

    @overload
    def __getitem__(self, i: slice) -> list[Part]: ...

    def __getitem__(self, i: int | slice) -> Part | list[Part]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"part index {i} out of range for a file of {len(self)} parts")
        a, b, r = int(self.start[i]), int(self.end[i]), int(self.rank[i])
        return RankPart(i + 1, r, a, b, bool(self.header[i])) if r >= 0 else GatherPart(i + 1, a, b)

    def __iter__(self) -> Iterator[Part]:
        for j, (r, a, b, h) in enumerate(
            zip(
                self.rank.tolist(),
                self.start.tolist(),
                self.end.tolist(),
                self.header.tolist(),
                strict=True,
            ),
            start=1,
        ):
            yield RankPart(j, r, a, b, h) if r >= 0 else GatherPart(j, a, b)

    def own(self) -> list[RankPart]:
        """The ranks' own parts, in file order."""
        own = np.flatnonzero(self.rank >= 0)
        return [
            RankPart(j + 1, r, a, b, h)
            for j, r, a, b, h in zip(
                own.tolist(),
                self.rank[own].tolist(),
                self.start[own].tolist(),
                self.end[own].tolist(),
                self.header[own].tolist(),
                strict=True,
            )
        ]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FileParts):
            return (
                len(self) == len(other)
                and bool((self.start == other.start).all())
                and bool((self.end == other.end).all())
                and bool((self.rank == other.rank).all())
                and bool((self.header == other.header).all())
            )
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable arrays: not hashable

    def __repr__(self) -> str:
        return f"FileParts({list(self)!r})"
