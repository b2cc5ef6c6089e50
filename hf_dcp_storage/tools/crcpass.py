"""The checksum pass of ``verify_checkpoint``: every tensor's bytes read once and their CRC32
compared with the one the index records.

Each file is read in ``BLOCK_BYTES`` ranged reads, ``thread_count`` at a time across all files
and within each file, so memory stays ``thread_count * BLOCK_BYTES`` whatever the checkpoint's
size; each block yields the CRC32 of its share of every tensor it overlaps, and the shares are
combined in order (``format/crc.py``: ``crc32_combine``).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..format.crc import crc32_combine, crc32_of
from ..io.files import ReadRange
from ..io.parallel import parallel_map
from .progress import Progress

__all__ = ["BLOCK_BYTES", "FileJob", "Tensor", "check_checksums"]

# Bytes per ranged read of the checksum pass: large enough that a request's latency is small
# next to its transfer (S3), small enough that thread_count of them in memory stay modest.
BLOCK_BYTES = 8 << 20

# ``report(file, key, message)``: one problem found.
Report = Callable[[str | None, str | None, str], None]


@dataclass(frozen=True)
class Tensor:
    """A tensor the checksum pass reads: its bytes ``[start, start + nbytes)`` in its file."""

    key: str
    start: int
    nbytes: int
    crc: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class FileJob:
    """One file of the checksum pass: its name in messages, its path, its tensors by offset."""

    name: str
    path: str
    tensors: tuple[Tensor, ...]

    @functools.cached_property
    def _bounds(self) -> tuple[list[int], list[int]]:
        return [t.start for t in self.tensors], [t.end for t in self.tensors]

    def overlapping(self, start: int, end: int) -> range:
        """Indices of the tensors that share bytes with ``[start, end)`` (tensors do not overlap,
        so both their starts and their ends ascend)."""
        starts, ends = self._bounds
        return range(bisect.bisect_right(ends, start), bisect.bisect_left(starts, end))


def check_checksums(
    jobs: list[FileJob], read_range: ReadRange, threads: int, progress: Progress, report: Report
) -> int:
    """Read every tensor of ``jobs`` once, in blocks, in parallel; ``report`` each mismatch.
    Returns the bytes read."""
    blocks = [(j, start, end) for j, job in enumerate(jobs) for start, end in _blocks(job.tensors)]
    progress.start(sum(t.nbytes for job in jobs for t in job.tensors), "verify checksums")

    def read(block: tuple[int, int, int]) -> list[tuple[int, int, int]] | None:
        j, start, end = block
        pieces = _block_crcs(read_range, jobs[j], start, end)
        progress.advance(end - start)
        return pieces

    checked = 0
    # (file, tensor) -> (crc32 of its bytes so far, their count); None once a read came up short.
    state: dict[tuple[int, int], tuple[int, int] | None] = {}
    for (j, start, end), pieces in zip(blocks, parallel_map(read, blocks, threads), strict=True):
        if pieces is None:
            state.update(dict.fromkeys(((j, i) for i in jobs[j].overlapping(start, end)), None))
            continue
        checked += end - start
        for i, crc, n in pieces:  # blocks come in file order, so each tensor's shares do too
            so_far = state.get((j, i), (0, 0))
            if so_far is not None:
                state[j, i] = (crc32_combine(so_far[0], crc, n), so_far[1] + n)
    for j, job in enumerate(jobs):
        for i, tensor in enumerate(job.tensors):
            _compare(job, tensor, state.get((j, i), (0, 0)), report)
    return checked


def _block_crcs(
    read_range: ReadRange, job: FileJob, start: int, end: int
) -> list[tuple[int, int, int]] | None:
    """``(tensor index, crc32, length)`` of each tensor's share of bytes ``[start, end)``;
    ``None`` if the file ended before ``end``."""
    data = read_range(job.path, start, end)
    if len(data) < end - start:
        return None
    view = memoryview(data)
    out = []
    for i in job.overlapping(start, end):
        t = job.tensors[i]
        a, b = max(start, t.start), min(end, t.end)
        out.append((i, crc32_of(view[a - start : b - start]), b - a))
    return out


def _compare(job: FileJob, tensor: Tensor, state: tuple[int, int] | None, report: Report) -> None:
    if state is None or state[1] != tensor.nbytes:
        report(
            job.name,
            tensor.key,
            f"{job.name}: tensor {tensor.key!r} could not be read whole: the file ended early "
            "(did it change during the check?)",
        )
    elif state[0] != tensor.crc:
        report(
            job.name,
            tensor.key,
            f"{job.name}: tensor {tensor.key!r} fails its checksum (crc32 of the bytes read "
            f"{state[0]:08x}, the index records {tensor.crc:08x}); the file is corrupt: restore "
            "it from a copy or re-save",
        )


def _blocks(tensors: Iterable[Tensor]) -> list[tuple[int, int]]:
    """Byte ranges to read: runs of adjacent tensors, cut into ``BLOCK_BYTES`` pieces, so each
    byte of each tensor is read exactly once and nothing else is read."""
    runs: list[list[int]] = []
    for t in tensors:
        if t.nbytes == 0:
            continue
        if runs and runs[-1][1] == t.start:
            runs[-1][1] = t.end
        else:
            runs.append([t.start, t.end])
    return [
        (s, min(s + BLOCK_BYTES, end))
        for start, end in runs
        for s in range(start, end, BLOCK_BYTES)
    ]
