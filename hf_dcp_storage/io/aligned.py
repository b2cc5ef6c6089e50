"""The page-aligned buffers of direct I/O, kept by the process from one save or load to the next.

An aligned buffer is an anonymous ``mmap`` (page-aligned by construction). Making one is not
free: its pages are faulted in one by one at first touch and freed one by one at ``munmap``,
which measured here 27 ms and 5-14 ms for the four 16 MiB buffers of a save, about a tenth of
a 1 GB save's time. So the buffers go back to this pool when a save or load is done, and the
next one takes them as they are. The pool keeps at most ``keep`` free buffers (``KEEP_BUFFERS``,
64 MiB); more are unmapped when given back, and ``release`` unmaps the free ones, for a
process that wants the memory back between saves. Where the process uses CUDA, each buffer is
page-locked once (``cudaHostRegister``, as PyTorch's own DCP stager does), so that a slab's
device-to-host copy lands in it at the bus's speed (``io/hostbuf.copy_into``), and unlocked
before it is unmapped.

Who calls what: the direct writes of a save (``io/direct.DirectWriter``) and the direct reads
of a load (``io/direct.pread_run``), from any thread; a pool is thread-safe. A forked child
starts with an empty pool of its own (the parent's buffers are the parent's).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import weakref

import torch

from .slabs import SLAB_BYTES

__all__ = ["BUFFER_BYTES", "KEEP_BUFFERS", "POOL", "AlignedPool"]

logger = logging.getLogger(__name__)

# One save's direct writes in flight and being filled (io/direct.WRITE_BUFFERS), or the reads of
# four I/O threads: 64 MiB of the process's memory between saves.
KEEP_BUFFERS = 4
# A slab (SLAB_BYTES) at any shift inside its first page: copied into a buffer at its place in its
# pages (io/direct.DirectStream.reserve), it is written from there without another copy.
BUFFER_BYTES = SLAB_BYTES + 4096


class AlignedPool:
    """Page-aligned buffers of ``nbytes`` bytes each, reused: ``take`` one, ``give`` it back.

    Args:
        nbytes: each buffer's size (a multiple of the page size).
        keep: how many free buffers to keep for the next taker; more given back are unmapped.
    """

    def __init__(self, nbytes: int = BUFFER_BYTES, keep: int = KEEP_BUFFERS) -> None:
        if nbytes <= 0 or nbytes % mmap.PAGESIZE or keep < 0:
            raise ValueError(
                f"AlignedPool(nbytes={nbytes}, keep={keep}): needs nbytes a positive multiple of "
                f"the page size ({mmap.PAGESIZE}) and keep >= 0"
            )
        self.nbytes, self.keep = nbytes, keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        """How many buffers are kept for the next taker."""
        return len(self._free)

    def take(self) -> mmap.mmap:
        """A buffer of ``nbytes``: a kept one (its bytes are whatever they were), else a new one;
        page-locked where the process uses CUDA."""
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = mmap.mmap(-1, self.nbytes)
        if buf not in _PINNED and torch.cuda.is_available() and torch.cuda.is_initialized():
            _pin(buf)
        return buf

    def give(self, buf: mmap.mmap) -> None:
        """Hand ``buf`` back (no one may use it after this); kept while fewer than ``keep`` are."""
        with self._lock:
            if len(self._free) < self.keep and len(buf) == self.nbytes and not buf.closed:
                self._free.append(buf)
                return
        _unmap(buf)

    def release(self) -> None:
        """Unmap every kept buffer (the ones in use go back and are kept again)."""
        with self._lock:
            free, self._free = self._free, []
        for buf in free:
            _unmap(buf)

    def _forget(self) -> None:
        # In a forked child: the lock may have been held by a parent thread that is not there.
        self._lock = threading.Lock()
        self._free = []


# The buffers page-locked for CUDA (unlocked before they are unmapped).
_PINNED: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()


def _address(buf: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # the buffer's export: a close would fail while it lives


def _pin(buf: mmap.mmap) -> None:
    err = int(
        torch.cuda.cudart().cudaHostRegister(_address(buf), len(buf), 1)
    )  # 1: portable, for every device
    if err == 0:
        _PINNED.add(buf)
    else:  # not fatal: the copies into it go through the driver's own staging, as before
        logger.debug(
            "cudaHostRegister of a %d-byte aligned buffer failed (cudaError %d): it stays pageable",
            len(buf),
            err,
        )


def _unmap(buf: mmap.mmap) -> None:
    if buf in _PINNED:
        _PINNED.discard(buf)
        torch.cuda.cudart().cudaHostUnregister(_address(buf))
    # A view of it still alive somewhere: unmapped when the last one goes.
    with contextlib.suppress(BufferError):
        buf.close()


# The process's pool, which every save's and load's direct I/O uses.
POOL = AlignedPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=POOL._forget)
