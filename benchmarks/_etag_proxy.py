"""An S3 proxy for the benchmarks that fills in the missing ETag of radosgw's
CompleteMultipartUpload answers, and otherwise forwards bytes unchanged.

Why: Ceph 16.2's radosgw (this Debian's) answers CompleteMultipartUpload with ``<ETag></ETag>``
and no ETag header. botocore and s3fs accept that; s3torchconnector's CRT client fails the save
on it. Behind this proxy it saves. Run another contender through the proxy as well
(``pt_fsspec_proxy`` in ``bench_object_store``): the difference is what the proxy itself costs.

It is ``tests/support/faultproxy.FaultProxy`` (keep-alive, 100-continue, chunked bodies) with one
rewrite of that answer (body and header), and it forgets the request log after every request: a
benchmark pushes gigabytes through it and only needs the count.
"""

from __future__ import annotations

import hashlib
import threading

from tests.support.faultproxy import FaultProxy

__all__ = ["EtagProxy"]

_EMPTY = b"<ETag></ETag>"


class EtagProxy(FaultProxy):
    """``EtagProxy(upstream)``: ``endpoint``, ``close()`` and context manager as ``FaultProxy``;
    ``served`` counts the requests answered, ``filled`` the ETags it filled in."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.served = 0
        self.filled = 0
        self._count = threading.Lock()

    def _forward(self, up, request: bytes, method: str):  # type: ignore[no-untyped-def]
        status_line, headers, body, until_close = super()._forward(up, request, method)
        target = request.split(b" ", 2)[1]
        with self._count:
            self.served += 1
        if method == "POST" and b"uploadId=" in target and status_line.split(" ")[1] == "200":
            # Any non-empty quoted value will do: no client checks a multipart ETag's digest.
            etag = f'"{hashlib.md5(target).hexdigest()}-1"'
            if _EMPTY in body:
                body = body.replace(_EMPTY, f"<ETag>{etag}</ETag>".encode())
                headers = [
                    (k, str(len(body)) if k.lower() == "content-length" else v) for k, v in headers
                ]
            if not any(k.lower() == "etag" for k, _ in headers):
                headers.append(("ETag", etag))  # where the CRT client looks for it
            with self._count:
                self.filled += 1
        with self._lock:
            self._log.clear()  # only the counts are kept: the log would hold every body
        return status_line, headers, body, until_close
