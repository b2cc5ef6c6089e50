"""A rank that dies before the ranks meet: the others stop waiting after ``rank_timeout``.

On object stores the ranks of a save meet on the job's key-value store once they have staged
their bytes (``session/meeting.py``). A rank killed before it arrives never arrives; the others must
fail within about ``rank_timeout`` seconds, naming it, and commit nothing. A rank that is only
slow keeps beating and is waited for.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.format.index import INDEX_NAME
from tests.support.jobs import kill_self, run_job


class _DiesWhileWriting(HFStorageWriter):
    """Rank ``victim`` SIGKILLs itself when it starts writing its own bytes."""

    victim = 1
    stall = 0.0

    def _write_own(self, items, rank_plan, planner):  # type: ignore[no-untyped-def]
        if rank_plan.rank == self.victim:
            if self.stall:
                time.sleep(self.stall)
            else:
                kill_self()
        return super()._write_own(items, rank_plan, planner)


def _state(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    full = {"a": torch.randn(64, 16, generator=g), "b": torch.randn(33, generator=g)}
    return {
        k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()
    }, full


def _save_with_victim(
    rank: int, world: int, url: str, victim: int, stall: float, timeout: float
) -> float:
    writer = _DiesWhileWriting(url, direct_write=False, rank_timeout=timeout)
    writer.victim, writer.stall = victim, stall
    sd, _ = _state(rank, world)
    started = time.monotonic()
    dcp.save(sd, storage_writer=writer)
    return time.monotonic() - started


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [1, 0], ids=["a-rank-dies", "the-coordinator-dies"])
def test_survivors_fail_soon_naming_the_dead_rank_and_commit_nothing(tmp_path, victim: int) -> None:
    url = f"file://{tmp_path}/ckpt"
    result = run_job(_save_with_victim, 2, url, victim, 0.0, 2.0, timeout=90)
    dead, survivor = result.ranks[victim], result.ranks[1 - victim]
    assert dead.how == "killed", result
    assert survivor.how == "raised", result
    # Bounded by rank_timeout (2 s) plus the save's own work, far from the store's 30 minutes.
    assert survivor.seconds < 45, survivor
    # Its own error, or, when DCP's next collective fails first on the dead peer, its log says why.
    said = f"ranks [{victim}] of 2 stopped answering for 2 s"
    assert said in survivor.error or said in survivor.log, (survivor.error, survivor.log)
    assert not os.path.exists(tmp_path / "ckpt" / INDEX_NAME)


@pytest.mark.distributed
def test_a_slow_rank_keeps_beating_and_is_waited_for(tmp_path) -> None:
    # The victim stalls 5 s, longer than rank_timeout (2 s): its beat (every 0.2 s, from a thread
    # of its own) goes on, the save succeeds. 2 s is 10 missed beats: a margin for a loaded machine.
    url = f"file://{tmp_path}/ckpt"
    result = run_job(_save_with_victim, 2, url, 1, 5.0, 2.0, timeout=90)
    result.check_returned()
    loaded = {"a": torch.zeros(64, 16), "b": torch.zeros(33)}
    dcp.load(loaded, storage_reader=HFStorageReader(url), no_dist=True)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(loaded["a"], torch.randn(64, 16, generator=g)) and torch.equal(
        loaded["b"], torch.randn(33, generator=g)
    )


def test_rank_timeout_is_validated() -> None:
    for bad in (0, -1, "5", True, float("nan")):
        with pytest.raises(ValueError, match=r"rank_timeout=.* must be a number of seconds > 0"):
            HFStorageWriter("/tmp/x", rank_timeout=bad)
