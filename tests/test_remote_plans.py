"""Pure plans for remote stores (no server): S3 multipart parts of a merge, coalesced read requests."""

from __future__ import annotations

import random

import pytest

from hf_dcp_storage._layout import chunk_runs
from hf_dcp_storage._s3 import MAX_PART_BYTES, MIN_PART_BYTES, ClientPart, CopyPart, plan_parts

from hf_dcp_storage.reader import coalesce

MiB = 2**20


def _segments(header_len: int, runs: list[tuple[str, int]]) -> tuple[list[tuple[int, str, int, int]], int]:
    """``runs`` of ``(source, nbytes)`` laid end to end after the header; each source object is
    filled front to back, as a rank's staged object is."""
    segs, pos, used = [], header_len, {}
    for source, n in runs:
        segs.append((pos, source, used.get(source, 0), n))
        used[source] = used.get(source, 0) + n
        pos += n
    return segs, pos


def _bytes_of(parts, header_len: int) -> list[tuple[str | None, int, int]]:
    """The output as ``(source, start, end)`` pieces, adjacent pieces of one source joined."""
    out: list[tuple[str | None, int, int]] = []
    for part in parts:
        pieces = [(part.source, part.start, part.end)] if isinstance(part, CopyPart) else list(part.pieces)
        for src, s, e in pieces:
            if s == e:
                continue
            if out and out[-1][0] == src and out[-1][2] == s:
                out[-1] = (src, out[-1][1], e)
            else:
                out.append((src, s, e))
    return out


def _check(parts, segs, header_len: int, size: int, *, min_copy: int = MIN_PART_BYTES) -> None:
    # Every part but the last is big enough; copy parts are within S3's limits.
    sizes = [p.end - p.start if isinstance(p, CopyPart) else p.nbytes for p in parts]
    assert all(s >= min_copy for s in sizes[:-1]), sizes
    assert all(p.end - p.start <= MAX_PART_BYTES for p in parts if isinstance(p, CopyPart))
    assert sum(sizes) == size
    # Concatenated, the parts are exactly the header then every run in order.
    expected = _bytes_of([ClientPart(((None, 0, header_len),) + tuple((src, so, so + n) for _, src, so, n in segs))], header_len)
    assert _bytes_of(parts, header_len) == expected


def test_big_runs_are_copied_and_the_header_part_borrows_the_first_bytes() -> None:
    segs, size = _segments(1000, [("r0", 20 * MiB), ("r1", 20 * MiB)])
    parts = plan_parts(1000, segs, size)
    _check(parts, segs, 1000, size)
    assert parts == [
        ClientPart(((None, 0, 1000), ("r0", 0, 5 * MiB - 1000))),
        CopyPart("r0", 5 * MiB - 1000, 20 * MiB),
        CopyPart("r1", 0, 20 * MiB),
    ]


def test_small_runs_are_gathered_and_a_short_tail_is_the_last_part() -> None:
    segs, size = _segments(100, [("r0", 6 * MiB), ("r1", 1 * MiB), ("r0", 2 * MiB), ("r1", 6 * MiB), ("r0", 100)])
    parts = plan_parts(100, segs, size)
    _check(parts, segs, 100, size)
    # header + r0's 6 MiB: too little would be left after topping up, so it is gathered whole.
    assert isinstance(parts[0], ClientPart) and parts[0].nbytes == 100 + 6 * MiB
    # 1 + 2 MiB gathered; topping up with r1's 6 MiB run would leave 4 MiB, too short to copy.
    assert [p.nbytes for p in parts] == [100 + 6 * MiB, 9 * MiB, 100]
    assert all(isinstance(p, ClientPart) for p in parts)


def test_a_run_over_5_gib_is_split_into_equal_copy_parts() -> None:
    segs, size = _segments(0, [("r0", 12 * 2**30)])
    parts = plan_parts(0, segs, size)
    _check(parts, segs, 0, size)
    assert [p.end - p.start for p in parts] == [4 * 2**30] * 3


def test_client_parts_grow_to_respect_the_part_limit() -> None:
    segs, size = _segments(8, [(f"r{i % 2}", MiB) for i in range(60_000)])  # 60,000 one-MiB runs
    parts = plan_parts(8, segs, size)
    _check(parts, segs, 8, size)
    assert len(parts) <= 5_000 and all(isinstance(p, ClientPart) for p in parts)


@pytest.mark.parametrize("seed", range(30))
def test_random_runs_tile_the_file_with_valid_parts(seed: int) -> None:
    rng = random.Random(seed)
    min_copy = 64
    runs = [(f"r{rng.randrange(4)}", rng.choice([0, 1, 7, 40, 63, 64, 65, 100, 300, 1000])) for _ in range(rng.randrange(1, 40))]
    header = rng.choice([0, 8, 70])
    segs, size = _segments(header, runs)
    segs = [s for s in segs if s[3]]
    parts = plan_parts(header, segs, size, min_copy=min_copy)
    _check(parts, segs, header, size, min_copy=min_copy)
    copied = sum(p.end - p.start for p in parts if isinstance(p, CopyPart))
    # Client bytes: the header, the small runs, and of each copyable run less than 2 * min_copy
    # (the head that tops up a short gather, or the whole run if too little would be left).
    small = header + sum(n for *_, n in segs if n < min_copy)
    assert size - copied <= small + sum(min(n, 2 * min_copy - 1) for *_, n in segs if n >= min_copy)


def test_without_server_copy_everything_goes_in_client_parts_of_bounded_size() -> None:
    segs, size = _segments(100, [("r0", 20 * MiB), ("r1", 3 * MiB), ("r0", 12 * MiB)])
    parts = plan_parts(100, segs, size, copy=False)
    _check(parts, segs, 100, size)
    assert all(isinstance(p, ClientPart) for p in parts)
    assert [p.nbytes for p in parts][:-1] == [5 * MiB] * (len(parts) - 1)  # memory: one part each


# -- coalesced ranged reads ---------------------------------------------------------------------------


def test_coalesce_joins_adjacent_and_near_spans_only() -> None:
    assert coalesce([]) == []
    assert coalesce([(0, 100), (100, 200), (205, 300)], gap_bytes=0) == [(0, 300)]  # gap 5 <= 10% of 95
    assert coalesce([(0, 100), (150, 250)], gap_bytes=0) == [(0, 100), (150, 250)]  # gap 50 > 10% of 100
    assert coalesce([(0, 100), (150, 250)], waste=0.5, gap_bytes=0) == [(0, 250)]
    assert coalesce([(0, 100), (150, 250)], gap_bytes=50) == [(0, 250)]  # a gap cheaper than a request


def test_column_shard_of_narrow_rows_is_one_request_and_of_wide_rows_one_per_row() -> None:
    """Half of each row: 4 KiB halves (gaps far under a request's worth) -> one request of 2x the
    bytes; 2 MiB halves -> one request per row, exactly the bytes needed."""
    narrow = [(t, t + n) for t, _, n in chunk_runs((1024, 4096), (0, 2048), (1024, 2048), 2)]
    assert coalesce(narrow) == [(4096, 1024 * 8192)]
    wide = [(t, t + n) for t, _, n in chunk_runs((4, 2 * 2**20), (0, 2**20), (4, 2**20), 2)]
    assert coalesce(wide) == wide and len(wide) == 4


@pytest.mark.parametrize("seed", range(20))
def test_coalesced_requests_cover_every_run_within_10_percent_extra(seed: int) -> None:
    """Runs of a random region of a random tensor (row and column cuts), with no gap allowance:
    every run lies inside one request, requests are disjoint and ordered, and they fetch at most
    1.1x the needed bytes."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))
    offsets = tuple(rng.randrange(d) for d in shape)
    sizes = tuple(rng.randint(1, d - o) for d, o in zip(shape, offsets))
    itemsize = rng.choice([1, 2, 4])
    spans = [(t, t + n) for t, _, n in chunk_runs(shape, offsets, sizes, itemsize)]
    requests = coalesce(spans, gap_bytes=0)
    assert all(a[1] < b[0] for a, b in zip(requests, requests[1:]))
    assert all(any(s >= r0 and e <= r1 for r0, r1 in requests) for s, e in spans)
    needed = sum(e - s for s, e in spans)
    assert sum(e - s for s, e in requests) <= 1.1 * needed
    if sizes[1:] == shape[1:]:
        assert len(requests) == 1  # a row cut is contiguous: one request
    # With the default gap allowance (1 MiB, far above these tensors) each region is one request.
    assert len(coalesce(spans)) == 1
