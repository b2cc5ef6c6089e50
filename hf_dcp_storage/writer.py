"""``HFStorageWriter``: DCP writes straight into consolidated HF safetensors files on any fsspec
store.

This module speaks DCP; how bytes reach a destination is its store's (``stores/``), and every
plan is made in ``plan/``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .io import fsio
from .io.companions import Companions, check_companions, read_companions
from .io.direct import check_direct_io
from .io.hostbuf import KeptHostBuffers
from .io.items import item_slabs
from .io.parallel import check_thread_count
from .plan.compact import LocalChunks, encode_local, plan_save, planner_data_to_send
from .plan.fp8export import export_config
from .plan.layout import Layout, check_file_name, parse_size, whole_tensor_metadata
from .plan.rankplan import (
    RankPlan,
    check_savable,
    compact_plans,
    meets,
    pack_results,
    rank_plans,
    unpack_table,
)
from .session import meeting
from .session.claim import Claim, released_on_error
from .stores import coordinator, open_store, ranks
from .stores.base import STAGING_DIR, MergeStats, Store
from .stores.retry import RetryPolicy, policy_or_default

__all__ = ["MERGE_STATS_KEY", "STAGING_DIR", "HFStorageWriter"]

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
       plan is recorded in ``.hf_dcp_staging/save.json`` (``session/records.py``).
    3. (all ranks) ``write_data``: each rank writes its own bytes through the store and records
       them; where bytes were staged, the ranks meet and each does its share of the finishing
       work (gathered parts, merged files): ``stores/ranks.py``.
    4. (coordinator) ``finish``: the store makes the files whole; the index is written (the
       commit; ``stores/coordinator.py``); ``.hf_dcp_staging/`` is removed. If the coordinator
       dies before the index, the records let ``hf-dcp consolidate`` run this step later.
    One save at a time: ``reset`` (or ``storage_meta``) takes the writer, its last step on the
    rank gives it back, done or failed (``session/claim.py``).

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
        direct_io: local disk: the whole pages of each rank's runs written with ``O_DIRECT``
            (``None``: where the filesystem takes it; ``True``: or an error; ``False``: never),
            the same bytes either way; ``merge_stats.direct_io_bytes`` says how much went direct.
        gather_memory: S3, GCS, Azure: the most host memory a rank may hold for its runs too
            small to be parts (``"2GB"``, an int; 0: none). Within it they go to the ranks
            gathering their parts over a gloo group of the save's own (``stores/exchange.py``),
            every byte uploaded once; beyond it they are staged in the store and uploaded twice
            (``merge_stats.network_bytes``, ``client_bytes``, ``held_bytes`` say which).
        companions: the model's config and tokenizer files, put next to the weights (the folder
            loads with ``from_pretrained``): a folder (path or URL) whose files are copied, or a
            dict of file name -> bytes, text, dict (JSON) or local path (``io/companions.py``).
        file_name: every tensor in the one file of this name (``"adapter_model.safetensors"``,
            as PEFT reads adapters), the index still the commit marker, written last.

    The coordinator's ``merge_stats`` (also in the returned ``Metadata``'s
    ``storage_data[MERGE_STATS_KEY]`` and an INFO log line) tells who moved the files' bytes.

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
        gather_memory: int | str = "2GB",
        companions: Companions | None = None,
        file_name: str | None = None,
    ) -> None:
        super().__init__()
        self.file_name = check_file_name(file_name, fqn_to_index_mapping)
        if fqn_to_index_mapping is not None and not isinstance(fqn_to_index_mapping, Mapping):
            raise ValueError(
                "fqn_to_index_mapping must be a dict of key -> 1-based file index, got "
                f"{type(fqn_to_index_mapping).__name__}"
            )
        self.max_shard_bytes = parse_size(max_shard_size)
        self.storage_options = storage_options
        self.fqn_to_index_mapping = (
            None if fqn_to_index_mapping is None else dict(fqn_to_index_mapping)
        )
        self.overwrite = overwrite
        self.thread_count = check_thread_count(thread_count)
        self.direct_write = direct_write
        self.retry = policy_or_default(retry)
        self.rank_timeout = meeting.check_rank_timeout(rank_timeout)
        self.direct_io = check_direct_io(direct_io)
        self.gather_memory = (
            0 if gather_memory in (0, "0") else parse_size(gather_memory, "gather_memory")
        )
        self.companions = check_companions(companions)
        self.store: Store | None = None
        self._host = KeptHostBuffers(thread_count)
        self.claim = Claim("HFStorageWriter", "save", "saving", "a dcp.async_save in flight")
        self.checkpoint_id: str | os.PathLike[str] | None = None
        self.is_coordinator = False
        if path is not None:
            self._start(path)  # not a save yet: the constructing thread takes no claim

    # Pickled as its settings and path (DCP's process-based async save sends the writer to its
    # background process): the store, host buffers, locks and claim are made anew there.
    _SETTINGS = (
        "storage_options",
        "fqn_to_index_mapping",
        "overwrite",
        "thread_count",
        "direct_write",
        "retry",
        "rank_timeout",
        "direct_io",
        "gather_memory",
        "companions",
        "file_name",
    )

    def __getstate__(self) -> dict[str, Any]:
        return {
            "path": self.checkpoint_id,
            "max_shard_size": self.max_shard_bytes,
            **{k: getattr(self, k) for k in self._SETTINGS},
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("path"), **state)  # type: ignore[misc]

    @property
    def merge_stats(self) -> MergeStats:
        """The bytes of the last save's files by who moved them (on the coordinator)."""
        return self.store.merge_stats if self.store is not None else MergeStats()

    # -- DCP protocol -------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, taking this writer for it; ``checkpoint_id`` (when given) replaces the
        path.

        Raises:
            RuntimeError: this writer's previous save is still running in another thread (two
                ``dcp.async_save`` calls sharing one writer), before anything changes: its path
                and plan would change under it.
            ValueError: ``direct_write=True`` on a store without positioned writes.
        """
        self.claim.take(
            lambda: str(checkpoint_id if checkpoint_id is not None else self.checkpoint_id)
        )
        with self.claim.released_on_error():
            self._start(checkpoint_id)

    def _start(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.fs, self.root = fsio.resolve(checkpoint_id, self.storage_options)
        if self.checkpoint_id is not None:
            self.store = open_store(
                self.fs,
                self.root,
                direct_write=self.direct_write,
                retry=self.retry,
                threads=self.thread_count,
                where=str(self.checkpoint_id),
                direct_io=self.direct_io,
            )
            self.store.gather_memory = self.gather_memory
        self._layout: Layout | None = None
        # Compact plans: this rank's write items, kept here while DCP gathers only their
        # ``LocalChunks``; on the coordinator, each key-table's keys and every rank's table.
        self._local: tuple[list[WriteItem], LocalChunks] | None = None
        self._tables: tuple[list[Any], Any] | None = None
        # The save's id, and whether its ranks meet in write_data: the coordinator drops the
        # meeting's keys in ``finish``.
        self._save_id = ""
        self._meets = False
        self._alone = False  # dcp.save(..., use_collectives=False): each rank plans alone

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        return fsio.resolvable(cls, checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        """(all ranks) DCP's first call of a save named by no ``reset``: the save takes the
        writer."""
        self.claim.join(lambda: str(self.checkpoint_id))
        return super().storage_meta()

    @released_on_error
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(all ranks) The save goes on (or, with no ``reset``, starts): this writer is taken for
        it.

        Raises:
            RuntimeError: another thread's save is still using this writer, naming its path.
            ValueError: no path was given.
        """
        self.claim.join(lambda: str(self.checkpoint_id))
        if self.checkpoint_id is None:
            raise ValueError(
                "HFStorageWriter has no path: pass HFStorageWriter(path) or dcp.save(..., "
                "checkpoint_id=path)"
            )
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
        data = planner_data_to_send(plan.planner_data)
        return dataclasses.replace(plan, items=[], storage_data=self._local[1], planner_data=data)

    @released_on_error
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Plan the whole layout, then prepare the destination for writing."""
        compact = compact_plans(plans)
        store = self.store
        assert store is not None
        # Step 1: pure planning: file of each key, headers, where every chunk goes, finishing work.
        try:
            planned = plan_save(
                compact,
                max_shard_bytes=self.max_shard_bytes,
                fqn_to_index_mapping=self.fqn_to_index_mapping,
                placement=store.needs_placement,
                file_name=self.file_name,
            )
            layout, self._tables = planned.layout, planned.key_tables
            tasks = store.plan(layout, planned.placed, len(compact))
        except ValueError as exc:
            if self._alone:
                raise ValueError(
                    "HFStorageWriter cannot save this with dcp.save(..., use_collectives=False): "
                    "in that mode every rank plans and commits alone, and a consolidated file "
                    f"needs every rank's shards ({exc}). Save with use_collectives=True (the "
                    "default), or give each rank whole tensors and a path of its own"
                ) from None
            raise
        self._layout = layout
        # Step 2: I/O, before any rank writes (companions read first: a missing one writes nothing).
        self._save_id = store.save_id = uuid.uuid4().hex
        extra = read_companions(self.companions, self.storage_options, export_config(plans))
        coordinator.prepare(store, layout, len(plans), overwrite=self.overwrite, companions=extra)
        self._meets = meets(tasks)
        return rank_plans(
            plans,
            layout,
            self._save_id,
            store.files_in_place,
            [{} for _ in plans],
            planned.tables,
            tasks,
            store.rank_data(len(plans)),
        )

    def adopt(self, store: Store, layout: Layout, save_id: str) -> None:
        """(``hf-dcp consolidate``, one process) Finish through ``store``, which took over an
        interrupted save (``stores/coordinator.adopt``) of ``layout``: what ``finish`` works
        from."""
        self.store, self._layout, self._tables, self._save_id = store, layout, None, save_id

    @released_on_error
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Write this rank's bytes through the store, record them (the save's
        ``rank{r}.json``, so an interrupted save can be finished), then do this rank's share of
        the finishing work once every rank has written."""
        rank_plan = plan.storage_data
        if self._local is None or not isinstance(rank_plan, RankPlan) or rank_plan.table is None:
            raise RuntimeError(
                "HFStorageWriter.write_data needs the compact plan this rank's prepare_local_plan "
                "made and the table prepare_global_plan sent back; a planner that replaces "
                "SavePlan.storage_data breaks that"
            )
        items, rank_plan = unpack_table(*self._local, rank_plan)
        store = self.store
        assert store is not None
        own = ranks.run_rank(
            store,
            rank_plan,
            lambda: self._write_own(items, rank_plan, planner),
            rank_timeout=self.rank_timeout,
            where=str(self.checkpoint_id),
        )
        results = [pack_results(*self._local, own)]
        if store.finishes(rank_plan):
            args = (self.thread_count, self.rank_timeout, (items, own))
            results.append(ranks.finish_tasks(store, rank_plan, *args))
        if not self.is_coordinator:
            self.claim.release()  # this rank's part of the save is done
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_own(
        self, items: list[WriteItem], rank_plan: RankPlan, planner: SavePlanner
    ) -> list[WriteResult]:
        """(each rank) This rank's bytes through the store, then its record (``stores/ranks``)."""
        assert self.store is not None
        slabs = lambda item, place=None: item_slabs(item, planner, self._host, place)  # noqa: E731
        return ranks.write_own(self.store, items, rank_plan, slabs)

    @released_on_error
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Let the store make the files whole, then commit by writing the index."""
        layout, store = self._layout, self.store
        if layout is None or store is None:
            raise RuntimeError(
                "HFStorageWriter.finish called before prepare_global_plan on the coordinator"
            )
        if self._meets:
            meeting.forget(self._save_id)  # every rank is past it: DCP gathered their results
        stats = coordinator.commit(store, layout, results, self._tables)
        if metadata is not None and self._tables is not None and not metadata.state_dict_metadata:
            # Compact plans left DCP's metadata empty; what dcp.save returns should describe the
            # checkpoint as HFStorageReader will: one whole-tensor chunk per key.
            metadata.state_dict_metadata.update(whole_tensor_metadata(layout))
        # Wherever the save ran (DCP's process-based async save runs it in a process of its
        # own, whose writer the caller never sees): in what dcp.save returns, and the log.
        if metadata is not None:
            metadata.storage_data = {MERGE_STATS_KEY: stats}
        logger.info("committed %s: %s", self.checkpoint_id, stats)
        # After the commit: until the index exists, the records can finish the save.
        store.clear_staging()
        self.claim.release()
