"""The fault-injection proxy (``tests/support/faultproxy.py``) in front of the moto server, driven
by plain s3fs.

Proves that the proxy is transparent (bytes of puts, gets, ranged gets and multipart uploads come
back equal; ``Expect: 100-continue``, chunked request bodies and keep-alive work), that each
fault kind does what it says, and that the client stack (botocore's and s3fs' own retries)
rides out a transient fault while a permanent one surfaces at once.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator

import pytest

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from tests.support.faultproxy import Fault, FaultProxy  # noqa: E402
from tests.support.storage_options import S3_BLOCK_SIZE, s3_storage_options  # noqa: E402

MiB = 2**20


# One proxy and two filesystems for the module: a new ``S3FileSystem`` costs ~0.3 s (botocore
# loads its service model), which would dominate these tests.


@pytest.fixture(scope="module")
def _proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(upstream=s3_endpoint) as p:
        yield p


@pytest.fixture(scope="module")
def direct_fs(s3_endpoint: str) -> s3fs.S3FileSystem:
    """s3fs straight to moto, bypassing the proxy."""
    return s3fs.S3FileSystem(**s3_storage_options(s3_endpoint))


@pytest.fixture(scope="module")
def fs(_proxy: FaultProxy) -> s3fs.S3FileSystem:
    """s3fs talking to moto through the proxy."""
    return s3fs.S3FileSystem(**s3_storage_options(_proxy.endpoint))


@pytest.fixture
def bucket(direct_fs: s3fs.S3FileSystem) -> Iterator[str]:
    """A fresh bucket, made directly on moto."""
    name = f"faultproxy-{uuid.uuid4().hex[:16]}"
    direct_fs.mkdir(name)
    yield name
    direct_fs.rm(name, recursive=True)


@pytest.fixture
def proxy(_proxy: FaultProxy, bucket: str) -> Iterator[FaultProxy]:
    """The module's proxy with no faults and an empty log."""
    _proxy.clear()
    yield _proxy
    _proxy.clear()
    assert _proxy.errors == []  # no unexpected exception in the proxy's threads


def _multipart(fs: s3fs.S3FileSystem, path: str, data: bytes) -> None:
    """Write in block-sized pieces so s3fs uploads one part per block (the last one smaller)."""
    with fs.open(path, "wb") as f:
        for i in range(0, len(data), S3_BLOCK_SIZE):
            f.write(data[i : i + S3_BLOCK_SIZE])


def _parts(proxy: FaultProxy) -> list:
    return [r for r in proxy.requests if r.method == "PUT" and "partNumber=" in r.query]


def test_pass_through(fs, proxy, bucket):
    small, big = os.urandom(1000), os.urandom(S3_BLOCK_SIZE + MiB)
    fs.pipe(f"{bucket}/small", small)
    _multipart(fs, f"{bucket}/big", big)
    assert fs.cat(f"{bucket}/small") == small
    assert fs.cat(f"{bucket}/big") == big
    assert (
        fs.cat_file(f"{bucket}/big", start=S3_BLOCK_SIZE - 10, end=S3_BLOCK_SIZE + 20)
        == big[S3_BLOCK_SIZE - 10 : S3_BLOCK_SIZE + 20]
    )

    parts = _parts(proxy)
    assert sorted(len(r.body) for r in parts) == [MiB, S3_BLOCK_SIZE]  # a real two-part upload
    assert b"".join(r.body for r in sorted(parts, key=lambda r: r.query)) == big
    assert {r.status for r in proxy.requests} <= {200, 206}
    assert proxy.faults_fired() == {}


def test_expect_100_continue(fs, proxy, bucket):
    """botocore turns every PutObject/UploadPart body into a file object and sends ``Expect``;
    aiohttp then waits for ``100 Continue`` before the body: without the proxy's answer these
    hang."""
    data = os.urandom(4096)
    fs.pipe(f"{bucket}/k", data)
    fs.pipe(f"{bucket}/empty", b"")
    puts = [r for r in proxy.requests if r.method == "PUT"]
    assert [(r.headers.get("expect"), r.body, r.status) for r in puts] == [
        ("100-continue", data, 200),
        ("100-continue", b"", 200),
    ]
    assert fs.cat(f"{bucket}/k") == data and fs.cat(f"{bucket}/empty") == b""


def test_raw_expect_chunked_keepalive(proxy, bucket, direct_fs):
    """One raw connection: a chunked PUT with ``Expect`` (100 first, then 200) stores the
    de-chunked payload; a second request on the same connection is answered (keep-alive,
    although moto closes every upstream connection)."""
    # The raw requests are unsigned: radosgw (unlike moto) enforces the bucket's ACL.
    direct_fs.call_s3("put_bucket_acl", Bucket=bucket, ACL="public-read-write")
    host = proxy.endpoint.removeprefix("http://")
    with socket.create_connection(("127.0.0.1", int(host.split(":")[1])), timeout=5) as s:
        f = s.makefile("rb")
        s.sendall(
            f"PUT /{bucket}/raw HTTP/1.1\r\nHost: {host}\r\nExpect: "
            "100-continue\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
        s.sendall(b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n")
        assert f.readline().startswith(b"HTTP/1.1 200")
        length = 0
        while (line := f.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        f.read(length)
        s.sendall(f"HEAD /{bucket}/raw HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert f.readline().startswith(
            b"HTTP/1.1 "
        )  # unsigned: moto may answer 403; any answer will do
    put, head = proxy.requests
    assert put.body == b"hello, world" and put.headers["transfer-encoding"] == "chunked"
    assert head.method == "HEAD"
    assert direct_fs.cat(f"{bucket}/raw") == b"hello, world"


def test_503_on_part_upload_is_retried(fs, proxy, bucket):
    proxy.add_fault(Fault(kind="503", method="PUT", query_has="partNumber", times=1))
    data = os.urandom(S3_BLOCK_SIZE + MiB)
    _multipart(fs, f"{bucket}/big", data)
    assert fs.cat(f"{bucket}/big") == data
    assert proxy.faults_fired() == {"503": 1}
    statuses = [(r.status, r.fault) for r in _parts(proxy)]
    assert statuses.count((503, "503")) == 1 and statuses.count((200, None)) == 2


def test_500_on_copy_is_retried(fs, proxy, bucket):
    data = os.urandom(1000)
    fs.pipe(f"{bucket}/src", data)
    proxy.add_fault(Fault(kind="500", header_has="x-amz-copy-source", times=1))
    fs.copy(f"{bucket}/src", f"{bucket}/dst")
    assert fs.cat(f"{bucket}/dst") == data
    assert proxy.faults_fired() == {"500": 1}


@pytest.mark.parametrize("kind, times", [("reset", 2), ("truncate", 1)])
def test_broken_get_is_retried(fs, proxy, bucket, kind, times):
    """A truncated body: s3fs retries (aiohttp's ContentLengthError). A reset: aiohttp itself
    retries the first one silently (the request went out on a reused pooled connection), the
    second reaches botocore as EndpointConnectionError, which it retries."""
    data = os.urandom(MiB)
    fs.pipe(f"{bucket}/k", data)
    proxy.clear()
    proxy.add_fault(Fault(kind=kind, method="GET", path=r"/k$", times=times))
    assert fs.cat(f"{bucket}/k") == data
    assert proxy.faults_fired() == {kind: times}
    gets = [r for r in proxy.requests if r.method == "GET"]
    broken = (kind, None, 0) if kind == "reset" else (kind, 200, MiB // 2)
    assert [(r.fault, r.status, r.response_bytes) for r in gets] == [broken] * times + [
        (None, 200, MiB)
    ]


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_403_raises_permission_error_at_once(fs, proxy, bucket, method):
    """Permanent: no retry anywhere. On PUT the proxy refuses before the body (``Expect``)."""
    fs.pipe(f"{bucket}/k", b"x")
    proxy.clear()
    proxy.add_fault(Fault(kind="403", method=method, times=None))
    with pytest.raises(PermissionError):
        fs.cat(f"{bucket}/k") if method == "GET" else fs.pipe(f"{bucket}/k", b"y" * 1000)
    assert proxy.faults_fired() == {"403": 1}  # counted, not timed: one request, no retry
    (refused,) = [r for r in proxy.requests if r.method == method]
    assert refused.status == 403 and refused.body == b""


def test_ranged_get_log_counts_bytes(fs, proxy, bucket):
    data = os.urandom(MiB)
    fs.pipe(f"{bucket}/k", data)
    proxy.clear()
    ranges = [(0, 10), (1000, 5000), (MiB - 77, MiB)]
    got = fs.cat_ranges([f"{bucket}/k"] * 3, [a for a, _ in ranges], [b for _, b in ranges])
    assert got == [data[a:b] for a, b in ranges]
    ranged = [r for r in proxy.requests if r.method == "GET" and "range" in r.headers]
    assert len(ranged) == 3
    assert sum(r.response_bytes for r in ranged) == sum(b - a for a, b in ranges)


def test_latency_and_matching(fs, proxy, bucket):
    fs.pipe(f"{bucket}/k", b"abc")
    proxy.add_fault(Fault(kind="latency", method="GET", seconds=0.3, times=1))
    t0 = time.monotonic()
    assert fs.cat(f"{bucket}/k") == b"abc"
    assert time.monotonic() - t0 >= 0.3

    f = Fault(
        kind="404",
        method="PUT",
        path="/b/",
        query_has="x-id=UploadPartCopy",
        header_has="X-Amz-Copy-Source",
    )
    hdrs = [("x-amz-copy-source", "b/src")]
    assert f.matches("PUT", "/b/k", [("partNumber", "1"), ("x-id", "UploadPartCopy")], hdrs)
    assert not f.matches("PUT", "/b/k", [("x-id", "UploadPart")], hdrs)
    assert not f.matches("PUT", "/b/k", [("x-id", "UploadPartCopy")], [])
    assert not f.matches("GET", "/b/k", [("x-id", "UploadPartCopy")], hdrs)
