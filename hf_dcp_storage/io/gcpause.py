"""The cyclic garbage collector paused while a rank builds many long-lived objects.

A load of a checkpoint with thousands of tensors builds tens of thousands of Python objects (the
index and its headers, per-tensor metadata, the S3 client's service model, each read's slabs)
that live until the load ends and form no reference cycles. The collector counts collections,
not objects: every 700 net allocations it scans the youngest generation, every tenth of those
the next, and every tenth of those (once enough objects have survived) the whole process heap,
at ~0.5 us per live object: 0.15 s with torch imported, seconds in a large trainer. Paused,
such a stretch counts as one young collection however many objects it builds, so it no longer
brings the next full collection nearer; objects it leaves unreachable are collected as usual
after it.

Only the caller's own stretch is paused (``with paused_gc():``, re-enabled on every exit,
errors included), nested and concurrent pauses (two loads on two threads) counted, and a
collector the process disabled itself (torchtitan's ``gc_freq`` does) is left disabled.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused_gc"]


class _Pauses:
    """The pauses in progress over all threads; the first found the collector enabled or not."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.resume = False  # the last pause to end re-enables the collector


_PAUSES = _Pauses()


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Run the block with automatic garbage collection off (``gc.collect()`` still works)."""
    with _PAUSES.lock:
        if _PAUSES.depth == 0:
            _PAUSES.resume = gc.isenabled()
            gc.disable()
        _PAUSES.depth += 1
    try:
        yield
    finally:
        with _PAUSES.lock:
            _PAUSES.depth -= 1
            if _PAUSES.depth == 0 and _PAUSES.resume:
                gc.enable()
