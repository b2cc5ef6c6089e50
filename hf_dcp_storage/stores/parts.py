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
import os
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.exchange import MAX_TAG_FILES, Sends, plan_sends
from ..plan.fileparts import FileParts
from ..plan.layout import Layout
from ..plan.partplan import PartPlan, PartsRankPlan, parts_rank_plans, plan_parts
from ..plan.parts import S3_RULES, GatherPart, PartRules, RankPart
from ..plan.placed import PlacedChunks, place_items
from ..plan.rankplan import Finished, RankPlan, WrittenRows
from ..plan.spread import GatherTask, GatherTasks
from ..session.group import forget_group, save_group
from ..session.records import COMPLETION_RECORD, SAVE_RECORD, CompletionRecord, rank_record_name
from .base import STAGING_DIR, Slabs, Store
from .exchange import Held, exchange
from .filling import (
    FileShare,
    GatheredSources,
    PartAssembler,
    fill_file,
    gather_bytes,
    with_parts,
    write_by_file,
)
from .partsclient import ClientRanges, PartRef, PartsClient, Uploader
from .reads import Ranges
from .retry import RetryPolicy

__all__ = ["PartsStore"]


class PartsStore(Store):
    """Files assembled by the server from the ranks' parts (see the module docstring)."""

    rules: PartRules  # what the server's assembly allows (part sizes, part count); a class's
    # rules before the save record kept them (how an older save's parts were planned)
    legacy_rules: ClassVar[PartRules | None] = None
    client_class: ClassVar[type[PartsClient]]  # the backend's requests

    def __init__(
        self, fs: AbstractFileSystem, root: str, *, retry: RetryPolicy, threads: int
    ) -> None:
        super().__init__(fs, root, retry=retry, threads=threads)
        self.client = self.client_class(fs, retry)
        self.layout: Layout | None = None
        self.parts: list[FileParts] = []  # every file's parts, numbered from 1
        self.gathers: list[GatherTasks] = []  # every rank's share of the gathered parts
        self.uploads: dict[int, str] = {}  # file -> the handle ``_make_files`` made (S3: upload id)
        self.completed: set[int] = set()  # files an interrupted save had assembled already
        # Whether this save's gathered parts travel over the ranks' network (``plan``), what each
        # rank sends there, and (each rank) its held runs by file until they are sent.
        self.exchanged = False
        self.sends: list[Sends] = []
        self.held: dict[int, Held] = {}
        self.world = 0  # the save's ranks (``plan``); 0 when finishing another save's records
        self.per_node = ranks_per_node()  # ranks a node (the save record keeps it, and the rules)

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
        """Every file's parts and each rank's gathering tasks; where every rank's runs too small
        to be parts fit in ``gather_memory``, they travel to the gathering ranks over the ranks'
        network (``stores/exchange.py``), else through the store as staged objects."""
        assert placed is not None
        plan = plan_parts(placed, layout, world, self.rules, self.per_node)
        self.layout, self.parts, self.gathers = layout, plan.parts, plan.tasks
        held = _held_bytes(placed, plan, world)
        self.exchanged = (
            world > 1
            and any(len(t) for t in plan.tasks)
            and 0 < int(held.max()) <= self.gather_memory
            and len(layout.files) <= MAX_TAG_FILES
        )
        self.sends = plan_sends(plan.tasks, world) if self.exchanged else []
        self.world = world
        return plan.tasks

    def adopt(
        self,
        layout: Layout,
        plans: list[SavePlan],
        uploads: Mapping[int, str],
        part_plan: Mapping[str, int],
    ) -> None:
        """(``consolidate``) Finish a save from its records: its parts, re-planned from every
        rank's items with the rules and nodes it was planned with (a record without them: this
        store's rules before they were recorded, no nodes), and the handles it made
        (``reconcile`` then notes what it had assembled)."""
        self.rules = _recorded_rules(part_plan, self.legacy_rules)
        self.per_node = int(part_plan.get("ranks_per_node", 1))
        self.plan(layout, place_items(layout, plans), len(plans))
        self.world = 0  # the interrupted save may have left more than its records: list them
        self.uploads = dict(uploads)

    def staging_names(self) -> list[str] | None:
        """The save's records (``session/records.py``: the save's, each rank's, the
        completion's) where no bytes were staged as objects (gathered over the ranks' network,
        or nothing gathered); ``prepare`` removed whatever an earlier save left there."""
        staged = not self.exchanged and any(len(t) for t in self.gathers)
        if not self.world or staged:
            return None
        ranks = [rank_record_name(r) for r in range(self.world)]
        return [SAVE_RECORD, *ranks, COMPLETION_RECORD]

    def rank_data(self, world: int) -> list[PartsRankPlan]:
        assert self.layout is not None, "plan() and prepare() come first"
        return parts_rank_plans(
            self.layout, self.parts, self.uploads, self.gathers, self.sends or None
        )

    def record_uploads(self) -> Mapping[int, str]:
        return self.uploads

    def record_plan(self) -> Mapping[str, int]:
        rules = dataclasses.asdict(self.rules)
        return {**rules, "ranks_per_node": self.per_node}

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
                try:
                    data = gather_bytes(
                        self.client,
                        sources.of(f, p),
                        lambda rank: self.staged_path(plan.name, rank),
                        url=self.client.url,
                    )
                except FileNotFoundError:
                    raise RuntimeError(
                        f"{self.client.url(fsio.join(self.root, plan.name))}: part {p.number} was "
                        "never uploaded, and its bytes were never staged in the store: the save "
                        "sent them over the ranks' network (HFStorageWriter(gather_memory=...)) "
                        "and a rank stopped before uploading it, so this save cannot be finished; "
                        "save again"
                    ) from None
                got[p.number] = self.client.upload_part(
                    self.root,
                    self.save_id,
                    PartRef(f, plan.name, p.number, p.start, self.uploads.get(f)),
                    data,
                )
            self._assemble(f, layout, [got[p.number] for p in parts])
            gathered = sum(p.nbytes for p in parts if isinstance(p, GatherPart))
            self.merge_stats.add(
                plan.size, gathered, sum(p.nbytes for p in missing), network=self.exchanged
            )

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
        stream: Any = contextlib.nullcontext()
        if staged_size and plan.exchange:
            stream = Held(staged_size)  # sent to the gathering ranks once every rank has written
        elif staged_size:
            stream = self.client.staged_writer(self.staged_path(name, rank_plan.rank), staged_size)
        try:
            with stream as staged:
                results = fill_file(file, share.items, rank_plan, slabs, parts, staged, assembler)
            assembler.check_filled(name, rank_plan.rank)
            entries = tuple(uploader.wait())
        finally:
            uploader.close()
        if isinstance(stream, Held):
            if stream.at != staged_size:
                raise RuntimeError(
                    f"{name}: rank {rank_plan.rank} held {stream.at} bytes for the gathering "
                    f"ranks, the plan says {staged_size}; the plan is inconsistent"
                )
            self.held[file] = stream
        return with_parts(results, entries)

    def finishes(self, rank_plan: RankPlan) -> bool:
        plan: PartsRankPlan = rank_plan.store
        return plan.exchange or bool(rank_plan.tasks)

    def records_late(self, rank_plan: RankPlan) -> bool:
        # Exchanged bytes were never staged: a save that dies before a gathered part is
        # uploaded cannot be finished, one that dies after can, from these records.
        plan: PartsRankPlan = rank_plan.store
        return plan.exchange

    def run_tasks(
        self, rank_plan: RankPlan, threads: int, rank_timeout: float
    ) -> tuple[list[tuple[int, dict[str, Any] | None]], int, int]:
        """Gathered parts from staged objects (``run_task``), or, where the save exchanges, over
        a group of the save's ranks: every rank takes part, tasks or not (its held runs go to
        the gathering ranks)."""
        plan: PartsRankPlan = rank_plan.store
        if not plan.exchange:
            return super().run_tasks(rank_plan, threads, rank_timeout)
        held = sum(h.size for h in self.held.values())
        try:
            group = save_group(rank_plan.save_id, rank_plan.rank, rank_plan.world, rank_timeout)
            tasks = rank_plan.tasks
            assert isinstance(tasks, GatherTasks) and plan.sends is not None
            done, received = exchange(
                group,
                rank_plan.rank,
                self.held,
                plan.sends,
                tasks,
                lambda task, data: self._upload_gathered(task, rank_plan, data),
                threads=threads,
            )
        finally:
            self.held.clear()  # sent or failed: the bytes are not needed again
            forget_group(rank_plan.save_id, rank_plan.rank)
        return list(done), received, held

    def run_task(self, task: GatherTask, rank_plan: RankPlan) -> tuple[int, dict[str, Any] | None]:
        """Gather one part from the ranks' staged runs and upload it."""
        name = rank_plan.files[task.file]
        data = gather_bytes(
            self.client,
            task.sources(),
            lambda rank: self.staged_path(name, rank),
            url=self.client.url,
        )
        return task.file, self._upload_gathered(task, rank_plan, data)

    def _upload_gathered(
        self, task: GatherTask, rank_plan: RankPlan, data: bytearray
    ) -> dict[str, Any]:
        name = rank_plan.files[task.file]
        ref = PartRef(
            task.file, name, task.number, task.start, rank_plan.store.uploads.get(task.file)
        )
        return self.client.upload_part(self.root, rank_plan.save_id, ref, data)

    def abort(self, rank_plan: RankPlan) -> None:
        """Remove what this save made (parts, uncommitted blocks, open uploads), so that no rank
        goes on writing a doomed checkpoint; best effort (the next save to this path, or pruning
        the step, removes what is left)."""
        self.held.clear()
        self._discard(rank_plan.files, rank_plan.save_id)


def _recorded_rules(part_plan: Mapping[str, int], legacy: PartRules | None) -> PartRules:
    """The rules a save record names; a record without them: ``legacy`` (or S3's)."""
    names = [f.name for f in dataclasses.fields(PartRules)]
    if not all(n in part_plan for n in names):
        return legacy or S3_RULES
    return PartRules(**{n: int(part_plan[n]) for n in names})


def ranks_per_node() -> int:
    """(coordinator) Ranks a node, as ``torchrun`` numbers them (consecutive, ``LOCAL_WORLD_SIZE``
    on every node; 1 where unset): only how gathered stretches are cut and who gathers them
    depend on it, so a job whose nodes differ is planned less well, never wrongly."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _held_bytes(placed: PlacedChunks, plan: PartPlan, world: int) -> np.ndarray:
    """Per rank, the bytes of its chunks outside its own parts: what it stages, or holds for
    the gathering ranks."""
    own = np.zeros(world, dtype=np.int64)
    for file_parts in plan.parts:
        mine = file_parts.rank >= 0
        np.add.at(own, file_parts.rank[mine], file_parts.nbytes[mine])
    return placed.bytes_per_rank(world) - own
