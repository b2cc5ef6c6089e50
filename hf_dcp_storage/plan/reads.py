"""Pure planning of a load's reads on a store that answers ranged requests: which byte spans of a
file one request fetches (``coalesce`` within one slab; ``plan_requests`` across every tensor a
rank reads of a file, cut to a request size), and which of a slab's runs the bytes a load holds
already serve (``split_kept``: a file's first bytes, read with its header). Local files are read
run by run instead (``stores/local.py``)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["READ_GAP_BYTES", "REQUEST_BYTES", "Request", "coalesce", "plan_requests", "split_kept"]

# A gap between needed byte runs up to this size is read rather than skipped, since one more
# request costs more than that much transfer.
READ_GAP_BYTES = 1 << 20


def coalesce(
    spans: list[tuple[int, int]], waste: float = 0.1, gap_bytes: int = READ_GAP_BYTES
) -> list[tuple[int, int]]:
    """Join sorted, disjoint byte spans ``[start, end)`` into fewer requests.

    A span joins the request before it when the gap between them is at most ``waste`` times
    the span's own length (extra bytes within ``1 + waste`` of those needed), or at most
    ``gap_bytes``: reading a gap that small costs less than one more request would (on S3 a
    request's latency is worth about a megabyte of transfer). So row shards, and column shards
    with wide rows, fetch no more than 1.1x what they need, while a column shard of narrow rows
    becomes one request per slab instead of one per row. Pure.
    """
    requests: list[tuple[int, int]] = []
    for start, end in spans:
        gap = start - requests[-1][1] if requests else -1
        if requests and (gap <= waste * (end - start) or gap <= gap_bytes):
            requests[-1] = (requests[-1][0], end)
        else:
            requests.append((start, end))
    return requests


# The most bytes one ranged request of a load asks for: large enough that a request's latency
# (10-50 ms to first byte on S3) is a small part of its time, small enough that many in flight
# keep every connection busy without holding much memory. Measured (bench_s3_load, radosgw and
# moto): 4 MiB loads many small tensors 2x slower than 16; 64 MiB is within 10 % of 16 but holds
# four times the memory per request in flight.
REQUEST_BYTES = 16 << 20


@dataclass(frozen=True)
class Request:
    """One ranged request of a load: bytes ``[start, end)`` of one file, and where they go:
    ``pieces`` of ``(offset in the request, bytes, sink, offset in the sink)``. Bytes of the
    request that no piece takes are gaps read because skipping them would cost a request."""

    start: int
    end: int
    pieces: tuple[tuple[int, int, int, int], ...]


def plan_requests(
    wants: Sequence[tuple[int, int, int, int]],
    *,
    request_bytes: int = REQUEST_BYTES,
    waste: float = 0.1,
    gap_bytes: int = READ_GAP_BYTES,
) -> list[Request]:
    """The requests that read ``wants`` of one file, each ``(start, end, sink, offset in the
    sink)``: bytes ``[start, end)`` of the file to be copied to the sink at that offset. In any
    order, overlapping or not (two destinations of the same bytes read them once).

    The wanted spans are sorted and joined across wants where they overlap or the gap between
    them is small (``coalesce``'s rule: at most ``waste`` times the joining span, or at most
    ``gap_bytes``), then each joined span is cut into ``ceil(len / request_bytes)`` requests of
    equal size. So a file's requests number at most its joined spans plus its bytes read over
    ``request_bytes``, however many tensors it holds. Pure.
    """
    if request_bytes < 1:
        raise ValueError(f"request_bytes={request_bytes!r} must be >= 1")
    order = sorted(range(len(wants)), key=lambda i: wants[i][0])
    spans: list[list[int]] = []
    for i in order:
        start, end = wants[i][0], wants[i][1]
        if end <= start:
            continue
        if spans:
            gap = start - spans[-1][1]
            if gap <= 0 or gap <= waste * (end - start) or gap <= gap_bytes:
                spans[-1][1] = max(spans[-1][1], end)
                continue
        spans.append([start, end])
    bounds: list[tuple[int, int]] = []
    for start, end in spans:
        count = -(-(end - start) // request_bytes)
        cuts = [start + (end - start) * k // count for k in range(count + 1)]
        bounds += itertools.pairwise(cuts)
    starts = [s for s, _ in bounds]
    pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in bounds]
    for i in order:
        start, end, sink, at = wants[i]
        j = bisect.bisect_right(starts, start) - 1
        while start < end:
            r0, r1 = bounds[j]
            stop = min(end, r1)
            pieces[j].append((start - r0, stop - start, sink, at))
            at += stop - start
            start = stop
            j += 1
    return [Request(s, e, tuple(p)) for (s, e), p in zip(bounds, pieces, strict=True) if p]


def split_kept(
    start: int, runs: Sequence[tuple[int, int, int]], kept_start: int, kept_end: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Split one slab's ``runs`` (``(offset from start, offset in the slab, bytes)``, the file's
    bytes ``[start + offset, start + offset + bytes)``) at the bytes ``[kept_start, kept_end)`` of
    the file a load holds already. Returns ``(served, rest)``: ``served`` as ``(offset in the
    kept bytes, offset in the slab, bytes)``, to be copied from them; ``rest``, the runs' parts
    outside, in the runs' own form, to be requested. Pure.
    """
    served: list[tuple[int, int, int]] = []
    rest: list[tuple[int, int, int]] = []
    for t, c, n in runs:
        a, b = start + t, start + t + n
        lo, hi = max(a, kept_start), min(b, kept_end)
        if lo >= hi:
            rest.append((t, c, n))
            continue
        if a < lo:
            rest.append((t, c, lo - a))
        served.append((lo - kept_start, c + lo - a, hi - lo))
        if hi < b:
            rest.append((t + hi - a, c + hi - a, b - hi))
    return served, rest
