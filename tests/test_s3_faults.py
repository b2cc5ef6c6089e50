"""S3 under faults: a pure-Python proxy (``tests/support/faultproxy.py``) between s3fs and the moto
server.

botocore's own retries are switched off here (``total_max_attempts: 1``) so that every retry
these tests see is the library's ``RetryPolicy``: transient faults (503 SlowDown, 500, resets,
truncated bodies, latency) are ridden out with identical bytes; permanent ones (403) fail fast
on every rank, leave no index and no unfinished multipart upload on the server.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from safetensors.torch import load as st_load  # noqa: E402

from hf_dcp_storage import HFStorageReader, HFStorageWriter, RetryPolicy  # noqa: E402
from hf_dcp_storage.plan.reads import REQUEST_BYTES  # noqa: E402
from tests.support.checks import raises_in_checkpoint  # noqa: E402
from tests.support.data import assert_same, folder_bytes, random_tensor  # noqa: E402
from tests.support.dist import run_ranks  # noqa: E402
from tests.support.faultproxy import Fault, FaultProxy  # noqa: E402
from tests.support.storage_options import s3_storage_options  # noqa: E402

INDEX = "model.safetensors.index.json"
# The deadline only bounds a broken retry loop: attempts end these tests' retries, and a deadline
# near the time the attempts take would end them earlier on a loaded machine.
FAST_RETRY = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05, deadline=300)


def _options(endpoint: str) -> dict:
    """s3fs options through ``endpoint`` with botocore's retries off: only ours remain."""
    return {
        **s3_storage_options(endpoint),
        "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
    }


@pytest.fixture
def proxied(
    s3_proxy: FaultProxy, s3_endpoint: str
) -> Iterator[tuple[FaultProxy, str, dict, s3fs.S3FileSystem]]:
    """``(proxy, s3://bucket, options through the proxy, s3fs straight to moto)``, fresh bucket."""
    direct = s3fs.S3FileSystem(**s3_storage_options(s3_endpoint))
    bucket = f"hf-dcp-fault-{uuid.uuid4().hex[:16]}"
    direct.mkdir(bucket)
    s3_proxy.clear()
    yield s3_proxy, f"s3://{bucket}", _options(s3_proxy.endpoint), direct
    s3_proxy.clear()
    assert s3_proxy.errors == []
    direct.rm(bucket, recursive=True)


def _state_dict() -> dict[str, torch.Tensor]:
    # 12 MiB + small tensors in one file: a multipart staged object, copy parts and a gathered part.
    return {
        "big": random_tensor((3072, 1024), torch.float32, 1),
        "norm": random_tensor((1024,), torch.bfloat16, 2),
        "head": random_tensor((64, 1024), torch.float32, 3),
    }


def _objects(direct: s3fs.S3FileSystem, url: str) -> dict[str, bytes]:
    root = direct._strip_protocol(url)
    return {posixpath.relpath(p, root): direct.cat_file(p) for p in direct.find(root)}


def _unfinished_uploads(direct: s3fs.S3FileSystem, bucket_url: str) -> list:
    return direct.list_multipart_uploads(bucket_url.removeprefix("s3://"))


def _save_to_s3_and_disk(
    rank: int, world: int, url: str, options: dict, local: str, gather: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)
        for k, v in _state_dict().items()
    }
    writer = HFStorageWriter(
        url,
        storage_options=options,
        retry=FAST_RETRY,
        thread_count=2,
        gather_memory="1GB" if gather == "network" else 0,
    )
    dcp.save(sd, storage_writer=writer)
    if rank == 0:  # a rank gathered the two ranks' small runs into one part
        stats = writer.merge_stats
        network, store = stats.network_bytes, stats.client_bytes
        assert stats.rank_part_bytes > 0 and (network, store).count(0) == 1, stats
        assert (network > 0) == (gather == "network"), stats
    dcp.save(sd, storage_writer=HFStorageWriter(local))


@pytest.mark.distributed
@pytest.mark.parametrize("gather", ["network", "store"])
def test_transient_faults_on_every_request_kind_are_retried(proxied, tmp_path, gather) -> None:
    """Two ranks save through faults on each kind of request (their parts, their staged objects
    and the gathering reads of them where small runs are staged in the store, creating and
    completing uploads, the commit), then one process loads through faults on its reads:
    identical bytes, every fault fired."""
    proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    sd = _state_dict()
    faults = [
        # The upload completes upstream but its answer is cut short, and the retry is told the
        # upload is gone (as S3 may say once it completed): the object is there, so it is done.
        proxy.add_fault(Fault("truncate", method="POST", query_has="uploadId", times=1)),
        proxy.add_fault(Fault("404", method="POST", query_has="uploadId", times=1)),
        proxy.add_fault(
            Fault("503", method="PUT", query_has="partNumber", times=2)
        ),  # a rank's part
        proxy.add_fault(Fault("500", method="PUT", path=r"\.rank\d+$", times=1)),  # a staged object
        proxy.add_fault(
            Fault("reset", method="GET", path=r"\.rank\d+$", times=2)
        ),  # gathering staged runs
        proxy.add_fault(Fault("truncate", method="GET", path=r"\.rank\d+$", times=1)),
        proxy.add_fault(
            Fault("latency", method="POST", seconds=0.3, times=2)
        ),  # create/complete uploads
        proxy.add_fault(Fault("503", method="PUT", path=INDEX, times=1)),  # the commit
    ]
    local = tmp_path / "local"
    run_ranks(_save_to_s3_and_disk, 2, url, options, str(local), gather)
    staged = 1 if gather == "store" else 0  # over the ranks' network nothing is staged
    assert [f.fired for f in faults] == [1, 1, 2, staged, 2 * staged, staged, 2, 1]
    # Identical to the same save on local disk (positioned writes, no faults).
    assert _objects(direct, url) == folder_bytes(local)
    assert _unfinished_uploads(direct, bucket) == []

    proxy.clear()
    # One after another on the first GETs (the header probe, then data): five failed attempts.
    load_faults = [
        proxy.add_fault(Fault("503", method="GET", path=r"safetensors$", times=2)),
        proxy.add_fault(Fault("reset", method="GET", path=r"safetensors$", times=1)),
        proxy.add_fault(Fault("truncate", method="GET", path=r"safetensors$", times=2)),
    ]
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(
        out,
        storage_reader=HFStorageReader(url, storage_options=options, retry=FAST_RETRY, verify=True),
    )
    assert [f.fired for f in load_faults] == [2, 1, 2]
    for k, v in sd.items():
        assert_same(out[k], v, k)


def test_a_persistent_503_fails_after_the_policy_with_no_index_and_no_upload(proxied) -> None:
    proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    # One process, one 12 MiB file: the rank PUTs it whole, and every attempt gets a 503.
    fault = proxy.add_fault(Fault("503", method="PUT", path=r"safetensors$", times=None))
    with raises_in_checkpoint(
        OSError,
        r"PUT s3://.*/run/step_1/model-00001-of-00001\.safetensors failed after 6 attempt\(s\)",
    ):
        dcp.save(
            _state_dict(),
            storage_writer=HFStorageWriter(url, storage_options=options, retry=FAST_RETRY),
        )
    assert fault.fired >= 6  # counted, not timed
    assert INDEX not in _objects(direct, url)
    assert _unfinished_uploads(direct, bucket) == []


def test_access_denied_fails_at_once_naming_operation_and_url(proxied) -> None:
    proxy, bucket, options, _direct = proxied
    url = f"{bucket}/run/step_1"
    dcp.save(_state_dict(), storage_writer=HFStorageWriter(url, storage_options=options))
    fault = proxy.add_fault(Fault("403", method="GET", path=r"safetensors$", times=None))
    # The index records the file's header, so the first GET of the file is a read of its data.
    with raises_in_checkpoint(
        PermissionError,
        r"GET bytes \d+-\d+ of s3://.*/model-00001-of-00001\.safetensors failed: "
        r".*AccessDenied.*\(not retried: the error is permanent\)",
    ):
        dcp.load(
            {k: torch.zeros_like(v) for k, v in _state_dict().items()},
            storage_reader=HFStorageReader(
                url,
                storage_options=options,
                retry=RetryPolicy(max_attempts=10, base_delay=1.0),
                thread_count=1,
            ),
        )
    assert fault.fired == 1  # one reading thread: its one GET, never repeated (counted, not timed)


def _save_on_ranks(rank: int, world: int, url: str, options: dict, expect_failure: bool) -> None:
    """Every rank saves; its small runs staged in the store (what the denial hits)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)
        for k, v in _state_dict().items()
    }
    writer = HFStorageWriter(url, storage_options=options, retry=FAST_RETRY, gather_memory=0)
    if not expect_failure:
        dcp.save(sd, storage_writer=writer)
        return
    try:
        dcp.save(sd, storage_writer=writer)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        assert "AccessDenied" in repr(exc) and "rank00001" in repr(exc), repr(exc)
    else:
        raise AssertionError(
            f"rank {rank}: the save succeeded although rank 1's uploads were denied"
        )


def _read_state_dict() -> dict[str, torch.Tensor]:
    # Few, short GETs on purpose: moto copies the whole object on every GET.
    return {
        "narrow": random_tensor(
            (96, 512), torch.float32, 4
        ),  # 1 KiB row halves: one request per rank
        "wide": random_tensor(
            (2, 2**20), torch.float32, 5
        ),  # 2 MiB row halves and gaps: gaps skipped
        "norm": random_tensor((512,), torch.bfloat16, 6),
    }


def _load_on_ranks(rank: int, world: int, url: str, options: dict, dim: int) -> None:
    """Load every tensor sharded along ``dim`` (1-D tensors along 0) and check this rank's part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _read_state_dict()
    dest = {
        k: distribute_tensor(
            torch.zeros_like(v), mesh, [Shard(min(dim, v.dim() - 1))], src_data_rank=None
        )
        for k, v in full.items()
    }
    dcp.load(dest, storage_reader=HFStorageReader(url, storage_options=options))
    for k, v in full.items():
        assert_same(dest[k].to_local(), v.chunk(world, dim=min(dim, v.dim() - 1))[rank], k)


@pytest.mark.distributed
def test_denied_uploads_on_one_rank_fail_the_save_on_every_rank(proxied) -> None:
    proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    fault = proxy.add_fault(Fault("403", method="PUT", path=r"\.rank00001$", times=None))
    run_ranks(_save_on_ranks, 2, url, options, True)
    assert fault.fired >= 1
    assert INDEX not in _objects(direct, url)
    assert _unfinished_uploads(direct, bucket) == []
    # The next save to the same place succeeds and clears what the failed one left.
    proxy.clear()
    run_ranks(_save_on_ranks, 2, url, options, False)
    assert sorted(_objects(direct, url)) == ["model-00001-of-00001.safetensors", INDEX]


def _save_two_files(rank: int, world: int, url: str, options: dict) -> None:
    """Two 40 MiB tensors that every rank holds: one rank writes each, into a file of its own
    (three parts, one multipart upload per file); rank 1's part uploads are denied."""
    tensors = {
        k: random_tensor((10240, 1024), torch.float32, seed) for k, seed in (("a", 7), ("b", 8))
    }
    try:
        dcp.save(
            tensors,
            storage_writer=HFStorageWriter(
                url, storage_options=options, retry=FAST_RETRY, max_shard_size="42MB"
            ),
        )
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        assert "AccessDenied" in repr(exc), repr(exc)
    else:
        raise AssertionError(
            f"rank {rank}: the save succeeded although rank 1's part uploads were denied"
        )


@pytest.mark.distributed
def test_a_failing_rank_aborts_the_uploads_of_files_it_had_no_part_in(proxied) -> None:
    """A rank's plan names only the uploads it sends parts to; when it fails it aborts the
    others too (from the save record), so no upload of the failed save is left open."""
    proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    fault = proxy.add_fault(
        Fault(
            "403",
            method="PUT",
            path=r"model-00002-of-00002\.safetensors$",
            query_has="partNumber",
            times=None,
        )
    )
    run_ranks(_save_two_files, 2, url, options)
    assert fault.fired >= 1
    uploads = [
        r
        for r in proxy.requests
        if r.method == "POST" and "uploads" in r.query and r.path.endswith(".safetensors")
    ]
    assert len(uploads) == 2  # one multipart upload per file, each filled by one rank
    assert INDEX not in _objects(direct, url)
    assert _unfinished_uploads(direct, bucket) == []


def _data_gets(proxy: FaultProxy) -> tuple[list, int, int]:
    """``(data GETs, data bytes, header-probe bytes)`` the proxy saw for shard files."""
    gets = [r for r in proxy.requests if r.method == "GET" and r.path.endswith(".safetensors")]
    probes = [r for r in gets if r.headers.get("range", "").startswith("bytes=0-")]
    data = [r for r in gets if r not in probes]
    return data, sum(r.response_bytes for r in data), sum(r.response_bytes for r in probes)


@pytest.mark.distributed
def test_resharded_loads_fetch_what_they_need_in_few_requests(proxied) -> None:
    """A one-process save loaded on two ranks, counted by the proxy. A rank's byte runs of a file
    are joined across tensors where the gap is small (``plan/reads.plan_requests``): reading a
    gap of up to ``READ_GAP_BYTES`` costs less than one more request. Row shards: one request
    per rank and file. Column shards: 2 MiB row halves are fetched alone (their 2 MiB gaps
    skipped), 1 KiB halves in one request per rank (reading the gaps costs less than ~100 more
    requests)."""
    proxy, bucket, options, _direct = proxied
    url = f"{bucket}/run/step_1"
    sd = _read_state_dict()
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options))
    nbytes = {k: v.numel() * v.element_size() for k, v in sd.items()}
    needed = sum(nbytes.values())

    proxy.clear()
    run_ranks(_load_on_ranks, 2, url, options, 0)
    data, data_bytes, probe_bytes = _data_gets(proxy)
    # Per rank: at most its file, its bytes over the request size, and one more.
    assert len(data) <= 2 * (1 + -(-(needed // 2) // REQUEST_BYTES) + 1)
    # The gaps read are the other rank's half of narrow (96 KiB): never its 4 MiB half of wide.
    assert needed <= data_bytes < needed + nbytes["wide"] // 2
    assert probe_bytes <= 2 * 64 * 1024  # one small header probe per rank, not the file

    proxy.clear()
    run_ranks(_load_on_ranks, 2, url, options, 1)
    data, data_bytes, _ = _data_gets(proxy)
    # narrow's 1 KiB gaps (and those between tensors) are read; wide's 2 MiB gaps never.
    assert needed <= data_bytes < needed + 2 * 2**20
    assert len(data) <= 2 * (1 + 2 + 1)  # per rank: narrow, wide's two rows, norm


def _many_tensors() -> dict[str, torch.Tensor]:
    # The MoE-like case: many small tensors (16 KiB each, 6.4 MB in all), in two files.
    return {f"experts.{i}.w": random_tensor((64, 64), torch.float32, 100 + i) for i in range(400)}


def _load_many(rank: int, world: int, url: str, options: dict, cast: bool, out: str) -> None:
    """Load ``_many_tensors`` row-sharded (into bfloat16 when ``cast``: through host memory),
    check this rank's part, and write what ``load_stats`` counted to ``out.<rank>``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _many_tensors()
    dtype = torch.bfloat16 if cast else torch.float32
    dest = {
        k: distribute_tensor(torch.zeros_like(v, dtype=dtype), mesh, [Shard(0)], src_data_rank=None)
        for k, v in full.items()
    }
    reader = HFStorageReader(url, storage_options=options)
    dcp.load(dest, storage_reader=reader)
    for k, v in full.items():
        assert_same(dest[k].to_local(), v.to(dtype).chunk(world)[rank], k)
    Path(f"{out}.{rank}").write_text(json.dumps(dataclasses.asdict(reader.load_stats)))


@pytest.mark.distributed
@pytest.mark.parametrize("cast", [False, True], ids=["in-place", "through-host-memory"])
def test_a_many_tensor_load_sends_few_requests_per_rank(proxied, tmp_path, cast: bool) -> None:
    """400 tensors in two files, loaded on two ranks: a rank's runs of a file are joined across
    tensors, so it sends at most files + bytes / request size + 1 GETs (one per tensor before),
    whether its destinations take the bytes in place or through host memory (another dtype, an
    accelerator); the ranks' own counts agree with the proxy's."""
    proxy, bucket, options, _ = proxied
    url = f"{bucket}/run/step_1"
    sd = _many_tensors()
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size="4MB"))
    files, nbytes = 2, sum(v.numel() * v.element_size() for v in sd.values())
    proxy.clear()
    run_ranks(_load_many, 2, url, options, cast, str(tmp_path / "stats"))
    data, data_bytes, _ = _data_gets(proxy)
    bound = files + -(-(nbytes // 2) // REQUEST_BYTES) + 1
    assert len(data) <= 2 * bound, f"{len(data)} GETs for 2 ranks, at most {bound} each"
    stats = [json.loads((tmp_path / f"stats.{r}").read_text()) for r in range(2)]
    assert sum(s["requests"] for s in stats) == len(data)
    assert sum(s["bytes_read"] for s in stats) == data_bytes
    assert [s["bytes_wanted"] for s in stats] == [nbytes // 2] * 2
    assert all(s["host_bytes_peak"] > 0 for s in stats) is cast


@pytest.mark.distributed
def test_a_file_shorter_than_its_header_fails_the_load_naming_it_and_the_range(proxied) -> None:
    """A joined request that comes back short (the object was cut after the save) is an error
    naming the file and the bytes asked for, not a tensor silently half filled."""
    _, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    sd = _many_tensors()
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size="4MB"))
    root = direct._strip_protocol(url)
    victim = max(p for p in direct.find(root) if p.endswith(".safetensors"))
    data = direct.cat_file(victim)
    direct.pipe_file(victim, data[: len(data) - 10_000])
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    with raises_in_checkpoint(
        ValueError,
        rf"{posixpath.basename(victim)}: got \d+ of \d+ bytes at \d+; the file is truncated",
    ):
        dcp.load(dest, storage_reader=HFStorageReader(url, storage_options=options))


def _save_column_shards(rank: int, world: int, url: str, options: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    # 1 KiB half-rows: every rank's runs are tiny and interleave row by row (8 MiB in all).
    full = random_tensor((4096, 512), torch.float32, 7)
    dcp.save(
        {"cols": distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None)},
        storage_writer=HFStorageWriter(url, storage_options=options, gather_memory=0),
    )


@pytest.mark.distributed
def test_a_gathered_part_reads_each_ranks_runs_with_one_request(proxied) -> None:
    """A column shard stages one run per row (small runs staged in the store); the rank that
    gathers a part fetches each rank's runs in it (back to back in that rank's staged object)
    with one ranged GET, not one per row."""
    proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    run_ranks(_save_column_shards, 2, url, options)
    staged_gets = [r for r in proxy.requests if r.method == "GET" and ".rank0000" in r.path]
    size = 4096 * 512 * 4
    parts = -(-size // (5 << 20))  # gathered parts of about 5 MiB
    assert 0 < len(staged_gets) <= 2 * parts, (
        f"{len(staged_gets)} GETs of staged runs for {parts} parts"
    )
    assert sum(r.response_bytes for r in staged_gets) == size
    tensors = st_load(
        direct.cat_file(f"{direct._strip_protocol(url)}/model-00001-of-00001.safetensors")
    )
    assert_same(tensors["cols"], random_tensor((4096, 512), torch.float32, 7), "cols")


def test_a_joined_request_that_fails_transiently_is_sent_again(proxied) -> None:
    """A 503 and a connection reset on the few large requests of a load: each is retried whole,
    and every tensor arrives exact."""
    proxy, bucket, options, _ = proxied
    url = f"{bucket}/run/step_1"
    sd = _many_tensors()
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size="4MB"))
    for kind in ("503", "reset"):
        proxy.add_fault(Fault(kind, method="GET", path=r"\.safetensors$", header_has="range"))
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(dest, storage_reader=HFStorageReader(url, storage_options=options, retry=FAST_RETRY))
    assert proxy.faults_fired() == {"503": 1, "reset": 1}
    for k, v in sd.items():
        assert_same(dest[k], v, k)
