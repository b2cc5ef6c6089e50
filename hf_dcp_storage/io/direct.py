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

A save's direct writes are pipelined (``DirectWriter``, ``DirectStream``): the I/O threads
checksum a slab and copy its pages into one of a few aligned buffers, and a writer thread of the
save issues the ``O_DIRECT`` writes, so the device is not idle while the next slab is
checksummed and copied (done one after the other, the CPU steps cost about half the device's
write time here).

Where a filesystem refuses ``O_DIRECT`` (ramfs, some network and FUSE filesystems: ``open``
fails with ``EINVAL``), ``open_direct`` says so and the caller falls back to buffered I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading

import numpy as np

from .aligned import POOL, AlignedPool
from .fsio import open_rw, pread_into, pwrite_all

__all__ = ["ALIGN", "MIN_DIRECT", "check_direct_io", "interior", "open_direct", "Descriptors", "AlignedBuffers", "DirectWriter", "DirectStream", "pread_run"]

logger = logging.getLogger(__name__)

ALIGN = 4096
# Smaller runs (column shards of narrow rows, norms) go through the page cache whole.
MIN_DIRECT = 256 << 10
# A save's aligned buffers (each one piece of a run's pages, being filled or being written) and
# the threads writing them: with one write in flight per rank the writer is busy the whole save
# and the I/O threads wait for buffers; two writer threads were no faster, with the files
# preallocated or not (benchmarks/results/2026-12_direct-io-pipelined-cpu-2core.md).
WRITE_BUFFERS = 4
WRITE_THREADS = 1
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


def interior(offset: int, n: int) -> tuple[int, int]:
    """``(start, end)`` of the aligned pages inside the run ``[offset, offset + n)`` that a direct
    write takes (``(offset, offset)``: none, under ``MIN_DIRECT``). Pure."""
    start, end = _round_up(offset), (offset + n) // ALIGN * ALIGN
    return (start, end) if end - start >= MIN_DIRECT else (offset, offset)


class DirectWriter:
    """The direct writes of one rank's save, pipelined: the store's I/O threads write through
    streams (``stream``), which copy the whole pages of their runs into free aligned buffers,
    a piece of up to ``pool.nbytes`` bytes each, and queue them; ``threads`` threads of this
    writer issue the ``O_DIRECT`` writes. At most ``buffers`` pieces are filled or in flight, so
    the memory is ``buffers x pool.nbytes`` (64 MiB) whatever the model; the buffers are taken
    from ``pool`` and given back by ``close``, for the process's next save.

    Who calls what: any number of threads make and use streams (one per thread and file run
    each); the owner calls ``close`` once every stream is flushed, and in any case before the
    descriptors are closed: it waits for every queued write. A failed write is raised by
    ``close`` (and by the next stream write); the writes queued after it are dropped, not written.
    """

    def __init__(self, *, buffers: int = WRITE_BUFFERS, threads: int = WRITE_THREADS, pool: AlignedPool = POOL) -> None:
        if pool.nbytes % ALIGN or buffers < 1 or threads < 1:
            raise ValueError(f"DirectWriter(buffers={buffers}, threads={threads}, pool of {pool.nbytes}-byte buffers): needs buffers, threads >= 1 and buffers of whole {ALIGN}-byte pages")
        self.pool, self.buffers, self.nthreads = pool, buffers, threads
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._taken: list[mmap.mmap] = []
        self._jobs: queue.SimpleQueue[tuple[int, mmap.mmap, int, int, int] | None] = queue.SimpleQueue()  # fd, buffer, [lo, hi) of it, file offset
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False

    @property
    def piece(self) -> int:
        """The most bytes one queued write takes: a buffer's size."""
        return self.pool.nbytes

    def stream(self, direct_fd: int, buffered_fd: int) -> DirectStream:
        """A stream of contiguous bytes into the file of ``direct_fd`` / ``buffered_fd``."""
        return DirectStream(self, direct_fd, buffered_fd)

    def queue_pages(self, direct_fd: int, start: int, pre: bytes, data: memoryview, nbytes: int) -> None:
        """Queue ``pre + data[: nbytes - len(pre)]`` for direct writing at ``start``: ``start``
        and ``nbytes`` whole pages, ``pre`` shorter than a page. ``data`` may be reused once
        this returns."""
        source = np.frombuffer(data, np.uint8) if len(data) else np.empty(0, np.uint8)
        lead = len(pre)
        for pos in range(0, nbytes, self.piece):
            n = min(self.piece, nbytes - pos)
            buf = self.acquire()
            dest = np.frombuffer(buf, np.uint8, n)
            # numpy copies without the GIL: the writer thread's next write is not held up.
            if pos == 0 and lead:
                dest[:lead] = np.frombuffer(pre, np.uint8)
                np.copyto(dest[lead:], source[: n - lead])
            else:
                np.copyto(dest, source[pos - lead : pos - lead + n])
            self.queue_buffer(direct_fd, buf, 0, n, start + pos)

    def queue_buffer(self, direct_fd: int, buf: mmap.mmap, lo: int, hi: int, start: int) -> None:
        """Queue ``buf[lo:hi]`` (whole pages, from a page of the buffer; ``buf`` one of this
        writer's, from ``acquire``) for direct writing at ``start``; the writer owns it after."""
        self._jobs.put((direct_fd, buf, lo, hi, start))

    def release(self, buf: mmap.mmap) -> None:
        """Hand back a buffer from ``acquire`` that nothing was queued from."""
        self._free.put(buf)

    def close(self, *, check: bool = True) -> None:
        """Wait for every queued write and stop the threads, give the buffers back to the pool;
        then (``check``) raise the first failed write's error. Idempotent."""
        with self._lock:
            threads, self._threads, self._closed = self._threads, [], True
        for _ in threads:
            self._jobs.put(None)
        for t in threads:
            t.join()
        # No write is in flight and no stream is filling a buffer (close comes after them).
        taken, self._taken = self._taken, []
        for buf in taken:
            self.pool.give(buf)
        error, self._error = self._error, None
        if check and error is not None:
            raise error

    def acquire(self) -> mmap.mmap:
        """A free buffer (taken from the pool while fewer than ``buffers`` are, else waited
        for); starts the threads at the first call."""
        if self._error is not None:
            raise self._error
        with self._lock:
            if self._closed:
                raise RuntimeError("DirectWriter: a stream wrote after the writer was closed")
            if not self._threads:
                self._threads = [threading.Thread(target=self._run, name=f"hf_dcp_storage-direct-{i}", daemon=True) for i in range(self.nthreads)]
                for t in self._threads:
                    t.start()
            if len(self._taken) < self.buffers:
                buf = self.pool.take()
                self._taken.append(buf)
                return buf
        buf = self._free.get()
        if self._error is not None:
            self._free.put(buf)
            raise self._error
        return buf

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fd, buf, lo, hi, pos = job
            try:
                if self._error is None:
                    pwrite_all(fd, memoryview(buf)[lo:hi], pos)
            except BaseException as exc:  # noqa: BLE001 - handed to the save's threads, raised there
                self._error = self._error or exc
            finally:
                self._free.put(buf)


def pread_run(direct_fd: int, buffered_fd: int, view: memoryview, offset: int, buffers: AlignedBuffers, *, where: str) -> int:
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
    start, end, step = offset // ALIGN * ALIGN, _round_up(offset + n), len(buf)
    done = read = 0  # the run's bytes filled, the bytes read directly
    for pos in range(start, end, step):
        span = min(step, end - pos)
        got = os.preadv(direct_fd, [memoryview(buf)[:span]], pos)
        read += got
        take = min(pos + got, offset + n) - (offset + done)  # of the run's bytes, from the next one
        if take > 0:
            # numpy copies without the GIL: the other I/O threads' reads complete meanwhile.
            np.copyto(np.frombuffer(view, np.uint8, take, done), np.frombuffer(buf, np.uint8, take, offset + done - pos))
            done += take
        if got < span:
            break
    if done < n:
        # A short direct read (the file's end, or an unusual one): the rest through the page
        # cache, where a truncated file fails naming itself.
        pread_into(buffered_fd, view[done:], offset + done, where=where)
    return read


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class DirectStream:
    """One I/O thread's contiguous bytes in one file (a write item's runs, slab after slab),
    through a ``DirectWriter``: the whole pages inside them go direct, and the bytes after a
    run's last whole page (fewer than a page) wait for the next run, which completes the page,
    so consecutive slabs go direct without a seam. Only the stream's first and last partial
    pages, which a neighbouring rank's bytes may share, go through the page cache; a stream
    holding fewer than ``MIN_DIRECT`` bytes of whole pages at its start goes through it whole.

    Not thread-safe: one per thread and run of bytes; ``flush`` writes the last partial page,
    before the writer's ``close``.

    Attributes:
        direct: bytes queued for direct writing so far.
    """

    def __init__(self, writer: DirectWriter, direct_fd: int, buffered_fd: int) -> None:
        self._writer, self._direct_fd, self._fd = writer, direct_fd, buffered_fd
        self._carry, self._carry_at = b"", 0
        self._reserved: tuple[mmap.mmap, int, int] | None = None  # (buffer, offset, bytes)
        self.direct = 0

    def reserve(self, offset: int, n: int) -> memoryview | None:
        """Where to put the ``n`` bytes the stream writes next, at ``offset``, so that they are
        written from there without a copy: a view inside an aligned buffer, at the bytes' place
        in their pages. The caller fills it and passes it to ``write`` next (it is the writer's
        after that). ``None`` where the bytes go another way (under ``MIN_DIRECT``; more than a
        buffer holds): the caller writes them from memory of its own."""
        lead = offset % ALIGN
        if not (self._carry and self._carry_at + len(self._carry) == offset):
            self.flush()  # not contiguous: the held partial page is an end of its run
            first, end = interior(offset, n)
            if first == end:
                return None
        if n < ALIGN or lead + n > self._writer.piece:
            return None
        buf = self._writer.acquire()
        self._reserved = (buf, offset, n)
        return memoryview(buf)[lead : lead + n]

    def write(self, data: memoryview, offset: int) -> None:
        """Write ``data`` at ``offset`` (``data`` may be reused once this returns, unless it is
        the view ``reserve`` gave, which must be the next write)."""
        if self._reserved is not None:
            self._write_reserved(data, offset)
            return
        if self._carry and self._carry_at + len(self._carry) == offset:
            start, pre = self._carry_at, self._carry
        else:
            self.flush()  # not contiguous: the held partial page is an end of its run
            first, end = interior(offset, len(data))
            if first == end:  # under MIN_DIRECT: a system call per small run costs more than the cache
                pwrite_all(self._fd, data, offset)
                return
            if first > offset:
                pwrite_all(self._fd, data[: first - offset], offset)
                data = data[first - offset :]
            start, pre = first, b""
        total = len(pre) + len(data)
        whole = total // ALIGN * ALIGN
        if not whole:
            self._carry = pre + bytes(data)
            return
        self._writer.queue_pages(self._direct_fd, start, pre, data, whole)
        self.direct += whole
        rest = total - whole  # from data's end: whole covers at least a page, more than pre
        self._carry, self._carry_at = (bytes(data[len(data) - rest :]) if rest else b""), start + whole

    def _write_reserved(self, data: memoryview, offset: int) -> None:
        buf, at, n = self._reserved  # type: ignore[misc]
        self._reserved = None
        if (at, n) != (offset, len(data)):
            self._writer.release(buf)
            raise RuntimeError(f"DirectStream: reserved {n} bytes at {at}, then wrote {len(data)} at {offset}")
        lead = offset % ALIGN
        if self._carry and self._carry_at + len(self._carry) == offset:
            buf[:lead] = self._carry  # the page's bytes before the run (len(carry) == lead)
            lo, start = 0, self._carry_at
        else:  # the run's first partial page goes through the page cache
            lo, start = (ALIGN if lead else 0), offset - lead + (ALIGN if lead else 0)
            if lead:
                pwrite_all(self._fd, memoryview(buf)[lead:ALIGN], offset)
        hi = lo + (offset + n - start) // ALIGN * ALIGN
        self._carry, self._carry_at = bytes(buf[hi : lead + n]), start + hi - lo
        if hi > lo:
            self._writer.queue_buffer(self._direct_fd, buf, lo, hi, start)
            self.direct += hi - lo
        else:
            self._writer.release(buf)

    def flush(self) -> None:
        """Write the partial page the stream ends in (through the page cache). Idempotent."""
        if self._carry:
            pwrite_all(self._fd, memoryview(self._carry), self._carry_at)
            self._carry = b""
