"""Moments of a save at which a kill test SIGKILLs the job (every rank) or one rank.

``arm(moment, kind, rank)`` wraps one of the library's own functions in the calling rank's
process so that, when the save reaches ``moment``, the rank that reaches it first SIGKILLs the
whole job (``kind="job"``) or only itself (``kind="rank"``). Nothing of boto, s3fs or fsspec is
touched: only ``hf_dcp_storage``'s functions, in a process that is about to die anyway.

``MOMENTS`` is in the order a ``CheckpointManager.save`` reaches them; ``BARE_MOMENTS`` are the
ones a bare ``dcp.save(storage_writer=HFStorageWriter(...))`` has.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.support.jobs import kill_job, kill_self

__all__ = ["ASSEMBLED_URLS", "BARE_MOMENTS", "MOMENTS", "S3_ONLY", "STAGED_ONLY", "arm"]

MOMENTS = (
    "planning",  # the coordinator plans the weights' save; nothing written yet
    "record-written",  # the save record (and on S3 the multipart uploads) exist; no data yet
    "early-write",  # a rank has written its first slab of weights
    "late-write",  # a rank's weights are all written, its record not yet
    "finishing",  # a rank gathers or merges staged bytes (object stores only)
    # S3, GCS, Azure: the coordinator has assembled the first file (completed its upload, composed
    # it, committed its blocks), not the rest
    "completing",
    "before-index",  # the coordinator is about to write the weights' index
    "index-written",  # the weights are committed (index), their staging folder not yet removed
    "training-state",  # the training state's bytes are written, its record not yet
    "before-commit",  # everything is written; the step's COMMITTED marker is not
    "pruning",  # the step is committed; retention has removed an old step's marker, not its files
)
BARE_MOMENTS = MOMENTS[:8]
# Moments that only a save with staged bytes reaches (stores without positioned writes), and
# those only a save whose server assembles the files reaches (S3, GCS, Azure).
STAGED_ONLY = frozenset({"finishing"})
S3_ONLY = frozenset({"completing"})
ASSEMBLED_URLS = ("s3://", "gs://", "az://")


def arm(moment: str, kind: str, rank: int, step: int | None = None) -> None:
    """Make this rank die at ``moment`` of the next save (``step``: the step a manager saves)."""
    if moment not in MOMENTS:
        raise ValueError(f"moment={moment!r} is not one of {MOMENTS}")
    import hf_dcp_storage.steps.manager as manager
    import hf_dcp_storage.stores.coordinator as coordinator
    import hf_dcp_storage.stores.ranks as ranks
    import hf_dcp_storage.writer as writer

    die = kill_job if kind == "job" else kill_self
    W = writer.HFStorageWriter

    def first_one() -> bool:
        # Only the first rank to get here dies (several may reach the moment at once).
        try:
            fd = os.open(
                os.path.join(os.environ["HF_DCP_TEST_JOB_DIR"], "fired"),
                os.O_CREAT | os.O_EXCL | os.O_WRONLY,
            )
        except FileExistsError:
            return False
        os.write(
            fd, repr(time.time()).encode()
        )  # when the kill came: the survivors' clock starts here
        os.close(fd)
        return True

    def before(owner: Any, name: str, when: Callable[..., bool]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs) and first_one():
                die()
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    def weights(w: Any) -> bool:
        return not str(w.checkpoint_id).rstrip("/").endswith("training_state")

    if moment == "planning":
        before(W, "prepare_global_plan", lambda w, plans: weights(w))
    elif moment == "record-written":
        original = W.prepare_global_plan

        def planned(w: Any, plans: Any) -> Any:
            out = original(w, plans)
            if weights(w) and first_one():
                die()
            return out

        W.prepare_global_plan = planned
    elif moment == "early-write":
        slabs = writer.item_slabs

        def first_slab_then_die(item: Any, planner: Any, host: Any, place: Any = None) -> Any:
            it = slabs(item, planner, host, place)
            yield next(it)  # the caller writes it before asking for more
            if rank == 1 and first_one():
                die()
            yield from it

        writer.item_slabs = first_slab_then_die
    elif moment == "late-write":
        # The writer builds the rank's record once the store has written every byte, then puts it.
        before(
            ranks, "rank_record", lambda save_id, r, items, *rest: rank == 1 and not _state(items)
        )
    elif moment == "finishing":
        before(
            ranks,
            "finish_tasks",
            lambda store, plan, *rest: not store.root.rstrip("/").endswith("training_state"),
        )
    elif moment == "completing":
        from hf_dcp_storage.stores.azure import AzureStore
        from hf_dcp_storage.stores.gcs import GcsStore
        from hf_dcp_storage.stores.s3 import S3Store

        # The coordinator assembles the files in parallel: one at a time here, so that exactly
        # one is assembled when the process dies and the others are still open.
        gate = threading.Lock()
        for store in (S3Store, GcsStore, AzureStore):
            assemble = store._assemble

            def first_assembled_then_die(
                self: Any, f: int, layout: Any, entries: Any, assemble: Any = assemble
            ) -> None:
                with gate:
                    assemble(self, f, layout, entries)
                    if "training_state" not in self.root and first_one():
                        die()

            store._assemble = first_assembled_then_die
    elif moment == "before-index":
        before(
            coordinator,
            "combine_checksums",
            lambda layout, results, tables: not any(k.startswith("state.") for k in layout.specs),
        )
    elif moment == "index-written":
        from hf_dcp_storage.stores.base import Store

        # The coordinator's step after the index: its staging records (or folder) removed.
        before(Store, "clear_staging", lambda store: "training_state" not in store.root)
    elif moment == "training-state":
        before(ranks, "rank_record", lambda save_id, r, items, *rest: rank == 1 and _state(items))
    elif moment == "before-commit":
        before(manager.CheckpointManager, "_commit", lambda m, s: True)
    elif moment == "pruning":
        remove_step = manager.remove_step

        def marker_then_die(fs: Any, root: str, s: int) -> None:
            if step is not None and s < step and first_one():
                from hf_dcp_storage.io import fsio as _fsio
                from hf_dcp_storage.steps.retention import COMMIT_MARKER, step_name

                _fsio.remove(fs, _fsio.join(root, step_name(s), COMMIT_MARKER))
                die()
            remove_step(fs, root, s)

        manager.remove_step = marker_then_die


def _state(items: Any) -> bool:
    """Whether write items are a training state's (the kill tests name its keys ``state.*``)."""
    return any(getattr(i.index, "fqn", "").startswith("state.") for i in items)
