"""Every DCP calling mode: process-based async saves, ``use_collectives=False``, and pickling.

DCP's ``AsyncCheckpointerType.PROCESS`` (what torchtitan's ``async_with_pinned_mem`` uses)
pickles the storage writer and planner into a background process of each rank and runs the save
there; the writer travels as its settings and path. Checked on 2 gloo ranks, on local disk,
``file://`` and S3 (moto): byte for byte what a synchronous save writes, tensors changed after
staging left out, the save's ``merge_stats`` in the ``Metadata`` it returns; and
``CheckpointManager(async_mode="process")``.
"""

from __future__ import annotations

import os
import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import (
    CheckpointManager,
    HFLoadPlanner,
    HFSavePlanner,
    HFStorageReader,
    HFStorageWriter,
    RetryPolicy,
)
from hf_dcp_storage.stores.base import MergeStats
from hf_dcp_storage.writer import MERGE_STATS_KEY
from tests.support.asyncsave import (
    LARGE,
    TENSORS,
    assert_same_checkpoints,
    original_tensors,
    train_step,
)
from tests.support.jobs import run_job

moto_only = pytest.mark.parametrize("s3_endpoint", ["moto"], indirect=True)
# The background process's own process group meets on a TCP store at MASTER_ADDR: loopback.
_ENV = {"MASTER_ADDR": "127.0.0.1"}


def _sharded(world: int, tensors: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        k: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for k, t in tensors.items()
    }


def _process_saves(rank: int, world: int, targets: list[tuple[str, dict | None]]) -> list[dict]:
    """For each target: a synchronous save to ``base/sync``, then a process-based async save to
    ``base/async`` through a ``DefaultStager`` (shared memory), the shards changed once staged."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = _sharded(world, original_tensors({**TENSORS, **LARGE}))
    stats = []
    for base, options in targets:
        dcp.save(sd, storage_writer=HFStorageWriter(f"{base}/sync", storage_options=options))
        cuda = torch.cuda.is_available()
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=True,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        try:
            fut = dcp.async_save(
                sd, storage_writer=HFStorageWriter(f"{base}/async", storage_options=options),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager,
            )  # fmt: skip
            train_step(sd)  # staged: the save must not see this
            metadata = getattr(fut, "upload_completion", fut).result(timeout=180)
        finally:
            stager.close()
        stats.append(metadata.storage_data[MERGE_STATS_KEY])
        sd = _sharded(
            world, original_tensors({**TENSORS, **LARGE})
        )  # back to the originals for the next target
    return stats


@pytest.mark.distributed
@moto_only
def test_process_based_async_saves_equal_sync_saves_everywhere(tmp_path, s3) -> None:
    bucket, options = s3
    targets = [
        (str(tmp_path / "local"), None),
        (f"file://{tmp_path}/file", None),
        (f"{bucket}/s3-{uuid.uuid4().hex[:6]}", options),
    ]
    stats = run_job(_process_saves, 2, targets, timeout=400, env=_ENV).check_returned()[0]
    originals = original_tensors({**TENSORS, **LARGE})
    for base, opts in targets:
        assert_same_checkpoints(f"{base}/async", f"{base}/sync", opts, originals)
    # Reported where the save ran, and handed back: on S3 the ranks sent parts of their own.
    s3_stats = stats[2]
    assert (
        s3_stats["total_bytes"] > 0 and s3_stats["rank_part_bytes"] > 0 and s3_stats["files"] >= 1
    ), s3_stats


def _manager_process_saves(rank: int, world: int, runs: tuple[str, str]) -> None:
    sync_run, async_run = runs
    originals = original_tensors({**TENSORS, **LARGE})
    state = {"opt": {"m": torch.arange(8.0)}, "epoch": 3}
    CheckpointManager(sync_run).save(
        1, _sharded(world, originals), {"opt": {"m": torch.arange(8.0)}, "epoch": 3}
    )
    sd = _sharded(world, originals)
    with CheckpointManager(async_run, async_mode="process") as manager:
        fut = manager.save(1, sd, state, async_save=True)
        train_step(sd)
        state["opt"]["m"] += 100  # after the call: not in the checkpoint either
        assert fut.result(timeout=180) == 1
        assert manager.latest() == 1


@pytest.mark.distributed
def test_checkpoint_manager_saves_in_a_background_process(tmp_path) -> None:
    sync_run, async_run = str(tmp_path / "sync"), str(tmp_path / "async")
    run_job(
        _manager_process_saves, 2, (sync_run, async_run), timeout=400, env=_ENV
    ).check_returned()
    from safetensors.torch import load_file

    for folder, expected in (
        ("step_1", original_tensors({**TENSORS, **LARGE})),
        ("step_1/training_state", {"opt.m": torch.arange(8.0)}),
    ):
        names = sorted(
            n
            for n in os.listdir(f"{sync_run}/{folder}")
            if n.endswith((".safetensors", ".index.json"))
        )
        assert names == sorted(
            n
            for n in os.listdir(f"{async_run}/{folder}")
            if n.endswith((".safetensors", ".index.json"))
        )
        for name in names:  # byte for byte the synchronous save's files
            assert (
                open(f"{async_run}/{folder}/{name}", "rb").read()
                == open(f"{sync_run}/{folder}/{name}", "rb").read()
            ), f"{folder}/{name}"
        saved = {
            k: v
            for n in names
            if n.endswith(".safetensors")
            for k, v in load_file(f"{async_run}/{folder}/{n}").items()
        }
        assert saved.keys() == expected.keys() and all(
            torch.equal(saved[k], v) for k, v in expected.items()
        )
    for rank in (0, 1):  # the non-tensor training state, as it was at the call
        assert (
            '"epoch": 3' in open(f"{async_run}/step_1/training_state/rank_{rank:05d}.json").read()
        )


def test_async_mode_is_validated() -> None:
    with pytest.raises(ValueError, match=r"async_mode='fork' must be 'thread' .* or 'process'"):
        CheckpointManager("/tmp/unused-run", async_mode="fork")


# -- pickling --------------------------------------------------------------------------------------


def _round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


def test_writers_readers_planners_and_policies_travel_as_their_settings(tmp_path) -> None:
    policy = RetryPolicy(max_attempts=3, base_delay=0.5)
    writer = _round_trip(
        HFStorageWriter(
            str(tmp_path / "a"),
            max_shard_size="1KB",
            retry=policy,
            rank_timeout=9.0,
            thread_count=2,
        )
    )
    assert (
        writer.checkpoint_id,
        writer.max_shard_bytes,
        writer.retry,
        writer.rank_timeout,
        writer.thread_count,
    ) == (str(tmp_path / "a"), 1000, policy, 9.0, 2)
    # What cannot travel is made anew: a store of its own, a fresh lock, no save in flight.
    assert writer.store is not None and writer.claim._holder is None and writer._host.pool is None
    reader = _round_trip(HFStorageReader(str(tmp_path / "a"), verify=True, retry=policy))
    assert (reader.checkpoint_id, reader.verify, reader.retry) == (
        str(tmp_path / "a"),
        True,
        policy,
    )
    stats = MergeStats()
    stats.add(10, 4, 1)
    again = _round_trip(stats)
    again.add(1, 0, 0)
    assert (again.files, again.total_bytes, again.client_bytes) == (2, 11, 4)
    saver, loader = (
        _round_trip(HFSavePlanner(save_dtype=torch.bfloat16)),
        _round_trip(HFLoadPlanner()),
    )
    # The travelled writer and planner save exactly what the originals save.
    sd = {"a": torch.arange(300.0), "b": torch.ones(4, 4)}
    dcp.save(sd, storage_writer=writer, planner=saver, no_dist=True)
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(str(tmp_path / "b"), max_shard_size="1KB"),
        planner=HFSavePlanner(save_dtype=torch.bfloat16),
        no_dist=True,
    )
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))
    for name in os.listdir(tmp_path / "b"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    dest = {"a": torch.zeros(300), "b": torch.zeros(4, 4)}
    dcp.load(dest, storage_reader=reader, planner=loader, no_dist=True)
    assert torch.equal(dest["a"], sd["a"].to(torch.bfloat16).float())


# -- use_collectives=False -------------------------------------------------------------------------


def _alone(rank: int, world: int, url: str) -> None:
    sd = _sharded(world, {"w0": torch.arange(64 * 32.0).reshape(64, 32)})
    dcp.save(sd, storage_writer=HFStorageWriter(url), use_collectives=False)


@pytest.mark.distributed
def test_saving_shards_without_collectives_is_refused_before_anything_is_written(tmp_path) -> None:
    result = run_job(_alone, 2, str(tmp_path / "ckpt"), timeout=120)
    for end in result.ranks:
        assert end.how == "raised", result
        assert (
            "cannot save this with dcp.save(..., use_collectives=False)" in end.error
            and "use_collectives=True (the default)" in end.error
        )
    assert not (tmp_path / "ckpt").exists()


def _load_alone(rank: int, world: int, url: str) -> None:
    dest = _sharded(world, {"w0": torch.zeros(64, 32)})
    dcp.load(dest, storage_reader=HFStorageReader(url))
    expected = _sharded(world, {"w0": torch.arange(64 * 32.0).reshape(64, 32)})["w0"].to_local()
    assert torch.equal(dest["w0"].to_local(), expected)


@pytest.mark.distributed
def test_whole_tensors_saved_without_collectives_load_resharded(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    # One process holding whole tensors needs no collective to plan exactly (dcp.load of torch
    # 2.13 has no use_collectives).
    dcp.save(
        {"w0": torch.arange(64 * 32.0).reshape(64, 32)},
        storage_writer=HFStorageWriter(url),
        use_collectives=False,
        no_dist=True,
    )
    run_job(_load_alone, 2, url, timeout=120).check_returned()
