"""What the coordinator does in a save, whatever its store (``HFStorageWriter`` runs it):
before any rank writes, prepare the destination and write the save record and the model's other
files (``prepare``); once
every rank has written, have the store make the files whole and commit by writing the index
(``commit``). The rank side is ``stores/ranks.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ..format.index import INDEX_NAME
from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.layout import Layout, index_bytes
from ..plan.rankplan import FINISHED, combine_checksums
from ..session.records import SAVE_RECORD, SaveRecord
from .base import STAGING_DIR, Store
from .registry import store_for_mode
from .retry import RetryPolicy

__all__ = ["adopt", "commit", "prepare"]


def prepare(
    store: Store,
    layout: Layout,
    world: int,
    *,
    overwrite: bool,
    companions: Mapping[str, bytes] | None = None,
) -> None:
    """(coordinator, before any rank writes) Prepare the destination (``Store.prepare``), then
    write the save record that lets ``hf-dcp consolidate`` finish the save and the model's other
    files (``companions``: name -> bytes, ``io/companions.py``; in parallel; the index, written
    last, publishes them with the weights); a failure undoes what ``prepare`` made."""
    store.prepare(layout, overwrite)
    files = tuple((f.name, f.header) for f in layout.files)
    record = SaveRecord(
        store.save_id, store.mode, world, files, store.record_uploads(), store.record_plan()
    )
    extra = dict(companions or {})
    try:
        store.put(fsio.join(store.root, STAGING_DIR, SAVE_RECORD), record.encode())
        parallel_map(
            lambda name: store.put(fsio.join(store.root, name), extra[name]),
            sorted(extra),
            store.threads,
        )
    except BaseException:
        store.undo_prepare(layout)
        raise


def commit(
    store: Store, layout: Layout, results: list[list[WriteResult]], tables: Any
) -> dict[str, Any]:
    """(coordinator, once every rank has written) Make every file whole from the ranks' results
    (their finishing tasks' apart), then commit: the index, with every tensor's CRC32, written
    last. Returns the save's ``merge_stats``; the staging folder is the caller's to clear."""
    finished = {
        rank: r.storage_data for rank, rs in enumerate(results) for r in rs if r.index == FINISHED
    }
    results = [[r for r in rs if r.index != FINISHED] for rs in results]
    for rank, f in finished.items():
        store.merge_stats.by_rank[rank] = f.nbytes
        store.merge_stats.held_bytes = max(store.merge_stats.held_bytes, f.held)
    store.complete(layout, results, finished)
    checksums = combine_checksums(layout, results, tables)
    store.put(fsio.join(store.root, INDEX_NAME), index_bytes(layout, checksums))
    return store.merge_stats.as_dict()


def adopt(
    mode: str,
    fs: AbstractFileSystem,
    root: str,
    record: tuple[Layout, list[SavePlan], Mapping[int, str], str, Mapping[str, int]],
    *,
    retry: RetryPolicy,
    threads: int,
    source: tuple[AbstractFileSystem, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Store:
    """(``hf-dcp consolidate``, one process) The store of kind ``mode`` at ``root`` that takes
    over an interrupted save from its records (``record``: its layout, every rank's write items,
    the handles it made, its save id, what its parts were planned with; ``source``: where its
    staged objects are read when it is finished elsewhere; ``on_bytes``: told the bytes
    merged). No I/O."""
    layout, plans, uploads, save_id, part_plan = record
    store = store_for_mode(mode, fs, root, retry=retry, threads=threads)
    store.save_id, store.source, store.on_bytes = save_id, source, on_bytes
    store.adopt(layout, plans, dict(uploads), part_plan)
    return store
