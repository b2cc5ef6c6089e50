"""Checksums recorded at save time, checked by ``HFStorageReader(verify=True)``."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from tests.support.checks import raises_in_checkpoint
from tests.support.data import assert_same, random_tensor
from tests.support.dist import run_ranks

INDEX = "model.safetensors.index.json"


def _state_dict() -> dict[str, torch.Tensor]:
    return {
        "big": random_tensor((1100, 4096), torch.float32, 1),  # 17.2 MiB: two slabs when read whole
        "bf16": random_tensor((33, 7), torch.bfloat16, 2),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "ints": torch.arange(-5, 5, dtype=torch.int64),
    }


def _zeros(
    sd: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    return {
        k: torch.zeros(v.shape, dtype=dtype if dtype and v.is_floating_point() else v.dtype)
        for k, v in sd.items()
    }


def _flip_byte(folder: str, key: str, at: int) -> str:
    """Flip one bit of byte ``at`` of tensor ``key``'s data in its file; returns the file name."""
    index = json.loads(open(os.path.join(folder, INDEX)).read())
    name = index["weight_map"][key]
    path = os.path.join(folder, name)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        pos = 8 + n + header[key]["data_offsets"][0] + at
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    return name


def test_verified_load_equals_plain_load_for_every_kind_of_tensor(url: str) -> None:
    sd = _state_dict()
    dcp.save(sd, storage_writer=HFStorageWriter(url, max_shard_size="1MB"))
    out = _zeros(sd)
    dcp.load(out, storage_reader=HFStorageReader(url, verify=True, thread_count=2))
    for k, v in sd.items():
        assert_same(out[k], v, k)
    # Into another dtype and a non-contiguous destination: the regions are filled from the same
    # bytes.
    cast = _zeros(sd, torch.float64)
    cast["bf16"] = torch.zeros(7, 33, dtype=torch.float32).T
    dcp.load(cast, storage_reader=HFStorageReader(url, verify=True))
    assert torch.equal(cast["big"], sd["big"].double())
    assert torch.equal(cast["bf16"], sd["bf16"].float())


@pytest.mark.parametrize(
    "key,at", [("big", 4096 * 4 * 1000 + 3), ("bf16", 0), ("scalar", 3), ("ints", 79)]
)
def test_a_flipped_bit_is_reported_with_file_and_key(tmp_path, key: str, at: int) -> None:
    url = str(tmp_path / "ck")
    sd = _state_dict()
    dcp.save(sd, storage_writer=HFStorageWriter(url, max_shard_size="1MB"))
    name = _flip_byte(url, key, at)
    # Without verification the corrupt value loads silently: this is what verify=True is for.
    plain = _zeros(sd)
    dcp.load(plain, storage_reader=HFStorageReader(url))
    assert not torch.equal(plain[key], sd[key])
    with raises_in_checkpoint(
        ValueError,
        rf"{name}: tensor '{key}' fails its checksum \(crc32 of the bytes read [0-9a-f]{{8}}, the "
        rf"index records [0-9a-f]{{8}}\); the file is corrupt",
    ):
        dcp.load(_zeros(sd), storage_reader=HFStorageReader(url, verify=True))
    # Loading only the intact keys still works.
    rest = {k: v for k, v in _zeros(sd).items() if k != key}
    dcp.load(rest, storage_reader=HFStorageReader(url, verify=True))
    for k in rest:
        assert_same(rest[k], sd[k], k)


def test_verify_needs_recorded_checksums(tmp_path) -> None:
    folder = tmp_path / "st"
    folder.mkdir()
    save_file({"w": torch.ones(3)}, str(folder / "model.safetensors"))
    with raises_in_checkpoint(
        AssertionError,
        r"verify=True, but the checkpoint records no checksums .*; load it with verify=False",
    ):
        dcp.load({"w": torch.zeros(3)}, storage_reader=HFStorageReader(str(folder), verify=True))
    dcp.load(
        {"w": torch.zeros(3)}, storage_reader=HFStorageReader(str(folder))
    )  # fine without verify


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda m: m.update(checksum_algorithm="sha1"),
            r"metadata.checksum_algorithm is 'sha1'; this version reads only 'crc32'",
        ),
        (
            lambda m: m["checksums"].update(a="xyz"),
            r"metadata.checksums must map tensor names to CRC32 values of 8 hex digits",
        ),
        (
            lambda m: m["checksums"].update(a="0000000g"),
            r"metadata.checksums must map tensor names to CRC32 values of 8 hex digits",
        ),
        (
            lambda m: m.update(checksums=[1]),
            r"metadata.checksums must map tensor names to CRC32 values of 8 hex digits",
        ),
    ],
)
def test_malformed_checksums_are_refused(tmp_path, edit, message: str) -> None:
    url = str(tmp_path / "ck")
    dcp.save({"a": torch.ones(4)}, storage_writer=HFStorageWriter(url))
    path = os.path.join(url, INDEX)
    index = json.loads(open(path).read())
    edit(index["metadata"])
    open(path, "w").write(json.dumps(index))
    with raises_in_checkpoint(AssertionError, message):
        dcp.load({"a": torch.zeros(4)}, storage_reader=HFStorageReader(url))


def _verified_resharded_load(rank: int, world: int, folder: str, corrupt: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {
        "w": random_tensor((64, 48), torch.float32, 5),
        "v": random_tensor((40,), torch.bfloat16, 6),
    }
    if not corrupt:
        sd = {
            k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()
        }
        dcp.save(sd, storage_writer=HFStorageWriter(folder))
        return
    # Column shards (strided regions) on load, verified.
    dest = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)], src_data_rank=None)}
    try:
        dcp.load(dest, storage_reader=HFStorageReader(folder, verify=True))
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        text = repr(exc)
        assert (
            "tensor 'w' fails its checksum" in text and "model-00001-of-00001.safetensors" in text
        ), text
    else:
        raise AssertionError(f"rank {rank}: corrupt 'w' loaded without error")
    dest = {
        "v": distribute_tensor(
            torch.zeros(40, dtype=torch.bfloat16), mesh, [Shard(0)], src_data_rank=None
        )
    }
    dcp.load(dest, storage_reader=HFStorageReader(folder, verify=True))
    assert_same(dest["v"].to_local(), full["v"].chunk(world)[rank], "v")


@pytest.mark.distributed
def test_two_ranks_verify_their_column_shards_and_both_see_corruption(tmp_path) -> None:
    folder = str(tmp_path / "ck")
    run_ranks(_verified_resharded_load, 2, folder, False)
    _flip_byte(folder, "w", 64 * 48 * 4 - 1)  # the last byte: only rank 1's columns hold it
    run_ranks(_verified_resharded_load, 2, folder, True)
