"""The one interface every destination kind implements: how a save's bytes get from the ranks into
consolidated files, and which ``Ranges`` a loader reads them back through (``stores/reads.py``).

A save calls a ``Store`` in this order (``writer.py``; a store holds one save's state, and the
writer makes a new one for every save):

1. (coordinator) ``plan(layout, placed, world)``: pure, from ``plan/``: each rank's finishing
   tasks (gathered parts, merged files). ``placed`` (every chunk placed in its rank's staged
   objects) is given only to stores with ``needs_placement``.
2. (coordinator) ``prepare(layout, overwrite)``, before any rank writes: refuses or un-commits a
   complete checkpoint, clears leftovers, and makes what the ranks write into (files at their
   final size, multipart uploads); then ``rank_data(world)`` says what else each rank must be
   told, and ``record_uploads()`` what the save record keeps.
3. (each rank) ``write(items, rank_plan, slabs)``: this rank's own bytes, durable on return.
   ``put`` then writes the rank's record. On any failure of the rank: ``abort(rank_plan)``.
4. (each rank with tasks, once every rank has written) ``run_task(task, rank_plan)``.
5. (coordinator) ``complete(layout, results, finished)``: what makes the files whole (merging,
   completing uploads); the writer then writes the index with ``put``, the commit.

``put`` writes a small file that readers see whole or not at all. ``merge_stats`` counts, on the
coordinator, the files' bytes by who moved them.
"""

from __future__ import annotations

import functools
import logging
import posixpath
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..format.index import INDEX_NAME, SHARD_NAME_RE, SINGLE_FILE_NAME
from ..io import fsio
from ..io.items import Place
from ..io.parallel import parallel_map
from ..plan.layout import Layout
from ..plan.placed import PlacedChunks
from ..plan.rankplan import Finished, RankPlan
from ..session.records import CompletionRecord
from .reads import Ranges
from .retry import FSSPEC_ERRORS, ErrorRules, RetryPolicy

__all__ = [
    "STAGING_DIR",
    "MergeStats",
    "Slabs",
    "Store",
    "staged_path",
]

logger = logging.getLogger(__name__)

# The save's own records (``session/records.py``) and per-rank staged objects live here until the
# coordinator has written the index; then the folder is removed.
STAGING_DIR = ".hf_dcp_staging"


class Slabs(Protocol):
    """``slabs(item) -> [(runs, bytes)]``: a write item's bytes in bounded slabs, cast to the
    saved dtype, with each slab's byte runs ``(offset in the tensor, offset in the slab,
    length)`` (``io/items.py``'s ``item_slabs``); a slab's bytes are valid until the next one is
    asked for. ``place``: where the store wants a slab that must be copied anyway (``Place``)."""

    def __call__(
        self, item: WriteItem, place: Place | None = None
    ) -> Iterable[tuple[Iterable[tuple[int, int, int]], memoryview]]: ...


@dataclass
class MergeStats:
    """Bytes of consolidated files by who sent them (coordinator side, object stores).

    ``client_bytes``: staged by their ranks, then downloaded and uploaded again (gathered S3
    parts, merged files) by the rank the coordinator gave them to (``by_rank``: bytes per rank);
    ``coordinator_bytes``: of those, the ones this process moved itself (all of them when it
    finishes an interrupted save). ``network_bytes``: gathered parts' bytes that went to their
    gathering rank over the ranks' own network instead (uploaded once; ``held_bytes``: the most
    host memory one rank held for it).
    """

    files: int = 0
    total_bytes: int = 0
    rank_part_bytes: int = 0  # uploaded by the ranks straight into the files' parts
    client_bytes: int = 0
    coordinator_bytes: int = 0
    network_bytes: int = 0
    held_bytes: int = 0
    by_rank: dict[int, int] = field(default_factory=dict)
    direct_io_bytes: int = (
        0  # local disk: bytes the ranks wrote with O_DIRECT (the rest through the page cache)
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain values (what ``dcp.save`` returns carries, ``writer.py``)."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"} | {
            "client_fraction": self.client_fraction
        }

    def add(self, total: int, gathered: int, here: int, *, network: bool = False) -> None:
        """Count one file of ``total`` bytes, ``gathered`` of them gathered (``network``: over
        the ranks' network, else through the store), ``here`` by this process."""
        with self._lock:
            self.files += 1
            self.total_bytes += total
            self.rank_part_bytes += total - gathered
            if network:
                self.network_bytes += gathered - here
                self.client_bytes += here
            else:
                self.client_bytes += gathered
            self.coordinator_bytes += here

    @property
    def client_fraction(self) -> float:
        return self.client_bytes / self.total_bytes if self.total_bytes else 0.0


class Store(ABC):
    """One destination kind (see the module docstring for the call sequence).

    Args:
        fs, root: the filesystem and the checkpoint folder.
        retry: how transient failures of the store's requests are retried.
        threads: I/O threads per rank.
    """

    mode: ClassVar[
        str
    ]  # recorded in the save record: "direct", "staged", "s3", "gcs" or "azure" (``registry.py``)
    needs_placement: ClassVar[bool] = (
        True  # plan() wants every chunk placed in its rank's staged objects
    )
    # How ``hf-dcp consolidate`` finishes an interrupted save of this kind: its files are complete
    # where they were written (only the index is missing); they are merged from staged objects;
    # or the server assembles them where they are (why, for a message; finished in place only).
    files_in_place: ClassVar[bool] = False
    merges_files: ClassVar[bool] = False
    bound_to_place: ClassVar[str | None] = None
    # How its requests' failures read (``stores/retry.py``): which are retried, which name a
    # missing object or a refusal. A backend with an SDK of its own states its rules.
    errors: ClassVar[ErrorRules] = FSSPEC_ERRORS

    def __init__(
        self, fs: AbstractFileSystem, root: str, *, retry: RetryPolicy, threads: int
    ) -> None:
        self.fs, self.root, self.retry, self.threads = fs, root, retry, threads
        self.merge_stats = MergeStats()
        # Told the bytes this process merges, as it merges them (``hf-dcp consolidate``'s progress).
        self.on_bytes: Callable[[int], None] | None = None
        # Where staged objects are read from when merging: this folder, unless an interrupted
        # save elsewhere is being finished into it (``consolidate``).
        self.source: tuple[AbstractFileSystem, str] | None = None
        # The save's id (set by the writer before ``prepare``), named in the records it writes.
        self.save_id = ""
        # (part stores) The most host memory a rank may hold for gathered parts sent over the
        # ranks' network (``HFStorageWriter(gather_memory=...)``); 0: staged in the store.
        self.gather_memory = 0

    @classmethod
    def ranges(cls, fs: AbstractFileSystem, retry: RetryPolicy) -> Ranges:
        """How loads read this store's objects (fsspec's ranged reads unless the store has a
        faster path)."""
        return Ranges(fs, retry)

    @classmethod
    def clear_leftovers_under(cls, fs: AbstractFileSystem, folder: str, retry: RetryPolicy) -> int:
        """(pruning a step) Clear what killed saves under ``folder`` left that deleting its
        objects does not remove (S3's open uploads, Azure's uncommitted blocks); how many.
        Nothing by default: elsewhere a save's leftovers are objects in the folder."""
        return 0

    # -- 1. coordinator, pure -----------------------------------------------------------------

    def plan(self, layout: Layout, placed: PlacedChunks | None, world: int) -> list[Any] | None:
        """Each rank's finishing tasks (one entry per rank), or ``None``: nothing to finish (what
        a store with positioned writes returns)."""
        return None

    # -- 2. coordinator, before any rank writes ---------------------------------------------

    def prepare(self, layout: Layout, overwrite: bool, *, make_files: bool = True) -> None:
        """Refuse or un-commit a complete checkpoint, clear leftovers, and (``make_files``) make
        what the ranks write into (``_make_files``).

        One listing of the whole folder answers every question: on an object store each
        ``exists`` is a request or two, and they run before any rank may start writing.

        Raises:
            FileExistsError: a complete checkpoint is there and ``overwrite`` is off.
        """
        fs, root = self.fs, self.root
        local = fsio.is_local(fs)
        if local:
            # Object stores have no folders, and s3fs's makedirs would create a missing bucket.
            fs.makedirs(root, exist_ok=True)
        names = self._retried(lambda: fsio.list_tree(fs, root), "list", root)
        committed = [n for n in (INDEX_NAME, SINGLE_FILE_NAME) if n in names]
        if committed and not overwrite:
            raise FileExistsError(
                f"{fsio.url_of(fs, root)} already holds a complete checkpoint "
                f"({', '.join(committed)}); pass HFStorageWriter(..., overwrite=True) to replace "
                "it, or save to a new path"
            )
        # The index goes first: from here on the folder is an incomplete checkpoint, never a
        # complete one whose files are being rewritten underneath it.
        for path in [fsio.join(root, name) for name in committed]:
            self._retried(functools.partial(fsio.remove, fs, path), "remove", path)
        keep = {f.name for f in layout.files}
        stale = [
            fsio.join(root, n)
            for n in names
            if n.startswith(STAGING_DIR + "/") or (SHARD_NAME_RE.match(n) and n not in keep)
        ]
        self._retried(lambda: fsio.remove_many(fs, stale), "remove leftovers under", root)
        if local:
            fs.makedirs(fsio.join(root, STAGING_DIR), exist_ok=True)
        if make_files:
            self._make_files(layout)

    def _make_files(self, layout: Layout) -> None:  # noqa: B027 - an optional step, empty by default
        """(``prepare``'s last step) Make what the ranks write into; nothing by default."""

    def undo_prepare(self, layout: Layout) -> None:  # noqa: B027 - an optional step, empty by default
        """Undo what ``prepare`` made when the save fails before any rank writes (S3: abort the
        uploads it created); never raises."""

    def adopt(  # noqa: B027 - an optional step, empty by default
        self,
        layout: Layout,
        plans: list[SavePlan],
        uploads: Mapping[int, str],
        part_plan: Mapping[str, int],
    ) -> None:
        """(``consolidate``) Take over an interrupted save: its layout, every rank's write items
        (``plans``), the handles it made (``record_uploads``: S3's multipart uploads) and what
        its parts were planned with (``record_plan``)."""

    def reconcile(self, layout: Layout, completion: CompletionRecord | None) -> None:  # noqa: B027 - an optional step, empty by default
        """(``consolidate``, in place, after ``adopt``) Check that what the interrupted save made
        is still there and note what it had finished (its completion record, if it wrote one);
        nothing to do by default.

        Raises:
            ValueError: what the save uploaded is gone (its bytes are lost).
        """

    def rank_data(self, world: int) -> list[Any] | None:
        """(after ``prepare``) What each rank must be told besides its place in the layout (one
        entry per rank, ``RankPlan.store``), or ``None``."""
        return None

    def record_uploads(self) -> Mapping[int, str]:
        """What the save record keeps of the store's own objects (S3: the multipart uploads)."""
        return {}

    def record_plan(self) -> Mapping[str, int]:
        """What the save record keeps of how the save was planned (part stores: their rules)."""
        return {}

    # -- 3. each rank ---------------------------------------------------------------------------

    @abstractmethod
    def write(self, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs) -> list[WriteResult]:
        """(each rank) Write this rank's own bytes; durable (or uploaded) when it returns."""

    def abort(self, rank_plan: RankPlan) -> None:  # noqa: B027 - an optional step, empty by default
        """(a rank whose part failed) Stop the save's other work where the store can (S3: abort
        its uploads, so no rank goes on writing a doomed checkpoint); never raises."""

    # -- 4. each rank with tasks ----------------------------------------------------------------

    def finishes(self, rank_plan: RankPlan) -> bool:
        """(each rank) Whether this rank has a part in the finishing work (``run_tasks``)."""
        return bool(rank_plan.tasks)

    def records_late(self, rank_plan: RankPlan) -> bool:
        """(each rank) Whether its record waits for the finishing work: where what it did there
        cannot be done again from the store (bytes that were never staged), the record names
        its results too. Else it is written as soon as the rank's own bytes are."""
        return False

    def run_tasks(
        self, rank_plan: RankPlan, threads: int, rank_timeout: float
    ) -> tuple[list[tuple[int, dict[str, Any] | None]], int, int]:
        """(each rank that ``finishes``, once every rank has written) Its finishing work, up to
        ``threads`` tasks at a time: each task's ``(file, ETag entry or None)``, the bytes it
        received from other ranks and the bytes it held for them (0 and 0 here: every task
        reads what the ranks staged in the store). ``rank_timeout``: how long the other ranks
        may stay silent where they take part."""
        done = parallel_map(
            lambda task: self.run_task(task, rank_plan), list(rank_plan.tasks), threads
        )
        return done, 0, 0

    def run_task(self, task: Any, rank_plan: RankPlan) -> tuple[int, dict[str, Any] | None]:
        """(each rank with finishing work) Do one task; returns ``(file, ETag entry or None)``."""
        raise NotImplementedError(f"{type(self).__name__} plans no finishing tasks")

    # -- 5. coordinator ---------------------------------------------------------------------------

    @abstractmethod
    def complete(
        self, layout: Layout, results: list[list[WriteResult]], finished: Mapping[int, Finished]
    ) -> None:
        """(coordinator) Make every file whole, before the index is written."""

    def clear_staging(self) -> None:
        """(coordinator, after the commit) Remove ``.hf_dcp_staging/``, retried; a failure is only
        logged: the checkpoint is committed, and ``hf-dcp consolidate`` (or the next save to
        this path) removes what is left."""
        staging = fsio.join(self.root, STAGING_DIR)
        names = self.staging_names()
        try:
            if names is None:
                self._retried(
                    lambda: fsio.remove_tree(self.fs, staging), "remove the staging folder", staging
                )
            else:  # one bulk delete, no listing: a round trip less on every save
                paths = [fsio.join(staging, n) for n in names]
                self._retried(
                    lambda: fsio.remove_many(self.fs, paths), "remove the records under", staging
                )
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed: a leftover is no failure
            url = fsio.url_of(self.fs, self.root)
            logger.warning(
                "%s is committed, but its staging folder could not be removed (%s); `hf-dcp "
                "consolidate %s` removes it",
                url,
                exc,
                url,
            )

    def staging_names(self) -> list[str] | None:
        """(coordinator) Every name this save put under ``.hf_dcp_staging/``, where it knows them
        all; ``None`` (the default) where others may be there: the folder is then listed."""
        return None

    def put(self, path: str, data: bytes) -> None:
        """Write a small file whole: readers see all of it or nothing (and it is durable)."""
        fsio.write_atomic(self.fs, path, data)

    # -- helpers
    # ------------------------------------------------------------------------------------

    def staged_path(self, file_name: str, rank: int, *, source: bool = False) -> str:
        """Where ``rank`` stages its bytes of output file ``file_name`` (``source``: where merges
        read them, which differs when finishing an interrupted save elsewhere)."""
        root = self.source[1] if source and self.source is not None else self.root
        return staged_path(root, file_name, rank)

    def _retried(self, fn: Callable[[], Any], operation: str, path: str) -> Any:
        """``fn()`` under the retry policy (fsspec requests: s3fs retries neither a 500 nor a
        reset); a permanent failure keeps its own error."""
        return self.retry.call(
            fn,
            operation=operation,
            url=fsio.url_of(self.fs, path),
            errors=self.errors,
            keep_permanent=True,
        )


def staged_path(root: str, file_name: str, rank: int) -> str:
    """Where ``rank`` stages its bytes of output file ``file_name`` of the checkpoint at
    ``root``."""
    return posixpath.join(root, STAGING_DIR, f"{file_name}.rank{rank:05d}")
