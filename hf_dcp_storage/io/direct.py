"""Direct I/O on local disk (``O_DIRECT``): the whole pages of a rank's byte runs, from and into
page-aligned buffers, the partial pages at their ends through the page cache.

A direct write or read must start at a file offset, cover a length and use a buffer address
that are all multiples of the device's logical block size; ``ALIGN`` (4 KiB, a page) is a
multiple of every one in use. A rank's contiguous bytes ``[f, g)`` (a tensor shard, slab after
slab) are written as their whole pages ``[A, B)`` (A, B the aligned bounds inside) direct and
their partial first and last pages buffered: the pages a rank writes directly hold only its own
bytes, so no page is ever written directly by two ranks, and the pages they share go through the
page cache, which keeps them coherent. A read takes the aligned superset of a run into a buffer,
a buffer at a time, and copies the run out. The buffers come from the process's pool
(``io/aligned.py``) and go back to it, so only the process's first direct save or load pays
for making them. Runs under ``MIN_DIRECT`` bytes go through the page cache whole: a
system call per small run costs more than the cache.

A save's direct writes are pipelined (``io/directwrite.py``: ``DirectWriter``,
``DirectStream``); the alignment and the ``O_DIRECT`` open are ``io/pages.py``. This module
holds a rank's descriptors, the direct reads, and is where the rest of the package imports
all of it from.

Where a filesystem refuses ``O_DIRECT`` (ramfs, some network and FUSE filesystems: ``open``
fails with ``EINVAL``), ``open_direct`` says so and the caller falls back to buffered I/O.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

import numpy as np

from .aligned import POOL, AlignedPool
from .directwrite import WRITE_BUFFERS, DirectStream, DirectWriter
from .fsio import open_rw, pread_into
from .pages import ALIGN, MIN_DIRECT, check_direct_io, interior, open_direct, round_up

__all__ = [
    "ALIGN",
    "MIN_DIRECT",
    "WRITE_BUFFERS",
    "AlignedBuffers",
    "Descriptors",
    "DirectStream",
    "DirectWriter",
    "check_direct_io",
    "interior",
    "open_direct",
    "pread_run",
]

logger = logging.getLogger(__name__)


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
                        raise ValueError(
                            f"direct_io=True, but the filesystem of {path} refuses O_DIRECT; pass "
                            "direct_io=None (direct I/O where the filesystem takes it) or False"
                        )
                    logger.info(
                        "the filesystem of %s refuses O_DIRECT: this %s goes through the page "
                        "cache",
                        path,
                        "save" if self.write else "load",
                    )
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
    """One aligned buffer per thread for a load's direct reads, taken from ``pool`` at the
    thread's first read and given back by ``close`` (the owner's, once every read is done)."""

    def __init__(self, pool: AlignedPool = POOL) -> None:
        self.pool = pool
        self._local = threading.local()
        self._taken: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        """This thread's buffer (``pool.nbytes`` bytes, page-aligned), valid until ``close``."""
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = self.pool.take()
            with self._lock:
                self._taken.append(buf)
        return buf

    def close(self) -> None:
        """Give every thread's buffer back to the pool. Idempotent."""
        with self._lock:
            taken, self._taken = self._taken, []
        self._local = threading.local()
        for buf in taken:
            self.pool.give(buf)


def pread_run(
    direct_fd: int,
    buffered_fd: int,
    view: memoryview,
    offset: int,
    buffers: AlignedBuffers,
    *,
    where: str,
) -> int:
    """Fill ``view`` from ``offset``: the run's aligned superset read directly, a buffer at a
    time, and copied out (a run under ``MIN_DIRECT``: buffered). Returns the bytes read directly.

    Raises:
        ValueError: the file ends before the run does (truncated), naming ``where``.
    """
    n = len(view)
    if n < MIN_DIRECT:
        pread_into(buffered_fd, view, offset, where=where)
        return 0
    buf = buffers.get()
    start, end, step = offset // ALIGN * ALIGN, round_up(offset + n), len(buf)
    done = read = 0  # the run's bytes filled, the bytes read directly
    for pos in range(start, end, step):
        span = min(step, end - pos)
        got = os.preadv(direct_fd, [memoryview(buf)[:span]], pos)
        read += got
        take = min(pos + got, offset + n) - (offset + done)  # of the run's bytes, from the next one
        if take > 0:
            # numpy copies without the GIL: the other I/O threads' reads complete meanwhile.
            np.copyto(
                np.frombuffer(view, np.uint8, take, done),
                np.frombuffer(buf, np.uint8, take, offset + done - pos),
            )
            done += take
        if got < span:
            break
    if done < n:
        # A short direct read (the file's end, or an unusual one): the rest through the page
        # cache, where a truncated file fails naming itself.
        pread_into(buffered_fd, view[done:], offset + done, where=where)
    return read
