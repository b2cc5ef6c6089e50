"""The S3 requests the library makes itself: multipart uploads, their parts, ranged GETs.

Used only when the fsspec filesystem is s3fs: ``stores/s3.py`` is the store built on them (the
part-store design of ``stores/parts.py``; ``stores/partsclient.PartsClient``), the reader's ranged
GETs and pruning's aborts go through them too; every other store goes through its own requests
or the generic fsspec path in ``io/fsio.py``. The requests go to s3fs's own botocore client (so
credentials, endpoint, region and ``s3_additional_kwargs`` such as server-side encryption are the
user's), but each one is retried by this library's :class:`~.retry.RetryPolicy`, which knows
which failures are transient, and fails with a message naming the operation and the object.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from ..io import fsio
from ..plan.parts import MIN_PART_BYTES
from .partsclient import PartRef, PartsClient, Uploader, quietly
from .retry import ErrorRules, RetryPolicy
from .s3_payload import BODY_METHODS, body_checksum, checkpoint_bytes

__all__ = ["S3", "S3_ERRORS", "MultipartWriter", "multipart_etag"]


def _s3_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)  # botocore's ClientError
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _s3_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) or None


# How S3's errors read (botocore's ClientError codes; its connection errors by class name, so
# that botocore need not be imported to judge them).
S3_ERRORS = ErrorRules(
    transient_codes=frozenset(
        {
            "SlowDown",
            "Throttling",
            "ThrottlingException",
            "RequestTimeout",
            "RequestTimeTooSkewed",
            "InternalError",
            "ServiceUnavailable",
            "RequestLimitExceeded",
            "BandwidthLimitExceeded",
        }
    ),
    unsupported_codes=frozenset({"NotImplemented", "XNotImplemented"}),
    missing_codes=frozenset({"NoSuchBucket", "NoSuchKey", "NoSuchUpload", "404", "NotFound"}),
    denied_codes=frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"}),
    transient_classes=frozenset(
        {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "IncompleteReadError",
            "ResponseStreamingError",
            "HTTPClientError",
            "ProxyConnectionError",
            "ResponseParserError",
            "ChecksumError",
            "FlexibleChecksumError",
            "AWSChunkedDecodingError",
        }
    ),
    code=_s3_code,
    status=_s3_status,
)

logger = logging.getLogger(__name__)


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


class S3(PartsClient):
    """Retried S3 requests on an s3fs filesystem's client; paths are ``bucket/key``. Thread-safe."""

    errors = S3_ERRORS

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        self.fs = fs
        self.retry = retry

    def url(self, path: str) -> str:
        return f"s3://{path}"

    async def _once(self, method: str, kwargs: dict[str, Any]) -> Any:
        fs = self.fs
        await fs.set_session()
        client = await fs.get_s3(kwargs.get("Bucket"))
        # The user's s3_additional_kwargs (e.g. SSE) and requester-pays, filtered per method.
        full = fs._get_s3_method_kwargs(getattr(client, method), **kwargs)
        if method not in BODY_METHODS:
            response = await getattr(client, method)(**full)
        else:
            # The body's checksum computed here, and the body sent unsigned (``s3_payload.py``).
            full.update(body_checksum(client, fs.s3_additional_kwargs, kwargs["Body"]))
            with checkpoint_bytes(client):
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
        return self.retry.call(
            lambda: sync(self.fs.loop, self._once, method, kwargs),
            operation=operation,
            url=f"s3://{path}",
            errors=self.errors,
        )

    async def read_span(self, path: str, start: int, end: int) -> bytes:
        bucket, key = _bucket_key(path)
        kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        r = await self.retry.acall(
            lambda: self._once("get_object", kwargs),
            operation=f"GET bytes {start}-{end - 1} of",
            url=f"s3://{path}",
            errors=self.errors,
        )
        return r["Data"]

    def put(self, path: str, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """One PUT: atomic on S3, and retried; its ``{"ETag"}``."""
        bucket, key = _bucket_key(path)
        r = self._call("put_object", "PUT", path, Bucket=bucket, Key=key, Body=data)
        return {"ETag": r.get("ETag")}

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
            return sync(
                self.fs.loop, self._once, "create_multipart_upload", {"Bucket": bucket, "Key": key}
            )

        upload_id = self.retry.call(
            once, operation="CreateMultipartUpload", url=f"s3://{path}", errors=self.errors
        )["UploadId"]
        if attempts > 1:
            self._abort_orphans(path, upload_id)
        return upload_id

    def _abort_orphans(self, path: str, keep: str) -> None:
        """Abort every unfinished upload of exactly ``path`` but ``keep``; a failure is only logged
        (the next save to this path aborts what is left)."""
        key = _bucket_key(path)[1]
        try:
            orphans = [
                upload_id
                for k, upload_id in self.list_uploads(path)
                if k == key and upload_id != keep
            ]
            for upload_id in orphans:
                self.abort_upload(path, upload_id)
        except Exception as exc:  # noqa: BLE001 - the upload itself was created; only cleanup failed
            logger.warning(
                "could not abort the uploads a retried CreateMultipartUpload of s3://%s may have "
                "left (%s)",
                path,
                exc,
            )

    def upload_part(
        self, root: str, save_id: str, part: PartRef, data: bytes | bytearray
    ) -> dict[str, Any]:
        """Part ``part.number`` into the file's multipart upload; a one-part file (no upload) is
        the whole object, one PUT."""
        path = fsio.join(root, part.name)
        if part.upload is None:
            return {"PartNumber": part.number, "ETag": self.put(path, data)["ETag"]}
        return self.upload_part_of(path, part.upload, part.number, data)

    def staged_writer(self, path: str, size: int) -> MultipartWriter:
        return MultipartWriter(self, path, max(fsio.part_bytes(self.fs, size), MIN_PART_BYTES))

    def upload_part_of(
        self, path: str, upload_id: str, number: int, data: bytes | bytearray
    ) -> dict[str, Any]:
        """Part ``number`` of multipart upload ``upload_id`` of ``path``; its ``{"PartNumber",
        "ETag"}``."""
        bucket, key = _bucket_key(path)
        r = self._call(
            "upload_part",
            f"UploadPart {number}",
            path,
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=data,
        )
        return {"PartNumber": number, "ETag": r["ETag"]}

    def complete_upload(
        self, path: str, upload_id: str, parts: Sequence[dict[str, Any]], size: int | None = None
    ) -> None:
        """Complete an upload. If a retry finds the upload gone because an earlier attempt did
        complete it (its answer was lost), an object of ``size`` bytes at ``path`` counts as
        done."""
        bucket, key = _bucket_key(path)
        try:
            self._call(
                "complete_multipart_upload",
                "CompleteMultipartUpload",
                path,
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": list(parts)},
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
        # Already gone (completed or aborted): done.
        with contextlib.suppress(FileNotFoundError):
            self._call(
                "abort_multipart_upload",
                "AbortMultipartUpload",
                path,
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
            )

    def list_uploads(self, path: str) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of unfinished multipart uploads under prefix ``path``."""
        bucket, prefix = _bucket_key(path)
        r = self._call(
            "list_multipart_uploads", "ListMultipartUploads", path, Bucket=bucket, Prefix=prefix
        )
        return [(u["Key"], u["UploadId"]) for u in r.get("Uploads", [])]


class MultipartWriter:
    """A write-only stream to one S3 object, uploaded in parts with a few in flight.

    ``write`` buffers; each full part is uploaded on a worker thread while the caller fills
    the next one, with at most two parts pending (``Uploader``), so memory stays below
    ``3 * part_bytes``. An object smaller than one part is a single PUT.
    Use as a context manager: a clean exit completes the upload; an error aborts it, so the
    store keeps neither the object nor orphaned parts.
    """

    def __init__(self, s3: S3, path: str, part_bytes: int) -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(
                f"part_bytes={part_bytes} is below S3's minimum part size {MIN_PART_BYTES}"
            )
        self.s3, self.path, self.part_bytes = s3, path, part_bytes
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._uploader: Uploader[int] | None = None
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
            self._upload_id = upload_id = self.s3.create_upload(self.path)
            self._uploader = Uploader(
                lambda number, data: self.s3.upload_part_of(self.path, upload_id, number, data)
            )
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
        parts = self._uploader.wait()
        self._uploader.close()
        self.s3.complete_upload(self.path, self._upload_id, parts)

    def abort(self) -> None:
        """Drop everything: wait for in-flight parts, then abort the upload (if one was started)."""
        if self._uploader is not None:
            self._uploader.close()
        if self._upload_id is not None:
            self.s3.abort_upload(self.path, self._upload_id)

    def __enter__(self) -> MultipartWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                quietly(self.abort, f"the multipart upload of {self.s3.url(self.path)}")
                raise
        else:
            quietly(self.abort, f"the multipart upload of {self.s3.url(self.path)}")
