"""Pure planning of a load's reads on a store that answers ranged requests: which byte spans of a
file one request fetches (``coalesce``). Local files are read run by run instead
(``stores/local.py``)."""

from __future__ import annotations

__all__ = ["READ_GAP_BYTES", "coalesce"]

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
