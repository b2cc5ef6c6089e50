"""A small fault-injection HTTP/1.1 proxy for the S3 tests (standard library only).

Contract:

* ``FaultProxy(upstream="http://127.0.0.1:PORT")`` listens on ``127.0.0.1`` (OS-chosen port) and
  forwards every request to ``upstream`` (plain HTTP, loopback only); ``proxy.endpoint`` is the
  URL to give a client (e.g. s3fs' ``endpoint_url``). Use it as a context manager or call
  ``close()``, which stops the listener and every connection promptly.
* Bytes are never changed: the request line, headers (``Host`` included, so SigV4 signatures
  still match) and bodies go upstream as sent, and the response comes back as sent (a chunked
  response keeps its framing). Hop-by-hop exceptions: ``Expect: 100-continue`` is answered by
  the proxy itself (``100 Continue`` before the body is read) and dropped upstream; a chunked
  request body is de-chunked and forwarded with ``Content-Length`` (payload bytes unchanged;
  HTTP trailer fields become headers); the response's ``Connection``/``Keep-Alive`` headers
  are the proxy's own (see next point).
* Keep-alive: a client connection carries any number of requests (one thread per connection,
  one upstream connection per client connection, reopened when upstream closes it). Moto's
  server (werkzeug) answers every request with ``Connection: close``; the proxy still keeps the
  client's connection open, as S3 does, so clients reuse pooled connections as in production.
* ``add_fault(Fault(...))``: for each request the first fault that matches and has not used up
  its ``times`` fires (at most one per request); see :class:`Fault` for the kinds.
* ``requests`` is a log of :class:`Record` (one per request that got an answer or a fault);
  ``faults_fired()`` counts fires per kind; ``errors`` holds unexpected exceptions from the
  proxy's threads (a test may assert it is empty).
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import BinaryIO, Literal
from urllib.parse import parse_qsl, urlsplit

Kind = Literal["403", "404", "500", "501", "503", "reset", "truncate", "latency"]

# kind -> (status line reason, S3 error code, message)
_ERRORS: dict[str, tuple[str, str, str]] = {
    "403": ("Forbidden", "AccessDenied", "Access Denied"),
    "404": ("Not Found", "NoSuchKey", "The specified key does not exist."),
    "500": (
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
    "501": (
        "Not Implemented",
        "NotImplemented",
        "A header you provided implies functionality that is not implemented.",
    ),
    "503": ("Slow Down", "SlowDown", "Please reduce your request rate."),
}

Headers = list[tuple[str, str]]  # in wire order, names as sent


def _has(pairs: Headers, spec: str, *, fold_names: bool) -> bool:
    """``spec`` is ``name`` (present) or ``name=value`` (present with that value)."""
    name, sep, value = spec.partition("=")
    if fold_names:
        name = name.lower()
    return any(
        (k.lower() if fold_names else k) == name and (not sep or v == value) for k, v in pairs
    )


@dataclass
class Fault:
    """What to do to matching requests.

    Kinds: ``"403"``/``"404"`` (permanent: AccessDenied / NoSuchKey), ``"501"`` (NotImplemented:
    a store without the feature, e.g. no server-side copy) and ``"500"``/``"503"``
    (transient: InternalError / SlowDown) answer an S3 XML error and never reach upstream
    (with ``Expect: 100-continue`` they answer before the body, then close the connection, as
    S3 does); ``"reset"`` reads the request, then drops the connection with a TCP RST;
    ``"truncate"`` forwards, sends the status and headers unchanged (full ``Content-Length``)
    and half of the body, then closes; ``"latency"`` sleeps ``seconds``, then forwards.

    Matching (all given conditions must hold): ``method`` (exact, e.g. ``"PUT"``), ``path``
    (``re.search`` on the URL path), ``query_has`` (``"partNumber"`` or ``"x-id=UploadPartCopy"``),
    ``query_re`` (``re.search`` on each ``name=value`` of the query: a value not known exactly),
    ``header_has`` (``"x-amz-copy-source"`` or ``"name=value"``; names case-insensitive).
    ``times=N`` fires on the first N matching requests, ``None`` on all; ``fired`` counts fires.
    """

    kind: Kind
    method: str | None = None
    path: str | None = None
    query_has: str | None = None
    query_re: str | None = None
    header_has: str | None = None
    times: int | None = 1
    seconds: float = 0.0
    fired: int = field(default=0, init=False)

    def matches(self, method: str, path: str, query: Headers, headers: Headers) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.path is None or re.search(self.path, path) is not None)
            and (self.query_has is None or _has(query, self.query_has, fold_names=False))
            and (
                self.query_re is None or any(re.search(self.query_re, f"{k}={v}") for k, v in query)
            )
            and (self.header_has is None or _has(headers, self.header_has, fold_names=True))
        )


@dataclass
class Record:
    """One request as the proxy saw it and what the client got back.

    ``headers``: the request headers (names lower-cased); ``body``: the request payload (de-chunked;
    empty when a fault answered before the body); ``status``: sent to the client (``None`` for a
    reset); ``response_bytes``: body bytes sent to the client (raw framing if chunked).
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    status: int | None
    response_bytes: int
    fault: Kind | None


class _Upstream:
    """The upstream connection of one client connection: opened lazily, reopened after a close."""

    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy
        self.sock: socket.socket | None = None
        self.reader: BinaryIO | None = None

    def open(self) -> BinaryIO:
        if self.reader is None:
            self.sock = socket.create_connection(self._proxy._upstream, timeout=60)
            self._proxy._track(self.sock)
            self.reader = self.sock.makefile("rb")
        return self.reader

    def close(self) -> None:
        if self.sock is not None and self.reader is not None:
            self.reader.close()  # the fd closes only once its reader is closed too
            self._proxy._drop(self.sock)
        self.sock = self.reader = None


class _Closed(Exception):
    """The peer closed the connection where a message was expected."""


def _field(line: bytes) -> tuple[str, str]:
    name, _, value = line.decode("latin-1").partition(":")
    return name.strip(), value.strip()


def _read_head(f: BinaryIO) -> tuple[str, Headers] | None:
    """Start line and headers of one message; ``None`` on a clean EOF before it."""
    line = f.readline(65537)
    while line in (b"\r\n", b"\n"):  # tolerate stray blank lines between messages
        line = f.readline(65537)
    if not line:
        return None
    headers: Headers = []
    while True:
        h = f.readline(65537)
        if not h:
            raise _Closed("EOF in headers")
        if h in (b"\r\n", b"\n"):
            break
        headers.append(_field(h))
    return line.decode("latin-1").rstrip("\r\n"), headers


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _Closed(f"EOF after {len(data)} of {n} body bytes")
    return data


def _read_chunked(f: BinaryIO) -> tuple[bytes, bytes, Headers]:
    """A chunked body: (raw framing as received, decoded payload, trailer fields)."""
    raw, payload = bytearray(), bytearray()
    while True:
        size_line = f.readline(65537)
        if not size_line:
            raise _Closed("EOF in chunked body")
        raw += size_line
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            break
        chunk = _read_exact(f, size + 2)
        raw += chunk
        payload += chunk[:-2]
    trailers: Headers = []
    while (t := f.readline(65537)) not in (b"\r\n", b"\n", b""):
        raw += t
        trailers.append(_field(t))
    return bytes(raw + b"\r\n"), bytes(payload), trailers


def _head_bytes(start: str, headers: Headers) -> bytes:
    return (start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode(
        "latin-1"
    )


def _error_response(kind: str, method: str, path: str, close: bool) -> tuple[bytes, bytes]:
    """Head and body of an S3 XML error (no body for HEAD, as S3)."""
    reason, code, message = _ERRORS[kind]
    xml = (
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{path}</Resource>"
        "<RequestId>faultproxy</RequestId></Error>"
    )
    body = b"" if method == "HEAD" else ('<?xml version="1.0" encoding="UTF-8"?>\n' + xml).encode()
    headers = [
        ("Content-Type", "application/xml"),
        ("Content-Length", str(len(body))),
        ("x-amz-request-id", "faultproxy"),
    ]
    return _head_bytes(
        f"HTTP/1.1 {kind} {reason}", headers + [("Connection", "close")] * close
    ), body


class FaultProxy:
    """Fault-injecting HTTP/1.1 proxy in front of ``upstream``; see the module docstring."""

    def __init__(self, upstream: str) -> None:
        url = urlsplit(upstream)
        if url.scheme != "http" or url.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"upstream must be http://127.0.0.1:PORT, not {upstream!r}")
        self._upstream = (url.hostname, url.port or 80)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[Record] = []
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # the accept loop polls _stop
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._spawn(self._accept_loop)

    # -- public API ----------------------------------------------------------------------------

    def add_fault(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    @property
    def requests(self) -> list[Record]:
        with self._lock:
            return list(self._log)

    def faults_fired(self) -> dict[str, int]:
        """``kind -> fires`` over all faults added since the last ``clear()``."""
        with self._lock:
            counts: Counter[str] = Counter()
            for f in self._faults:
                counts[f.kind] += f.fired
            return {k: n for k, n in counts.items() if n}

    def clear(self) -> None:
        """Forget every fault and the request log."""
        with self._lock:
            self._faults.clear()
            self._log.clear()

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(timeout=5)  # the accept loop: no new connection after this
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        for t in self._threads[1:]:
            t.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> FaultProxy:  # Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="faultproxy")
        self._threads.append(t)
        t.start()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.add(s)

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.discard(s)
        s.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # timeout included
                continue
            conn.settimeout(None)
            self._track(conn)
            self._spawn(self._serve, conn)

    def _take_fault(self, method: str, path: str, query: Headers, headers: Headers) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if (f.times is None or f.fired < f.times) and f.matches(
                    method, path, query, headers
                ):
                    f.fired += 1
                    return f
        return None

    def _serve(self, client: socket.socket) -> None:
        cf = client.makefile("rb")
        up = _Upstream(self)
        try:
            while not self._stop.is_set() and self._one_request(client, cf, up):
                pass
        except (OSError, _Closed):
            pass  # a peer went away (or close() shut the sockets): end this connection
        except Exception as e:  # noqa: BLE001 - surfaced through .errors, never a thread crash
            self.errors.append(e)
        finally:
            cf.close()  # the fd closes only once its reader is closed too
            self._drop(client)
            up.close()

    def _one_request(self, client: socket.socket, cf: BinaryIO, up: _Upstream) -> bool:
        """Serve one request; ``False`` when the client connection must end."""
        head = _read_head(cf)
        if head is None:
            return False
        start, headers = head
        method, target, version = start.split(" ", 2)
        url = urlsplit(target)
        query = parse_qsl(url.query, keep_blank_values=True)
        fault = self._take_fault(method, url.path, query, headers)
        kind = fault.kind if fault else None
        lower = {k.lower(): v for k, v in headers}
        expect = lower.get("expect", "").lower() == "100-continue"
        chunked = "chunked" in lower.get("transfer-encoding", "").lower()
        length = int(lower.get("content-length", "0") or 0)
        rec = Record(method, url.path, url.query, lower, b"", None, 0, kind)

        def reply(status: int | None, head: bytes, body: bytes) -> None:
            rec.status, rec.response_bytes = status, len(body)
            with self._lock:  # logged before sending: a client that has its answer sees the record
                self._log.append(rec)
            client.sendall(head + body)

        if kind in _ERRORS and expect:  # refuse before the body, as S3 does; the body never comes
            reply(int(kind), *_error_response(kind, method, url.path, close=True))
            return False
        if expect:  # even for an empty body: aiohttp waits for the 100 before "sending" it
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        fwd = [(k, v) for k, v in headers if k.lower() != "expect"]
        if chunked:
            _, rec.body, trailers = _read_chunked(cf)
            fwd = [
                (k, v) for k, v in fwd if k.lower() not in ("transfer-encoding", "content-length")
            ]
            fwd += [*trailers, ("Content-Length", str(len(rec.body)))]
        elif length:
            rec.body = _read_exact(cf, length)
        keep = lower.get("connection", "").lower() != "close" and version == "HTTP/1.1"

        if kind == "latency":
            self._stop.wait(fault.seconds)
        if kind == "reset":
            reply(None, b"", b"")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False  # _serve closes the socket: with linger 0 that sends RST
        if kind in _ERRORS:
            reply(int(kind), *_error_response(kind, method, url.path, close=not keep))
            return keep

        status_line, rheaders, body, until_close = self._forward(
            up, _head_bytes(start, fwd) + rec.body, method
        )
        # Connection headers are per hop: moto (werkzeug) closes after every response, but the
        # client keeps its connection, as with S3, unless the body was delimited by the close.
        rheaders = [(k, v) for k, v in rheaders if k.lower() not in ("connection", "keep-alive")]
        keep = keep and not until_close
        if kind == "truncate":
            body, keep = body[: len(body) // 2], False
        elif not keep:
            rheaders.append(("Connection", "close"))
        reply(int(status_line.split(" ", 2)[1]), _head_bytes(status_line, rheaders), body)
        return keep

    def _forward(
        self, up: _Upstream, request: bytes, method: str
    ) -> tuple[str, Headers, bytes, bool]:
        """Send ``request`` upstream; (status line, headers, raw body, body delimited by close)."""
        for attempt in (0, 1):
            reused = up.reader is not None
            reader = up.open()
            try:
                assert up.sock is not None
                up.sock.sendall(request)
                head = _read_head(reader)
                while head is not None and head[0].split(" ", 2)[1].startswith("1"):
                    head = _read_head(reader)  # skip interim responses
                if head is None:
                    raise _Closed("upstream closed before responding")
                break
            except (OSError, _Closed):
                up.close()
                if not reused or attempt:  # only a stale kept-alive connection is retried
                    raise
        status_line, headers = head
        status = int(status_line.split(" ", 2)[1])
        lower = {k.lower(): v for k, v in headers}
        until_close = False
        if method == "HEAD" or status in (204, 304):
            body = b""
        elif "chunked" in lower.get("transfer-encoding", "").lower():
            body = _read_chunked(reader)[0]
        elif "content-length" in lower:
            body = _read_exact(reader, int(lower["content-length"]))
        else:
            body, until_close = reader.read(), True
        if until_close or lower.get("connection", "").lower() == "close":
            up.close()
        return status_line, headers, body, until_close
