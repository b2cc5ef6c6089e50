"""The S3 requests the library makes itself: multipart uploads, their parts, ranged GETs.

Used only when the fsspec filesystem is s3fs (``stores/s3.py`` is the store built on them; the
reader's ranged GETs and retention's aborts use them too); every other store goes through the
generic fsspec path in ``io/fsio.py``. The requests go to s3fs's own botocore client (so credentials,
endpoint, region and ``s3_additional_kwargs`` such as server-side encryption are the user's),
but each one is retried by this library's :class:`~.io.retry.RetryPolicy`, which knows which
failures are transient, and fails with a message naming the operation and the object.

Consolidation costs almost nothing here: every consolidated file is one multipart upload
created by the coordinator before any rank writes, and each rank uploads the parts that hold
only its own bytes straight into it (``PartUploader``; the part plan is ``plan/s3parts.py``). Those
bytes are sent once, by the rank that has them, and never copied or downloaded again. Only runs
too small to be a part of their own (S3 parts hold at least 5 MiB, but the last) are staged
(``MultipartWriter``) and gathered into parts (``gather_bytes``) by the ranks the coordinator
gave them to (``plan/spread.py``); the coordinator then completes the upload (``complete_file``).
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from ..io import fsio
from ..io.parallel import fetch_spans, parallel_map
from ..io.retry import RetryPolicy
from ..plan.s3parts import MIN_PART_BYTES, GatherPart, RankPart
from ..plan.spread import Source
from .base import MergeStats
from .filling import gather_bytes

__all__ = ["S3", "s3_for", "s3_url", "multipart_etag", "MultipartWriter", "PartUploader", "complete_file", "quietly"]

logger = logging.getLogger(__name__)


def s3_url(path: str) -> str:
    """``bucket/key`` as the URL a message shows."""
    return f"s3://{path}"

# Parts a stream uploads at a time: enough to keep a connection busy while the next part fills.
_IN_FLIGHT = 2


def s3_for(fs: AbstractFileSystem, retry: RetryPolicy) -> S3 | None:
    """An :class:`S3` over ``fs`` if it is an s3fs filesystem, else ``None`` (generic path)."""
    return S3(fs, retry) if fsio.is_s3(fs) else None


def multipart_etag(parts: Sequence[dict[str, Any]]) -> str | None:
    """The ETag S3 gives the object a multipart upload of ``parts`` completes into: the MD5 of
    the parts' binary MD5s, then ``-N``. ``None`` when a part's ETag is no plain MD5 (SSE-KMS,
    some S3-compatible stores), so nothing can be told from it."""
    digests = []
    for e in sorted(parts, key=lambda e: e["PartNumber"]):
        tag = str(e["ETag"]).strip('"')
        if len(tag) != 32:
            return None
        try:
            digests.append(bytes.fromhex(tag))
        except ValueError:
            return None
    return f'"{hashlib.md5(b"".join(digests)).hexdigest()}-{len(digests)}"'


def _bucket_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class S3:
    """Retried S3 requests on an s3fs filesystem's client; paths are ``bucket/key``. Thread-safe."""

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        self.fs = fs
        self.retry = retry

    async def _once(self, method: str, kwargs: dict[str, Any]) -> Any:
        fs = self.fs
        await fs.set_session()
        client = await fs.get_s3(kwargs.get("Bucket"))
        # The user's s3_additional_kwargs (e.g. SSE) and requester-pays, filtered per method.
        full = fs._get_s3_method_kwargs(getattr(client, method), **kwargs)
        response = await getattr(client, method)(**full)
        if method == "get_object":
            # Read inside the retried call: a body cut short is retried like any transient failure.
            body = response["Body"]
            try:
                response["Data"] = await body.read()
            finally:
                body.close()
        return response

    def _call(self, method: str, operation: str, path: str, **kwargs: Any) -> Any:
        return self.retry.call(lambda: sync(self.fs.loop, self._once, method, kwargs), operation=operation, url=f"s3://{path}")

    def get_ranges(self, path: str, ranges: Sequence[tuple[int, int]], *, concurrency: int = 16) -> list[bytes]:
        """Bytes ``[start, end)`` of each range, fetched with up to ``concurrency`` GETs in flight."""
        return self.get_spans([(path, start, end) for start, end in ranges], concurrency=concurrency)

    def get_spans(self, spans: Sequence[tuple[str, int, int]], *, concurrency: int = 16) -> list[bytes]:
        """Bytes ``[start, end)`` of each ``(path, start, end)``, of any objects, with up to
        ``concurrency`` GETs in flight."""

        async def read(path: str, start: int, end: int) -> bytes:
            bucket, key = _bucket_key(path)
            kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
            r = await self.retry.acall(lambda: self._once("get_object", kwargs), operation=f"GET bytes {start}-{end - 1} of", url=f"s3://{path}")
            return r["Data"]

        return fetch_spans(self.fs.loop, read, spans, concurrency)

    def put(self, path: str, data: bytes | bytearray) -> None:
        bucket, key = _bucket_key(path)
        self._call("put_object", "PUT", path, Bucket=bucket, Key=key, Body=data)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; fewer only if the object is shorter."""
        return self.get_ranges(path, [(start, end)])[0]

    def create_upload(self, path: str) -> str:
        """A new multipart upload of ``path``; its id.

        The one request here that is not idempotent: an attempt whose answer was lost (cut
        short, or the connection dropped once the request was sent) may have created an upload
        whose id nobody knows, invisible but billed, which even a save that completes would
        leave open. So after a retried create, every other unfinished upload of this exact key
        is aborted: a save creates its uploads only after aborting those a killed save left
        under its path, so any other is such an orphan.
        """
        bucket, key = _bucket_key(path)
        attempts = 0

        def once() -> Any:
            nonlocal attempts
            attempts += 1
            return sync(self.fs.loop, self._once, "create_multipart_upload", {"Bucket": bucket, "Key": key})

        upload_id = self.retry.call(once, operation="CreateMultipartUpload", url=f"s3://{path}")["UploadId"]
        if attempts > 1:
            self._abort_orphans(path, upload_id)
        return upload_id

    def _abort_orphans(self, path: str, keep: str) -> None:
        """Abort every unfinished upload of exactly ``path`` but ``keep``; a failure is only logged
        (the next save to this path aborts what is left)."""
        key = _bucket_key(path)[1]
        try:
            orphans = [upload_id for k, upload_id in self.list_uploads(path) if k == key and upload_id != keep]
            for upload_id in orphans:
                self.abort_upload(path, upload_id)
        except Exception as exc:  # noqa: BLE001 - the upload itself was created; only cleanup failed
            logger.warning("could not abort the uploads a retried CreateMultipartUpload of s3://%s may have left (%s)", path, exc)

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes | bytearray) -> dict[str, Any]:
        bucket, key = _bucket_key(path)
        r = self._call(
            "upload_part", f"UploadPart {number}", path, Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )
        return {"PartNumber": number, "ETag": r["ETag"]}

    def complete_upload(self, path: str, upload_id: str, parts: Sequence[dict[str, Any]], size: int | None = None) -> None:
        """Complete an upload. If a retry finds the upload gone because an earlier attempt did
        complete it (its answer was lost), an object of ``size`` bytes at ``path`` counts as done."""
        bucket, key = _bucket_key(path)
        try:
            self._call(
                "complete_multipart_upload", "CompleteMultipartUpload", path,
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)},
            )
        except FileNotFoundError:
            if size is None or self._size(path) != size:
                raise

    def _size(self, path: str) -> int | None:
        head = self.head(path)
        return None if head is None else head[0]

    def head(self, path: str) -> tuple[int, str] | None:
        """``(size, ETag)`` of an object, or ``None`` if there is none."""
        bucket, key = _bucket_key(path)
        try:
            r = self._call("head_object", "HEAD", path, Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return int(r["ContentLength"]), str(r["ETag"])

    def abort_upload(self, path: str, upload_id: str) -> None:
        bucket, key = _bucket_key(path)
        try:
            self._call("abort_multipart_upload", "AbortMultipartUpload", path, Bucket=bucket, Key=key, UploadId=upload_id)
        except FileNotFoundError:
            pass  # already gone (completed or aborted)

    def list_uploads(self, path: str) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of unfinished multipart uploads under prefix ``path``."""
        bucket, prefix = _bucket_key(path)
        r = self._call("list_multipart_uploads", "ListMultipartUploads", path, Bucket=bucket, Prefix=prefix)
        return [(u["Key"], u["UploadId"]) for u in r.get("Uploads", [])]


class PartUploader:
    """Uploads numbered parts of one multipart upload on a worker thread pool, at most
    ``in_flight`` pending, so the caller fills the next part while earlier ones travel."""

    def __init__(self, s3: S3, path: str, upload_id: str, in_flight: int = _IN_FLIGHT) -> None:
        self.s3, self.path, self.upload_id, self.in_flight = s3, path, upload_id, in_flight
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="hf-dcp-part")
        self._pending: deque[Future[dict[str, Any]]] = deque()
        self.etags: list[dict[str, Any]] = []

    def submit(self, number: int, data: bytes | bytearray) -> None:
        while len(self._pending) >= self.in_flight:
            self.etags.append(self._pending.popleft().result())
        self._pending.append(self._pool.submit(self.s3.upload_part, self.path, self.upload_id, number, data))

    def wait(self) -> list[dict[str, Any]]:
        """Every submitted part's ``{"PartNumber", "ETag"}``, once all are uploaded."""
        while self._pending:
            self.etags.append(self._pending.popleft().result())
        self._pool.shutdown(wait=True)
        return self.etags

    def cancel(self) -> None:
        for fut in self._pending:
            fut.cancel()
        self._pool.shutdown(wait=True)


class MultipartWriter:
    """A write-only stream to one S3 object, uploaded in parts with a few in flight.

    ``write`` buffers; each full part is uploaded on a worker thread while the caller fills
    the next one, with at most ``_IN_FLIGHT`` parts pending, so memory stays below
    ``(_IN_FLIGHT + 1) * part_bytes``. An object smaller than one part is a single PUT.
    Use as a context manager: a clean exit completes the upload; an error aborts it, so the
    store keeps neither the object nor orphaned parts.
    """

    def __init__(self, s3: S3, path: str, part_bytes: int) -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes={part_bytes} is below S3's minimum part size {MIN_PART_BYTES}")
        self.s3, self.path, self.part_bytes = s3, path, part_bytes
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._uploader: PartUploader | None = None
        self._parts = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        while view:
            take = min(len(view), self.part_bytes - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.part_bytes:
                self._send()
        return written

    def _send(self) -> None:
        if self._uploader is None:
            self._upload_id = self.s3.create_upload(self.path)
            self._uploader = PartUploader(self.s3, self.path, self._upload_id)
        self._parts += 1
        data, self._buf = self._buf, bytearray()  # hand the buffer over instead of copying it
        self._uploader.submit(self._parts, data)

    def close(self) -> None:
        """Upload what is buffered and commit the object."""
        if self._uploader is None:
            self.s3.put(self.path, self._buf)
            return
        if self._buf:
            self._send()
        assert self._upload_id is not None
        self.s3.complete_upload(self.path, self._upload_id, self._uploader.wait())

    def abort(self) -> None:
        """Drop everything: wait for in-flight parts, then abort the upload (if one was started)."""
        if self._uploader is not None:
            self._uploader.cancel()
        if self._upload_id is not None:
            self.s3.abort_upload(self.path, self._upload_id)

    def __enter__(self) -> MultipartWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                quietly(self.abort, self.path)
                raise
        else:
            quietly(self.abort, self.path)


def quietly(abort: Callable[[], None], path: str) -> None:
    """Clean up after a failure without masking it: a failing abort is logged, not raised."""
    try:
        abort()
    except Exception as exc:  # noqa: BLE001 - the original error is the one to report
        logger.warning("could not abort the multipart upload of s3://%s (%s); the next save to this path aborts it", path, exc)


# -- consolidated files -----------------------------------------------------------------------------


def complete_file(
    s3: S3,
    path: str,
    upload_id: str | None,
    header: bytes,
    parts: Sequence[RankPart | GatherPart],
    etags: Sequence[dict[str, Any]],
    gathered_by_ranks: Collection[int],
    sources: Callable[[GatherPart], Sequence[Source]],
    staged_path: Callable[[int], str],
    *,
    threads: int,
    stats: MergeStats,
) -> None:
    """(coordinator) Complete the multipart upload of ``path``.

    ``etags``: every part uploaded so far, the ranks' own parts and the gathered parts numbered
    in ``gathered_by_ranks``. Any gathered part not among those (finishing an interrupted save)
    is gathered here from ``sources(part)``, staged objects named by ``staged_path(rank)``. A
    one-part file has no ``upload_id``: a single PUT, by the rank that holds or gathered it, or
    here. On failure the upload is aborted.

    Raises:
        RuntimeError: a part is missing (an inconsistent save).
    """
    gathers = [p for p in parts if isinstance(p, GatherPart)]
    here = [p for p in gathers if p.number not in gathered_by_ranks]
    gathered = sum(p.nbytes for p in gathers)
    size = sum(p.nbytes for p in parts) + (len(header) if any(isinstance(p, RankPart) and p.header for p in parts) else 0)
    if upload_id is None:  # a one-part file: PUT already by a rank, or here
        if here:
            s3.put(path, gather_bytes(s3, sources(here[0]), staged_path, url=s3_url))
        stats.add(size, gathered, sum(p.nbytes for p in here))
        return
    try:
        expected = {p.number for p in parts} - {p.number for p in here}
        got = {e["PartNumber"] for e in etags}
        if got != expected:
            raise RuntimeError(f"s3://{path}: parts {sorted(expected - got)} were never uploaded by their ranks")
        done = list(etags)
        done += parallel_map(lambda p: s3.upload_part(path, upload_id, p.number, gather_bytes(s3, sources(p), staged_path, url=s3_url)), here, threads)
        s3.complete_upload(path, upload_id, sorted(done, key=lambda e: e["PartNumber"]), size)
    except BaseException:
        quietly(lambda: s3.abort_upload(path, upload_id), path)
        raise
    stats.add(size, gathered, sum(p.nbytes for p in here))
