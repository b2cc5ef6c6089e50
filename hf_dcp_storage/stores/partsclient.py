"""What a part store's backend gives (``stores/parts.py``): its SDK's retried requests
(:class:`PartsClient`), named parts (:class:`PartRef`), and what every backend's requests share:
ranged GETs for loads (:class:`ClientRanges`), a small pool of part uploads in flight
(:class:`Uploader`), and clean-up that never masks the error it follows (``quietly``).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Generic, TypeVar

from fsspec import AbstractFileSystem

from ..io.parallel import fetch_spans
from .reads import Ranges
from .retry import ErrorRules, RetryPolicy

__all__ = ["ClientRanges", "PartRef", "PartsClient", "Uploader", "quietly"]

logger = logging.getLogger(__name__)

_Part = TypeVar("_Part")

# Parts a rank uploads at a time: enough to keep a connection busy while the next part fills.
_IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True)
class PartRef:
    """Which part an upload is: part ``number`` of file ``file`` (``name``), its first byte
    ``start``; ``upload``: the file's handle where the store made one in ``prepare`` (S3's
    multipart upload id; ``None`` for a one-part file, which is the whole object)."""

    file: int
    name: str
    number: int
    start: int
    upload: str | None = None


class PartsClient(ABC):
    """The retried requests of one store (one SDK); paths as fsspec strips them. Thread-safe."""

    # How this SDK's failures read; its calls retry by these rules (the store's ``errors``).
    errors: ClassVar[ErrorRules]

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        self.fs, self.retry = fs, retry

    @abstractmethod
    def url(self, path: str) -> str:
        """``path`` as the user writes it (``gs://b/k``, ``az://c/k``), for messages."""

    @abstractmethod
    def put(self, path: str, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """Write a whole object in one request (readers see all of it or nothing); its metadata."""

    @abstractmethod
    async def read_span(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` in one retried ranged GET, on ``fs``'s event loop
        (fewer only if the object is shorter)."""

    def get_spans(
        self,
        spans: Sequence[tuple[str, int, int]],
        *,
        concurrency: int = 16,
        deliver: Callable[[int, bytes], None] | None = None,
    ) -> list[bytes]:
        """Bytes ``[start, end)`` of each ``(path, start, end)``, with up to ``concurrency`` in
        flight; with ``deliver``, each handed to ``deliver(index, data)`` as it arrives (on the
        event loop) instead, so that at most ``concurrency`` are held at once."""
        return fetch_spans(self.fs.loop, self.read_span, spans, concurrency, deliver)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path``; fewer only if the object is shorter."""
        return self.get_spans([(path, start, end)])[0]

    @abstractmethod
    def upload_part(
        self, root: str, save_id: str, part: PartRef, data: bytes | bytearray
    ) -> dict[str, Any]:
        """Upload one part of a file of the checkpoint at ``root``; its ``{"PartNumber", "ETag"}``
        entry (``ETag``: what identifies this upload of the part when the file is assembled)."""

    @abstractmethod
    def staged_writer(self, path: str, size: int) -> Any:
        """A write stream to one staged object of about ``size`` bytes, with bounded memory: a
        context manager whose clean exit publishes the object and whose error leaves nothing."""


class ClientRanges(Ranges):
    """Ranged GETs through a part store's own retried client, up to 16 in flight per call."""

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy, client: PartsClient) -> None:
        super().__init__(fs, retry, client.errors)
        self.client = client

    def get_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self.client.get_spans([(path, start, end) for start, end in ranges])

    def get_range(self, path: str, start: int, end: int) -> bytes:
        return self.client.get_range(path, start, end)

    def fetch(
        self,
        spans: Sequence[tuple[str, int, int]],
        concurrency: int,
        deliver: Callable[[int, bytes], None],
    ) -> None:
        self.client.get_spans(spans, concurrency=concurrency, deliver=deliver)


class Uploader(Generic[_Part]):
    """Runs ``send(part, data)`` for filled parts (a rank's own, or a staged object's) on a small
    pool, at most ``in_flight`` pending, so the caller fills the next part while earlier ones
    travel; ``wait`` gives every part's result (the first failure raised)."""

    def __init__(
        self, send: Callable[[_Part, bytearray], dict[str, Any]], in_flight: int = _IN_FLIGHT
    ) -> None:
        self.send, self.in_flight = send, in_flight
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future[dict[str, Any]]] = deque()
        self.done: list[dict[str, Any]] = []

    def submit(self, part: _Part, data: bytearray) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.in_flight, thread_name_prefix="hf-dcp-part")
        while len(self._pending) >= self.in_flight:
            self.done.append(self._pending.popleft().result())
        self._pending.append(self._pool.submit(self.send, part, data))

    def wait(self) -> list[dict[str, Any]]:
        while self._pending:
            self.done.append(self._pending.popleft().result())
        return self.done

    def close(self) -> None:
        for fut in self._pending:
            fut.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def quietly(cleanup: Callable[[], None], what: str) -> None:
    """Clean up after a failure without masking it: a failing clean-up is logged, not raised."""
    try:
        cleanup()
    except Exception as exc:  # noqa: BLE001 - the original error is the one to report
        logger.warning("could not remove %s (%s); the next save to this path removes it", what, exc)
