"""S3 requests the data path makes itself: multipart uploads, server-side part copies, ranged GETs.

Used only when the fsspec filesystem is s3fs; every other store goes through the generic
fsspec path in ``_fsio``. The requests go to s3fs's own botocore client (so credentials,
endpoint, region and ``s3_additional_kwargs`` such as server-side encryption are the user's),
but each one is retried by this library's :class:`~._retry.RetryPolicy`, which knows which
failures are transient, and fails with a message naming the operation and the object.

Two things make S3 consolidation cheap here:

* ``MultipartWriter`` streams a rank's staged object as a multipart upload with a few parts in
  flight, so memory stays a few part buffers per stream.
* ``merge_object`` builds a consolidated file as one multipart upload whose parts are mostly
  ``UploadPartCopy`` of byte ranges of the staged objects: those bytes move inside the store
  and never pass through the client. Only runs too small to be a part of their own (S3 parts
  are at least 5 MiB, except the last) are downloaded and uploaded again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from ._parallel import parallel_map
from ._retry import RetryPolicy

__all__ = [
    "S3",
    "s3_for",
    "MultipartWriter",
    "CopyPart",
    "ClientPart",
    "plan_parts",
    "MergeStats",
    "MIN_PART_BYTES",
    "MAX_PART_BYTES",
    "MAX_PARTS",
]

logger = logging.getLogger(__name__)

# S3's multipart rules: every part but the last holds at least 5 MiB and at most 5 GiB; an
# upload has at most 10,000 parts.
MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
MAX_PARTS = 10_000
# Parts a stream uploads at a time: enough to keep a connection busy while the next part fills.
_IN_FLIGHT = 2


def s3_for(fs: AbstractFileSystem, retry: RetryPolicy) -> S3 | None:
    """An :class:`S3` over ``fs`` if it is an s3fs filesystem, else ``None`` (generic path)."""
    if type(fs).__module__.split(".")[0] != "s3fs":
        return None
    return S3(fs, retry)


def _bucket_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class S3:
    """Retried S3 requests on an s3fs filesystem's client; paths are ``bucket/key``. Thread-safe."""

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        self.fs = fs
        self.retry = retry
        # Cleared the first time the store answers UploadPartCopy with 501 Not Implemented.
        self.server_copy = True

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
        bucket, key = _bucket_key(path)

        async def fetch_all() -> list[bytes]:
            gate = asyncio.Semaphore(concurrency)

            async def one(start: int, end: int) -> bytes:
                if end <= start:
                    return b""
                kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
                async with gate:
                    r = await self.retry.acall(
                        lambda: self._once("get_object", kwargs), operation=f"GET bytes {start}-{end - 1} of", url=f"s3://{path}"
                    )
                return r["Data"]

            return list(await asyncio.gather(*(one(s, e) for s, e in ranges)))

        return sync(self.fs.loop, fetch_all)

    def put(self, path: str, data: bytes | memoryview) -> None:
        bucket, key = _bucket_key(path)
        self._call("put_object", "PUT", path, Bucket=bucket, Key=key, Body=bytes(data))

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; fewer only if the object is shorter."""
        if end <= start:
            return b""
        bucket, key = _bucket_key(path)
        r = self._call("get_object", f"GET bytes {start}-{end - 1} of", path, Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        return r["Data"]

    def create_upload(self, path: str) -> str:
        bucket, key = _bucket_key(path)
        return self._call("create_multipart_upload", "CreateMultipartUpload", path, Bucket=bucket, Key=key)["UploadId"]

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        bucket, key = _bucket_key(path)
        r = self._call(
            "upload_part", f"UploadPart {number}", path, Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )
        return {"PartNumber": number, "ETag": r["ETag"]}

    def copy_part(self, path: str, upload_id: str, number: int, source: str, start: int, end: int) -> dict[str, Any]:
        """Part ``number`` of ``path`` := bytes ``[start, end)`` of object ``source``, copied by the server."""
        bucket, key = _bucket_key(path)
        src_bucket, src_key = _bucket_key(source)
        r = self._call(
            "upload_part_copy",
            f"UploadPartCopy {number} (from s3://{source} bytes {start}-{end - 1})",
            path,
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            CopySource={"Bucket": src_bucket, "Key": src_key},
            CopySourceRange=f"bytes={start}-{end - 1}",
        )
        return {"PartNumber": number, "ETag": r["CopyPartResult"]["ETag"]}

    def complete_upload(self, path: str, upload_id: str, parts: Sequence[dict[str, Any]]) -> None:
        bucket, key = _bucket_key(path)
        self._call(
            "complete_multipart_upload", "CompleteMultipartUpload", path,
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)},
        )

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
        self._pending: deque[Future[dict[str, Any]]] = deque()
        self._parts: list[dict[str, Any]] = []
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        while view:
            take = min(len(view), self.part_bytes - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.part_bytes:
                self._send(bytes(self._buf))
                self._buf.clear()
        return written

    def _send(self, data: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self.s3.create_upload(self.path)
            self._pool = ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="hf-dcp-part")
        while len(self._pending) >= _IN_FLIGHT:
            self._parts.append(self._pending.popleft().result())
        assert self._pool is not None
        number = len(self._parts) + len(self._pending) + 1
        self._pending.append(self._pool.submit(self.s3.upload_part, self.path, self._upload_id, number, data))

    def close(self) -> None:
        """Upload what is buffered and commit the object."""
        if self._upload_id is None:
            self.s3.put(self.path, bytes(self._buf))
            return
        if self._buf:
            self._send(bytes(self._buf))
        while self._pending:
            self._parts.append(self._pending.popleft().result())
        self._shutdown()
        self.s3.complete_upload(self.path, self._upload_id, self._parts)

    def abort(self) -> None:
        """Drop everything: wait for in-flight parts, then abort the upload (if one was started)."""
        for fut in self._pending:
            fut.cancel()
        self._shutdown()
        if self._upload_id is not None:
            self.s3.abort_upload(self.path, self._upload_id)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> MultipartWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                _quietly(self.abort, self.path)
                raise
        else:
            _quietly(self.abort, self.path)


def _quietly(abort: Callable[[], None], path: str) -> None:
    """Clean up after a failure without masking it: a failing abort is logged, not raised."""
    try:
        abort()
    except Exception as exc:  # noqa: BLE001 - the original error is the one to report
        logger.warning("could not abort the multipart upload of s3://%s (%s); the next save to this path aborts it", path, exc)


# -- server-side merge -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyPart:
    """A part copied by the server: bytes ``[start, end)`` of staged object ``source``."""

    source: str
    start: int
    end: int


@dataclass(frozen=True)
class ClientPart:
    """A part assembled by the client from small pieces ``(source | None, start, end)``; ``None`` = header."""

    pieces: tuple[tuple[str | None, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(e - s for _, s, e in self.pieces)


def plan_parts(
    header_len: int,
    segments: Iterable[tuple[int, str, int, int]],
    size: int,
    *,
    min_copy: int = MIN_PART_BYTES,
    max_part: int = MAX_PART_BYTES,
    copy: bool = True,
) -> list[CopyPart | ClientPart]:
    """Cut an output file into multipart parts, copying server-side every run that can be a part.

    ``segments`` are ``(output_offset, source, source_offset, nbytes)`` in output order after a
    header of ``header_len`` bytes (``_merge.merge_segments``). A run of at least ``min_copy``
    bytes becomes copy parts; smaller runs are gathered into client parts. Every part but the
    last holds at least ``min_copy`` bytes: a short gather in front of a copyable run takes the
    run's first bytes to reach it, so at most ``min_copy`` bytes per such switch pass through the
    client. Client parts grow as needed to keep the part count within S3's limit. ``copy=False``
    (a store without ``UploadPartCopy``) gathers everything in client parts. Pure.
    """
    client_target = max(MIN_PART_BYTES, min_copy if copy else 0, -(-size // (MAX_PARTS // 2)))
    parts: list[CopyPart | ClientPart] = []
    gather: list[tuple[str | None, int, int]] = [(None, 0, header_len)] if header_len else []
    gathered = header_len

    def flush() -> None:
        nonlocal gather, gathered
        if gather:
            parts.append(ClientPart(tuple(gather)))
        gather, gathered = [], 0

    for _, source, start, n in segments:
        end = start + n
        if copy and n >= min_copy:
            if 0 < gathered < min_copy:
                # Top the gather up to a valid part with the head of this run.
                need = min_copy - gathered
                if n - need < min_copy:
                    gather.append((source, start, end))  # too little would be left to copy
                    gathered += n
                    if gathered >= client_target:
                        flush()
                    continue
                gather.append((source, start, start + need))
                start += need
            flush()
            count = -(-(end - start) // max_part)
            step = -(-(end - start) // count)
            for s in range(start, end, step):
                parts.append(CopyPart(source, s, min(s + step, end)))
        else:
            # Long runs go in pieces so that a client part stays about ``client_target`` bytes.
            while start < end:
                take = min(end - start, client_target - gathered)
                gather.append((source, start, start + take))
                gathered += take
                start += take
                if gathered >= client_target:
                    flush()
    flush()
    if len(parts) > MAX_PARTS:
        raise ValueError(f"{len(parts)} parts exceed S3's limit of {MAX_PARTS}; lower max_shard_size")
    return parts


@dataclass
class MergeStats:
    """Bytes of consolidated files by how they got there (coordinator side)."""

    files: int = 0
    total_bytes: int = 0
    server_copied_bytes: int = 0
    client_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, total: int, copied: int, client: int) -> None:
        with self._lock:
            self.files += 1
            self.total_bytes += total
            self.server_copied_bytes += copied
            self.client_bytes += client

    @property
    def client_fraction(self) -> float:
        return self.client_bytes / self.total_bytes if self.total_bytes else 0.0


def merge_object(
    s3: S3,
    out_path: str,
    header: bytes,
    size: int,
    segments: Iterable[tuple[int, str, int, int]],
    *,
    threads: int,
    stats: MergeStats,
    min_copy: int = MIN_PART_BYTES,
) -> None:
    """Write ``out_path`` as header + staged runs, mostly by server-side copies, parts in parallel.

    Raises:
        RuntimeError: the runs leave a hole or the total is not ``size`` (inconsistent save).
    """
    segments = _checked(out_path, len(header), size, segments)
    parts = plan_parts(len(header), segments, size, min_copy=min_copy, copy=s3.server_copy)
    if len(parts) == 1 and isinstance(parts[0], ClientPart):
        s3.put(out_path, _gather(s3, header, parts[0]))  # one small file: a single PUT
        stats.add(size, 0, size)
        return
    upload_id = s3.create_upload(out_path)

    def send(numbered: tuple[int, CopyPart | ClientPart]) -> dict[str, Any]:
        number, part = numbered
        if isinstance(part, CopyPart):
            return s3.copy_part(out_path, upload_id, number, part.source, part.start, part.end)
        return s3.upload_part(out_path, upload_id, number, _gather(s3, header, part))

    try:
        etags = parallel_map(send, list(enumerate(parts, start=1)), threads)
        s3.complete_upload(out_path, upload_id, etags)
    except BaseException as exc:
        _quietly(lambda: s3.abort_upload(out_path, upload_id), out_path)
        if s3.server_copy and _not_implemented(exc):
            # A store without UploadPartCopy: stream the ranges through the client instead,
            # for this file and every later one.
            s3.server_copy = False
            merge_object(s3, out_path, header, size, segments, threads=threads, stats=stats, min_copy=min_copy)
            return
        raise
    copied = sum(p.end - p.start for p in parts if isinstance(p, CopyPart))
    stats.add(size, copied, size - copied)


def _not_implemented(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is the store saying it lacks a feature (HTTP 501)."""
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            error = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error.get("Code") in {"NotImplemented", "XNotImplemented"} or status == 501:
                return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def _checked(out_path: str, pos: int, size: int, segments: Iterable[tuple[int, str, int, int]]) -> list[tuple[int, str, int, int]]:
    result = []
    for seg in segments:
        if seg[0] != pos:
            raise RuntimeError(f"{out_path}: staged data jumps from byte {pos} to {seg[0]}; the save is inconsistent")
        pos += seg[3]
        result.append(seg)
    if pos != size:
        raise RuntimeError(f"{out_path}: merged {pos} bytes but the layout has {size}")
    return result


def _gather(s3: S3, header: bytes, part: ClientPart) -> bytes:
    out = bytearray()
    for source, start, end in part.pieces:
        if source is None:
            out += header[start:end]
            continue
        data = s3.get_range(source, start, end)
        if len(data) != end - start:
            raise RuntimeError(f"s3://{source}: staged object ends early at byte {start + len(data)}")
        out += data
    return bytes(out)
