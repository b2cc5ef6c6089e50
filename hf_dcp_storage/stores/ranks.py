"""What every rank does in a save, whatever its store (``HFStorageWriter.write_data`` runs it):
write its own bytes through the store and record them (``write_own``), meet the other ranks
around that when the save has finishing work (``run_rank``), then do its share of that work
(``finish_tasks``). A failure anywhere aborts what the store can (S3: every upload of the save),
so that no rank goes on writing a doomed checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..io import fsio
from ..plan.rankplan import FINISHED, Finished, RankPlan
from ..session import meeting
from ..session.records import rank_record, rank_record_name
from .base import STAGING_DIR, Slabs, Store

__all__ = ["finish_tasks", "record", "run_rank", "write_own"]


def run_rank(
    store: Store,
    rank_plan: RankPlan,
    write: Callable[[], list[WriteResult]],
    *,
    rank_timeout: float,
    where: str,
) -> list[WriteResult]:
    """(each rank) ``write()`` this rank's own bytes; where the save has finishing work
    (``rank_plan.meet``), the ranks meet once every one has written, so none gathers bytes a
    failed rank never staged.

    Raises:
        RuntimeError: another rank failed to write (naming it); the store is aborted.
    """
    meet = (
        meeting.Meeting(rank_plan.save_id, rank_plan.rank, rank_plan.world, rank_timeout)
        if rank_plan.meet
        else None
    )
    try:
        if meet is not None:
            meet.start()
        try:
            results = write()
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
        store.abort(rank_plan)  # every rank is past its writes: clean up after them
        shown = failed if len(failed) <= 16 else [*failed[:16], "..."]
        raise RuntimeError(
            f"ranks {shown} of {rank_plan.world} failed to write their bytes (their errors tell "
            f"why), so rank {rank_plan.rank} gathers nothing and the save fails; the checkpoint "
            f"at {where} is not committed"
        )
    return results


def write_own(
    store: Store, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs
) -> list[WriteResult]:
    """(each rank) This rank's own bytes, then its record (what lets ``hf-dcp consolidate``
    finish the save), unless the store records it after the finishing work
    (``Store.records_late``: ``finish_tasks`` does); a failure aborts what the store can."""
    try:
        results = store.write(items, rank_plan, slabs)
        if not store.records_late(rank_plan):
            record(store, items, rank_plan, results)
    except BaseException:
        store.abort(rank_plan)
        raise
    return results


def record(
    store: Store,
    items: list[WriteItem],
    rank_plan: RankPlan,
    results: list[WriteResult],
    gathered: Mapping[int, tuple[dict[str, Any], ...]] | None = None,
) -> None:
    """(each rank) Put its record (``rank{r}.json``): its items' results and, where it records
    late, the parts it gathered."""
    data = rank_record(rank_plan.save_id, rank_plan.rank, items, results, gathered).encode()
    store.put(fsio.join(store.root, STAGING_DIR, rank_record_name(rank_plan.rank)), data)


def finish_tasks(
    store: Store,
    rank_plan: RankPlan,
    threads: int,
    rank_timeout: float,
    own: tuple[list[WriteItem], list[WriteResult]],
) -> WriteResult:
    """(each rank the store ``finishes`` with, once every rank has staged) Run its tasks on the
    store, then, where the store records late, the rank's record (``own``: its items and their
    results) with the parts it gathered; one result for the coordinator: the parts it gathered,
    the files it merged, its bytes. A failure aborts what the store can, as a failed write
    does."""
    tasks: list[Any] = list(rank_plan.tasks)  # GatherTask or MergeTask: each has nbytes
    try:
        done, received, held = store.run_tasks(rank_plan, threads, rank_timeout)
        if store.records_late(rank_plan):
            gathered: dict[int, list[dict[str, Any]]] = {}
            for file, etag in done:
                if etag is not None:
                    gathered.setdefault(file, []).append(etag)
            items, results = own
            record(store, items, rank_plan, results, {f: tuple(e) for f, e in gathered.items()})
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
    return WriteResult(
        FINISHED,
        nbytes,
        Finished({f: tuple(e) for f, e in parts.items()}, tuple(merged), nbytes, received, held),
    )
