"""Where each byte of a merged file comes from: the runs of the ranks' staged objects, in output
order. Pure; ``stores/staged.py`` does the copying."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..format.geometry import chunk_runs

__all__ = ["StagedPiece", "merge_segments"]


@dataclass(frozen=True)
class StagedPiece:
    """One write item's bytes inside a staged object, and where its tensor lives in the output."""

    path: str
    tensor_start: int
    staged_offset: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    itemsize: int


def merge_segments(pieces: Iterable[StagedPiece]) -> Iterator[tuple[int, str, int, int]]:
    """``(output_offset, staged_path, staged_offset, nbytes)`` in output order, adjacent runs
    joined.

    Runs of different pieces interleave (column shards alternate by row), so the pieces' run
    streams are merged lazily by output offset; memory stays one pending run per piece.
    """
    streams = [_piece_runs(p) for p in pieces]
    current: tuple[int, str, int, int] | None = None
    for seg in heapq.merge(*streams):
        if current is not None:
            off, path, soff, n = current
            if seg[1] == path and seg[0] == off + n and seg[2] == soff + n:
                current = (off, path, soff, n + seg[3])
                continue
            yield current
        current = seg
    if current is not None:
        yield current


def _piece_runs(p: StagedPiece) -> Iterator[tuple[int, str, int, int]]:
    for t, c, n in chunk_runs(p.shape, p.offsets, p.sizes, p.itemsize):
        yield p.tensor_start + t, p.path, p.staged_offset + c, n
