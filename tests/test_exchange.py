"""Gathered parts over the ranks' own network (``plan/exchange.py``, ``stores/exchange.py``).

On S3 a rank's run under 5 MiB cannot be a part; it used to be staged in the store, read back
by the rank gathering its part and uploaded again. Now it goes to that rank over a gloo group of
the save's own, and every byte is uploaded once. Pure: each gathered byte has exactly one
sender, who sends it in the order the receiver places it. On S3 (moto and radosgw), counted
through a proxy: the requests of a save by kind, pinned; client bytes sent per checkpoint byte
≤ 1.02; the files byte-identical to a save on local disk; in sync, thread-async and
process-async saves; a denied upload of a gathered part fails every rank, none waits for it.
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks._synthetic_plans import LlamaConfig, Mesh, llama_shapes, rank_save_plan
from benchmarks.bench_scale import dcp_global_plan, object_local_plan, plan_ours
from hf_dcp_storage import HFSavePlanner, HFStorageReader, HFStorageWriter, RetryPolicy
from hf_dcp_storage.plan.exchange import part_tag, plan_sends
from hf_dcp_storage.plan.spread import GatherTasks
from hf_dcp_storage.stores.exchange import Held
from tests.support.data import assert_same, folder_bytes, random_tensor
from tests.support.dist import run_ranks

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from tests.support.faultproxy import Fault, FaultProxy, Record  # noqa: E402
from tests.support.storage_options import s3_storage_options  # noqa: E402

INDEX = "model.safetensors.index.json"
FAST_RETRY = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05, deadline=300)
# One layer of a 1B-class model: every rank's run of a weight is under 5 MiB over 8+ ranks.
SMALL_RUNS = LlamaConfig(layers=1, hidden=2048, intermediate=5632, kv_dim=256, vocab=32000)


# -- pure: who sends what -------------------------------------------------------------------------


def _tasks(mesh: Mesh) -> list[GatherTasks]:
    writer = HFStorageWriter("/nonexistent/unused", max_shard_size="64MB")
    plans = [
        object_local_plan(rank_save_plan(llama_shapes(SMALL_RUNS), mesh, r))
        for r in range(mesh.size)
    ]
    global_plan, _ = dcp_global_plan(plans, {})
    return [p.storage_data.tasks for p in plan_ours(writer, global_plan, "s3").rank_plans]


@pytest.mark.parametrize("mesh", [Mesh(8), Mesh(4, 2), Mesh(2, 4)], ids=str)
def test_every_gathered_byte_has_one_sender_who_sends_it_in_the_receivers_order(mesh) -> None:
    """For every gathered part and every rank holding bytes of it, the rows that rank sends are
    exactly the part's rows of that rank, in file order; the gathering rank sends itself
    nothing; each rank's messages go out in tag order (what keeps the exchange deadlock-free)."""
    tasks = _tasks(mesh)
    sends = plan_sends(tasks, mesh.size)
    sent: dict[tuple[int, int, int], list[list[int]]] = {}  # (src, dst, tag) -> rows
    for src, s in enumerate(sends):
        tags = [part_tag(f, n) for f, n in s.tasks.parts[:, :2].tolist()]
        assert tags == sorted(tags) and len(set(tags)) == len(tags), f"rank {src}: not in order"
        for i in range(len(s)):
            rows = s.tasks.task(i).ranges()
            assert len(rows) and set(rows[:, 1].tolist()) == {src}, (src, i)
            sent[(src, int(s.to[i]), tags[i])] = rows.tolist()
    wanted: dict[tuple[int, int, int], list[list[int]]] = {}
    for dst, mine in enumerate(tasks):
        for task in mine:
            rows = task.checked_ranges()  # also: they tile the part
            for src in set(rows[:, 1].tolist()) - {dst}:
                wanted[(src, dst, part_tag(task.file, task.number))] = rows[
                    rows[:, 1] == src
                ].tolist()
    assert sum(len(t) for t in tasks) > 0 and len(wanted) > mesh.size  # the case this is for
    assert sent.keys() == wanted.keys()
    assert all(sent[k] == wanted[k] for k in wanted)


def test_a_save_that_gathers_nothing_sends_nothing() -> None:
    empty = GatherTasks(
        np.empty((0, 4), dtype=np.int64),
        np.zeros(1, dtype=np.int64),
        np.empty((0, 4), dtype=np.int64),
        np.zeros(1, dtype=np.int64),
        np.empty((0, 3), dtype=np.int64),
        {},
        {},
        0,
    )
    assert [len(s) for s in plan_sends([empty, empty], 2)] == [0, 0]


def test_held_pieces_keep_views_of_tensors_and_copy_reused_buffers() -> None:
    """A rank's held bytes: a tensor read in place is held as a view of it (no copy: its memory
    is shared), a slab in a reusable buffer as a copy (the buffer changes after, the held bytes
    do not); any range of the stream reads back, across pieces too."""
    tensor = torch.arange(64, dtype=torch.uint8)
    reused = bytearray(b"abcdefgh")
    held = Held(64 + 8 + 16)
    held.keep(tensor.numpy().data[:64])
    held.write(reused)
    held.write(b"")  # an empty tensor's piece: nothing held, nothing breaks
    held.keep(tensor.numpy().data[16:32])
    reused[:] = b"XXXXXXXX"
    assert held.at == held.size == 88 and len(held.pieces) == 3
    assert np.shares_memory(np.frombuffer(held.pieces[0], np.uint8), tensor.numpy())
    expect = bytes(range(64)) + b"abcdefgh" + bytes(range(16, 32))
    for start, n in [(0, 88), (3, 5), (60, 10), (64, 8), (70, 12), (87, 1), (10, 0)]:
        assert bytes(held.view(start, n)) == expect[start : start + n], (start, n)
    assert np.shares_memory(np.frombuffer(held.view(3, 5), np.uint8), tensor.numpy())


# -- on S3, counted ---------------------------------------------------------------------------


def _state_dict() -> dict[str, torch.Tensor]:
    """~19 MiB in one file: six 3 MiB weights (1.5 MiB a rank: no rank's run is a part) with a
    bias after each, and a norm: every part is gathered, as at a thousand ranks."""
    sd: dict[str, torch.Tensor] = {}
    for i in range(6):
        sd[f"layers.{i}.weight"] = random_tensor((1024, 1536), torch.bfloat16, 10 + i)
        sd[f"layers.{i}.bias"] = random_tensor((1536,), torch.bfloat16, 20 + i)
    sd["norm.weight"] = random_tensor((1536,), torch.float32, 30)
    return sd


def _kind(r: Record) -> str:
    q = r.query
    if r.method == "PUT":
        return "UploadPart" if "partNumber=" in q else "PutObject"
    if r.method == "POST":
        if q.startswith("uploads") or q == "uploads=":
            return "CreateMultipartUpload"
        return "CompleteMultipartUpload" if "uploadId=" in q else f"POST {q}"
    if r.method == "GET":
        return "List" if ("list-type" in q or "prefix=" in q or "uploads" in q) else "GetObject"
    return r.method


@pytest.fixture
def proxied(
    s3_proxy: FaultProxy, s3_endpoint: str
) -> Iterator[tuple[FaultProxy, str, dict, object]]:
    direct = s3fs.S3FileSystem(**s3_storage_options(s3_endpoint))
    bucket = f"hf-dcp-exchange-{uuid.uuid4().hex[:16]}"
    direct.mkdir(bucket)
    s3_proxy.clear()
    options = {
        **s3_storage_options(s3_proxy.endpoint),
        "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
    }
    yield s3_proxy, f"s3://{bucket}", options, direct
    s3_proxy.clear()
    assert s3_proxy.errors == []
    direct.rm(bucket, recursive=True)


def _save(rank: int, world: int, url: str, options: dict, local: str, mode: str, out: str) -> None:
    """Every rank saves the sharded state dict to ``url`` (``mode``: sync, thread or process
    async, or thread async with a background stager), then to local disk; rank 0 writes the
    save's merge stats to ``out``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)
        for k, v in _state_dict().items()
    }
    writer = HFStorageWriter(url, storage_options=options, retry=FAST_RETRY, thread_count=2)
    # "cast": every tensor saved as float32, so every slab is a copy in a reusable host buffer
    # (held copied), where the other modes hold views of the tensors themselves.
    planner = HFSavePlanner(save_dtype=torch.float32) if mode == "cast" else None
    if mode in ("sync", "cast"):
        meta = dcp.save(sd, storage_writer=writer, planner=planner)
    elif mode == "stager":
        stager = DefaultStager(StagingOptions(False, False, True, False))
        try:
            response = dcp.async_save(sd, storage_writer=writer, async_stager=stager)
            meta = response.upload_completion.result()
        finally:
            stager.close()
    else:
        kind = AsyncCheckpointerType.THREAD if mode == "thread" else AsyncCheckpointerType.PROCESS
        meta = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind).result()
    stats = meta.storage_data["hf_dcp_storage.merge_stats"]
    dist.barrier()
    if rank == 0 and mode == "sync":  # the save's group left no key on the job's store
        store = dist.distributed_c10d._get_default_store()
        keys = [f"hf_dcp_storage/group/{writer._save_id}/0/{r}" for r in range(world)]
        stats["group_keys_left"] = [k for k in keys if store.check([k])]
    if rank == 0:
        Path(out).write_text(json.dumps(stats))
    planner = HFSavePlanner(save_dtype=torch.float32) if mode == "cast" else None
    dcp.save(sd, storage_writer=HFStorageWriter(local), planner=planner)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sync", "cast", "thread", "process", "stager"])
def test_small_runs_go_over_the_ranks_network_and_every_byte_is_uploaded_once(
    proxied, tmp_path, mode
) -> None:
    proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    out = tmp_path / "stats.json"
    run_ranks(_save, 2, url, options, str(tmp_path / "local"), mode, str(out))
    stats = json.loads(out.read_text())
    files = folder_bytes(tmp_path / "local")
    root = url.removeprefix("s3://")
    assert {p.removeprefix(root + "/"): direct.cat_file(p) for p in direct.find(root)} == files
    weights = sum(len(b) for n, b in files.items() if n.endswith(".safetensors"))
    # Every part gathered, each over the ranks' network; nothing staged, nothing read back.
    assert stats["client_bytes"] == 0 and stats["network_bytes"] > 0.9 * weights, stats
    assert 0 < stats["held_bytes"] <= weights, stats
    assert stats.get("group_keys_left", []) == [], stats
    save = list(proxy.requests)  # the save to S3 only: the one to local disk does not pass it
    kinds = collections.Counter(_kind(r) for r in save)
    assert not [r.path for r in save if ".rank0000" in r.path and "staging" in r.path]
    sent = sum(len(r.body) for r in save)
    # The records (save plan, two rank records, completion) and the index are a few KiB.
    assert sent <= 1.02 * weights, f"clients sent {sent} B for {weights} B of files"
    # One file of ~19 MiB, every part gathered and at least 5 MiB (S3's least); one multipart
    # upload; five small PUTs (save.json, rank00000.json, rank00001.json, the completion record,
    # the index); two listings (the folder before writing, the open uploads a killed save may
    # have left); one batched delete of the four records, by name. No GET, no HEAD.
    assert dict(kinds) == {
        "List": 2,
        "CreateMultipartUpload": 1,
        "UploadPart": weights // (5 << 20),
        "CompleteMultipartUpload": 1,
        "PutObject": 5,
        "POST delete": 1,
    }, kinds


def _save_denied(rank: int, world: int, url: str, options: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)
        for k, v in _state_dict().items()
    }
    # A long rank timeout: a rank left waiting on the failed one would hang the test for it.
    writer = HFStorageWriter(url, storage_options=options, retry=FAST_RETRY, rank_timeout=600)
    try:
        dcp.save(sd, storage_writer=writer)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        assert "AccessDenied" in repr(exc), repr(exc)
        assert "Timed out" not in repr(exc), repr(exc)
    else:
        raise AssertionError(f"rank {rank}: the save succeeded although a part was denied")


@pytest.mark.distributed
def test_a_denied_gathered_part_fails_every_rank_and_no_rank_waits_for_it(proxied) -> None:
    """The upload of one gathered part is refused: the rank gathering it goes on taking part in
    the exchange without uploading, so the other rank finishes its sends, and both fail with the
    store's error (DCP gathers every rank's result); no index, no open upload."""
    proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    fault = proxy.add_fault(Fault("403", method="PUT", query_has="partNumber=2", times=None))
    run_ranks(_save_denied, 2, url, options)
    assert fault.fired >= 1
    root = url.removeprefix("s3://")
    assert INDEX not in [p.rsplit("/", 1)[-1] for p in direct.find(root)]
    assert direct.list_multipart_uploads(bucket.removeprefix("s3://")) == []
    proxy.clear()
    run_ranks(_save_then_load, 2, url, options)


def _save_then_load(rank: int, world: int, url: str, options: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _state_dict()
    sd = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options))
    dest = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(dest, storage_reader=HFStorageReader(url, storage_options=options), no_dist=True)
    for k, v in full.items():
        assert_same(dest[k], v, k)
