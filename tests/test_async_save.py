"""``dcp.async_save`` through ``HFStorageWriter`` on every backend (issue 6, async save).

The contract tested here: the call returns once the tensors are staged (copied); the write runs
in the background; what it writes is byte for byte what a synchronous ``dcp.save`` of the same
state dict writes (every file, the index included); tensors changed by training after the call
(after staging completed, where the API reports staging separately) do not reach the checkpoint;
an error of the background write comes out of the future and leaves an existing checkpoint as it
was.

Making "the change happened before the write" deterministic, without sleeps:

* one process: the save runs with a real ``DefaultSavePlanner`` (the one ``dcp.save`` uses by
  default) whose local planning, in the save's background thread, first waits for an event the
  test sets only after it has changed every tensor. The writer therefore reads the tensors
  strictly after the change: a save that skipped staging would write the changed values and
  fail the byte comparison.
* two ranks: rank 1 calls ``async_save`` only after a barrier that rank 0 reaches after changing
  its tensors, and rank 0's background save cannot get past planning (a gather of every rank's
  plan on the save's own process group) before rank 1 has joined it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from hf_dcp_storage import HFStorageWriter
from tests.support.asyncsave import (
    LARGE,
    TENSORS,
    assert_same_checkpoints,
    checkpoint_files,
    original_tensors,
    train_step,
)
from tests.support.checks import raises_in_checkpoint
from tests.support.data import same
from tests.support.dist import run_ranks

# Upper bound on any wait: a broken save fails the test instead of hanging it.
WAIT_S = 60.0

moto_only = pytest.mark.parametrize("s3_endpoint", ["moto"], indirect=True)


# -- helpers -----------------------------------------------------------------------------------


class _GatedPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose local planning waits for ``gate``.

    ``create_local_plan`` runs in the save's background thread before any byte is written, so
    while the gate is closed the write has certainly not started (and its future is not done).
    """

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def create_local_plan(self) -> SavePlan:
        if not self.gate.wait(WAIT_S):
            raise TimeoutError(f"the test did not open the gate within {WAIT_S} s")
        return super().create_local_plan()


def _stager(staging: str) -> DefaultStager | None:
    """``blocking``: async_save's own default (the copy is made inside the call); ``background``:
    the copy is made by a staging thread and reported by
    ``AsyncSaveResponse.staging_completion``."""
    if staging == "blocking":
        return None
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )


def _completions(response: Any) -> tuple[concurrent.futures.Future, concurrent.futures.Future]:
    """(staging done, write done) of an ``async_save`` result, whichever form it took."""
    if isinstance(response, AsyncSaveResponse):
        return response.staging_completion, response.upload_completion
    staged: concurrent.futures.Future = concurrent.futures.Future()
    staged.set_result(None)  # a plain future: the call itself staged the state dict
    return staged, response


# -- one process: every backend ------------------------------------------------------------------


def _check_async_equals_sync(base: str, options: dict | None, staging: str) -> None:
    sync_url, async_url = f"{base}/sync", f"{base}/async"
    originals = original_tensors(TENSORS)
    sd = {key: t.clone() for key, t in originals.items()}
    dcp.save(sd, storage_writer=HFStorageWriter(sync_url, storage_options=options))

    gate = threading.Event()
    stager = _stager(staging)
    try:
        response = dcp.async_save(
            sd,
            storage_writer=HFStorageWriter(async_url, storage_options=options),
            planner=_GatedPlanner(gate),
            async_stager=stager,
        )
        assert isinstance(response, AsyncSaveResponse) == (staging == "background")
        staged, written = _completions(response)
        staged.result(timeout=WAIT_S)  # from here on training may change the tensors
        assert not written.done(), "the write finished while its planner was still waiting"
        train_step(sd)
        gate.set()
        written.result(timeout=WAIT_S)
    finally:
        gate.set()  # never leave the background thread waiting on a failed test
        if stager is not None:
            stager.close()  # a stager passed in is the caller's to close
    for key, original in originals.items():
        assert not same(sd[key], original), f"{key}: the training step did not change it"
    assert_same_checkpoints(async_url, sync_url, options, originals)


@pytest.mark.parametrize("staging", ["blocking", "background"])
def test_async_save_equals_sync_save_and_ignores_later_changes(url: str, staging: str) -> None:
    _check_async_equals_sync(url, None, staging)


@pytest.mark.parametrize("staging", ["blocking", "background"])
def test_async_save_equals_sync_save_and_ignores_later_changes_on_s3(
    s3: tuple[str, dict], staging: str
) -> None:
    bucket, options = s3
    _check_async_equals_sync(f"{bucket}/run", options, staging)


def _check_failed_write(url: str, options: dict | None) -> None:
    originals = original_tensors(TENSORS)
    dcp.save(originals, storage_writer=HFStorageWriter(url, storage_options=options))
    before = checkpoint_files(url, options)
    changed = {key: t.clone() for key, t in originals.items()}
    train_step(changed)
    fut = dcp.async_save(changed, storage_writer=HFStorageWriter(url, storage_options=options))
    # The refusal happens in the background thread (the coordinator's prepare_global_plan).
    with raises_in_checkpoint(FileExistsError, "already holds a complete checkpoint"):
        fut.result(timeout=WAIT_S)
    assert checkpoint_files(url, options) == before, (
        "the refused save changed the existing checkpoint"
    )


def test_failed_background_write_raises_from_the_future_and_keeps_the_checkpoint(url: str) -> None:
    _check_failed_write(url, None)


def test_failed_background_write_raises_from_the_future_and_keeps_the_checkpoint_on_s3(
    s3: tuple[str, dict],
) -> None:
    bucket, options = s3
    _check_failed_write(f"{bucket}/run", options)


# -- two gloo ranks, DTensor Shard(0) --------------------------------------------------------------


def _two_ranks(rank: int, world: int, base: str, options: dict | None) -> None:
    """Sync save to ``base/sync``, then async save to ``base/async`` on an extra gloo group (as
    ``CheckpointManager`` does), changing every local shard right after the call returns."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    # src_data_rank=None: every rank builds the same full tensor, so no scatter is needed.
    sd = {
        k: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
        for k, t in original_tensors({**TENSORS, **LARGE}).items()
    }
    dcp.save(sd, storage_writer=HFStorageWriter(f"{base}/sync", storage_options=options))
    # Background collectives must not share a group with the training loop's collectives.
    group = dist.new_group(backend="gloo")
    if rank == 1:
        dist.barrier()  # joins the save only after rank 0 has changed its shards
    fut = dcp.async_save(
        sd,
        storage_writer=HFStorageWriter(f"{base}/async", storage_options=options),
        process_group=group,
    )
    if rank == 0:
        # Deterministic: rank 0's save is stuck in planning until rank 1 calls async_save,
        # which it does only after the barrier below, i.e. after this rank's change.
        assert not fut.done(), "rank 0's save finished before rank 1 joined it"
    train_step(sd)
    if rank == 0:
        dist.barrier()
    fut.result(timeout=WAIT_S)
    dist.destroy_process_group(group)


@pytest.mark.distributed
def test_two_ranks_async_save_equals_sync_save_local(tmp_path) -> None:
    base = str(tmp_path / "run")
    run_ranks(_two_ranks, 2, base, None)
    assert_same_checkpoints(
        f"{base}/async", f"{base}/sync", None, original_tensors({**TENSORS, **LARGE})
    )


@pytest.mark.distributed
@moto_only
def test_two_ranks_async_save_equals_sync_save_on_s3(s3: tuple[str, dict]) -> None:
    bucket, options = s3
    base = f"{bucket}/run"
    run_ranks(_two_ranks, 2, base, options)
    assert_same_checkpoints(
        f"{base}/async", f"{base}/sync", options, original_tensors({**TENSORS, **LARGE})
    )


def test_a_writer_already_saving_refuses_a_second_save(tmp_path) -> None:
    """Two saves in flight on one writer would share its path and plan (one save's bytes landing
    in the other's folder): the second is refused, the first completes untouched."""
    originals = original_tensors(TENSORS)
    writer = HFStorageWriter(tmp_path / "one")
    gate = threading.Event()
    try:
        first = dcp.async_save(originals, storage_writer=writer, planner=_GatedPlanner(gate))
        assert not first.done()  # held in planning: the writer is in use
        refusal = "still saving .*one.* pass a new HFStorageWriter to each save"
        # Elsewhere: refused by reset(), which DCP calls before its error wrapping.
        with pytest.raises(RuntimeError, match=refusal):
            dcp.async_save(originals, storage_writer=writer, checkpoint_id=tmp_path / "two").result(
                timeout=WAIT_S
            )
        # To the same path (no reset): refused when the save sets the writer up.
        with raises_in_checkpoint(RuntimeError, refusal):
            dcp.async_save(originals, storage_writer=writer).result(timeout=WAIT_S)
        gate.set()
        first.result(timeout=WAIT_S)
    finally:
        gate.set()
    dcp.save(originals, storage_writer=HFStorageWriter(tmp_path / "sync"))
    assert_same_checkpoints(str(tmp_path / "one"), str(tmp_path / "sync"), None, originals)
    assert not (tmp_path / "two").exists()
    # Once the save is over the writer takes the next one.
    dcp.save(originals, storage_writer=writer, checkpoint_id=tmp_path / "three")
    assert_same_checkpoints(str(tmp_path / "three"), str(tmp_path / "sync"), None, originals)
