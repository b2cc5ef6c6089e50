"""S3 (and S3-compatible endpoints, through s3fs): every consolidated file is one multipart upload,
assembled by the server from the parts the ranks upload.

The coordinator plans every file's parts (``plan/s3plan.py``) and creates the uploads before any
rank writes (``prepare``). Each rank uploads the parts that hold only its own bytes straight into
them and stages its runs under S3's 5 MiB part minimum (``write``); once every rank has staged,
the ranks gather the mixed parts from the staged runs, spread by bytes (``run_task``), and the
coordinator completes the uploads (``complete``). A failure anywhere aborts every upload of the
save (``abort``). The requests themselves, retried, are ``stores/s3_requests.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..io import fsio
from ..io.parallel import parallel_map
from ..io.records import COMPLETION_RECORD, SAVE_RECORD, CompletionRecord, SaveRecord
from ..io.retry import RetryPolicy
from ..plan.layout import Layout
from ..plan.placed import PlacedChunks, place_items
from ..plan.rankplan import Finished, RankPlan, WrittenRows
from ..plan.s3parts import MIN_PART_BYTES, GatherPart, RankPart
from ..plan.s3plan import S3RankPlan, plan_s3, s3_rank_plans
from ..plan.spread import GatherTask, GatherTasks
from .base import STAGING_DIR, Ranges, Slabs, Store
from .filling import FileShare, GatheredSources, PartAssembler, fill_file, gather_bytes, with_parts, write_by_file
from .s3_requests import S3, MultipartWriter, PartUploader, complete_file, quietly, s3_for, s3_url

__all__ = ["S3Store", "S3Ranges", "abort_uploads_under"]

logger = logging.getLogger(__name__)


class S3Ranges(Ranges):
    """Ranged GETs through the library's own retried client, up to 16 in flight per call."""

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        super().__init__(fs, retry)
        self.s3 = S3(fs, retry)

    def get_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self.s3.get_ranges(path, ranges)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        return self.s3.get_range(path, start, end)


class S3Store(Store):
    """Multipart uploads the ranks fill (see the module docstring)."""

    mode = "s3"

    def __init__(self, fs: AbstractFileSystem, root: str, *, retry: RetryPolicy, threads: int) -> None:
        super().__init__(fs, root, retry=retry, threads=threads)
        self.s3 = S3(fs, retry)
        self.layout: Layout | None = None
        self.parts: list[list[RankPart | GatherPart]] = []  # every file's parts, numbered from 1
        self.gathers: list[GatherTasks] = []  # every rank's share of the gathered parts
        self.uploads: dict[int, str] = {}  # file -> upload id, for files of more than one part
        self.completed: set[int] = set()  # files an interrupted save had completed already

    # -- coordinator --------------------------------------------------------------------------------

    def plan(self, layout: Layout, placed: PlacedChunks | None, world: int) -> list[GatherTasks]:
        assert placed is not None
        s3 = plan_s3(placed, layout, world)
        self.layout, self.parts, self.gathers = layout, s3.parts, s3.tasks
        return s3.tasks

    def adopt(self, layout: Layout, plans: list[SavePlan], uploads: Mapping[int, str], completed: Collection[int] = ()) -> None:
        """(``consolidate``) Finish a save from its records: its parts, re-planned from every
        rank's items, and the uploads it created (``completed``: those it had completed)."""
        s3 = plan_s3(place_items(layout, plans), layout, len(plans))
        self.layout, self.parts, self.gathers = layout, s3.parts, s3.tasks
        self.uploads, self.completed = dict(uploads), set(completed)

    def prepare(self, layout: Layout, overwrite: bool, *, make_files: bool = True) -> None:
        """Also aborts the uploads a killed save left unfinished under this path (invisible,
        but billed; listed beside the folder's listing), then creates one upload per file of
        more than one part."""
        with ThreadPoolExecutor(1) as pool:
            listing = pool.submit(self.s3.list_uploads, self.root.rstrip("/") + "/")
            super().prepare(layout, overwrite, make_files=False)
            orphans = listing.result()
        bucket = self.root.split("/", 1)[0]
        parallel_map(lambda o: self.s3.abort_upload(f"{bucket}/{o[0]}", o[1]), orphans, self.threads)
        if make_files:
            self._create_uploads(layout)

    def _create_uploads(self, layout: Layout) -> None:
        # A one-part file is a single PUT, by its rank or by the coordinator.
        files = [f for f, parts in enumerate(self.parts) if len(parts) > 1]

        def create(f: int) -> None:
            self.uploads[f] = self.s3.create_upload(fsio.join(self.root, layout.files[f].name))

        try:
            parallel_map(create, files, self.threads)
        except BaseException:
            self.abort_uploads(layout.names)
            raise

    def undo_prepare(self, layout: Layout) -> None:
        self.abort_uploads(layout.names)

    def rank_data(self, world: int) -> list[S3RankPlan]:
        assert self.layout is not None, "plan() and prepare() come first"
        return s3_rank_plans(self.layout, self.parts, self.uploads, self.gathers)

    def record_uploads(self) -> Mapping[int, str]:
        return self.uploads

    def put(self, path: str, data: bytes) -> None:
        self.s3.put(path, data)  # one PUT: atomic on S3, and retried

    def abort_uploads(self, names: Sequence[str]) -> None:
        """Abort this save's uploads (of files ``names[f]``); a failing abort is only logged."""
        for f, upload_id in self.uploads.items():
            path = fsio.join(self.root, names[f])
            quietly(lambda: self.s3.abort_upload(path, upload_id), path)

    def complete(self, layout: Layout, results: list[list[WriteResult]], finished: Mapping[int, Finished]) -> None:
        """Complete every file's upload with the parts the ranks uploaded; any gathered part no
        rank uploaded (finishing an interrupted save) is gathered here."""
        etags: dict[int, list[dict[str, Any]]] = {}
        by_ranks: dict[int, set[int]] = {}
        for rank_results in results:
            for r in rank_results:
                written = r.storage_data
                for f, parts in written.parts.items() if isinstance(written, WrittenRows) else [(written.file, written.parts)]:
                    etags.setdefault(f, []).extend(parts)
        for fin in finished.values():
            for f, parts in fin.parts.items():
                by_ranks.setdefault(f, set()).update(e["PartNumber"] for e in parts)
                etags.setdefault(f, []).extend(e for e in parts if "ETag" in e)
        # Before the first completion: a save that dies among them leaves completed objects and
        # open uploads; this record tells ``hf-dcp consolidate`` which is which (and every
        # part's ETag, so it gathers nothing again).
        known = {layout.files[f].name: tuple(sorted(etags.get(f, []), key=lambda e: e["PartNumber"])) for f in sorted(self.uploads)}
        self.put(fsio.join(self.root, STAGING_DIR, COMPLETION_RECORD), CompletionRecord(self.save_id, known).encode())
        sources = GatheredSources(self.gathers)
        try:
            for f, plan in enumerate(layout.files):
                if f in self.completed:
                    self.merge_stats.add(plan.size, 0, 0)
                    continue
                complete_file(
                    self.s3, fsio.join(self.root, plan.name), self.uploads.get(f), plan.header, self.parts[f],
                    etags.get(f, []), by_ranks.get(f, set()), functools.partial(sources.of, f), lambda rank, name=plan.name: self.staged_path(name, rank),
                    threads=self.threads, stats=self.merge_stats,
                )
        except BaseException:
            self.abort_uploads(layout.names)
            raise

    # -- each rank ----------------------------------------------------------------------------------

    def write(self, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs) -> list[WriteResult]:
        """Upload the parts that hold only this rank's bytes straight into the consolidated
        files; stage the rest (a failure: the writer calls ``abort``)."""
        return write_by_file(items, rank_plan, lambda f, file_items: self._write_file(f, file_items, rank_plan, slabs), self.threads)

    def _write_file(self, file: int, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs) -> list[WriteResult]:
        s3_plan: S3RankPlan = rank_plan.store
        share = FileShare.of(file, items, rank_plan)
        name, parts, staged_size = share.name, share.parts, share.staged_size
        path = fsio.join(self.root, name)
        upload_id = s3_plan.uploads.get(file)
        uploader = PartUploader(self.s3, path, upload_id) if parts and upload_id is not None else None

        def send(part: RankPart, data: bytearray) -> None:
            if uploader is not None:
                uploader.submit(part.number, data)
            else:  # the whole file is this one part
                self.s3.put(path, data)

        assembler = PartAssembler(s3_plan.headers.get(file, b""), send)
        staged_path = self.staged_path(name, rank_plan.rank)
        stream: Any = MultipartWriter(self.s3, staged_path, max(fsio.part_bytes(self.fs, staged_size), MIN_PART_BYTES)) if staged_size else contextlib.nullcontext()
        try:
            with stream as staged:
                results = fill_file(file, share.items, rank_plan, slabs, parts, staged, assembler)
            assembler.check_filled(name, rank_plan.rank)
            etags = tuple(uploader.wait()) if uploader is not None else ()
        except BaseException:
            if uploader is not None:
                uploader.cancel()
            raise
        return with_parts(results, etags)

    def run_task(self, task: GatherTask, rank_plan: RankPlan) -> tuple[int, dict[str, Any] | None]:
        """Gather one part from the ranks' staged runs and upload it (a one-part file: PUT whole)."""
        name = rank_plan.files[task.file]
        path = fsio.join(self.root, name)
        data = gather_bytes(self.s3, task.sources(), lambda rank: self.staged_path(name, rank), url=s3_url)
        upload_id = rank_plan.store.uploads.get(task.file)
        if upload_id is None:
            self.s3.put(path, data)
            return task.file, {"PartNumber": task.number}
        return task.file, self.s3.upload_part(path, upload_id, task.number, data)

    def abort(self, rank_plan: RankPlan) -> None:
        """Abort every multipart upload of the save, so that the other ranks' next parts fail
        too: those this rank's plan names and the rest from the save record, which the
        coordinator wrote before any rank began. Best effort: what cannot be read or aborted is
        logged (the next save to this path aborts what is left)."""
        uploads = dict(rank_plan.store.uploads)
        where = fsio.join(self.root, STAGING_DIR, SAVE_RECORD)
        try:
            record = SaveRecord.decode(self._retried(lambda: fsio.read_all(self.fs, where), "read", where), where)
            if record.save_id == rank_plan.save_id:
                uploads.update(record.uploads)
        except Exception as exc:  # noqa: BLE001 - the failure being handled is the one to report
            logger.warning("could not read the save record %s (%s); aborting the uploads this rank knows of", where, exc)
        self.uploads = uploads
        self.abort_uploads(rank_plan.files)


def abort_uploads_under(fs: AbstractFileSystem, folder: str, retry: RetryPolicy | None = None) -> int:
    """Abort every unfinished multipart upload under ``folder`` (``bucket/key``) if ``fs`` is
    s3fs; returns how many. Such uploads (of a killed save) are invisible in listings but
    billed, and only a save to the same path would otherwise abort them."""
    s3 = s3_for(fs, retry or RetryPolicy())
    if s3 is None:
        return 0
    bucket = folder.split("/", 1)[0]
    orphans = s3.list_uploads(folder.rstrip("/") + "/")
    parallel_map(lambda o: s3.abort_upload(f"{bucket}/{o[0]}", o[1]), orphans, 8)
    return len(orphans)
