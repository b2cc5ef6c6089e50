"""Direct I/O on local disk (``O_DIRECT``): the aligned interior of each byte run, from and into
page-aligned buffers, the unaligned edges through the page cache.

A direct write or read must start at a file offset, cover a length and use a buffer address
that are all multiples of the device's logical block size; ``ALIGN`` (4 KiB, a page) is a
multiple of every one in use. A run ``[f, f + n)`` is written as its head ``[f, A)`` and tail
``[B, f + n)`` buffered and its interior ``[A, B)`` (A, B the aligned bounds inside it) direct,
through a thread's aligned buffer: the pages a rank writes directly hold only its own bytes,
so no page is ever written directly by two ranks, and the pages they share go through the page
cache, which keeps them coherent. A read takes the aligned superset of a run into the buffer
and copies the run out. Runs under ``MIN_DIRECT`` bytes go through the page cache whole: a
system call per small run costs more than the cache.

Where a filesystem refuses ``O_DIRECT`` (ramfs, some network and FUSE filesystems: ``open``
fails with ``EINVAL``), ``open_direct`` says so and the caller falls back to buffered I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading

from .fsio import open_rw, pread_into, pwrite_all

__all__ = ["ALIGN", "MIN_DIRECT", "check_direct_io", "interior", "open_direct", "Descriptors", "AlignedBuffers", "pwrite_run", "pread_run"]

logger = logging.getLogger(__name__)

ALIGN = 4096
# Smaller runs (column shards of narrow rows, norms) go through the page cache whole.
MIN_DIRECT = 256 << 10
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def check_direct_io(value: object) -> bool | None:
    """``value`` as the writer's and reader's ``direct_io`` option, or ``ValueError`` naming it."""
    if value not in (None, True, False) or isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"direct_io={value!r} must be None (O_DIRECT where the filesystem takes it), True (or an error) or False (never)")
    return value  # type: ignore[return-value]


def open_direct(path: str, *, write: bool) -> int | None:
    """A descriptor of ``path`` opened with ``O_DIRECT``, or ``None`` where the filesystem (or
    the platform) has no direct I/O. Other errors (a missing file, no permission) raise."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | _O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


class Descriptors:
    """One rank's descriptors of the local files a save writes (``write``) or a load reads: a
    buffered one each, and an ``O_DIRECT`` one while ``direct`` holds. Whether the filesystem
    takes ``O_DIRECT`` is learnt at the first file, so once per save or load: where refused,
    the rest goes through the page cache (a log line says so), or with ``required`` it is an
    error. Thread-safe."""

    def __init__(self, *, write: bool, direct: bool, required: bool) -> None:
        self.write, self.direct, self.required = write, direct, required
        self.fds: dict[str, tuple[int, int | None]] = {}
        self.lock = threading.Lock()

    def open(self, path: str) -> tuple[int, int | None]:
        """``(buffered descriptor, O_DIRECT descriptor or None)`` of ``path``, opened once.

        Raises:
            ValueError: ``required``, and the filesystem refuses ``O_DIRECT``.
        """
        with self.lock:
            if path not in self.fds:
                fd = open_rw(path, create=False) if self.write else os.open(path, os.O_RDONLY)
                direct_fd = open_direct(path, write=self.write) if self.direct else None
                if self.direct and direct_fd is None:
                    self.direct = False
                    if self.required:
                        os.close(fd)
                        raise ValueError(f"direct_io=True, but the filesystem of {path} refuses O_DIRECT; pass direct_io=None (direct I/O where the filesystem takes it) or False")
                    logger.info("the filesystem of %s refuses O_DIRECT: this %s goes through the page cache", path, "save" if self.write else "load")
                self.fds[path] = (fd, direct_fd)
            return self.fds[path]

    def sync(self) -> None:
        """(writes) Make every byte and the files' sizes durable."""
        for fd, direct_fd in self.fds.values():
            os.fsync(fd)
            if direct_fd is not None:
                os.fsync(direct_fd)  # the file's extents and size (its data went to disk already)

    def close(self) -> None:
        for fd, direct_fd in self.fds.values():
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)
        self.fds = {}


class AlignedBuffers:
    """One page-aligned buffer per thread (anonymous ``mmap``: page-aligned by construction),
    grown to the largest request; its pages are resident only once touched."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> memoryview:
        """A writable page-aligned view of at least ``nbytes`` (valid until this thread's next call)."""
        held: mmap.mmap | None = getattr(self._local, "buf", None)
        if held is None or len(held) < nbytes:
            if held is not None:
                held.close()
            held = self._local.buf = mmap.mmap(-1, _round_up(max(nbytes, ALIGN)))
        return memoryview(held)


def interior(offset: int, n: int) -> tuple[int, int]:
    """``(start, end)`` of the aligned pages inside the run ``[offset, offset + n)`` that a direct
    write takes (``(offset, offset)``: none, under ``MIN_DIRECT``). Pure."""
    start, end = _round_up(offset), (offset + n) // ALIGN * ALIGN
    return (start, end) if end - start >= MIN_DIRECT else (offset, offset)


def pwrite_run(direct_fd: int, buffered_fd: int, data: memoryview, offset: int, buffers: AlignedBuffers) -> int:
    """Write ``data`` at ``offset``: its aligned interior direct, its edges buffered. Returns the
    bytes written directly (0 for a run under ``MIN_DIRECT``)."""
    start, end = interior(offset, len(data))
    if start == end:
        pwrite_all(buffered_fd, data, offset)
        return 0
    head, interior_bytes = start - offset, end - start
    if head:
        pwrite_all(buffered_fd, data[:head], offset)
    buf = buffers.get(interior_bytes)
    buf[:interior_bytes] = data[head : head + interior_bytes]
    pwrite_all(direct_fd, buf[:interior_bytes], start)
    if head + interior_bytes < len(data):
        pwrite_all(buffered_fd, data[head + interior_bytes :], end)
    return interior_bytes


def pread_run(direct_fd: int, buffered_fd: int, view: memoryview, offset: int, buffers: AlignedBuffers, *, where: str) -> int:
    """Fill ``view`` from ``offset``: the run's aligned superset read directly and copied out
    (a run under ``MIN_DIRECT``: buffered). Returns the bytes read directly.

    Raises:
        ValueError: the file ends before the run does (truncated), naming ``where``.
    """
    n = len(view)
    if n < MIN_DIRECT:
        pread_into(buffered_fd, view, offset, where=where)
        return 0
    start = offset // ALIGN * ALIGN
    span = _round_up(offset + n) - start
    buf = buffers.get(span)
    got = max(0, os.preadv(direct_fd, [buf[:span]], start) - (offset - start))  # of the run's bytes
    useful = min(got, n)
    view[:useful] = buf[offset - start : offset - start + useful]
    if useful < n:
        # A short direct read (the file's end, or an unusual one): the rest through the page
        # cache, where a truncated file fails naming itself.
        pread_into(buffered_fd, view[useful:], offset + useful, where=where)
    return span


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
