"""``HFStorageWriter``: DCP writes straight into consolidated HF safetensors files on any fsspec store."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ._merge import merge_file
from ._progress import NO_PROGRESS, Progress
from ._s3 import (
    MergeStats,
    MultipartWriter,
    PartAssembler,
    PartUploader,
    _quietly,
    complete_file,
    gather_bytes,
    s3_for,
)
from .format.crc import CrcAccumulator
from .format.header import dtype_name
from .format.index import (
    INDEX_NAME,
    SHARD_NAME_RE,
    SINGLE_FILE_NAME,
    index_json,
    json_bytes,
)
from .io import fsio, meeting
from .io.hostbuf import HostBuffers, to_host
from .io.parallel import parallel_map
from .io.records import (
    COMPLETION_RECORD,
    SAVE_RECORD,
    CompletionRecord,
    ItemRecord,
    RankRecord,
    SaveRecord,
    rank_record_name,
)
from .io.retry import RetryPolicy
from .io.slabs import as_bytes, slab_bounds, sub_chunk
from .plan.compact import (
    LocalChunks,
    TablePlan,
    check_and_dedup,
    encode_local,
    gather,
    table_plans,
    xor_shares,
)
from .plan.layout import (
    Layout,
    Placement,
    chunk_runs,
    element_size,
    parse_size,
    plan_layout,
)
from .plan.merge import StagedPiece
from .plan.packed import PackedTuple
from .plan.placed import PlacedChunks, place_chunks, place_items
from .plan.s3parts import MIN_PART_BYTES, GatherPart, RankPart, route_run
from .plan.s3plan import S3Plan, plan_s3
from .plan.spread import GatherTask, GatherTasks, MergeTask, assign, merge_tasks

__all__ = ["HFStorageWriter", "STAGING_DIR"]

logger = logging.getLogger(__name__)

# The save's own record (``io/records.py``) and per-rank staged files live here until the
# coordinator has written the index; then the folder is removed.
STAGING_DIR = ".hf_dcp_staging"


@dataclass(frozen=True)
class _RankPlan:
    """``SavePlan.storage_data`` the coordinator sends each rank: the part of the layout it writes."""

    rank: int
    save_id: str
    direct: bool
    files: tuple[str, ...]
    placements: Mapping[MetadataIndex, Placement]
    s3: _S3RankPlan | None = None
    # Where each row of the rank's key table goes, which the rank turns into ``placements`` for
    # the write items it kept (``plan/compact.py``); set by every save.
    table: TablePlan | None = None
    # The save's finishing work this rank does once every rank has staged (``plan/spread.py``), and
    # whether the ranks meet before it (on a save of several ranks where any rank has tasks).
    tasks: GatherTasks | tuple[MergeTask, ...] = ()
    world: int = 1
    meet: bool = False


@dataclass(frozen=True)
class _S3RankPlan:
    """On S3: the parts this rank uploads of its own, and the multipart uploads it sends parts
    to (of its own or gathered)."""

    uploads: Mapping[int, str]  # file index -> upload id, of the files this rank sends parts to (a failing rank aborts the rest from the save record)
    parts: Mapping[int, tuple[RankPart, ...]]  # file index -> this rank's parts, by start
    headers: Mapping[int, bytes]  # file index -> header, where this rank's part carries it


@dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data``: the output file, the item's offset in its staged file, and
    the item's share of its tensor's CRC32 (XOR of all shares = the tensor's CRC32)."""

    file: int
    staged_offset: int | None
    crc: int
    parts: tuple[dict[str, Any], ...] = ()  # S3: ETags of this rank's parts of the file (its last item)


@dataclass(frozen=True)
class _WrittenRows:
    """Compact plans: a rank's one ``WriteResult.storage_data`` for all its items: the key-table
    row and CRC32 share of each item it wrote (what ``finish`` needs; the rest stays in its record)."""

    rows: Any  # np.ndarray int64
    crcs: Any  # np.ndarray uint32
    parts: Mapping[int, tuple[dict[str, Any], ...]] = dataclasses.field(default_factory=dict)  # S3: file -> ETags of this rank's parts


@dataclass(frozen=True)
class _Finished:
    """``WriteResult.storage_data`` of a rank's finishing tasks: per file, the parts it gathered
    and uploaded (``{"PartNumber", "ETag"}``; no ETag for a one-part file's PUT), the files it
    merged, and the bytes it assembled."""

    parts: Mapping[int, tuple[dict[str, Any], ...]]
    merged: tuple[int, ...]
    nbytes: int


# The ``WriteResult.index`` of a rank's packed results (compact plans), and of its finishing tasks.
_PACKED = MetadataIndex("__hf_dcp_rank_results__")
_FINISHED = MetadataIndex("__hf_dcp_finishing_tasks__")


class HFStorageWriter(StorageWriter):
    """Save a DCP state dict as a consolidated Hugging Face safetensors checkpoint.

    The output is ``model-0000k-of-0000N.safetensors`` files plus ``model.safetensors.index.json``,
    readable unchanged by ``safetensors`` and ``transformers``. The index is the commit marker:
    it is written last, by the coordinator, after every byte is durable.

    Call sequence (DCP drives it):

    1. (all ranks) ``prepare_local_plan``: rejects non-tensor values and unsupported dtypes
       before anything is written. The rank keeps its write items and sends only their chunks,
       as arrays (``plan/compact.py``): the coordinator's planning then costs microseconds per rank,
       not DCP's object gather and pairwise overlap check.
    2. (coordinator) ``prepare_global_plan``: computes the complete layout from every rank's
       chunks (file of each key, headers, byte position of every chunk; it checks that each
       tensor's chunks tile it and picks one writer per replicated chunk, spreading them by
       bytes; without positioned writes it places every chunk in its rank's staged objects and
       spreads the finishing work, ``plan/placed.py``, ``plan/spread.py``), refuses to replace a complete checkpoint unless
       ``overwrite=True``, and on local disk creates every file at its final size with its
       header; on S3 it plans every file's multipart parts and creates the uploads. It records
       the plan in ``.hf_dcp_staging/save.json`` (``io/records.py``).
    3. (all ranks) ``write_data``: each rank writes only its own bytes. On local disk (and NFS)
       they go straight to their final place with positioned writes, so nothing is left to
       consolidate. On S3 each rank uploads the parts that hold only its bytes straight into the
       files' uploads and stages its runs under 5 MiB. Elsewhere each rank streams one staged
       object per output file. Once its bytes are durable, each rank records what it wrote
       (``.hf_dcp_staging/rankNNNNN.json``). Then, where bytes were staged, the ranks wait for
       each other (on the job's key-value store, ``io/meeting.py``) and each does its share of the
       finishing work the coordinator spread by bytes (``plan/spread.py``): on S3 it assembles
       gathered parts from the staged runs and uploads them; elsewhere it merges whole files.
    4. (coordinator) ``finish``: on S3 completes the uploads; then writes the index, and removes
       ``.hf_dcp_staging/``. If the coordinator dies before the index, the records let
       ``hf-dcp consolidate`` (``consolidate_checkpoint``) run this step later (that one
       process then also gathers and merges).

    Args:
        path: a local folder or any fsspec URL (``file://``, ``memory://``, ``s3://``...); may be
            given later as ``dcp.save(..., checkpoint_id=...)``.
        storage_options: passed to the fsspec filesystem.
        fqn_to_index_mapping: saved key -> 1-based file index; replaces the size-based split.
        max_shard_size: most tensor bytes per file (``"5GB"``, ``"512MiB"`` or an int); keys fill
            files greedily in state-dict order, a larger tensor gets a file of its own.
        overwrite: replace a complete checkpoint already at ``path``.
        thread_count: I/O threads per rank (and the coordinator's threads for packing merge
            tasks on stores without positioned writes).
        direct_write: positioned writes into the final files; ``None`` picks them wherever the
            filesystem supports them (local disk). ``False`` forces the staged path.
        retry: how transient failures of remote requests are retried (S3); default
            ``RetryPolicy()``. Permanent failures (access denied, missing bucket) are not retried.
        rank_timeout: on object stores, where the ranks wait for each other after staging
            (step 3), how many seconds a rank may stay silent (its process dead or hung) before
            the others stop waiting and fail the save, naming it. Every live rank signals every
            ``rank_timeout / 10`` s (at most 5 s) while it writes, so a slow rank is never cut
            off. Default 120 s (the store's own timeout, 30 min, would apply otherwise).

    After a save to an object store, the coordinator's ``merge_stats`` tells how many bytes of
    the consolidated files the ranks sent as their own parts, how many were staged and gathered
    (downloaded and uploaded again), and by which ranks.

    Raises:
        ValueError: a bad option, naming it and the accepted values.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        fqn_to_index_mapping: Mapping[str, int] | None = None,
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
        thread_count: int = 4,
        direct_write: bool | None = None,
        retry: RetryPolicy | None = None,
        rank_timeout: float = meeting.DEFAULT_RANK_TIMEOUT,
    ) -> None:
        super().__init__()
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ValueError(f"retry must be a hf_dcp_storage.RetryPolicy, got {type(retry).__name__}")
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count={thread_count!r} must be an int >= 1")
        if fqn_to_index_mapping is not None and not isinstance(fqn_to_index_mapping, Mapping):
            raise ValueError(f"fqn_to_index_mapping must be a dict of key -> 1-based file index, got {type(fqn_to_index_mapping).__name__}")
        self.max_shard_bytes = parse_size(max_shard_size)
        self.storage_options = storage_options
        self.fqn_to_index_mapping = dict(fqn_to_index_mapping) if fqn_to_index_mapping is not None else None
        self.overwrite = overwrite
        self.thread_count = thread_count
        self.direct_write = direct_write
        self.retry = retry or RetryPolicy()
        self.rank_timeout = meeting.check_rank_timeout(rank_timeout)
        self._s3 = None
        # Made on first need and kept across saves: pinned memory is slow to allocate.
        self._host: HostBuffers | None = None
        self._host_lock = threading.Lock()
        # The thread running this writer's save, from set_up_storage_writer until the save ends
        # on this rank: a writer holds one save's state, so a second save may not start meanwhile.
        self._owner: threading.Thread | None = None
        self.checkpoint_id: str | os.PathLike[str] | None = None
        self.is_coordinator = False
        if path is not None:
            self.reset(path)

    # -- DCP protocol -------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; ``checkpoint_id`` (when given) replaces the path.

        Raises:
            RuntimeError: this writer's previous save is still running in another thread (two
                ``dcp.async_save`` calls sharing one writer): its path and plan would change under it.
        """
        self._refuse_if_busy()
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.fs, self.root = fsio.resolve(checkpoint_id, self.storage_options)
            self._s3 = s3_for(self.fs, self.retry)
            if self.direct_write and not fsio.is_local(self.fs):
                raise ValueError(
                    f"direct_write=True needs positioned writes, which {checkpoint_id!s} does not "
                    f"support; use direct_write=None (automatic) or False"
                )
        self._layout: Layout | None = None
        self._direct = False
        self._items: dict[MetadataIndex, WriteItem] = {}
        self._s3_parts: list[list[RankPart | GatherPart]] | None = None
        self._gathers: list[GatherTasks] = []  # S3: where every gathered part's bytes are staged (each rank's share)
        self._uploads: dict[int, str] = {}
        # Files whose upload an interrupted save had completed already (``consolidate``).
        self._completed: set[int] = set()
        # Compact plans: this rank's write items, kept here while DCP gathers only their
        # ``LocalChunks``; on the coordinator, each key-table's keys and every rank's table.
        self._local: tuple[list[WriteItem], LocalChunks] | None = None
        self._tables: tuple[list[Any], Any] | None = None
        # The save's id, and whether its ranks meet in write_data (``io/meeting.py``): the coordinator
        # drops the meeting's keys in ``finish``.
        self._save_id = ""
        self._meets = False
        self.merge_stats = MergeStats()
        # Where staged objects are read from when merging: this folder, unless an interrupted
        # save elsewhere is being finished into it (``consolidate``).
        self._source: tuple[Any, str] | None = None
        self._progress: Progress = NO_PROGRESS

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            fsio.resolve(checkpoint_id, None)
        except (ValueError, ImportError, TypeError):
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.checkpoint_id is None:
            raise ValueError(
                "HFStorageWriter has no path: pass HFStorageWriter(path) or dcp.save(..., checkpoint_id=path)"
            )
        self._refuse_if_busy()
        self._owner = threading.current_thread()
        self.is_coordinator = is_coordinator

    def _refuse_if_busy(self) -> None:
        owner = getattr(self, "_owner", None)
        if owner is not None and owner is not threading.current_thread() and owner.is_alive():
            raise RuntimeError(
                f"this HFStorageWriter is still saving {self.checkpoint_id!s} in thread {owner.name!r} "
                f"(a dcp.async_save in flight); a writer holds one save's state: pass a new "
                f"HFStorageWriter to each save, or wait for the previous one"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """(all ranks) Reject what safetensors cannot hold, before anything is written.

        The plan DCP gathers carries no write items: the rank keeps them and sends their chunks
        as arrays (``plan/compact.LocalChunks``), a few KiB instead of ~2 KiB per item. DCP's own
        planner then sees empty plans (nothing to deduplicate or validate);
        ``prepare_global_plan`` does both, linearly, and plans every store's work from the arrays.
        """
        not_tensors = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        if not_tensors:
            raise ValueError(
                f"safetensors holds only tensors, but these state-dict values are not tensors: "
                f"{sorted(set(not_tensors))}. Save them separately (e.g. as JSON) or wrap numbers in torch.tensor()."
            )
        for item in plan.items:
            assert item.tensor_data is not None  # every non-BYTE_IO item carries tensor data
            dtype_name(item.tensor_data.properties.dtype, key=item.index.fqn)
        self._local = (list(plan.items), encode_local(plan.items))
        planner_data = plan.planner_data
        if isinstance(planner_data, Mapping) and all(tuple(path) == (key,) for key, path in planner_data.items()):
            # DCP's flattening map of a flat state dict (each key to itself) says nothing, and
            # gathered from thousands of ranks it would cost the coordinator GiBs.
            planner_data = {}
        return dataclasses.replace(plan, items=[], storage_data=self._local[1], planner_data=planner_data)

    def _direct_mode(self) -> bool:
        """Positioned writes into the final files: the same answer on every rank."""
        return self.direct_write if self.direct_write is not None else fsio.is_local(self.fs)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Plan the whole layout, then prepare the destination for writing."""
        stale = [rank for rank, p in enumerate(plans) if not p.usable]
        if stale:
            # DCP's plan caching sends ``usable=False`` for a plan it reuses, with the previous
            # save's storage data: its layout, save id and placements, which this save cannot reuse.
            raise ValueError(
                f"ranks {stale[:8]} sent a cached plan (DefaultSavePlanner(enable_plan_caching=True)); "
                f"HFStorageWriter plans every save afresh. Use a planner without enable_plan_caching"
            )
        # Step 1: pure planning: file of each key, headers, where every chunk goes.
        compact = [p.storage_data for p in plans if isinstance(p.storage_data, LocalChunks)]
        if len(compact) != len(plans):
            raise RuntimeError(
                f"{len(plans) - len(compact)} of {len(plans)} ranks sent no compact plan: HFStorageWriter.prepare_local_plan "
                f"must be the last step of every rank's local planning (a planner that replaces SavePlan.storage_data breaks it)"
            )
        direct = self._direct_mode()
        mode = "direct" if direct else "s3" if self._s3 is not None else "staged"
        layout, tables, tasks = self._plan_compact(compact, mode)
        placements: list[dict[MetadataIndex, Placement]] = [{} for _ in plans]
        # Step 2: I/O on the destination, still before any rank writes data.
        self._prepare_destination(layout, direct)
        if self._s3_parts is not None:
            self._uploads = self._create_uploads(layout, self._s3_parts)
        save_id = uuid.uuid4().hex
        record = SaveRecord(save_id, mode, len(plans), tuple((f.name, f.header) for f in layout.files), self._uploads)
        try:
            self._put(fsio.join(self.root, STAGING_DIR, SAVE_RECORD), record.encode())
        except BaseException:
            if self._uploads:
                self._abort_uploads(layout.names, self._uploads)
            raise
        self._save_id, self._meets = save_id, _meets(tasks)
        return _rank_plans(plans, layout, save_id, direct, placements, self._s3_parts, self._uploads, tables, tasks)

    def _plan_compact(self, chunks: list[LocalChunks], mode: str) -> tuple[Layout, list[TablePlan], list[GatherTasks] | list[list[MergeTask]] | None]:
        """(coordinator) From compact local plans: the layout, each rank's table plan, and
        unless ``mode`` is ``direct`` each rank's finishing tasks (and on S3 every file's parts).
        No I/O."""
        g = gather(chunks)
        dedup = check_and_dedup(g)
        layout = plan_layout(g.specs, max_shard_bytes=self.max_shard_bytes, fqn_to_index_mapping=self.fqn_to_index_mapping)
        self._layout, self._direct, self._items, self._uploads = layout, mode == "direct", {}, {}
        self._tables = (g.table_keys, g.table_of_rank)
        tables = table_plans(g, layout, dedup)
        placed = place_chunks(g, dedup, layout) if mode != "direct" else None
        del g  # its per-chunk arrays (hundreds of MiB at thousands of ranks) are not needed further
        s3, tasks = _plan_tasks(layout, mode, placed, len(chunks), self.thread_count)
        self._s3_parts = s3.parts if s3 is not None else None
        self._gathers = s3.tasks if s3 is not None else []
        return layout, tables, tasks

    def _adopt(
        self, layout: Layout, mode: str, plans: list[SavePlan], uploads: Mapping[int, str] | None = None,
        save_id: str = "", completed: Collection[int] = (),
    ) -> None:
        """(coordinator) Take ``layout`` and every rank's items as this save's plan, written in
        ``mode`` (``direct``, ``staged`` or ``s3``): what ``finish`` works from. No I/O. Also used to
        finish an interrupted save from its records (``uploads``: the ids it created; ``completed``:
        the files whose upload it had completed already)."""
        self._save_id = save_id
        self._completed = set(completed)
        self._layout = layout
        self._direct = mode == "direct"
        self._items = {item.index: item for plan in plans for item in plan.items}
        s3 = plan_s3(place_items(layout, plans), layout, len(plans)) if mode == "s3" else None
        self._s3_parts = s3.parts if s3 is not None else None
        self._gathers = s3.tasks if s3 is not None else []
        self._uploads = dict(uploads or {})
        self._tables = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Write this rank's bytes: in place on local disk, else staged objects; then
        record what was written (the save's ``rank{r}.json``), so an interrupted save can be finished."""
        items, rank_plan = self._unpack_table(plan.storage_data)
        meet = meeting.Meeting(rank_plan.save_id, rank_plan.rank, rank_plan.world, self.rank_timeout) if rank_plan.meet else None
        try:
            if meet is not None:
                meet.start()
            try:
                results = self._write_own(items, rank_plan, planner)
            except BaseException:
                if meet is not None:
                    # Arrive anyway, as failed: the others are waiting for every rank, and stop too.
                    with contextlib.suppress(Exception):
                        meet.arrive_failed()
                raise
            failed = meet.arrive_and_wait() if meet is not None else []
        finally:
            if meet is not None:
                meet.stop()
        if failed:
            shown = failed if len(failed) <= 16 else [*failed[:16], "..."]
            raise RuntimeError(
                f"ranks {shown} of {rank_plan.world} failed to write their bytes (their errors tell why), so "
                f"rank {rank_plan.rank} gathers nothing and the save fails; the checkpoint at {self.checkpoint_id!s} is not committed"
            )
        results = self._pack_results(items, results)
        if rank_plan.tasks:
            results.append(self._finish_tasks(rank_plan))
        if not self.is_coordinator:
            self._owner = None  # this rank's part of the save is done
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_own(self, items: list[WriteItem], rank_plan: _RankPlan, planner: SavePlanner) -> list[WriteResult]:
        """(each rank) Write this rank's own bytes, then its record (``rank{r}.json``)."""
        if rank_plan.direct:
            results = self._write_direct(items, rank_plan, planner)
        elif rank_plan.s3 is not None:
            results = self._write_s3(items, rank_plan, planner)
        else:
            results = self._write_staged(items, rank_plan, planner)
        try:
            self._put(fsio.join(self.root, STAGING_DIR, rank_record_name(rank_plan.rank)), _rank_record(rank_plan, items, results).encode())
        except BaseException:
            if rank_plan.s3 is not None:
                self._abort_save_uploads(rank_plan)
            raise
        return results

    def _finish_tasks(self, rank_plan: _RankPlan) -> WriteResult:
        """(each rank given finishing work, once every rank has staged) Gather this rank's S3
        parts from the staged runs and upload them, or merge its files; a failure aborts every
        upload of the save, as a failed write does."""
        files = rank_plan.files
        uploads = rank_plan.s3.uploads if rank_plan.s3 is not None else {}

        def run(task: GatherTask | MergeTask) -> tuple[int, dict[str, Any] | None]:
            path = fsio.join(self.root, files[task.file])
            if isinstance(task, MergeTask):
                merge_file(self.fs, path, task.header, task.nbytes, task.pieces(lambda rank: self._staged_path(files[task.file], rank)))
                return task.file, None
            assert self._s3 is not None
            data = gather_bytes(self._s3, task.sources(), lambda rank: self._staged_path(files[task.file], rank))
            upload_id = uploads.get(task.file)
            if upload_id is None:  # a one-part file: the object whole
                self._s3.put(path, data)
                return task.file, {"PartNumber": task.number}
            return task.file, self._s3.upload_part(path, upload_id, task.number, data)

        tasks = list(rank_plan.tasks)
        try:
            done = parallel_map(run, tasks, self.thread_count)
        except BaseException:
            if rank_plan.s3 is not None:
                self._abort_save_uploads(rank_plan)
            raise
        parts: dict[int, list[dict[str, Any]]] = {}
        merged = []
        for file, etag in done:
            if etag is None:
                merged.append(file)
            else:
                parts.setdefault(file, []).append(etag)
        nbytes = sum(t.nbytes for t in tasks)
        return WriteResult(_FINISHED, nbytes, _Finished({f: tuple(e) for f, e in parts.items()}, tuple(merged), nbytes))

    def _unpack_table(self, rank_plan: _RankPlan) -> tuple[list[WriteItem], _RankPlan]:
        """(each rank) The write items this rank kept, with their placements."""
        table = rank_plan.table
        if self._local is None or table is None:
            raise RuntimeError(
                "HFStorageWriter.write_data needs the compact plan this rank's prepare_local_plan made and the table "
                "prepare_global_plan sent back; a planner that replaces SavePlan.storage_data breaks that"
            )
        all_items, local = self._local
        keep = np.ones(len(all_items), dtype=bool)
        keep[table.skip] = False
        rows = local.rows[:, 0]
        placements, items = {}, []
        for i in np.flatnonzero(keep).tolist():
            row = int(rows[i])
            items.append(all_items[i])
            placements[all_items[i].index] = Placement(int(table.file[row]), int(table.start[row]))
        return items, dataclasses.replace(rank_plan, placements=placements)

    def _pack_results(self, items: list[WriteItem], results: list[WriteResult]) -> list[WriteResult]:
        """(each rank, compact plans) One result for all items: their table rows and CRC shares."""
        assert self._local is not None
        all_items, local = self._local
        position = {item.index: i for i, item in enumerate(all_items)}
        rows = local.rows[[position[r.index] for r in results], 0] if results else np.empty(0, dtype=np.int64)
        crcs = np.array([r.storage_data.crc for r in results], dtype=np.uint32)
        parts = {r.storage_data.file: r.storage_data.parts for r in results if r.storage_data.parts}
        return [WriteResult(_PACKED, sum(r.size_in_bytes for r in results), _WrittenRows(rows, crcs, parts))]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Merge staged objects if any, then commit by writing the index."""
        layout = self._layout
        if layout is None:
            raise RuntimeError("HFStorageWriter.finish called before prepare_global_plan on the coordinator")
        if self._meets:
            meeting.forget(self._save_id)  # every rank is past it: DCP gathered their results
        finished = {rank: r.storage_data for rank, rs in enumerate(results) for r in rs if r.index == _FINISHED}
        results = [[r for r in rs if r.index != _FINISHED] for rs in results]
        for rank, f in finished.items():
            self.merge_stats.by_rank[rank] = f.nbytes
        if self._direct:
            if fsio.is_local(self.fs):
                fsio.fsync_dir(self.root)
        elif self._s3_parts is not None:
            self._complete_s3(layout, results, finished)
        else:
            merged = {f for fin in finished.values() for f in fin.merged}
            if self._tables is not None:
                # Compact plans: the coordinator holds no write items to merge from; every file
                # was a rank's task, done before that rank's results came back.
                missing = [layout.files[f].name for f in range(len(layout.files)) if f not in merged]
                if missing:
                    raise RuntimeError(f"files {missing[:8]} were not merged by any rank; the checkpoint at {self.checkpoint_id!s} is not committed")
                staged = []
            else:
                staged = [(r.index, rank, r.storage_data) for rank, rs in enumerate(results) for r in rs]
            self._merge(layout, staged, merged)
        checksums = self._checksums(layout, results)
        if metadata is not None and self._tables is not None and not metadata.state_dict_metadata:
            # Compact plans left DCP's metadata empty; what dcp.save returns should describe the
            # checkpoint as HFStorageReader will: one whole-tensor chunk per key.
            metadata.state_dict_metadata.update(_whole_tensors(layout))
        self._put(fsio.join(self.root, INDEX_NAME), _index_bytes(layout, checksums))
        # After the commit: until the index exists, the records are what can finish the save.
        staging = fsio.join(self.root, STAGING_DIR)
        try:
            self._retried(lambda: fsio.remove_tree(self.fs, staging), "remove the staging folder", staging)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed: a leftover is no failure
            logger.warning(
                "%s is committed, but its staging folder could not be removed (%s); `hf-dcp consolidate %s` "
                "removes it (so does the next save to this path)", self.checkpoint_id, exc, self.checkpoint_id,
            )
        self._owner = None

    def _retried(self, fn: Callable[[], Any], operation: str, path: str) -> Any:
        """``fn()`` under the retry policy (fsspec requests: s3fs retries neither a 500 nor a
        reset); a permanent failure keeps its own error."""
        return self.retry.call(fn, operation=operation, url=fsio.url_of(self.fs, path), keep_permanent=True)

    def _host_buffers(self, tensor: torch.Tensor) -> HostBuffers:
        """(each rank) The host buffers of slabs that need a copy: two per I/O thread (one being
        written, one being filled), pinned when the tensors live on CUDA."""
        with self._host_lock:
            if self._host is None:
                self._host = HostBuffers(2 * self.thread_count, pin=tensor.device.type == "cuda")
            return self._host

    def _checksums(self, layout: Layout, results: list[list[WriteResult]]) -> dict[str, int]:
        """Each key's CRC32: the XOR of the shares every rank reported for it."""
        if results and results[0] and isinstance(results[0][0].storage_data, _WrittenRows):
            assert self._tables is not None
            keys, table_of_rank = self._tables
            specs = list(layout.specs)  # in key-table order: the layout was planned from it
            shares = [(rs[0].storage_data.rows, rs[0].storage_data.crcs) for rs in results]
            return dict(zip(specs, xor_shares(keys, table_of_rank, shares, len(specs)).tolist(), strict=True))
        checksums = dict.fromkeys(layout.weight_map, 0)
        for rank_results in results:
            for r in rank_results:
                checksums[r.index.fqn] ^= r.storage_data.crc
        return checksums

    # -- steps --------------------------------------------------------------------------------

    def _prepare_destination(self, layout: Layout, direct: bool) -> None:
        """Refuse or un-commit an existing checkpoint, clear leftovers, and pre-create files."""
        fs, root = self.fs, self.root
        local = fsio.is_local(fs)
        if local:
            # Object stores have no folders, and s3fs's makedirs would create a missing bucket.
            fs.makedirs(root, exist_ok=True)
        # One listing of the whole folder answers every question below: on an object store each
        # exists() is a request or two, and they run before any rank may start writing. On S3
        # the listing of unfinished uploads runs beside it.
        with ThreadPoolExecutor(1) as pool:
            uploads = pool.submit(self._s3.list_uploads, root.rstrip("/") + "/") if self._s3 is not None else None
            names = self._retried(lambda: fsio.list_tree(fs, root), "list", root)
            orphans = uploads.result() if uploads is not None else []
        committed = [n for n in (INDEX_NAME, SINGLE_FILE_NAME) if n in names]
        if committed and not self.overwrite:
            raise FileExistsError(
                f"{fsio.url_of(fs, root)} already holds a complete checkpoint ({', '.join(committed)}); "
                f"pass HFStorageWriter(..., overwrite=True) to replace it, or save to a new path"
            )
        # The index goes first: from here on the folder is an incomplete checkpoint, never a
        # complete one whose files are being rewritten underneath it.
        for name in committed:
            self._retried(lambda path=fsio.join(root, name): fsio.remove(fs, path), "remove", fsio.join(root, name))
        keep = {f.name for f in layout.files}
        stale = [fsio.join(root, n) for n in names if n.startswith(STAGING_DIR + "/") or (SHARD_NAME_RE.match(n) and n not in keep)]
        self._retried(lambda: fsio.remove_many(fs, stale), "remove leftovers under", root)
        if self._s3 is not None:
            # Uploads a killed save left unfinished under this path: invisible, but billed.
            s3, bucket = self._s3, root.split("/", 1)[0]
            parallel_map(lambda o: s3.abort_upload(f"{bucket}/{o[0]}", o[1]), orphans, self.thread_count)
        if local:
            fs.makedirs(fsio.join(root, STAGING_DIR), exist_ok=True)
        if direct:
            for f in layout.files:
                _create_with_header(fsio.join(root, f.name), f.header, f.size)

    def _write_direct(self, items: list[WriteItem], rank_plan: _RankPlan, planner: SavePlanner) -> list[WriteResult]:
        fds: dict[int, int] = {}
        lock = threading.Lock()

        def fd_for(file: int) -> int:
            with lock:
                if file not in fds:
                    fds[file] = fsio.open_rw(fsio.join(self.root, rank_plan.files[file]), create=False)
                return fds[file]

        def write_item(item: WriteItem) -> WriteResult:
            place = rank_plan.placements[item.index]
            fd = fd_for(place.file)
            nbytes = 0
            crc = CrcAccumulator()
            for runs, data in _item_slabs(item, planner, self._host_buffers):
                first = last = None
                for tensor_off, chunk_off, n in runs:
                    run = data[chunk_off : chunk_off + n]
                    fsio.pwrite_all(fd, run, place.tensor_start + tensor_off)
                    crc.update(tensor_off, run)  # while the run is still in cache
                    first = tensor_off if first is None else first
                    last = tensor_off + n
                if first is not None:
                    fsio.start_writeback(fd, place.tensor_start + first, last - first)
                nbytes += len(data)
            return WriteResult(item.index, nbytes, _Written(place.file, None, crc.contribution(_tensor_bytes(item))))

        try:
            results = parallel_map(write_item, items, self.thread_count)
            # Durable before we report success: the coordinator commits on our word.
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return results

    def _write_staged(self, items: list[WriteItem], rank_plan: _RankPlan, planner: SavePlanner) -> list[WriteResult]:
        by_file: dict[int, list[WriteItem]] = {}
        for item in items:
            by_file.setdefault(rank_plan.placements[item.index].file, []).append(item)

        def write_file(file: int) -> list[WriteResult]:
            path = self._staged_path(rank_plan.files[file], rank_plan.rank)
            # Output order, so the merge reads each staged object front to back.
            file_items = _in_write_order(by_file[file], lambda it: rank_plan.placements[it.index].tensor_start)
            results, pos = [], 0
            size = sum(_chunk_bytes(it) for it in file_items)
            with self._staged_stream(path, size) as out:
                for item in file_items:
                    start = pos
                    crc = CrcAccumulator()
                    for runs, data in _item_slabs(item, planner, self._host_buffers):
                        out.write(data)
                        for tensor_off, chunk_off, n in runs:
                            crc.update(tensor_off, data[chunk_off : chunk_off + n])
                        pos += len(data)
                    results.append(WriteResult(item.index, pos - start, _Written(file, start, crc.contribution(_tensor_bytes(item)))))
                if fsio.is_local(self.fs):
                    out.flush()
                    os.fsync(out.fileno())
            return results

        return [r for rs in parallel_map(write_file, sorted(by_file), self.thread_count) for r in rs]

    def _create_uploads(self, layout: Layout, s3_parts: list[list[RankPart | GatherPart]]) -> dict[int, str]:
        """(coordinator) One multipart upload per file of more than one part, before any rank writes."""
        assert self._s3 is not None
        uploads: dict[int, str] = {}
        s3 = self._s3
        # A one-part file is a single PUT, by its rank or by the coordinator.
        files = [f for f, parts in enumerate(s3_parts) if len(parts) > 1]

        def create(f: int) -> None:
            uploads[f] = s3.create_upload(fsio.join(self.root, layout.files[f].name))

        try:
            parallel_map(create, files, self.thread_count)
        except BaseException:
            self._abort_uploads(layout.names, uploads)
            raise
        return uploads

    def _abort_save_uploads(self, rank_plan: _RankPlan) -> None:
        """(a failing rank, S3) Abort every multipart upload of the save, so that the other
        ranks' next parts fail too and no rank goes on writing a doomed checkpoint: those its
        plan names and the rest from the save record, which the coordinator wrote before any
        rank began. Best effort: what cannot be read or aborted is logged (the next save to
        this path aborts what is left)."""
        assert rank_plan.s3 is not None
        uploads = dict(rank_plan.s3.uploads)
        where = fsio.join(self.root, STAGING_DIR, SAVE_RECORD)
        try:
            record = SaveRecord.decode(self._retried(lambda: fsio.read_all(self.fs, where), "read", where), where)
            if record.save_id == rank_plan.save_id:
                uploads.update(record.uploads)
        except Exception as exc:  # noqa: BLE001 - the failure being handled is the one to report
            logger.warning("could not read the save record %s (%s); aborting the uploads this rank knows of", where, exc)
        self._abort_uploads(rank_plan.files, uploads)

    def _abort_uploads(self, names: tuple[str, ...], uploads: Mapping[int, str]) -> None:
        """Abort the multipart uploads of files ``names[f]``; a failing abort is only logged."""
        s3 = self._s3
        assert s3 is not None
        for f, upload_id in uploads.items():
            path = fsio.join(self.root, names[f])
            _quietly(lambda: s3.abort_upload(path, upload_id), path)

    def _write_s3(self, items: list[WriteItem], rank_plan: _RankPlan, planner: SavePlanner) -> list[WriteResult]:
        """(each rank, S3) Upload the parts that hold only this rank's bytes straight into the
        consolidated files; stage the rest. A failure aborts every upload of the save, so the
        other ranks' next part fails too and no rank goes on writing a doomed checkpoint."""
        s3_plan = rank_plan.s3
        assert s3_plan is not None and self._s3 is not None
        by_file: dict[int, list[WriteItem]] = {}
        for item in items:
            by_file.setdefault(rank_plan.placements[item.index].file, []).append(item)

        def write_file(file: int) -> list[WriteResult]:
            name = rank_plan.files[file]
            parts = s3_plan.parts.get(file, ())
            starts = [p.start for p in parts]
            header = s3_plan.headers.get(file, b"")
            file_items = _in_write_order(by_file[file], lambda it: rank_plan.placements[it.index].tensor_start)
            staged_size = sum(_chunk_bytes(it) for it in file_items) - sum(p.nbytes for p in parts)
            path = fsio.join(self.root, name)
            upload_id = s3_plan.uploads.get(file)
            uploader = PartUploader(self._s3, path, upload_id) if parts and upload_id is not None else None
            s3 = self._s3

            def send(part: RankPart, data: bytearray) -> None:
                if uploader is not None:
                    uploader.submit(part.number, data)
                else:  # the whole file is this one part
                    s3.put(path, data)

            assembler = PartAssembler(header, send)
            results: list[WriteResult] = []
            staged_pos = 0
            stream = self._staged_stream(self._staged_path(name, rank_plan.rank), staged_size) if staged_size else contextlib.nullcontext()
            try:
                with stream as staged:
                    for item in file_items:
                        start = rank_plan.placements[item.index].tensor_start
                        crc, first_staged, nbytes = CrcAccumulator(), staged_pos, 0
                        for runs, data in _item_slabs(item, planner, self._host_buffers):
                            nbytes += len(data)
                            for tensor_off, chunk_off, n in runs:
                                run = data[chunk_off : chunk_off + n]
                                crc.update(tensor_off, run)
                                run_start = start + tensor_off
                                for at, take, part in route_run(run_start, n, starts, parts):
                                    piece = run[at - run_start : at - run_start + take]
                                    if part is None:
                                        staged.write(piece)
                                        staged_pos += take
                                    else:
                                        assembler.add(part, at, piece)
                        results.append(WriteResult(item.index, nbytes, _Written(file, first_staged, crc.contribution(_tensor_bytes(item)))))
                if assembler.unfinished:
                    raise RuntimeError(f"{name}: parts {assembler.unfinished} were planned for rank {rank_plan.rank} but not filled")
                etags = tuple(uploader.wait()) if uploader is not None else ()
            except BaseException:
                if uploader is not None:
                    uploader.cancel()
                raise
            last = results[-1]
            results[-1] = dataclasses.replace(last, storage_data=dataclasses.replace(last.storage_data, parts=etags))
            return results

        try:
            return [r for rs in parallel_map(write_file, sorted(by_file), self.thread_count) for r in rs]
        except BaseException:
            self._abort_save_uploads(rank_plan)
            raise

    def _complete_s3(self, layout: Layout, results: list[list[WriteResult]], finished: Mapping[int, _Finished]) -> None:
        """(coordinator, S3) Complete every file's upload with the parts the ranks uploaded; any
        gathered part no rank uploaded (finishing an interrupted save) is gathered here."""
        assert self._s3 is not None and self._s3_parts is not None
        s3_parts = self._s3_parts
        etags: dict[int, list[dict[str, Any]]] = {}
        by_ranks: dict[int, set[int]] = {}
        for rank_results in results:
            for r in rank_results:
                written = r.storage_data
                for f, parts in written.parts.items() if isinstance(written, _WrittenRows) else [(written.file, written.parts)]:
                    etags.setdefault(f, []).extend(parts)
        for fin in finished.values():
            for f, parts in fin.parts.items():
                by_ranks.setdefault(f, set()).update(e["PartNumber"] for e in parts)
                etags.setdefault(f, []).extend(e for e in parts if "ETag" in e)
        gathers = self._gathers
        where: dict[tuple[int, int], tuple[int, int]] = {}  # (file, part number) -> (share, index)

        def sources(f: int, part: GatherPart) -> list[Any]:
            if not where:  # only parts no rank uploaded come here: an interrupted save
                where.update(((fp[0], fp[1]), (b, i)) for b, batch in enumerate(gathers) for i, fp in enumerate(batch.parts[:, :2].tolist()))
            b, i = where[(f, part.number)]
            return gathers[b].task(i).sources()

        # Before the first completion: a save that dies among them leaves completed objects and
        # open uploads; this record tells ``hf-dcp consolidate`` which is which (and every
        # part's ETag, so it gathers nothing again).
        known = {layout.files[f].name: tuple(sorted(etags.get(f, []), key=lambda e: e["PartNumber"])) for f in sorted(self._uploads)}
        self._put(fsio.join(self.root, STAGING_DIR, COMPLETION_RECORD), CompletionRecord(self._save_id, known).encode())
        try:
            for f, plan in enumerate(layout.files):
                if f in self._completed:
                    self.merge_stats.add(plan.size, 0, 0)
                    continue
                complete_file(
                    self._s3, fsio.join(self.root, plan.name), self._uploads.get(f), plan.header, s3_parts[f],
                    etags.get(f, []), by_ranks.get(f, set()), functools.partial(sources, f), lambda rank, name=plan.name: self._staged_path(name, rank),
                    threads=self.thread_count, stats=self.merge_stats,
                )
        except BaseException:
            self._abort_uploads(layout.names, self._uploads)
            raise

    def _put(self, path: str, data: bytes) -> None:
        """Write a small file whole: readers see all of it or nothing (and it is durable)."""
        if self._s3 is not None:
            self._s3.put(path, data)  # one PUT: atomic on S3, and retried
        else:
            fsio.write_atomic(self.fs, path, data)

    def _staged_stream(self, path: str, size: int) -> Any:
        """A stream for one staged object that publishes it only on a clean exit."""
        if self._s3 is not None:
            return MultipartWriter(self._s3, path, max(fsio.part_bytes(self.fs, size), MIN_PART_BYTES))
        return fsio.write_stream(self.fs, path, size)

    def _staged_path(self, file_name: str, rank: int, *, source: bool = False) -> str:
        """Where ``rank`` stages its bytes of output file ``file_name`` (``source``: where the
        merge reads them, which differs when finishing an interrupted save elsewhere)."""
        root = self._source[1] if source and self._source is not None else self.root
        return fsio.join(root, STAGING_DIR, f"{file_name}.rank{rank:05d}")

    def _merge(self, layout: Layout, staged: list[tuple[MetadataIndex, int, _Written]], merged: Collection[int] = ()) -> None:
        """(coordinator) Merge each file's staged objects into it, but ``merged`` (done by ranks)."""
        pieces: dict[int, list[StagedPiece]] = {}
        for index, rank, written in staged:
            item = self._items[index]
            td = item.tensor_data
            assert td is not None and written.staged_offset is not None
            path = self._staged_path(layout.files[written.file].name, rank, source=True)
            pieces.setdefault(written.file, []).append(
                StagedPiece(
                    path=path,
                    tensor_start=layout.tensor_start[index.fqn],
                    staged_offset=written.staged_offset,
                    shape=tuple(td.size),
                    offsets=tuple(td.chunk.offsets),
                    sizes=tuple(td.chunk.sizes),
                    itemsize=element_size(td.properties.dtype),
                )
            )

        source_fs = self._source[0] if self._source is not None else self.fs

        def merge_one(file: int) -> None:
            plan = layout.files[file]
            out = fsio.join(self.root, plan.name)
            merge_file(self.fs, out, plan.header, plan.size, pieces.get(file, []), source_fs=source_fs, on_bytes=self._progress.advance)
            self.merge_stats.add(plan.size, plan.size, plan.size)

        for f in merged:
            self.merge_stats.add(layout.files[f].size, layout.files[f].size, 0)
        parallel_map(merge_one, [f for f in range(len(layout.files)) if f not in merged], self.thread_count)


def _rank_plans(
    plans: list[SavePlan],
    layout: Layout,
    save_id: str,
    direct: bool,
    placements: list[dict[MetadataIndex, Placement]],
    s3_parts: list[list[RankPart | GatherPart]] | None,
    uploads: Mapping[int, str],
    tables: list[TablePlan] | None = None,
    tasks: list[GatherTasks] | list[list[MergeTask]] | None = None,
) -> list[SavePlan]:
    """(coordinator) Every rank's final plan: its ``_RankPlan`` (the part of the layout it
    writes: placements or table plan, on S3 its own parts and the headers they carry, and its
    finishing tasks). Pure."""
    meet = _meets(tasks)
    # Each rank's own S3 parts, by file: one pass over all parts, not one per rank.
    own: dict[int, dict[int, list[RankPart]]] = {}
    for f, parts in enumerate(s3_parts or ()):
        for p in parts:
            if isinstance(p, RankPart):
                own.setdefault(p.rank, {}).setdefault(f, []).append(p)
    out, names = [], PackedTuple(layout.names)  # in every plan: pickled as one blob, not a string per file
    for rank, (plan, placed) in enumerate(zip(plans, placements, strict=True)):
        mine = tasks[rank] if tasks is not None else ()
        mine_tasks = mine if isinstance(mine, GatherTasks) else tuple(mine)
        s3_plan = None
        if s3_parts is not None:
            parts = {f: tuple(ps) for f, ps in own.get(rank, {}).items()}
            headers = {f: layout.files[f].header for f, ps in parts.items() if any(p.header for p in ps)}
            # The uploads this rank sends parts to (all of them, in every plan, were a quarter
            # of what the coordinator sent at 8,192 ranks).
            sends = set(parts) | (set(mine_tasks.parts[:, 0].tolist()) if isinstance(mine_tasks, GatherTasks) else set())
            s3_plan = _S3RankPlan({f: uploads[f] for f in sorted(sends) if f in uploads}, parts, headers)
        table = tables[rank] if tables is not None else None
        rank_plan = _RankPlan(rank, save_id, direct, names, placed, s3_plan, table, mine_tasks, len(plans), meet)
        out.append(dataclasses.replace(plan, storage_data=rank_plan))
    return out


def _meets(tasks: list[GatherTasks] | list[list[MergeTask]] | None) -> bool:
    """Whether the ranks must wait for each other before their tasks: only if there are
    several ranks and any has a task (a task may read any rank's staged bytes)."""
    return tasks is not None and len(tasks) > 1 and any(tasks)


def _plan_tasks(layout: Layout, mode: str, placed: PlacedChunks | None, world: int, threads: int = 1) -> tuple[S3Plan | None, list[GatherTasks] | list[list[MergeTask]] | None]:
    """(coordinator) The finishing work of a save on an object store, spread over its ranks by
    bytes (``plan/spread.assign``): on S3 each gathered part (and every file's parts), elsewhere each
    file to merge (packed on ``threads`` threads), given to the rank with the fewest bytes so
    far, counting each rank's own bytes. ``(None, None)`` in direct mode (nothing to finish).
    Pure."""
    if mode == "direct":
        return None, None
    assert placed is not None
    if mode == "s3":
        s3 = plan_s3(placed, layout, world)
        return s3, s3.tasks
    merges = merge_tasks(placed, layout, threads)
    out: list[list[MergeTask]] = [[] for _ in range(world)]
    for task, rank in zip(merges, assign([t.nbytes for t in merges], placed.bytes_per_rank(world).tolist()), strict=True):
        out[rank].append(task)
    return None, out


def _item_slabs(item: WriteItem, planner: SavePlanner, host: Callable[[torch.Tensor], HostBuffers]) -> Iterable[tuple[Iterable[tuple[int, int, int]], memoryview]]:
    """``(runs, bytes)`` per slab of a write item, cast to the planned dtype (bounded memory).

    A CPU tensor already in the planned dtype is read in place; any other (on an accelerator,
    or cast) goes through ``host(tensor)``'s reusable buffers, copied a slab ahead on CUDA.
    Each slab's bytes are valid until the next slab is asked for."""
    td = item.tensor_data
    assert td is not None
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"planner resolved {item.index.fqn!r} to {type(tensor).__name__}, expected a tensor")
    sizes = tuple(td.chunk.sizes)
    if tuple(tensor.shape) != sizes:
        raise RuntimeError(f"{item.index.fqn!r}: planned chunk {list(sizes)} but the data has shape {list(tensor.shape)}")
    dtype = td.properties.dtype
    itemsize = element_size(dtype)
    bounds = list(slab_bounds(sizes, max(itemsize, tensor.element_size())))
    runs = [chunk_runs(td.size, *sub_chunk(td.chunk.offsets, sizes, r0, r1), itemsize) for r0, r1 in bounds]
    if tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous():
        for (r0, r1), slab_runs in zip(bounds, runs, strict=True):
            yield slab_runs, as_bytes(tensor[r0:r1] if sizes else tensor)
        return
    parts = (tensor[r0:r1] if sizes else tensor for r0, r1 in bounds)
    depth = 2 if tensor.device.type == "cuda" else 1  # CPU copies are synchronous: nothing to overlap
    for slab_runs, data in zip(runs, to_host(parts, dtype, host(tensor), depth), strict=True):
        yield slab_runs, as_bytes(data)


def _whole_tensors(layout: Layout) -> dict[str, TensorStorageMetadata]:
    """DCP metadata of the consolidated checkpoint: one whole-tensor chunk per key."""
    out = {}
    for key, spec in layout.specs.items():
        size = torch.Size(spec.shape)
        out[key] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), size, [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
    return out


def _rank_record(rank_plan: _RankPlan, items: list[WriteItem], results: list[WriteResult]) -> RankRecord:
    """What this rank wrote, for ``rank{r}.json``: each item's result and its chunk's sizes."""
    sizes = {item.index: tuple(item.tensor_data.chunk.sizes) for item in items if item.tensor_data is not None}
    records = []
    for r in results:
        w: _Written = r.storage_data
        records.append(ItemRecord(r.index.fqn, tuple(r.index.offset or ()), sizes[r.index], r.size_in_bytes, w.file, w.staged_offset, w.crc, w.parts))
    return RankRecord(rank_plan.save_id, rank_plan.rank, tuple(records))


def _in_write_order(items: Iterable[WriteItem], tensor_start: Callable[[WriteItem], int]) -> list[WriteItem]:
    """A rank's items of one file in output order (by the chunk's first byte: for chunks of one
    tensor, the order of their offsets), the order it stages them in; ``plan/placed.py`` sorts alike."""
    return sorted(items, key=lambda it: (tensor_start(it), _chunk_offsets(it)))


def _tensor_bytes(item: WriteItem) -> int:
    """Bytes of the whole tensor (not the chunk) in the saved dtype."""
    td = item.tensor_data
    assert td is not None
    return math.prod(td.size) * element_size(td.properties.dtype)


def _chunk_offsets(item: WriteItem) -> tuple[int, ...]:
    assert item.tensor_data is not None
    return tuple(item.tensor_data.chunk.offsets)


def _chunk_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    return math.prod(td.chunk.sizes) * element_size(td.properties.dtype)


def _create_with_header(path: str, header: bytes, size: int) -> None:
    """Create (or reuse) a file at exactly ``size`` bytes with ``header`` at its start, durably."""
    fd = fsio.open_rw(path, create=True)
    try:
        os.ftruncate(fd, size)
        fsio.pwrite_all(fd, memoryview(header), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _index_bytes(layout: Layout, checksums: Mapping[str, int]) -> bytes:
    """The index file a save of ``layout`` commits (``format/index.py``'s ``index_json``). Pure."""
    files = [(f.name, f.size, f.header) for f in layout.files]
    return json_bytes(index_json(layout.total_size, layout.weight_map, files, checksums))
