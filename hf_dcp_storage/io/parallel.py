"""One thread-pool helper shared by the writer, the reader and the merge."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["parallel_map"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def parallel_map(fn: Callable[[_T], _R], items: Iterable[_T], threads: int) -> list[_R]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads; the first exception propagates.

    I/O and tensor copies release the GIL, so threads overlap them; ``threads=1`` runs inline.
    After a failure the items not yet started are cancelled, so a permanent error (a denied
    write, say) fails the call after the running items, not after every remaining one.
    """
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()
            raise failed[0].exception()  # type: ignore[misc]
        return [f.result() for f in futures]
