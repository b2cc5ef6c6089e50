"""Stores whose server assembles every consolidated file from parts the ranks upload: S3
(multipart uploads, ``stores/s3.py``), GCS (objects composed server-side, ``stores/gcs.py``) and
Azure Blob (blocks of the final blob committed with one block list, ``stores/azure.py``). This
module is how all three write; each backend module adds its requests and its rules.

How a save goes, top-down:

1. (coordinator) ``plan``: every file's parts with the store's rules (``plan/partplan.py``'s
   ``plan_parts`` with ``PartRules``), and each rank's share of the gathered ones.
2. (coordinator) ``prepare``: clears what a killed save left and makes what the ranks upload
   into (``_make_files``; S3: a multipart upload per file of several parts).
3. (each rank) ``write``: uploads the parts that hold only its own bytes, straight from its
   tensors (``Uploader``, ``PartsClient.upload_part``), and stages the runs too small to be
   parts of their own (``PartsClient.staged_writer``); ``stores/filling.py`` routes the bytes.
4. (each rank with tasks) ``run_task``: gathers a mixed part from the staged runs and uploads it.
5. (coordinator) ``complete``: has the server assemble each file from its parts
   (``_assemble``: a compose tree, a block list, a completed upload).

Bytes a rank uploads of its own are sent once and never move again; ``merge_stats`` counts the
gathered ones (downloaded and uploaded again) apart. A failure anywhere removes what the save
made (``_discard``).

A backend gives its requests as a :class:`PartsClient`, its ``rules``, and its assembly
(``_assemble``) and clean-up (``_discard``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Generic, TypeVar

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..io import fsio
from ..io.parallel import fetch_spans, parallel_map
from ..plan.layout import Layout
from ..plan.partplan import PartsRankPlan, parts_rank_plans, plan_parts
from ..plan.parts import GatherPart, PartRules, RankPart
from ..plan.placed import PlacedChunks, place_items
from ..plan.rankplan import Finished, RankPlan, WrittenRows
from ..plan.spread import GatherTask, GatherTasks
from ..session.records import COMPLETION_RECORD, CompletionRecord
from .base import STAGING_DIR, Slabs, Store
from .filling import (
    FileShare,
    GatheredSources,
    PartAssembler,
    fill_file,
    gather_bytes,
    with_parts,
    write_by_file,
)
from .reads import Ranges
from .retry import ErrorRules, RetryPolicy

__all__ = ["ClientRanges", "PartRef", "PartsClient", "PartsStore", "Uploader", "quietly"]

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


class PartsStore(Store):
    """Files assembled by the server from the ranks' parts (see the module docstring)."""

    rules: ClassVar[PartRules]  # what the server's assembly allows (part sizes, part count)
    client_class: ClassVar[type[PartsClient]]  # the backend's requests

    def __init__(
        self, fs: AbstractFileSystem, root: str, *, retry: RetryPolicy, threads: int
    ) -> None:
        super().__init__(fs, root, retry=retry, threads=threads)
        self.client = self.client_class(fs, retry)
        self.layout: Layout | None = None
        self.parts: list[list[RankPart | GatherPart]] = []  # every file's parts, numbered from 1
        self.gathers: list[GatherTasks] = []  # every rank's share of the gathered parts
        self.uploads: dict[int, str] = {}  # file -> the handle ``_make_files`` made (S3: upload id)
        self.completed: set[int] = set()  # files an interrupted save had assembled already

    @classmethod
    def ranges(cls, fs: AbstractFileSystem, retry: RetryPolicy) -> Ranges:
        """How loads read this store's objects: its own retried ranged GETs."""
        return ClientRanges(fs, retry, cls.client_class(fs, retry))

    @abstractmethod
    def _assemble(self, f: int, layout: Layout, entries: list[dict[str, Any]]) -> None:
        """(coordinator) Have the server make file ``f`` from its parts (``entries``: every
        part's ``{"PartNumber", "ETag"}``, in file order); idempotent: done again, it gives
        the same file."""

    @abstractmethod
    def _discard(self, names: Sequence[str], save_id: str) -> None:
        """Remove what this save made for files ``names`` besides the files themselves (parts,
        intermediates, uncommitted blocks); best effort, never raises."""

    # -- coordinator
    # --------------------------------------------------------------------------------

    def plan(self, layout: Layout, placed: PlacedChunks | None, world: int) -> list[GatherTasks]:
        assert placed is not None
        plan = plan_parts(placed, layout, world, self.rules)
        self.layout, self.parts, self.gathers = layout, plan.parts, plan.tasks
        return plan.tasks

    def adopt(self, layout: Layout, plans: list[SavePlan], uploads: Mapping[int, str]) -> None:
        """(``consolidate``) Finish a save from its records: its parts, re-planned from every
        rank's items, and the handles it made (``reconcile`` then notes what it had assembled)."""
        self.plan(layout, place_items(layout, plans), len(plans))
        self.uploads = dict(uploads)

    def rank_data(self, world: int) -> list[PartsRankPlan]:
        assert self.layout is not None, "plan() and prepare() come first"
        return parts_rank_plans(self.layout, self.parts, self.uploads, self.gathers)

    def record_uploads(self) -> Mapping[int, str]:
        return self.uploads

    def put(self, path: str, data: bytes) -> None:
        self.client.put(path, data)  # one request: atomic, and retried

    def complete(
        self, layout: Layout, results: list[list[WriteResult]], finished: Mapping[int, Finished]
    ) -> None:
        """Assemble every file from the parts the ranks uploaded; any gathered part no rank
        uploaded (finishing an interrupted save) is gathered here. A failure removes what the
        save made (``abort``'s clean-up)."""
        entries: dict[int, dict[int, dict[str, Any]]] = {}
        for rank_results in results:
            for r in rank_results:
                written = r.storage_data
                for f, ps in (
                    written.parts.items()
                    if isinstance(written, WrittenRows)
                    else [(written.file, written.parts)]
                ):
                    entries.setdefault(f, {}).update((e["PartNumber"], e) for e in ps)
        for fin in finished.values():
            for f, ps in fin.parts.items():
                entries.setdefault(f, {}).update((e["PartNumber"], e) for e in ps)
        # Before the first assembly: every part's entry, so that ``hf-dcp consolidate`` of a save
        # that dies here gathers nothing again.
        known = {
            layout.files[f].name: tuple(sorted(es.values(), key=lambda e: e["PartNumber"]))
            for f, es in sorted(entries.items())
        }
        self.put(
            fsio.join(self.root, STAGING_DIR, COMPLETION_RECORD),
            CompletionRecord(self.save_id, known).encode(),
        )
        sources = GatheredSources(self.gathers)

        def one(f: int) -> None:
            plan, parts, got = layout.files[f], self.parts[f], entries.get(f, {})
            if f in self.completed:  # assembled by the interrupted save being finished
                self.merge_stats.add(plan.size, 0, 0)
                return
            missing = [p for p in parts if p.number not in got]
            own = [p.number for p in missing if isinstance(p, RankPart)]
            if own:
                raise RuntimeError(
                    f"{self.client.url(fsio.join(self.root, plan.name))}: parts {own} were never "
                    "uploaded by their ranks"
                )
            # Gathered parts no rank uploaded: an interrupted save being finished.
            for p in (q for q in missing if isinstance(q, GatherPart)):
                data = gather_bytes(
                    self.client,
                    sources.of(f, p),
                    lambda rank: self.staged_path(plan.name, rank),
                    url=self.client.url,
                )
                got[p.number] = self.client.upload_part(
                    self.root,
                    self.save_id,
                    PartRef(f, plan.name, p.number, p.start, self.uploads.get(f)),
                    data,
                )
            self._assemble(f, layout, [got[p.number] for p in parts])
            gathered = sum(p.nbytes for p in parts if isinstance(p, GatherPart))
            self.merge_stats.add(plan.size, gathered, sum(p.nbytes for p in missing))

        try:
            parallel_map(one, [f for f in range(len(layout.files)) if self.parts[f]], self.threads)
        except BaseException:
            self._discard(layout.names, self.save_id)
            raise

    # -- each rank
    # ----------------------------------------------------------------------------------

    def write(self, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs) -> list[WriteResult]:
        """Upload the parts that hold only this rank's bytes; stage the rest."""
        return write_by_file(
            items,
            rank_plan,
            lambda f, file_items: self._write_file(f, file_items, rank_plan, slabs),
            self.threads,
        )

    def _write_file(
        self, file: int, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs
    ) -> list[WriteResult]:
        plan: PartsRankPlan = rank_plan.store
        share = FileShare.of(file, items, rank_plan)
        name, parts, staged_size = share.name, share.parts, share.staged_size
        upload = plan.uploads.get(file)
        uploader: Uploader[RankPart] = Uploader(
            lambda part, data: self.client.upload_part(
                self.root,
                rank_plan.save_id,
                PartRef(file, name, part.number, part.start, upload),
                data,
            )
        )
        assembler = PartAssembler(plan.headers.get(file, b""), uploader.submit)
        stream: Any = (
            self.client.staged_writer(self.staged_path(name, rank_plan.rank), staged_size)
            if staged_size
            else contextlib.nullcontext()
        )
        try:
            with stream as staged:
                results = fill_file(file, share.items, rank_plan, slabs, parts, staged, assembler)
            assembler.check_filled(name, rank_plan.rank)
            entries = tuple(uploader.wait())
        finally:
            uploader.close()
        return with_parts(results, entries)

    def run_task(self, task: GatherTask, rank_plan: RankPlan) -> tuple[int, dict[str, Any] | None]:
        """Gather one part from the ranks' staged runs and upload it."""
        name = rank_plan.files[task.file]
        data = gather_bytes(
            self.client,
            task.sources(),
            lambda rank: self.staged_path(name, rank),
            url=self.client.url,
        )
        ref = PartRef(
            task.file, name, task.number, task.start, rank_plan.store.uploads.get(task.file)
        )
        return task.file, self.client.upload_part(self.root, rank_plan.save_id, ref, data)

    def abort(self, rank_plan: RankPlan) -> None:
        """Remove what this save made (parts, uncommitted blocks, open uploads), so that no rank
        goes on writing a doomed checkpoint; best effort (the next save to this path, or pruning
        the step, removes what is left)."""
        self._discard(rank_plan.files, rank_plan.save_id)


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
