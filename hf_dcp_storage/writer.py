"""``HFStorageWriter``: DCP writes straight into consolidated HF safetensors files on any fsspec store.

This module speaks DCP; how bytes reach a destination is its store's (``stores/``), and every
plan is made in ``plan/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .format.index import INDEX_NAME
from .io import fsio, meeting
from .io.claim import Claim, released_on_error
from .io.direct import check_direct_io
from .io.hostbuf import KeptHostBuffers
from .io.items import item_slabs
from .io.parallel import parallel_map
from .io.records import SAVE_RECORD, SaveRecord, rank_record, rank_record_name
from .io.retry import RetryPolicy
from .plan.compact import LocalChunks, TablePlan, check_and_dedup, encode_local, gather, table_plans
from .plan.layout import Layout, index_bytes, parse_size, plan_layout, whole_tensor_metadata
from .plan.placed import place_chunks
from .plan.rankplan import FINISHED, Finished, RankPlan, check_savable, combine_checksums, compact_plans, meets, pack_results, rank_plans, unpack_table
from .stores import open_store, store_for_mode
from .stores.base import STAGING_DIR, MergeStats, Store

__all__ = ["HFStorageWriter", "STAGING_DIR", "MERGE_STATS_KEY"]

# Where the ``Metadata`` that ``dcp.save`` returns (and ``async_save``'s future resolves to)
# carries the save's ``merge_stats``, as a plain dict.
MERGE_STATS_KEY = "hf_dcp_storage.merge_stats"

logger = logging.getLogger(__name__)


class HFStorageWriter(StorageWriter):
    """Save a DCP state dict as a consolidated Hugging Face safetensors checkpoint.

    The output is ``model-0000k-of-0000N.safetensors`` files plus ``model.safetensors.index.json``,
    readable unchanged by ``safetensors`` and ``transformers``. The index is the commit marker:
    it is written last, by the coordinator, after every byte is durable.

    Call sequence (DCP drives it), each step one call into the save's store (``stores/base.py``):

    1. (all ranks) ``prepare_local_plan``: rejects non-tensor values and unsupported dtypes
       before anything is written. The rank keeps its write items and sends only their chunks,
       as arrays (``plan/compact.py``).
    2. (coordinator) ``prepare_global_plan``: plans the layout from every rank's chunks (file of
       each key, headers, byte position of every chunk; each tensor's chunks must tile it; one
       writer per replicated chunk, spread by bytes) and the store's finishing work; the store
       prepares the destination (refusing a complete checkpoint unless ``overwrite=True``); the
       plan is recorded in ``.hf_dcp_staging/save.json`` (``io/records.py``).
    3. (all ranks) ``write_data``: each rank writes only its own bytes through the store and
       records them (``.hf_dcp_staging/rankNNNNN.json``). Where bytes were staged, the ranks
       then meet on the job's key-value store (``io/meeting.py``) and each does its share of the
       finishing work (gathered S3 parts, merged files).
    4. (coordinator) ``finish``: the store makes the files whole; the index is written (the
       commit); ``.hf_dcp_staging/`` is removed. If the coordinator dies before the index, the
       records let ``hf-dcp consolidate`` run this step later.
    One save at a time: ``reset`` (or ``storage_meta``) takes the writer, its last step on the
    rank gives it back, done or failed (``io/claim.py``).

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
        retry: how transient failures of remote requests are retried; default ``RetryPolicy()``.
            Permanent failures (access denied, missing bucket) are not retried.
        rank_timeout: on object stores, where the ranks wait for each other after staging
            (step 3), how many seconds a rank may stay silent (its process dead or hung) before
            the others stop waiting and fail the save, naming it. Every live rank signals every
            ``rank_timeout / 10`` s (at most 5 s) while it writes, so a slow rank is never cut
            off. Default 120 s (the store's own timeout, 30 min, would apply otherwise).
        direct_io: local disk: the whole pages of each rank's runs written with ``O_DIRECT`` (``None``:
            where the filesystem takes it; ``True``: or an error; ``False``: never), the same
            bytes either way; ``merge_stats.direct_io_bytes`` says how much went direct.

    After a save to an object store, the coordinator's ``merge_stats`` tells how many bytes of
    the consolidated files the ranks sent as their own parts, how many were staged and gathered
    (downloaded and uploaded again), and by which ranks. The same figures, as a dict, are in
    the ``Metadata`` the save returns (``metadata.storage_data[MERGE_STATS_KEY]``) and in an
    INFO log line of the coordinator: where a save runs in a process of its own (DCP's
    ``AsyncCheckpointerType.PROCESS``), that is where to read them.

    Picklable: it travels as its settings and path, and what cannot travel (the store, host
    buffers, locks) is made anew where it lands.

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
        direct_io: bool | None = None,
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
        self.direct_io = check_direct_io(direct_io)
        self.store: Store | None = None
        self._host = KeptHostBuffers(thread_count)
        self.claim = Claim("HFStorageWriter", "save", "saving", "a dcp.async_save in flight")
        self.checkpoint_id: str | os.PathLike[str] | None = None
        self.is_coordinator = False
        if path is not None:
            self._start(path)  # not a save yet: the constructing thread takes no claim

    # Pickled as its settings and path (DCP's process-based async save sends the writer to its
    # background process): the store, host buffers, locks and claim are made anew there.
    _SETTINGS = ("storage_options", "fqn_to_index_mapping", "overwrite", "thread_count", "direct_write", "retry", "rank_timeout", "direct_io")

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.checkpoint_id, "max_shard_size": self.max_shard_bytes, **{k: getattr(self, k) for k in self._SETTINGS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("path"), **state)  # type: ignore[misc]

    @property
    def merge_stats(self) -> MergeStats:
        """The bytes of the last save's files by who moved them (on the coordinator)."""
        return self.store.merge_stats if self.store is not None else MergeStats()

    # -- DCP protocol -------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, taking this writer for it; ``checkpoint_id`` (when given) replaces the path.

        Raises:
            RuntimeError: this writer's previous save is still running in another thread (two
                ``dcp.async_save`` calls sharing one writer), before anything changes: its path
                and plan would change under it.
            ValueError: ``direct_write=True`` on a store without positioned writes.
        """
        self.claim.take(lambda: str(checkpoint_id if checkpoint_id is not None else self.checkpoint_id))
        with self.claim.released_on_error():
            self._start(checkpoint_id)

    def _start(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.fs, self.root = fsio.resolve(checkpoint_id, self.storage_options)
        if self.checkpoint_id is not None:
            self.store = open_store(
                self.fs, self.root, direct_write=self.direct_write, retry=self.retry, threads=self.thread_count, where=str(self.checkpoint_id), direct_io=self.direct_io
            )
        self._layout: Layout | None = None
        # Compact plans: this rank's write items, kept here while DCP gathers only their
        # ``LocalChunks``; on the coordinator, each key-table's keys and every rank's table.
        self._local: tuple[list[WriteItem], LocalChunks] | None = None
        self._tables: tuple[list[Any], Any] | None = None
        # The save's id, and whether its ranks meet in write_data: the coordinator drops the
        # meeting's keys in ``finish``.
        self._save_id = ""
        self._meets = False
        self._alone = False  # dcp.save(..., use_collectives=False): every rank plans and commits alone

    validate_checkpoint_id = classmethod(fsio.resolvable)

    def storage_meta(self) -> StorageMeta | None:
        """(all ranks) DCP's first call of a save named by no ``reset``: the save takes the writer."""
        self.claim.join(lambda: str(self.checkpoint_id))
        return super().storage_meta()

    @released_on_error
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(all ranks) The save goes on (or, with no ``reset``, starts): this writer is taken for it.

        Raises:
            RuntimeError: another thread's save is still using this writer, naming its path.
            ValueError: no path was given.
        """
        self.claim.join(lambda: str(self.checkpoint_id))
        if self.checkpoint_id is None:
            raise ValueError("HFStorageWriter has no path: pass HFStorageWriter(path) or dcp.save(..., checkpoint_id=path)")
        self.is_coordinator = is_coordinator
        self._alone = kwargs.get("use_collectives") is False

    @released_on_error
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """(all ranks) Reject what safetensors cannot hold, before anything is written.

        The plan DCP gathers carries no write items: the rank keeps them and sends their chunks
        as arrays (``plan/compact.LocalChunks``), a few KiB instead of ~2 KiB per item. DCP's own
        planner then sees empty plans (nothing to deduplicate or validate);
        ``prepare_global_plan`` does both, linearly, and plans every store's work from the arrays.
        """
        check_savable(plan.items)
        self._local = (list(plan.items), encode_local(plan.items))
        planner_data = plan.planner_data
        if isinstance(planner_data, Mapping) and all(tuple(path) == (key,) for key, path in planner_data.items()):
            # DCP's flattening map of a flat state dict (each key to itself) says nothing, and
            # gathered from thousands of ranks it would cost the coordinator GiBs.
            planner_data = {}
        return dataclasses.replace(plan, items=[], storage_data=self._local[1], planner_data=planner_data)

    @released_on_error
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Plan the whole layout, then prepare the destination for writing."""
        compact = compact_plans(plans)
        store = self.store
        assert store is not None
        # Step 1: pure planning: file of each key, headers, where every chunk goes, finishing work.
        try:
            layout, tables, tasks = self._plan_compact(compact)
        except ValueError as exc:
            if self._alone:
                raise ValueError(
                    f"HFStorageWriter cannot save this with dcp.save(..., use_collectives=False): in that mode every rank "
                    f"plans and commits alone, and a consolidated file needs every rank's shards ({exc}). Save with "
                    f"use_collectives=True (the default), or give each rank whole tensors and a path of its own"
                ) from None
            raise
        # Step 2: I/O on the destination, still before any rank writes data.
        self._save_id = store.save_id = uuid.uuid4().hex
        store.prepare(layout, self.overwrite)
        record = SaveRecord(self._save_id, store.mode, len(plans), tuple((f.name, f.header) for f in layout.files), store.record_uploads())
        try:
            store.put(fsio.join(self.root, STAGING_DIR, SAVE_RECORD), record.encode())
        except BaseException:
            store.undo_prepare(layout)
            raise
        self._meets = meets(tasks)
        return rank_plans(plans, layout, self._save_id, store.mode == "direct", [{} for _ in plans], tables, tasks, store.rank_data(len(plans)))

    def _plan_compact(self, chunks: list[LocalChunks]) -> tuple[Layout, list[TablePlan], list[Any] | None]:
        """(coordinator) From compact local plans: the layout, each rank's table plan, and the
        store's finishing tasks. No I/O."""
        assert self.store is not None
        g = gather(chunks)
        dedup = check_and_dedup(g)
        layout = plan_layout(g.specs, max_shard_bytes=self.max_shard_bytes, fqn_to_index_mapping=self.fqn_to_index_mapping)
        self._layout, self._tables = layout, (g.table_keys, g.table_of_rank)
        tables = table_plans(g, layout, dedup)
        placed = place_chunks(g, dedup, layout) if self.store.needs_placement else None
        del g  # its per-chunk arrays (hundreds of MiB at thousands of ranks) are not needed further
        return layout, tables, self.store.plan(layout, placed, len(chunks))

    def _adopt(self, layout: Layout, mode: str, plans: list[SavePlan], uploads: Mapping[int, str] | None = None, save_id: str = "", completed: Any = ()) -> Store:
        """(``consolidate``) Take ``layout`` and every rank's items as this save's plan, written
        in ``mode`` by an interrupted save (``uploads``: the ids it created; ``completed``: the
        files whose upload it had completed): what ``finish`` works from. No I/O."""
        self.store = store = store_for_mode(mode, self.fs, self.root, retry=self.retry, threads=self.thread_count)
        store.save_id = save_id
        store.adopt(layout, plans, dict(uploads or {}), completed)
        self._layout, self._tables, self._save_id = layout, None, save_id
        return store

    @released_on_error
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Write this rank's bytes through the store, record them (the save's ``rank{r}.json``,
        so an interrupted save can be finished), then do this rank's share of the finishing work once every rank has written."""
        rank_plan = plan.storage_data
        if self._local is None or not isinstance(rank_plan, RankPlan) or rank_plan.table is None:
            raise RuntimeError(
                "HFStorageWriter.write_data needs the compact plan this rank's prepare_local_plan made and the table "
                "prepare_global_plan sent back; a planner that replaces SavePlan.storage_data breaks that"
            )
        items, rank_plan = unpack_table(*self._local, rank_plan)
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
            self.store.abort(rank_plan)  # type: ignore[union-attr]  # every rank is past its writes: clean up after them
            shown = failed if len(failed) <= 16 else [*failed[:16], "..."]
            raise RuntimeError(
                f"ranks {shown} of {rank_plan.world} failed to write their bytes (their errors tell why), so "
                f"rank {rank_plan.rank} gathers nothing and the save fails; the checkpoint at {self.checkpoint_id!s} is not committed"
            )
        assert self._local is not None
        results = [pack_results(*self._local, results)]
        if rank_plan.tasks:
            results.append(self._finish_tasks(rank_plan))
        if not self.is_coordinator:
            self.claim.release()  # this rank's part of the save is done
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_own(self, items: list[WriteItem], rank_plan: RankPlan, planner: SavePlanner) -> list[WriteResult]:
        """(each rank) This rank's own bytes, then its record; a failure aborts what the store
        can (S3: every upload of the save, so no rank goes on writing a doomed checkpoint)."""
        store = self.store
        assert store is not None
        try:
            results = store.write(items, rank_plan, lambda item, place=None: item_slabs(item, planner, self._host, place))
            store.put(fsio.join(self.root, STAGING_DIR, rank_record_name(rank_plan.rank)), rank_record(rank_plan.save_id, rank_plan.rank, items, results).encode())
        except BaseException:
            store.abort(rank_plan)
            raise
        return results

    def _finish_tasks(self, rank_plan: RankPlan) -> WriteResult:
        """(each rank given finishing work, once every rank has staged) Run its tasks on the
        store; a failure aborts what the store can, as a failed write does."""
        store = self.store
        assert store is not None
        tasks = list(rank_plan.tasks)
        try:
            done = parallel_map(lambda task: store.run_task(task, rank_plan), tasks, self.thread_count)
        except BaseException:
            store.abort(rank_plan)
            raise
        parts: dict[int, list[dict[str, Any]]] = {}
        merged = []
        for file, etag in done:
            if etag is None:
                merged.append(file)
            else:
                parts.setdefault(file, []).append(etag)
        nbytes = sum(t.nbytes for t in tasks)
        return WriteResult(FINISHED, nbytes, Finished({f: tuple(e) for f, e in parts.items()}, tuple(merged), nbytes))

    @released_on_error
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Let the store make the files whole, then commit by writing the index."""
        layout, store = self._layout, self.store
        if layout is None or store is None:
            raise RuntimeError("HFStorageWriter.finish called before prepare_global_plan on the coordinator")
        if self._meets:
            meeting.forget(self._save_id)  # every rank is past it: DCP gathered their results
        finished = {rank: r.storage_data for rank, rs in enumerate(results) for r in rs if r.index == FINISHED}
        results = [[r for r in rs if r.index != FINISHED] for rs in results]
        for rank, f in finished.items():
            store.merge_stats.by_rank[rank] = f.nbytes
        store.complete(layout, results, finished)
        checksums = combine_checksums(layout, results, self._tables)
        if metadata is not None and self._tables is not None and not metadata.state_dict_metadata:
            # Compact plans left DCP's metadata empty; what dcp.save returns should describe the
            # checkpoint as HFStorageReader will: one whole-tensor chunk per key.
            metadata.state_dict_metadata.update(whole_tensor_metadata(layout))
        store.put(fsio.join(self.root, INDEX_NAME), index_bytes(layout, checksums))
        # Wherever the save ran (DCP's process-based async save runs it in a process of its
        # own, whose writer the caller never sees): in what dcp.save returns, and the log.
        stats = store.merge_stats.as_dict()
        if metadata is not None:
            metadata.storage_data = {MERGE_STATS_KEY: stats}
        logger.info("committed %s: %s", self.checkpoint_id, stats)
        store.clear_staging()  # after the commit: until the index exists, the records can finish the save
        self.claim.release()
