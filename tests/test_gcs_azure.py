"""GCS and Azure Blob as first-class stores: real servers on 127.0.0.1 (fake-gcs-server, Azurite;
``conftest.py``), gcsfs and adlfs untouched.

A save is consolidated server-side: each rank uploads its own runs as parts (GCS: part objects,
composed; Azure: blocks of the final blob, committed), small runs are staged and gathered by the
ranks. Checked here: the files are byte-identical to a local save and readable by safetensors,
``merge_stats`` splits the bytes, nothing is left behind, loads reshard with ranged reads, a
GCS file of more than 32 parts is composed as a tree, transient faults (through the fault
proxy) are retried and permanent ones fail fast naming operation and URL, leaving no index and
no parts or uncommitted blocks.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as st_load

from hf_dcp_storage import HFStorageReader, HFStorageWriter, RetryPolicy
from tests.support.checks import raises_in_checkpoint
from tests.support.data import assert_same, folder_bytes, random_tensor
from tests.support.dist import run_ranks
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.storage_options import azure_options, gcs_options

INDEX = "model.safetensors.index.json"
# The deadline only bounds a broken retry loop: attempts end these tests' retries, and a deadline
# near the time the attempts take would end them earlier on a loaded machine.
FAST_RETRY = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05, deadline=300)
MiB = 2**20


@pytest.fixture(params=["gcs", "azure"])
def store(request: pytest.FixtureRequest) -> tuple[str, str, dict]:
    """``(kind, fresh bucket/container URL, storage_options)``."""
    url, options = request.getfixturevalue(request.param)
    return request.param, url, options


def _fs(kind: str, options: dict) -> Any:
    """A filesystem of our own, nothing cached."""
    if kind == "gcs":
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
    import adlfs

    return adlfs.AzureBlobFileSystem(skip_instance_cache=True, **options)


def _objects(kind: str, url: str, options: dict) -> dict[str, bytes]:
    fs = _fs(kind, options)
    root = fs._strip_protocol(url)
    return {posixpath.relpath(p, root): fs.cat_file(p) for p in fs.find(root)}


def _uncommitted(kind: str, url: str, options: dict, names: list[str]) -> dict[str, int]:
    """Azure: uncommitted blocks left on the blobs ``names`` under ``url`` (Azurite lists no
    uncommitted-only blob, so each name is asked)."""
    if kind != "azure":
        return {}
    from fsspec.asyn import sync

    fs = _fs(kind, options)
    root = fs._strip_protocol(url)
    out = {}
    for name in names:
        container, _, blob = f"{root}/{name}".partition("/")

        async def ask() -> int:
            async with fs.service_client.get_blob_client(container, blob) as bc:  # noqa: B023 - called within the iteration
                try:
                    return len((await bc.get_block_list("uncommitted"))[1])
                except Exception:  # noqa: BLE001 - no such blob: nothing uncommitted
                    return 0

        n = sync(fs.loop, ask)
        if n:
            out[name] = n
    return out


def _state_dict(big_rows: int = 3072) -> dict[str, torch.Tensor]:
    # A big row-sharded tensor (the ranks' own parts), small ones (staged, gathered) and a
    # column-sharded one (one run per row per rank: gathered), in one file.
    return {
        "big": random_tensor((big_rows, 1024), torch.float32, 1),
        "cols": random_tensor((512, 256), torch.float32, 2),
        "norm": random_tensor((1024,), torch.bfloat16, 3),
        "head": random_tensor((64, 1024), torch.float32, 4),
    }


def test_a_gcs_file_of_more_than_32_parts_is_composed_as_a_tree(gcs, monkeypatch, tmp_path) -> None:
    from hf_dcp_storage.plan.parts import PartRules
    from hf_dcp_storage.stores import gcs as gcs_store
    from hf_dcp_storage.stores.gcs_requests import GCS

    bucket, options = gcs
    url = f"{bucket}/tree"
    # Our own part rules, smaller (a 5 MiB tensor in 80 parts): three levels of composes.
    monkeypatch.setattr(
        gcs_store.GcsStore,
        "rules",
        PartRules(min_part=32 << 10, max_parts=10_000, rank_part=64 << 10),
    )
    composes: list[tuple[str, int]] = []
    real = GCS.compose
    monkeypatch.setattr(
        GCS,
        "compose",
        lambda self, target, sources: (
            composes.append((target.rsplit("/", 1)[1], len(sources))) or real(self, target, sources)
        ),
    )
    sd = {
        "w": random_tensor((1280, 1024), torch.float32, 9),
        "b": random_tensor((1024,), torch.float32, 10),
    }
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options), no_dist=True)
    dcp.save(sd, storage_writer=HFStorageWriter(str(tmp_path / "local")), no_dist=True)
    assert max(n for _, n in composes) <= 32
    assert len([c for c in composes if c[0].endswith(".safetensors")]) == 1  # one final compose
    assert len(composes) == 4  # 81 parts: 3 composes of up to 32, then the file
    assert _objects("gcs", url, options) == folder_bytes(
        tmp_path / "local"
    )  # parts and intermediates gone


# -- faults: the fault proxy in front of each server -----------------------------------------------


@pytest.fixture(scope="module", params=["gcs", "azure"])
def proxied_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, FaultProxy, dict, dict]]:
    """``(kind, proxy, options through the proxy, options straight to the server)``."""
    from tests.support import objectservers

    kind = request.param
    if kind == "gcs":
        reason = objectservers.gcs_unavailable()
        if reason:
            pytest.skip(f"GCS: {reason}")
        # Its own server, whose resumable uploads name the proxy as their Location.
        port = objectservers.free_port()
        with FaultProxy(upstream=f"http://127.0.0.1:{port}") as proxy:
            endpoint, stop = objectservers.start_fake_gcs(external_url=proxy.endpoint, port=port)
            try:
                yield kind, proxy, gcs_options(proxy.endpoint), gcs_options(endpoint)
            finally:
                stop()
        return
    endpoint = request.getfixturevalue("azure_endpoint")
    with FaultProxy(upstream=endpoint.rsplit("/", 1)[0]) as proxy:
        yield (
            kind,
            proxy,
            azure_options(f"{proxy.endpoint}/{objectservers.AZURITE_ACCOUNT}"),
            azure_options(endpoint),
        )


@pytest.fixture
def proxied(proxied_server) -> Iterator[tuple[str, FaultProxy, str, dict, dict]]:
    kind, proxy, through, direct = proxied_server
    fs = _fs(kind, direct)
    bucket = f"hf-dcp-fault-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    proxy.clear()
    yield kind, proxy, f"{'gs' if kind == 'gcs' else 'az'}://{bucket}", through, direct
    proxy.clear()
    assert proxy.errors == []
    fs.rm(bucket, recursive=True)


def _part_kinds(kind: str) -> dict[str, dict]:
    """Fault matchers by request kind, per store."""
    if kind == "gcs":
        return {
            "part": {
                "method": "PUT",
                "path": r"/upload/",
            },  # a resumable chunk (parts over 8 MiB, staged streams)
            "small": {"method": "POST", "path": r"/upload/", "query_has": "uploadType=media"},
            "staged read": {"method": "GET", "path": r"\.rank\d+$"},
            "assemble": {"method": "POST", "path": r"/compose$"},
            "index": {"method": "POST", "query_has": f"name=run/step_1/{INDEX}"},
            "denied": {
                "method": "POST",
                "query_re": (
                    r"^name=run/step_1/\.hf_dcp_staging/parts/[0-9a-f]+/"
                    r"model-00001-of-00001\.safetensors\.part00002$"
                ),
            },
        }
    return {
        "part": {"method": "PUT", "query_has": "comp=block"},
        "small": {"method": "PUT", "header_has": "x-ms-blob-type=BlockBlob"},
        "staged read": {"method": "GET", "path": r"\.rank\d+$"},
        "assemble": {"method": "PUT", "query_has": "comp=blocklist"},
        "index": {"method": "PUT", "path": INDEX + "$"},
        "denied": {
            "method": "PUT",
            "query_has": "comp=block",
            "path": r"model-00001-of-00001\.safetensors$",
        },
    }


# 12 MiB a rank of "big": parts over 8 MiB, which go up as resumable uploads on GCS.
BIG_ROWS = 6144


def _save_load_on_ranks(
    rank: int, world: int, url: str, options: dict, local: str, gather: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _state_dict(BIG_ROWS)
    sd = {
        k: distribute_tensor(v, mesh, [Shard(1 if k == "cols" else 0)], src_data_rank=None)
        for k, v in full.items()
    }
    writer = HFStorageWriter(
        url,
        storage_options=options,
        retry=FAST_RETRY,
        thread_count=2,
        gather_memory="1GB" if gather == "network" else 0,
    )
    meta = dcp.save(sd, storage_writer=writer)
    if rank == 0:
        stats = writer.merge_stats
        total = sum(v.numel() * v.element_size() for v in full.values())
        # cols, norm, head gathered: over the ranks' network (uploaded once), or staged in
        # the store (read back and uploaded again)
        gathered = stats.network_bytes if gather == "network" else stats.client_bytes
        assert (stats.network_bytes if gather == "store" else stats.client_bytes) == 0, stats
        assert stats.rank_part_bytes + gathered == stats.total_bytes > total, stats
        assert 0 < gathered < 0.1 * total and stats.rank_part_bytes > 0.9 * total, stats
        assert (
            sum(stats.by_rank.values())
            == gathered
            == meta.storage_data["hf_dcp_storage.merge_stats"][
                "network_bytes" if gather == "network" else "client_bytes"
            ]
        )
        assert (stats.held_bytes > 0) == (gather == "network"), stats
    dcp.save(sd, storage_writer=HFStorageWriter(local))
    # Resharded: rows saved by rank become columns loaded, and the other way round.
    dest = {
        k: distribute_tensor(
            torch.zeros_like(v),
            mesh,
            [Shard(0 if k == "cols" else v.dim() - 1)],
            src_data_rank=None,
        )
        for k, v in full.items()
    }
    dcp.load(
        dest,
        storage_reader=HFStorageReader(url, storage_options=options, retry=FAST_RETRY, verify=True),
    )
    for k, v in full.items():
        assert_same(dest[k].full_tensor(), v, k)


def _small_runs_on_ranks(rank: int, world: int, url: str, options: dict, local: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _small_runs()
    sd = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
    writer = HFStorageWriter(url, storage_options=options, retry=FAST_RETRY, thread_count=2)
    dcp.save(sd, storage_writer=writer)
    if rank == 0:
        stats = writer.merge_stats
        # No rank's run reaches 1 MiB: every byte is gathered, each node's runs by the node.
        assert stats.rank_part_bytes == 0 and stats.network_bytes == stats.total_bytes, stats
    dcp.save(sd, storage_writer=HFStorageWriter(local))


def _small_runs() -> dict[str, torch.Tensor]:
    # What 8,192 ranks make of a big model: every rank's run of every tensor far under 1 MiB
    # (48 KiB here), its node's (2 ranks) 96 KiB; a norm of 512 B a rank, last in the file.
    sd = {f"a.{i}": random_tensor((48, 1024), torch.float32, 20 + i) for i in range(6)}
    sd["z.norm"] = random_tensor((1024,), torch.bfloat16, 30)
    return sd


@pytest.mark.distributed
def test_runs_of_a_few_kib_cut_at_the_nodes_make_the_same_files(
    store, tmp_path, monkeypatch
) -> None:
    """4 ranks, 2 a node (``LOCAL_WORLD_SIZE``, as ``torchrun`` sets it): the parts are each
    node's runs (96 KiB: GCS and Azure have no part minimum), gathered within the node, and the
    norm's; the servers assemble them into files byte-identical to a save on disk."""
    kind, url, options = store
    url = f"{url}/small-runs"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    run_ranks(_small_runs_on_ranks, 4, url, options, str(tmp_path / "local"))
    objects = _objects(kind, url, options)
    assert objects == folder_bytes(tmp_path / "local")
    tensors = st_load(objects["model-00001-of-00001.safetensors"])
    assert all(torch.equal(tensors[k], v) for k, v in _small_runs().items())


@pytest.mark.distributed
@pytest.mark.parametrize("gather", ["network", "store"])
def test_two_ranks_consolidate_server_side_through_transient_faults_then_load_resharded(
    proxied, tmp_path, gather
) -> None:
    """Two ranks save through faults on each kind of request (their parts, the gathering reads
    of staged runs where the small runs are staged in the store, the assembly, the commit), load
    resharded; then one process loads through faults on its reads. The files are byte-identical
    to a save on local disk."""
    kind, proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    m = _part_kinds(kind)
    faults = [
        proxy.add_fault(Fault("503", **m["part"], times=2)),
        proxy.add_fault(Fault("reset", **m["staged read"], times=1)),
        proxy.add_fault(Fault("truncate", **m["staged read"], times=1)),
        proxy.add_fault(Fault("500", **m["assemble"], times=1)),
        proxy.add_fault(Fault("503", **m["index"], times=1)),
    ]
    run_ranks(_save_load_on_ranks, 2, url, options, str(tmp_path / "local"), gather)
    # Over the ranks' network nothing is staged, so nothing is read back.
    staged_reads = 1 if gather == "store" else 0
    assert [f.fired for f in faults] == [2, staged_reads, staged_reads, 1, 1]
    objects = _objects(kind, url, direct)
    assert objects == folder_bytes(
        tmp_path / "local"
    )  # byte-identical to positioned writes on disk; no staging left
    tensors = st_load(objects["model-00001-of-00001.safetensors"])
    assert all(torch.equal(tensors[k], v) for k, v in _state_dict(BIG_ROWS).items())
    assert _uncommitted(kind, url, direct, ["model-00001-of-00001.safetensors"]) == {}
    proxy.clear()
    read = proxy.add_fault(Fault("503", method="GET", path=r"safetensors$", times=2))
    cut = proxy.add_fault(Fault("truncate", method="GET", path=r"safetensors$", times=1))
    out = {k: torch.zeros_like(v) for k, v in _state_dict(BIG_ROWS).items()}
    dcp.load(
        out,
        storage_reader=HFStorageReader(url, storage_options=options, retry=FAST_RETRY, verify=True),
        no_dist=True,
    )
    assert (read.fired, cut.fired) == (2, 1)
    for k, v in _state_dict(BIG_ROWS).items():
        assert_same(out[k], v, k)


def test_a_persistent_503_fails_after_the_policy_naming_operation_and_url(proxied) -> None:
    kind, proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    m = _part_kinds(kind)
    # Every attempt the policy allows (then the clean-up's own requests get through).
    fault = proxy.add_fault(Fault("503", **m["assemble"], times=FAST_RETRY.max_attempts))
    op = r"compose 1 objects into gs://" if kind == "gcs" else r"Put Block List \(1 blocks\) az://"
    with raises_in_checkpoint(
        OSError, op + r".*/run/step_1/model-00001-of-00001\.safetensors failed after 6 attempt\(s\)"
    ):
        dcp.save(
            _state_dict(),
            storage_writer=HFStorageWriter(url, storage_options=options, retry=FAST_RETRY),
            no_dist=True,
        )
    assert fault.fired == 6  # counted, not timed: exactly the attempts the policy allows
    left = _objects(kind, url, direct)
    assert INDEX not in left and not [k for k in left if "/parts/" in k or "/compose/" in k], (
        sorted(left)
    )
    assert _uncommitted(kind, url, direct, ["model-00001-of-00001.safetensors"]) == {}


def test_access_denied_fails_at_once_leaves_no_parts_and_the_next_save_clears_up(proxied) -> None:
    kind, proxy, bucket, options, direct = proxied
    url = f"{bucket}/run/step_1"
    # The second part upload of the file is refused (403): never retried.
    fault = proxy.add_fault(
        Fault("403", **_part_kinds(kind)["denied"], times=1)
    )  # a retry would succeed
    sd = _state_dict(BIG_ROWS)
    op = (
        r"start a resumable upload of gs://.*/parts/[0-9a-f]+/model-00001-of-00001\.safetensors\.part\d+"
        if kind == "gcs"
        else r"Put Block az://.*/run/step_1/model-00001-of-00001\.safetensors"
    )
    with raises_in_checkpoint(
        PermissionError, "(?s)" + op + r" failed: .*\(not retried: the error is permanent\)"
    ):
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(
                url, storage_options=options, retry=RetryPolicy(max_attempts=10, base_delay=1.0)
            ),
            no_dist=True,
        )
    assert (
        fault.fired == 1
    )  # counted, not timed: refused once, never retried (a retry would succeed)
    left = _objects(kind, url, direct)
    assert INDEX not in left and not [k for k in left if "/parts/" in k or "/compose/" in k], (
        sorted(left)
    )
    assert _uncommitted(kind, url, direct, ["model-00001-of-00001.safetensors"]) == {}
    proxy.clear()
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options), no_dist=True)
    assert sorted(_objects(kind, url, direct)) == ["model-00001-of-00001.safetensors", INDEX]


def test_the_store_kind_follows_the_filesystem(gcs, azure) -> None:
    from hf_dcp_storage.io import fsio
    from hf_dcp_storage.stores import open_store, ranges_for
    from hf_dcp_storage.stores.azure import AzureStore
    from hf_dcp_storage.stores.azure_requests import Azure
    from hf_dcp_storage.stores.gcs import GcsStore
    from hf_dcp_storage.stores.gcs_requests import GCS
    from hf_dcp_storage.stores.partsclient import ClientRanges

    for (url, options), store_kind, client_kind in (
        (gcs, GcsStore, GCS),
        (azure, AzureStore, Azure),
    ):
        fs, root = fsio.resolve(url + "/x", options)
        assert (
            type(open_store(fs, root, direct_write=None, retry=RetryPolicy(), threads=1))
            is store_kind
        )
        ranges = ranges_for(fs, RetryPolicy())  # the store's own retried ranged GETs
        assert type(ranges) is ClientRanges and type(ranges.client) is client_kind
        with pytest.raises(
            ValueError,
            match=r"direct_write=True needs positioned writes, which .* does not support",
        ):
            open_store(fs, root, direct_write=True, retry=RetryPolicy(), threads=1)


def test_index_is_written_last_and_records_the_save(store) -> None:
    kind, bucket, options = store
    url = f"{bucket}/one"
    sd = _state_dict()
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options), no_dist=True)
    objects = _objects(kind, url, options)
    assert sorted(objects) == ["model-00001-of-00001.safetensors", INDEX]
    index = json.loads(objects[INDEX])
    assert set(index["metadata"]["checksums"]) == set(sd)
