"""The direct writes of a save, pipelined (:class:`DirectWriter`, :class:`DirectStream`): the
I/O threads checksum a slab and copy its pages into one of a few aligned buffers, and a writer
thread of the save issues the ``O_DIRECT`` writes, so the device is not idle while the next
slab is checksummed and copied (done one after the other, the CPU steps cost about half the
device's write time here). ``io/direct.py`` says which bytes go direct.
"""

from __future__ import annotations

import mmap
import queue
import threading

import numpy as np

from .aligned import POOL, AlignedPool
from .fsio import pwrite_all
from .pages import ALIGN, interior

__all__ = ["WRITE_BUFFERS", "WRITE_THREADS", "DirectStream", "DirectWriter"]

# A save's aligned buffers (each one piece of a run's pages, being filled or being written) and
# the threads writing them: with one write in flight per rank the writer is busy the whole save
# and the I/O threads wait for buffers; two writer threads were no faster, with the files
# preallocated or not (the pipelined direct-I/O run, in git history; the current run is
# benchmarks/results/save_load-cpu-2core.md).
WRITE_BUFFERS = 4
WRITE_THREADS = 1


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

    def __init__(
        self,
        *,
        buffers: int = WRITE_BUFFERS,
        threads: int = WRITE_THREADS,
        pool: AlignedPool = POOL,
    ) -> None:
        if pool.nbytes % ALIGN or buffers < 1 or threads < 1:
            raise ValueError(
                f"DirectWriter(buffers={buffers}, threads={threads}, pool of {pool.nbytes}-byte "
                f"buffers): needs buffers, threads >= 1 and buffers of whole {ALIGN}-byte pages"
            )
        self.pool, self.buffers, self.nthreads = pool, buffers, threads
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._taken: list[mmap.mmap] = []
        self._jobs: queue.SimpleQueue[tuple[int, mmap.mmap, int, int, int] | None] = (
            queue.SimpleQueue()
        )  # fd, buffer, [lo, hi) of it, file offset
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

    def queue_pages(
        self, direct_fd: int, start: int, pre: bytes, data: memoryview, nbytes: int
    ) -> None:
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
        if (error := self._failure()) is not None:
            raise error
        with self._lock:
            if self._closed:
                raise RuntimeError("DirectWriter: a stream wrote after the writer was closed")
            if not self._threads:
                self._threads = [
                    threading.Thread(
                        target=self._run, name=f"hf_dcp_storage-direct-{i}", daemon=True
                    )
                    for i in range(self.nthreads)
                ]
                for t in self._threads:
                    t.start()
            if len(self._taken) < self.buffers:
                buf = self.pool.take()
                self._taken.append(buf)
                return buf
        buf = self._free.get()
        if (error := self._failure()) is not None:
            self._free.put(buf)
            raise error
        return buf

    def _failure(self) -> BaseException | None:
        """The first failed write's error, which a writer thread may set at any time."""
        return self._error

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
            if (
                first == end
            ):  # under MIN_DIRECT: a system call per small run costs more than the cache
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
        self._carry, self._carry_at = (
            (bytes(data[len(data) - rest :]) if rest else b""),
            start + whole,
        )

    def _write_reserved(self, data: memoryview, offset: int) -> None:
        buf, at, n = self._reserved  # type: ignore[misc]
        self._reserved = None
        if (at, n) != (offset, len(data)):
            self._writer.release(buf)
            raise RuntimeError(
                f"DirectStream: reserved {n} bytes at {at}, then wrote {len(data)} at {offset}"
            )
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
