"""Reusable host buffers for the slabs that do not go to storage (or come from it) as they are:
a tensor on an accelerator, or one saved or loaded in another dtype.

Saving such a slab used to allocate a fresh host copy per slab (``.cpu()``, ``.to(dtype)``);
with a few buffers reused round-robin the host memory stays ``count x SLAB_BYTES`` whatever the
model, the cast happens inside the copy, and on CUDA the buffers are pinned so that the
device-to-host copy of slab k+1 runs on a side stream while slab k is being written
(:func:`to_host`). Loading reads into a buffer and copies it to the destination, converting the
dtype on the destination's device (``reading.py``). The code is the same for every device;
the CPU test suite runs it with CPU tensors.

Who calls what: the writer's I/O threads and the reader's batches (``reading.py``), each with the
pool of their storage object; a pool is thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .slabs import SLAB_BYTES

__all__ = ["HostBuffers", "KeptHostBuffers", "copy_into", "to_host"]


class HostBuffers:
    """At most ``count`` host buffers of ``nbytes`` each, made on first use and then reused.

    ``pin`` page-locks them (only meaningful, and only done, when CUDA is available): copies
    between a device and pinned memory can run asynchronously. A request larger than ``nbytes``
    (one row of a tensor bigger than a slab) gets a buffer of its own, freed after use.
    """

    def __init__(self, count: int, nbytes: int = SLAB_BYTES, *, pin: bool = False) -> None:
        if count < 1:
            raise ValueError(f"count={count} must be >= 1")
        self.count, self.nbytes = count, nbytes
        self.pin = pin and torch.cuda.is_available()
        self._free: list[tuple[torch.Tensor, Any]] = []  # (buffer, event of its last copy or None)
        self._made = 0
        self._cond = threading.Condition()

    @property
    def made(self) -> int:
        """Pooled buffers allocated so far (never more than ``count``)."""
        return self._made

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` host tensor of at least ``nbytes``; blocks while all are in use."""
        if nbytes > self.nbytes:
            return self._alloc(nbytes)
        with self._cond:
            while not self._free and self._made >= self.count:
                self._cond.wait()
            if self._free:
                buf, done = self._free.pop()
            else:
                self._made += 1
                buf, done = None, None
        if done is not None:
            done.synchronize()  # its last copy must have finished before it is refilled
        return buf if buf is not None else self._alloc(self.nbytes)

    def release(self, buf: torch.Tensor, done: Any = None) -> None:
        """Give ``buf`` back; ``done`` (a CUDA event recorded after the last copy that reads it,
        or ``None``) must complete before anyone refills it, which ``acquire`` waits for: the
        caller goes on without waiting for its copy."""
        if buf.numel() != self.nbytes:
            if done is not None:
                done.synchronize()  # an oversized one-off: freed when this returns
            return
        with self._cond:
            self._free.append((buf, done))
            self._cond.notify()

    def drain(self) -> None:
        """Wait for every copy still reading a released buffer (a load's last host-to-device
        copies)."""
        with self._cond:
            pending = [done for _, done in self._free if done is not None]
        for done in pending:
            done.synchronize()

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)


class KeptHostBuffers:
    """The host buffers of one writer (or reader): made on the first slab that needs one and
    kept across its saves (loads), since pinned memory is slow to allocate. Two per I/O thread
    (one being filled while the other is written or copied), pinned where the tensors live on
    CUDA (``count`` of them instead where given: a reader's batches of slabs take more).
    Calling it with a slab's tensor returns the pool; thread-safe."""

    def __init__(self, threads: int, count: int | None = None) -> None:
        self._count = count or 2 * threads
        self._lock = threading.Lock()
        self.pool: HostBuffers | None = None

    def __call__(self, tensor: torch.Tensor) -> HostBuffers:
        with self._lock:
            if self.pool is None:
                self.pool = HostBuffers(self._count, pin=tensor.device.type == "cuda")
            return self.pool


def _view(
    buf: torch.Tensor, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return buf[: n * dtype.itemsize].view(dtype).view(shape)


def to_host(
    parts: Iterable[torch.Tensor], dtype: torch.dtype, pool: HostBuffers, depth: int = 2
) -> Iterator[torch.Tensor]:
    """Host copies of ``parts`` in ``dtype``, in order, each in a pooled buffer that stays valid
    until the next item is asked for (or the generator is closed).

    Holds at most ``depth`` buffers. On CUDA the copy of the next part is queued on a side stream
    before the current one is handed out, so copying overlaps whatever the caller does with it
    (writing it out); CPU copies are synchronous, so ``depth`` 1 is enough there. A narrower
    ``dtype`` is cast on the device, before the copy, so fewer bytes cross the bus; otherwise
    the copy into the host buffer casts.
    """
    pending: deque[tuple[torch.Tensor, torch.Tensor, Any]] = deque()
    handed: torch.Tensor | None = None
    stream = None
    try:
        for given in parts:
            if handed is not None:  # asked for more: the caller is done with it
                pool.release(handed)
                handed = None
            narrower = given.device.type == "cuda" and given.dtype.itemsize > dtype.itemsize
            part = given.to(dtype) if narrower else given
            buf = pool.acquire(part.numel() * dtype.itemsize)
            host = _view(buf, dtype, part.shape)
            event = None
            if part.device.type == "cuda":
                if stream is None:
                    stream = torch.cuda.Stream(part.device)
                # The side stream must see the part as its producer left it, and the caching
                # allocator must not hand the part's memory out before the copy has read it.
                stream.wait_stream(torch.cuda.current_stream(part.device))
                with torch.cuda.stream(stream):
                    host.copy_(part, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                part.record_stream(stream)
            else:
                host.copy_(part)
            pending.append((buf, host, event))
            if len(pending) >= depth:
                handed, host = _oldest(pending)
                yield host
        while pending:
            if handed is not None:
                pool.release(handed)
                handed = None
            handed, host = _oldest(pending)
            yield host
    finally:
        if handed is not None:
            pool.release(handed)
        for buf, _, event in pending:
            pool.release(buf, event)


def copy_into(part: torch.Tensor, dtype: torch.dtype, dest: memoryview) -> None:
    """Copy ``part``, in ``dtype``, into the bytes of ``dest`` (host memory: exactly its size),
    and wait for the copy: a slab whose bytes go straight into an aligned buffer of a direct
    write (``io/direct.DirectStream.reserve``) instead of a pooled host buffer. A narrower
    ``dtype`` is cast on the device first, as in ``to_host``."""
    if part.device.type == "cuda" and part.dtype.itemsize > dtype.itemsize:
        part = part.to(dtype)
    host = torch.frombuffer(dest, dtype=torch.uint8)
    _view(host, dtype, part.shape).copy_(part)  # synchronous: the bytes are there when it returns


def _oldest(
    pending: deque[tuple[torch.Tensor, torch.Tensor, Any]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oldest copy, once complete: ``(buffer, host tensor)``."""
    buf, host, event = pending.popleft()
    if event is not None:
        event.synchronize()
    return buf, host
