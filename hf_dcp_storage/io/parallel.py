"""Concurrency helpers shared by the writer, the reader, the merge and the object stores: a
thread pool (``parallel_map``) and bounded concurrent ranged reads on an fsspec event loop
(``fetch_spans``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from fsspec.asyn import sync

__all__ = ["check_thread_count", "fetch_spans", "parallel_map"]

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


def fetch_spans(
    loop: Any,
    read: Callable[[str, int, int], Awaitable[bytes]],
    spans: Sequence[tuple[str, int, int]],
    concurrency: int,
    deliver: Callable[[int, bytes], None] | None = None,
) -> list[bytes]:
    """``[read(path, start, end) for each span]`` on the event loop ``loop`` (an fsspec async
    filesystem's), up to ``concurrency`` reads in flight, in the spans' order; an empty span
    reads nothing. ``read`` is a store's one retried ranged GET. With ``deliver``, each span's
    bytes go to ``deliver(index, data)`` as they arrive (on the loop) and are dropped, so no more
    than ``concurrency`` are held at once; the list is then of empty bytes. The first failure
    (of a read or of ``deliver``) is raised."""

    async def fetch_all() -> list[bytes]:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, path: str, start: int, end: int) -> bytes:
            if end <= start:
                return b""
            async with gate:
                data = await read(path, start, end)
                if deliver is None:
                    return data
                deliver(i, data)  # inside the gate: the bytes are let go before the next read
                return b""

        return list(await asyncio.gather(*(one(i, *span) for i, span in enumerate(spans))))

    return sync(loop, fetch_all)


def check_thread_count(thread_count: int) -> int:
    """A ``thread_count`` option (the writer's, the reader's, the tools'): an int >= 1, or
    ``ValueError`` naming it."""
    if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
        raise ValueError(f"thread_count={thread_count!r} must be an int >= 1")
    return thread_count
