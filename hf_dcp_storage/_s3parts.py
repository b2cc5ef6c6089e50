"""Pure planning of S3 consolidated files as multipart uploads that the ranks fill directly.

A consolidated file on S3 is one multipart upload. Its parts are cut so that most of them hold
bytes of a single rank: that rank uploads them itself, straight from its tensors, and they never
pass through any other process nor get copied afterwards (``RankPart``). S3 wants every part but
the last to hold at least 5 MiB, so byte runs too small for that (norms, biases, the header, a
rank's share of a small tensor) are staged by their ranks and gathered into parts, each by the
rank the coordinator gives it to (``GatherPart``, ``_spread``); a short gather in front of a big
run takes that run's first bytes to reach the minimum. The coordinator completes the upload once
every part is in.

Both sides run the same pure code: the coordinator plans the parts (``plan_file_parts``) and every
rank routes each byte run it writes either into one of its parts or into its staged object
(``route_run``), in a processing order both sides reproduce, so the coordinator knows where each
staged byte is without being told, and can tell the rank that gathers it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "MIN_PART_BYTES",
    "MAX_PART_BYTES",
    "MAX_PARTS",
    "RANK_PART_BYTES",
    "RankPart",
    "GatherPart",
    "plan_file_parts",
    "route_run",
    "StagedIndex",
]

# S3's multipart rules: every part but the last holds 5 MiB to 5 GiB; at most 10,000 parts.
MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
MAX_PARTS = 10_000
# Size of the parts a rank uploads (a long run is cut into parts about this big): a few of them
# in flight per rank stay well inside the memory budget; grown only for the part-count limit.
RANK_PART_BYTES = 16 << 20


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
    """Part ``number``, assembled by one rank from ``pieces`` ``(rank, start, end)`` of the
    file (``rank`` ``None``: the header); the ranks staged those bytes."""

    number: int
    pieces: tuple[tuple[int | None, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(e - s for _, s, e in self.pieces)


def plan_file_parts(
    header_len: int,
    runs: Iterable[tuple[int, int, int]],
    size: int,
    *,
    min_part: int = MIN_PART_BYTES,
    rank_part: int = RANK_PART_BYTES,
) -> list[RankPart | GatherPart]:
    """Cut a file of ``size`` bytes into multipart parts: ranks' own parts wherever a run allows.

    ``runs`` are ``(start, rank, nbytes)`` in file order after a ``header_len``-byte header,
    tiling the rest of the file. Adjacent runs of one rank are joined. A run of at least
    ``min_part`` bytes becomes rank parts of about ``rank_part`` bytes; smaller runs are gathered
    into parts of at least ``min_part`` bytes (but the last); a gathered part that holds one
rank's bytes only (the header aside) is that rank's to send. Pure.

    Raises:
        ValueError: the runs do not tile the file, or the file needs more than 10,000 parts.
    """
    # Both part sizes grow for a huge file so that each kind stays under half the part limit.
    rank_part = max(rank_part, 2 * min_part, -(-size // (MAX_PARTS // 2)))
    gather_target = max(min_part, -(-size // (MAX_PARTS // 2)))
    parts: list[RankPart | GatherPart] = []
    gather: list[tuple[int | None, int, int]] = [(None, 0, header_len)] if header_len else []
    gathered = header_len

    def flush() -> None:
        nonlocal gather, gathered
        ranks = {r for r, _, _ in gather if r is not None}
        if len(ranks) == 1:
            # One rank holds all of it (the header aside): that rank sends it, nothing is staged.
            has_header = gather[0][0] is None
            first = gather[1] if has_header else gather[0]
            parts.append(RankPart(len(parts) + 1, ranks.pop(), first[1], gather[-1][2], header=has_header))
        elif gather:
            parts.append(GatherPart(len(parts) + 1, tuple(gather)))
        gather, gathered = [], 0

    def add(rank: int, start: int, end: int) -> None:
        nonlocal gathered
        while start < end:  # long runs in pieces: a gathered part stays about gather_target
            if gathered >= gather_target:  # a header alone can be that big
                flush()
            take = min(end - start, gather_target - gathered)
            gather.append((rank, start, start + take))
            gathered += take
            start += take
            if gathered >= gather_target:
                flush()

    for start, rank, n in _joined(header_len, runs, size):
        end = start + n
        if n < min_part:
            add(rank, start, end)
            continue
        with_header = False
        if gather == [(None, 0, header_len)]:
            with_header, gather, gathered = True, [], 0  # the rank sends the header in front
        elif gather and gathered < min_part:
            need = min_part - gathered
            if n - need < min_part:
                add(rank, start, end)  # too little would be left for a part of its own
                continue
            gather.append((rank, start, start + need))
            start += need
            flush()
        else:
            flush()
        count = -(-(end - start) // rank_part)
        step = -(-(end - start) // count)
        for s in range(start, end, step):
            parts.append(RankPart(len(parts) + 1, rank, s, min(s + step, end), header=with_header and s == start))
    flush()
    if len(parts) > MAX_PARTS:
        raise ValueError(f"the file needs {len(parts)} multipart parts, over S3's limit of {MAX_PARTS}; lower max_shard_size")
    return parts


def _joined(header_len: int, runs: Iterable[tuple[int, int, int]], size: int) -> Iterator[tuple[int, int, int]]:
    """Non-empty runs with adjacent runs of one rank joined; checks that they tile the file."""
    pos = header_len
    current: tuple[int, int, int] | None = None
    for start, rank, n in runs:
        if start != pos:
            raise ValueError(f"byte runs jump from {pos} to {start}: they must tile the file after its header")
        pos += n
        if n == 0:
            continue
        if current is not None and current[1] == rank:
            current = (current[0], rank, current[2] + n)
            continue
        if current is not None:
            yield current
        current = (start, rank, n)
    if current is not None:
        yield current
    if pos != size:
        raise ValueError(f"byte runs end at {pos}, but the file has {size} bytes")


def route_run(start: int, n: int, part_starts: Sequence[int], parts: Sequence[RankPart]) -> Iterator[tuple[int, int, RankPart | None]]:
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


class StagedIndex:
    """Where a rank's staged bytes of one file sit in its staged object (coordinator side).

    Fed the rank's staged pieces ``(file_offset, nbytes)`` in the order the rank wrote them
    (``route_run`` pieces with no part), it answers which staged-object ranges hold any file range.
    """

    def __init__(self) -> None:
        self._pieces: list[tuple[int, int, int]] = []  # (file_offset, staged_offset, nbytes)
        self._pos = 0
        self._sorted = True

    def add(self, file_offset: int, nbytes: int) -> None:
        if self._pieces and file_offset < self._pieces[-1][0]:
            self._sorted = False
        self._pieces.append((file_offset, self._pos, nbytes))
        self._pos += nbytes

    @property
    def nbytes(self) -> int:
        return self._pos

    def locate(self, start: int, end: int) -> list[tuple[int, int]]:
        """Staged ranges ``(staged_offset, nbytes)`` that hold file bytes ``[start, end)``, in order.

        Raises:
            RuntimeError: part of the range was never staged (an inconsistent save).
        """
        if not self._sorted:
            self._pieces.sort()
            self._sorted = True
        out: list[tuple[int, int]] = []
        i = max(bisect.bisect_right(self._pieces, (start, float("inf"), 0)) - 1, 0)
        pos = start
        while pos < end:
            if i >= len(self._pieces) or not self._pieces[i][0] <= pos < self._pieces[i][0] + self._pieces[i][2]:
                raise RuntimeError(f"file bytes {pos}..{end} were not staged by their rank; the save is inconsistent")
            f, soff, n = self._pieces[i]
            take = min(end, f + n) - pos
            soff += pos - f
            if out and out[-1][0] + out[-1][1] == soff:
                out[-1] = (out[-1][0], out[-1][1] + take)
            else:
                out.append((soff, take))
            pos += take
            i += 1
        return out
