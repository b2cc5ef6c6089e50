"""Save and load through S3: s3fs over real HTTP to a moto server on 127.0.0.1 (see conftest.py).

Nothing is mocked or patched: the writer takes its staged path (each rank streams staged objects
under ``.hf_dcp_staging/``, the coordinator merges them and writes the index last) and the
reader uses ranged GETs, exactly as against AWS. ``default_block_size`` is 5 MiB (conftest), so
the tensors over 5 MiB here go up as real multipart uploads, whose parts moto requires to be at
least 5 MiB.
"""

from __future__ import annotations

import json
import posixpath
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from safetensors.torch import load as st_load  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

from hf_dcp_storage import HFLoadPlanner, HFSavePlanner, HFStorageReader, HFStorageWriter  # noqa: E402
from hf_dcp_storage.format.header import NAME_TO_DTYPE  # noqa: E402
from tests.support.checks import raises_in_checkpoint  # noqa: E402
from tests.support.data import (  # noqa: E402
    assert_checksums,
    assert_same,
    folder_bytes,
    headers_of,
    random_tensor,
    seed_of,
    tensor_crc32,
)
from tests.support.dist import run_ranks  # noqa: E402

INDEX = "model.safetensors.index.json"
STAGING_DIR = ".hf_dcp_staging"
MiB = 2**20


# -- helpers ------------------------------------------------------------------------------------


def _fs(options: dict) -> s3fs.S3FileSystem:
    """A fresh filesystem of our own (the fixture's options skip the instance cache)."""
    return s3fs.S3FileSystem(**options)


def _objects(url: str, options: dict) -> dict[str, bytes]:
    """``key relative to url -> content`` of every object under ``url`` (straight from S3)."""
    fs = _fs(options)
    root = fs._strip_protocol(url)
    return {posixpath.relpath(p, root): fs.cat_file(p) for p in fs.find(root)}


def _read_back(objects: dict[str, bytes]) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor parsed by ``safetensors.torch.load`` from the object bytes, and the index.

    Checks that the index and the files agree (each key in the file the index names, no extra
    keys, ``total_size`` counts exactly the tensor bytes) and that the files are exactly the
    shards ``model-0000k-of-0000N.safetensors`` the index names, plus the index.
    """
    index = json.loads(objects[INDEX])
    weight_map: dict[str, str] = index["weight_map"]
    files = sorted(set(weight_map.values()))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)], files
    assert sorted(objects) == sorted([*files, INDEX]), f"unexpected objects: {sorted(objects)}"
    assert list(weight_map) == sorted(weight_map), "weight_map keys are not sorted"
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for key, t in st_load(objects[file]).items():
            assert weight_map.get(key) == file, (
                f"{file} holds {key!r}, the index maps it to {weight_map.get(key)!r}"
            )
            assert key not in tensors
            tensors[key] = t
    assert set(tensors) == set(weight_map)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert_checksums(index, tensors)
    return tensors, index


def _assert_equal_dicts(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str
) -> None:
    assert set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
    for key, t in expected.items():
        assert_same(actual[key], t.contiguous(), f"{where}: {key!r}")


def _zeros_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}


def _is_multipart(fs: s3fs.S3FileSystem, path: str) -> bool:
    """S3 gives an object completed by a multipart upload an ETag ``"<md5 of md5s>-<parts>"``."""
    return "-" in fs.info(path)["ETag"]


def _mixed_state_dict() -> dict[str, torch.Tensor]:
    """Every safetensors dtype, 0-dim, empty, non-contiguous, tied, and one 24 MiB tensor."""
    sd = {
        f"dtype.{name}": random_tensor((3, 5), dtype, seed_of(name))
        for name, dtype in sorted(NAME_TO_DTYPE.items())
    }
    base = random_tensor((6, 4), torch.float32, 1)
    sd.update(
        {
            "odd.scalar": torch.tensor(2.5),
            "odd.scalar_i64": torch.tensor(-7, dtype=torch.int64),
            "odd.empty": torch.empty(0, 3),
            "odd.empty_bf16": torch.empty(4, 0, dtype=torch.bfloat16),
            "odd.transposed": base.T,
            "odd.strided": base[::2, 1:],
            "odd.tied_a": base,
            "odd.tied_b": base,
            # 24 MiB: the rank uploads it as two parts of the final file's multipart upload.
            "big": random_tensor((6144, 1024), torch.float32, 2),
        }
    )
    return sd


# -- single process --------------------------------------------------------------------------------


def test_round_trip_dtypes_odd_tensors_several_files_multipart(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    sd = _mixed_state_dict()
    # Small files: the small tensors spread over several; "big" gets one of its own.
    writer = HFStorageWriter(url, storage_options=options, max_shard_size="200B")
    dcp.save(sd, storage_writer=writer)

    objects = _objects(url, options)
    assert not any(STAGING_DIR in name for name in objects), sorted(
        objects
    )  # staging removed after commit
    on_s3, index = _read_back(objects)
    _assert_equal_dicts(on_s3, sd, "safetensors.torch.load of the S3 objects")
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 5
    big_file = index["weight_map"]["big"]
    assert [k for k, f in index["weight_map"].items() if f == big_file] == ["big"]
    fs = _fs(options)
    assert _is_multipart(fs, f"{url}/{big_file}"), fs.info(f"{url}/{big_file}")
    assert not _is_multipart(fs, f"{url}/{files[0]}")  # a small file is one PUT
    # One process holds every byte, so it sent every file itself (the big one as parts of one
    # multipart upload, header in front; the small ones as single PUTs): nothing was staged.
    stats = writer.merge_stats
    assert stats.files == len(files)
    assert stats.total_bytes == sum(len(objects[f]) for f in files)
    assert (stats.rank_part_bytes, stats.client_bytes) == (stats.total_bytes, 0)

    out = {
        k: torch.full(v.shape, 7, dtype=v.dtype)
        if v.numel()
        else torch.empty(v.shape, dtype=v.dtype)
        for k, v in sd.items()
    }
    dcp.load(out, storage_reader=HFStorageReader(url, storage_options=options, thread_count=3))
    _assert_equal_dicts(out, sd, "dcp.load from S3")


def test_index_json_is_exact(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    sd = {
        "a": torch.arange(100.0),
        "b": -torch.arange(100.0),
        "c": torch.ones(10, dtype=torch.bfloat16),
    }
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size=500))
    objects = _objects(url, options)
    assert sorted(objects) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        INDEX,
    ]
    assert json.loads(objects[INDEX]) == {
        "metadata": {
            "total_size": 820,
            "checksum_algorithm": "crc32",
            "checksums": {k: tensor_crc32(v) for k, v in sd.items()},
            "headers": headers_of(objects),
        },
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }


def test_s3_files_are_byte_identical_to_a_local_save(s3, tmp_path) -> None:
    bucket, options = s3
    sd = _mixed_state_dict()
    local = tmp_path / "local"
    dcp.save(
        sd, storage_writer=HFStorageWriter(str(local), max_shard_size="1KB")
    )  # direct pwrite path
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(
            f"{bucket}/ck", storage_options=options, max_shard_size="1KB"
        ),
    )
    on_s3, on_disk = _objects(f"{bucket}/ck", options), folder_bytes(local)
    assert sorted(on_s3) == sorted(on_disk) and len(on_disk) >= 4
    assert [n for n in on_disk if on_s3[n] != on_disk[n]] == []


class _FailingPlanner(DefaultSavePlanner):
    """Raises while the writer pulls one tensor's data: a crash in the middle of write_data."""

    def resolve_data(self, write_item):
        if write_item.index.fqn == "boom":
            raise OSError("disk on fire")
        return super().resolve_data(write_item)


def test_failed_save_leaves_no_index_and_a_later_save_cleans_up(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    # "a" and "z" land in other files than "boom", so they do get uploaded.
    sd = {"a": torch.randn(64), "boom": torch.randn(64), "z": torch.randn(64)}
    with raises_in_checkpoint(OSError, "disk on fire"):
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(
                url, storage_options=options, max_shard_size=256, thread_count=1
            ),
            planner=_FailingPlanner(),
        )
    # Files a rank had already sent whole may be there (as on local disk), but no index: the
    # folder is not a checkpoint.
    left = _objects(url, options)
    assert INDEX not in left
    with raises_in_checkpoint(
        AssertionError,
        r"has neither model.safetensors.index.json nor model.safetensors \(an unfinished save has "
        r"no index\)",
    ):
        dcp.load(
            {"a": torch.zeros(64)}, storage_reader=HFStorageReader(url, storage_options=options)
        )
    # A good save to the same prefix succeeds and removes the crashed save's staged objects.
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size=256))
    tensors, _ = _read_back(_objects(url, options))
    _assert_equal_dicts(tensors, sd, "after the good save")


def test_failed_save_aborts_its_multipart_upload(s3) -> None:
    """A stream that fails after uploading a 5 MiB part aborts the upload: no orphaned parts and no
    partial staged object on the server."""
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    sd = {
        "big": torch.randn(1600, 1024),
        "boom": torch.randn(8),
    }  # one file: big's 6.25 MiB, then boom
    with raises_in_checkpoint(OSError, "disk on fire"):
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(url, storage_options=options, thread_count=1),
            planner=_FailingPlanner(),
        )
    fs = _fs(options)
    assert fs.list_multipart_uploads(bucket.removeprefix("s3://")) == []
    # Only the save's own record is left (no index, no data): a later save to the path clears it.
    assert sorted(_objects(url, options)) == [".hf_dcp_staging/save.json"]


def test_a_killed_saves_unfinished_uploads_are_aborted_by_the_next_save(s3) -> None:
    """A process killed mid-upload leaves multipart uploads no one completes or aborts; the next
    save to that path aborts them (and leaves uploads elsewhere in the bucket alone)."""
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    fs = _fs(options)
    name = bucket.removeprefix("s3://")
    for key in (
        "run/step_1/.hf_dcp_staging/model-00001-of-00001.safetensors.rank00003",
        "run/step_1/model-00001-of-00001.safetensors",
        "run/step_10/other",
    ):
        fs.call_s3("create_multipart_upload", Bucket=name, Key=key)
    dcp.save({"w": torch.ones(8)}, storage_writer=HFStorageWriter(url, storage_options=options))
    assert [u["Key"] for u in fs.list_multipart_uploads(name)] == ["run/step_10/other"]


def test_existing_checkpoint_is_refused_then_replaced_with_overwrite(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    first = {"a": torch.ones(100), "b": torch.ones(100)}
    dcp.save(
        first, storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size=400)
    )
    before = _objects(url, options)
    assert len(before) == 3
    with raises_in_checkpoint(
        FileExistsError,
        r"already holds a complete checkpoint \(model.safetensors.index.json\); pass "
        r"HFStorageWriter\(..., overwrite=True\)",
    ):
        dcp.save(
            {"a": torch.zeros(100)}, storage_writer=HFStorageWriter(url, storage_options=options)
        )
    assert _objects(url, options) == before
    second = {"a": torch.full((100,), 5.0)}
    dcp.save(second, storage_writer=HFStorageWriter(url, storage_options=options, overwrite=True))
    after = _objects(url, options)
    assert sorted(after) == ["model-00001-of-00001.safetensors", INDEX]  # stale shard 2-of-2 gone
    tensors, _ = _read_back(after)
    _assert_equal_dicts(tensors, second, "after overwrite")


def test_save_to_a_missing_bucket_fails_without_creating_it(s3) -> None:
    _, options = s3
    missing = f"hf-dcp-missing-{uuid.uuid4().hex[:16]}"
    with pytest.raises(CheckpointException):
        dcp.save(
            {"w": torch.ones(4)},
            storage_writer=HFStorageWriter(f"s3://{missing}/ck", storage_options=options),
        )
    assert not _fs(options).exists(missing)


def test_key_mapping_and_save_dtype_round_trip(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    sd = {
        "model": {
            "embed": torch.randn(8, 4),
            "layers": {"0": {"w": torch.randn(4, 4)}},
            "step": torch.tensor(3),
        }
    }
    mapping = lambda fqn: fqn.replace("model.", "hf.").replace("layers.", "h.")  # noqa: E731
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(url, storage_options=options),
        planner=HFSavePlanner(key_mapping=mapping, save_dtype=torch.bfloat16),
    )
    on_s3, _ = _read_back(_objects(url, options))
    assert {k: v.dtype for k, v in on_s3.items()} == {
        "hf.embed": torch.bfloat16,
        "hf.h.0.w": torch.bfloat16,
        "hf.step": torch.int64,
    }
    assert torch.equal(on_s3["hf.embed"], sd["model"]["embed"].bfloat16())
    out = {
        "model": {
            "embed": torch.zeros(8, 4),
            "layers": {"0": {"w": torch.zeros(4, 4, dtype=torch.float64)}},
            "step": torch.tensor(0),
        }
    }
    dcp.load(
        out,
        storage_reader=HFStorageReader(url, storage_options=options),
        planner=HFLoadPlanner(key_mapping=mapping),
    )
    assert torch.equal(out["model"]["embed"], sd["model"]["embed"].bfloat16().float())
    assert torch.equal(
        out["model"]["layers"]["0"]["w"], sd["model"]["layers"]["0"]["w"].bfloat16().double()
    )
    assert out["model"]["step"].item() == 3


def test_default_s3fs_caches_save_overwrite_fail_load(s3) -> None:
    """What a user gets without our test-only options: s3fs' instance cache and listings cache on.

    The writers and readers below then share one ``S3FileSystem`` (and its directory cache)
    across saves, a failed save, an overwrite and loads; every step must still see S3 as it is.
    """
    bucket, options = s3
    plain = {k: options[k] for k in ("anon", "key", "secret", "client_kwargs")}
    url = f"{bucket}/run/step_1"
    v1 = {"a": torch.randn(50), "b": torch.randn(50)}
    dcp.save(v1, storage_writer=HFStorageWriter(url, storage_options=plain, max_shard_size=200))
    out = _zeros_like(v1)
    dcp.load(out, storage_reader=HFStorageReader(url, storage_options=plain))
    _assert_equal_dicts(out, v1, "v1")
    with raises_in_checkpoint(FileExistsError, "already holds a complete checkpoint"):
        dcp.save(v1, storage_writer=HFStorageWriter(url, storage_options=plain))
    with raises_in_checkpoint(OSError, "disk on fire"):
        dcp.save(
            {"a": torch.randn(50), "boom": torch.randn(50)},
            storage_writer=HFStorageWriter(url, storage_options=plain, overwrite=True),
            planner=_FailingPlanner(),
        )
    with raises_in_checkpoint(AssertionError, "an unfinished save has no index"):
        dcp.load(_zeros_like(v1), storage_reader=HFStorageReader(url, storage_options=plain))
    v2 = {"a": torch.randn(50), "c": torch.randn(3, 3)}
    dcp.save(v2, storage_writer=HFStorageWriter(url, storage_options=plain, max_shard_size=200))
    out = _zeros_like(v2)
    dcp.load(out, storage_reader=HFStorageReader(url, storage_options=plain))
    _assert_equal_dicts(out, v2, "v2")
    tensors, _ = _read_back(_objects(url, options))  # checked with a fresh, uncached filesystem
    _assert_equal_dicts(tensors, v2, "v2 on S3")


# -- two ranks -------------------------------------------------------------------------------------

# (name, shape, dtype, placement when saving on 2 ranks, placement when loading on 2 ranks)
DIST_KEYS = [
    # 12 MiB: each rank's 6 MiB staged object and the merged file are multipart uploads.
    ("big.rows", (3072, 1024), torch.float32, "S0", "R"),
    ("dt.shard0", (16, 8), torch.float32, "S0", "S1"),
    ("dt.shard0_uneven", (5, 3), torch.float64, "S0", "S1"),
    ("dt.shard1", (6, 12), torch.bfloat16, "S1", "S0"),
    ("dt.shard1_uneven", (4, 3), torch.int32, "S1", "R"),
    ("dt.replicate", (8,), torch.float32, "R", "S0"),
    ("dt.replicate_2d", (3, 5), torch.int64, "R", "S1"),
    ("dt.scalar", (), torch.float32, "R", "R"),
    ("plain.vec", (7,), torch.int16, "plain", "S0"),
    ("plain.empty", (0, 4), torch.float32, "plain", "plain"),
]


def _dist_original(name: str) -> torch.Tensor:
    shape, dtype = next((s, d) for n, s, d, _, _ in DIST_KEYS if n == name)
    return random_tensor(shape, dtype, seed_of(name))


def _dist_state_dict(mesh, which: int) -> dict[str, torch.Tensor]:
    """Placements ``which`` (3: save, 4: load) on the 1-D mesh; ``plain``: a plain tensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    sd = {}
    for entry in DIST_KEYS:
        name, tag = entry[0], entry[which]
        full = _dist_original(name)
        # src_data_rank=None: each rank cuts its shard from its own copy (no collective).
        sd[name] = (
            full
            if tag == "plain"
            else distribute_tensor(full, mesh, [placements[tag]], src_data_rank=None)
        )
    return sd


def _save_then_load_on_ranks(
    rank: int, world: int, endpoint: str, bucket: str, local_dir: str
) -> None:
    """Every rank: save the DTensor state dict to S3 and to local disk, then load S3 resharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tests.support.storage_options import s3_storage_options

    options = s3_storage_options(endpoint)
    url = f"s3://{bucket}/run/step_1"
    mesh = init_device_mesh("cpu", (world,))
    sd = _dist_state_dict(mesh, 3)
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size="1KB"))
    dcp.save(sd, storage_writer=HFStorageWriter(local_dir, max_shard_size="1KB"))
    dist.barrier()

    dest = _dist_state_dict(mesh, 4)
    for value in dest.values():
        (value.to_local() if isinstance(value, DTensor) else value).zero_()
    dcp.load(dest, storage_reader=HFStorageReader(url, storage_options=options))
    # Each rank checks its own shard against the one it cuts from the original (no collective:
    # gloo cannot gather every dtype).
    expected = _dist_state_dict(mesh, 4)
    for name, value in dest.items():
        want = expected[name]
        want = want.to_local() if isinstance(want, DTensor) else want
        got = value.to_local() if isinstance(value, DTensor) else value
        assert_same(got, want.contiguous(), f"rank {rank}: {name!r} loaded from S3")


@pytest.mark.distributed
def test_two_ranks_save_dtensors_to_s3_and_load_resharded(s3, s3_endpoint, tmp_path) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    local = tmp_path / "local"
    run_ranks(_save_then_load_on_ranks, 2, s3_endpoint, bucket.removeprefix("s3://"), str(local))

    expected = {name: _dist_original(name) for name, *_ in DIST_KEYS}
    objects = _objects(url, options)
    assert not any(STAGING_DIR in n for n in objects), sorted(objects)
    tensors, index = _read_back(objects)
    _assert_equal_dicts(tensors, expected, "2-rank save, read with safetensors")
    # The staged (S3) and direct (local pwrite) paths of the same 2-rank save: identical bytes.
    on_disk = folder_bytes(local)
    assert sorted(objects) == sorted(on_disk)
    assert [n for n in on_disk if objects[n] != on_disk[n]] == []
    assert _is_multipart(_fs(options), f"{url}/{index['weight_map']['big.rows']}")

    # And one process (no process group) loads the 2-rank S3 checkpoint into plain tensors.
    out = _zeros_like(expected)
    dcp.load(out, storage_reader=HFStorageReader(url, storage_options=options))
    _assert_equal_dicts(out, expected, "1-process load of the 2-rank checkpoint")


def test_stream_part_size_bounds_upload_buffers(s3) -> None:
    """Each open upload stream buffers one part: 8 MiB by default (s3fs would use 50 MiB), the
    user's smaller block size if set, and larger only when the part-count limit needs it."""
    from hf_dcp_storage.io import fsio as _fsio

    bucket, options = s3
    default_fs = s3fs.S3FileSystem(
        **{k: v for k, v in options.items() if k != "default_block_size"}
    )
    assert default_fs.default_block_size == 50 * 2**20
    cases = [
        (default_fs, 10, 8 * 2**20),
        (default_fs, 100 * 10**9, -(-100 * 10**9 // 9000)),
        (_fs(options), 10, 5 * 2**20),
    ]
    for fs, hint, expected in cases:
        f = _fsio.open_stream(fs, f"{bucket}/probe", hint)
        assert f.blocksize == expected, (hint, f.blocksize)
        f.close()
    _fs(options).rm_file(f"{bucket}/probe")


def _sent_bodies(fs: s3fs.S3FileSystem) -> list[dict[str, str]]:
    """The headers (lower-cased) of every request with a body that ``fs``'s client sends from now
    on, observed on botocore's ``before-send`` event (nothing is changed)."""
    from fsspec.asyn import sync

    seen: list[dict[str, str]] = []

    def observe(request, **_) -> None:
        if request.body:
            seen.append(
                {
                    str(k).lower(): v.decode() if isinstance(v, bytes) else str(v)
                    for k, v in request.headers.items()
                }
            )

    sync(fs.loop, fs.set_session).meta.events.register("before-send.s3", observe)
    return seen


@pytest.mark.parametrize(
    ("config", "signed", "checksummed"),
    [
        ({}, False, True),  # the defaults: our CRC32, the body unsigned
        ({"s3": {"payload_signing_enabled": True}}, True, True),  # the user keeps it signed
        ({"request_checksum_calculation": "when_required"}, True, False),  # no checksums: signed
    ],
)
def test_body_requests_carry_our_crc32_and_go_unsigned_unless_configured(
    s3, config, signed, checksummed
) -> None:
    """Parts and PUTs carry the CRC32 computed here (botocore computes none) and are signed as
    ``UNSIGNED-PAYLOAD`` (no SHA-256 pass over the body on an http endpoint), unless the user's
    client configuration says otherwise; the server accepts them and the bytes are the ones
    sent. Another request through the same client stays signed as botocore signs it."""
    import base64
    import hashlib
    import zlib

    from hf_dcp_storage.stores.retry import RetryPolicy
    from hf_dcp_storage.stores.s3_requests import S3

    bucket, options = s3
    fs = _fs(options | {"skip_instance_cache": True, "config_kwargs": config})
    seen = _sent_bodies(fs)
    client = S3(fs, RetryPolicy())
    root = bucket.removeprefix("s3://")
    small, part = b"index bytes", random_tensor((5 * MiB // 4,), torch.float32, 7).numpy().tobytes()
    client.put(f"{root}/small", small)
    upload = client.create_upload(f"{root}/big")
    entries = [client.upload_part_of(f"{root}/big", upload, 1, part)]
    client.complete_upload(f"{root}/big", upload, entries)
    fs.pipe_file(f"{root}/theirs", small)  # s3fs's own PUT through the same client

    assert fs.cat_file(f"{root}/small") == small and fs.cat_file(f"{root}/big") == part
    assert len(seen) == 4, [sorted(h) for h in seen]  # PUT, UploadPart, Complete, their PUT
    for headers, body in [(seen[0], small), (seen[1], part)]:
        crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
        assert headers.get("x-amz-checksum-crc32") == (crc if checksummed else None)
        assert not checksummed or "x-amz-sdk-checksum-algorithm" not in headers  # not botocore's
        expected = hashlib.sha256(body).hexdigest() if signed else "UNSIGNED-PAYLOAD"
        assert headers["x-amz-content-sha256"] == expected
    assert seen[3]["x-amz-content-sha256"] == hashlib.sha256(small).hexdigest()
