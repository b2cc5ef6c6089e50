"""How a load reads a store: ``Ranges`` (a store's ranged reads, retried by its rules), and the
``Reads`` one rank's load goes through (``Ranges.open_reads``).

A rank's load hands its reads over in batches (``reading.py``): every slab of every tensor it
reads, each a few byte runs of one file and the buffer they go to. ``RangeReads``, for stores
where each request costs a round trip, plans a batch's requests across all of them at once, per
file (``plan/reads.plan_requests``: runs sorted, near ones joined, cut to a request size), sends
them concurrently across files, and copies each answer into its slabs as it arrives, so a load
sends about one request per joined span or request size, not one per tensor, and holds no more
than the requests in flight. Local files are read run by run instead (``stores/local.py``).
``KeptReads`` serves the runs that lie in bytes the load read already (each file's first bytes,
read with its header where the index records none) and hands only the rest on.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from fsspec import AbstractFileSystem

from ..io import fsio
from ..plan.reads import REQUEST_BYTES, coalesce, plan_requests, split_kept
from .retry import FSSPEC_ERRORS, ErrorRules, RetryPolicy

__all__ = ["KeptReads", "RangeReads", "Ranges", "Reads", "SlabDone", "SlabRead"]

T = TypeVar("T")

# One slab of a batch: ``(path, start, runs, view)``: the runs ``(offset from start, offset in
# view, bytes)`` of file ``path`` (``start``: its tensor's first byte) that fill ``view``.
SlabRead = tuple[str, int, Sequence[tuple[int, int, int]], memoryview]
# ``done(i)``: slab ``i`` of a batch has all its bytes (``Reads.read_batch``).
SlabDone = Callable[[int], None]


class Ranges:
    """How a loader reads byte ranges of a store's objects: fsspec's ``cat_ranges`` (concurrent
    on async stores), retried on transient failures. Stores with a faster path subclass it
    (their own ranged GETs; local files read in place)."""

    # Whether a load's nearby byte runs are fetched as one request (``plan/reads.coalesce``),
    # gaps included: where each request costs a round trip. Local reads take each run exactly.
    coalesces: ClassVar[bool] = True

    def __init__(
        self, fs: AbstractFileSystem, retry: RetryPolicy, errors: ErrorRules = FSSPEC_ERRORS
    ) -> None:
        # ``errors``: the store's rules (``Store.errors``), for whatever else a loader asks the
        # store through ``fs`` (listing, index, headers) beside these reads.
        self.fs, self.retry, self.errors = fs, retry, errors

    def get_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of each range (fewer only where the object is shorter)."""
        return self.retry.call(
            lambda: self.fs.cat_ranges(
                [path] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges]
            ),
            operation="read byte ranges of",
            url=fsio.url_of(self.fs, path),
            errors=self.errors,
        )

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (fewer only if the object is shorter)."""
        return self.retry.call(
            lambda: fsio.read_range(self.fs, path, start, end),
            operation=f"read bytes {start}-{end - 1} of",
            url=fsio.url_of(self.fs, path),
            errors=self.errors,
        )

    def fetch(
        self,
        spans: Sequence[tuple[str, int, int]],
        concurrency: int,
        deliver: Callable[[int, bytes], None],
    ) -> None:
        """Hand the bytes ``[start, end)`` of each ``(path, start, end)`` to ``deliver(index,
        data)``, at most ``concurrency`` held at once: here ``concurrency`` spans per
        ``cat_ranges`` call (one retried call each: a failure raised, not returned), in order."""
        for at in range(0, len(spans), concurrency):
            batch = spans[at : at + concurrency]
            paths, starts, ends = zip(*batch, strict=True)
            blobs: list[bytes] = self.retry.call(
                functools.partial(
                    self.fs.cat_ranges, list(paths), list(starts), list(ends), on_error="raise"
                ),
                operation="read byte ranges of",
                url=fsio.url_of(self.fs, batch[0][0]),
                errors=self.errors,
            )
            for k, blob in enumerate(blobs):
                deliver(at + k, blob)

    def retried(self, fn: Callable[[], T], *, operation: str, url: str) -> T:
        """``fn()``: a loader's own requests through ``fs`` (a listing, the index, a header),
        retried by the store's rules, as s3fs retries neither a 500 nor a reset; a permanent
        failure (a malformed index) keeps its own error."""
        return self.retry.call(
            fn, operation=operation, url=url, errors=self.errors, keep_permanent=True
        )

    def open_reads(self, direct_io: bool | None) -> Reads:
        """(each rank, once per load) What this load's reads go through; closed when the rank's
        reads are done. ``direct_io``: the reader's option (only local files honour it)."""
        return RangeReads(self)


class Reads(Protocol):
    """One rank's reads of a load (``Ranges.open_reads``): byte runs of files into buffers."""

    def read_runs(
        self, path: str, start: int, runs: Sequence[tuple[int, int, int]], view: memoryview
    ) -> None:
        """Fill ``view`` with ``runs`` of ``path`` (``(offset from start, offset in view,
        bytes)``), alone."""

    def read_batch(
        self,
        slabs: Sequence[SlabRead],
        *,
        threads: int,
        in_flight: int,
        request_bytes: int,
        done: SlabDone | None = None,
    ) -> tuple[int, int]:
        """Fill every slab's view; ``threads`` I/O threads, at most ``in_flight`` requests of at
        most ``request_bytes`` each held at once. Returns the requests sent and the bytes they
        read (gaps included). ``done(i)``, once slab ``i``'s bytes are all in, from whichever
        thread brought the last of them (an event loop's, on part stores: it must only hand
        the slab on, as ``reading.read_items`` does, to finish it elsewhere).

        Raises:
            ValueError: a file ends before a run does (truncated), naming the file and range.
        """

    def close(self) -> None: ...


class RangeReads:
    """One rank's reads of a load through ``ranges``: a batch's byte runs planned into few large
    requests per file (``plan/reads.plan_requests``), sent concurrently; one slab's runs alone
    joined where near (``plan/reads.coalesce``). Thread-safe."""

    def __init__(self, ranges: Ranges) -> None:
        self.ranges = ranges

    def read_runs(
        self, path: str, start: int, runs: Sequence[tuple[int, int, int]], view: memoryview
    ) -> None:
        spans = [(start + t, start + t + n) for t, _, n in runs]
        requests = coalesce(spans)
        blobs: list[Any] = self.ranges.get_ranges(path, requests)
        j = 0
        for (_, c, n), (s, e) in zip(runs, spans, strict=True):
            while requests[j][1] < e:
                j += 1
            blob, r0 = blobs[j], requests[j][0]
            if isinstance(blob, BaseException):
                raise blob
            self._check_length(path, r0, requests[j][1], len(blob), e - r0)
            view[c : c + n] = memoryview(blob)[s - r0 : e - r0]

    def read_batch(
        self,
        slabs: Sequence[SlabRead],
        *,
        threads: int,
        in_flight: int,
        request_bytes: int = REQUEST_BYTES,
        done: SlabDone | None = None,
    ) -> tuple[int, int]:
        wants: dict[str, list[tuple[int, int, int, int]]] = {}
        for i, (path, start, runs, _) in enumerate(slabs):
            wants.setdefault(path, []).extend((start + t, start + t + n, i, c) for t, c, n in runs)
        spans: list[tuple[str, int, int]] = []
        pieces: list[tuple[tuple[int, int, int, int], ...]] = []
        for path, wanted in wants.items():
            for request in plan_requests(wanted, request_bytes=request_bytes):
                spans.append((path, request.start, request.end))
                pieces.append(request.pieces)
        left = [0] * len(slabs)  # pieces still to come, per slab
        for request_pieces in pieces:
            for _, _, slab, _ in request_pieces:
                left[slab] += 1
        lock = threading.Lock()
        if done is not None:
            for i in (i for i, n in enumerate(left) if n == 0):
                done(i)  # nothing to read (an empty region)

        def deliver(k: int, blob: bytes) -> None:
            path, start, end = spans[k]
            needed = max(at + n for at, n, _, _ in pieces[k])
            self._check_length(path, start, end, len(blob), needed)
            data = memoryview(blob)
            finished = []
            for at, n, slab, offset in pieces[k]:
                slabs[slab][3][offset : offset + n] = data[at : at + n]
                with lock:
                    left[slab] -= 1
                    if left[slab] == 0:
                        finished.append(slab)
            if done is not None:
                for slab in finished:
                    done(slab)

        self.ranges.fetch(spans, in_flight, deliver)
        return len(spans), sum(end - start for _, start, end in spans)

    def _check_length(self, path: str, start: int, end: int, got: int, needed: int) -> None:
        if got < needed:
            raise ValueError(
                f"{fsio.url_of(self.ranges.fs, path)}: got {got} of {end - start} bytes at "
                f"{start}; the file is truncated"
            )

    def close(self) -> None:
        """Nothing is held between requests."""


class KeptReads:
    """``reads``, less the byte runs that ``kept`` holds: ``path -> (first byte, bytes)`` of a
    file that the load read already (``HFStorageReader.read_metadata``: the bytes after a header,
    ``io/files.read_head``). Those runs are copied from them (``plan/reads.split_kept``), the
    rest go to ``reads`` as they would have; ``served`` counts the bytes copied. Thread-safe."""

    def __init__(self, reads: Reads, kept: Mapping[str, tuple[int, bytes]]) -> None:
        self.reads, self.kept = reads, kept
        self.served = 0
        self._lock = threading.Lock()

    def _serve(
        self, path: str, start: int, runs: Sequence[tuple[int, int, int]], view: memoryview
    ) -> Sequence[tuple[int, int, int]]:
        """Copy the runs ``kept`` holds into ``view``; returns the rest of ``runs``."""
        if path not in self.kept:
            return runs
        at, data = self.kept[path]
        served, rest = split_kept(start, runs, at, at + len(data))
        source = memoryview(data)
        for offset, c, n in served:
            view[c : c + n] = source[offset : offset + n]
        with self._lock:
            self.served += sum(n for _, _, n in served)
        return rest

    def read_runs(
        self, path: str, start: int, runs: Sequence[tuple[int, int, int]], view: memoryview
    ) -> None:
        rest = self._serve(path, start, runs, view)
        if rest:
            self.reads.read_runs(path, start, rest, view)

    def read_batch(
        self,
        slabs: Sequence[SlabRead],
        *,
        threads: int,
        in_flight: int,
        request_bytes: int,
        done: SlabDone | None = None,
    ) -> tuple[int, int]:
        rest: list[SlabRead] = []
        index: list[int] = []  # each of ``rest``'s slab in ``slabs``
        for i, (p, s, runs, v) in enumerate(slabs):
            if r := self._serve(p, s, runs, v):
                rest.append((p, s, r, v))
                index.append(i)
            elif done is not None:
                done(i)  # served whole from the kept bytes
        if not rest:
            return 0, 0
        return self.reads.read_batch(
            rest,
            threads=threads,
            in_flight=in_flight,
            request_bytes=request_bytes,
            done=None if done is None else lambda j: done(index[j]),
        )

    def close(self) -> None:
        self.reads.close()
