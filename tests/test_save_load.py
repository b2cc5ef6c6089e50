"""Single-process dcp.save/dcp.load through HFStorageWriter/HFStorageReader on every backend."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hf_dcp_storage import HFLoadPlanner, HFSavePlanner, HFStorageReader, HFStorageWriter
from hf_dcp_storage.format.header import NAME_TO_DTYPE
from hf_dcp_storage.plan.layout import DATA_ALIGN
from tests.support.checks import raises_in_checkpoint
from tests.support.data import headers_of, tensor_crc32


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def _files(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {os.path.basename(p): fs.cat_file(p) for p in fs.find(root)}


def _load_all(url: str) -> dict[str, torch.Tensor]:
    """Every tensor via safetensors itself (bytes fetched through fsspec, parsed by safetensors)."""
    from safetensors.torch import load as st_load

    files = _files(url)
    index = json.loads(files["model.safetensors.index.json"])
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(st_load(files[name]))
    assert set(out) == set(index["weight_map"])
    return out


DTYPES = sorted(NAME_TO_DTYPE.items())


def test_dtype_matrix_round_trips_and_reads_in_safetensors(url: str) -> None:
    sd = {f"t.{name}": _sample(dtype, (3, 5), seed=i) for i, (name, dtype) in enumerate(DTYPES)}
    dcp.save(sd, storage_writer=HFStorageWriter(url, max_shard_size=64))
    on_disk = _load_all(url)
    for key, t in sd.items():
        assert on_disk[key].dtype == t.dtype and torch.equal(
            on_disk[key].view(torch.uint8), t.view(torch.uint8)
        ), key
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=HFStorageReader(url))
    for key, t in sd.items():
        assert torch.equal(out[key].view(torch.uint8), t.view(torch.uint8)), key


def test_odd_tensors_round_trip(url: str) -> None:
    base = torch.randn(6, 4)
    sd = {
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": base.T,  # non-contiguous
        "strided": base[::2, 1:],
        "tied_a": base,
        "tied_b": base,  # same storage under two keys
        "big": torch.randn(300, 257),
    }
    dcp.save(sd, storage_writer=HFStorageWriter(url, max_shard_size="1KB", thread_count=3))
    on_disk = _load_all(url)
    assert all(torch.equal(on_disk[k], v) for k, v in sd.items())
    out = {k: torch.full_like(v.contiguous(), 7.0) for k, v in sd.items()}
    dcp.load(out, storage_reader=HFStorageReader(url, thread_count=3))
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_bytes_equal_safetensors_own_output_but_for_the_header_padding() -> None:
    """One file, one dtype, names in sorted order: safetensors' layout equals ours byte for byte,
    the header JSON and the data, except that ours pads the header with spaces to a page
    (``DATA_ALIGN``) where safetensors pads to 8 bytes."""
    sd = {f"layer.{i}.weight": _sample(torch.float32, (i + 1, 3), seed=i) for i in range(5)}
    url = f"memory://{os.urandom(6).hex()}/ck"
    dcp.save(sd, storage_writer=HFStorageWriter(url))
    ours, theirs = (
        _files(url)["model-00001-of-00001.safetensors"],
        st_save(sd, metadata={"format": "pt"}),
    )
    ours_n, theirs_n = (int.from_bytes(b[:8], "little") for b in (ours, theirs))
    assert (8 + ours_n) % DATA_ALIGN == 0 and ours_n - theirs_n < DATA_ALIGN
    assert ours[8 : 8 + ours_n].rstrip(b" ") == theirs[8 : 8 + theirs_n].rstrip(b" ")
    assert ours[8 + ours_n :] == theirs[8 + theirs_n :]


def test_index_is_complete_and_matches_files(url: str) -> None:
    sd = {
        "a": torch.arange(100.0),
        "b": -torch.arange(100.0),
        "c": torch.ones(10, dtype=torch.bfloat16),
    }
    dcp.save(sd, storage_writer=HFStorageWriter(url, max_shard_size=500))
    files = _files(url)
    index = json.loads(files["model.safetensors.index.json"])
    assert index == {
        "metadata": {
            "total_size": 820,
            "checksum_algorithm": "crc32",
            "checksums": {k: tensor_crc32(v) for k, v in sd.items()},
            "headers": headers_of(files),
        },
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    assert sorted(files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


def test_metadata_comes_from_the_index_alone(tmp_path) -> None:
    """The index records every file's header, so a loader's ``read_metadata`` (every rank's)
    reads one object: with the shards emptied it still describes the checkpoint exactly; an
    index without the copies (other tools' checkpoints) has the headers read from the files."""
    url = str(tmp_path / "ck")
    sd = {
        "w": torch.randn(16, 8),
        "b": torch.randn(8, dtype=torch.float64),
        "s": torch.tensor(3, dtype=torch.int8),
    }
    dcp.save(sd, storage_writer=HFStorageWriter(url, max_shard_size=300))
    shards = sorted(p for p in os.listdir(url) if p.endswith(".safetensors"))
    assert len(shards) >= 2
    before = HFStorageReader(url).read_metadata()
    index_path = os.path.join(url, "model.safetensors.index.json")
    index = json.loads(open(index_path).read())
    index["metadata"].pop("headers")
    open(index_path, "w").write(json.dumps(index))
    from_files = HFStorageReader(url).read_metadata()
    assert (
        from_files.state_dict_metadata == before.state_dict_metadata
        and from_files.storage_data == before.storage_data
    )
    dcp.save(sd, storage_writer=HFStorageWriter(str(tmp_path / "again"), max_shard_size=300))
    for name in shards:
        open(os.path.join(tmp_path, "again", name), "wb").close()  # no header to read any more
    emptied = HFStorageReader(str(tmp_path / "again")).read_metadata()
    assert (
        emptied.state_dict_metadata == before.state_dict_metadata
        and emptied.storage_data == before.storage_data
    )


def test_checkpoint_id_and_fqn_to_index_mapping(url: str) -> None:
    sd = {"x": torch.ones(4), "y": torch.ones(4) * 2, "z": torch.ones(4) * 3}
    writer = HFStorageWriter(fqn_to_index_mapping={"x": 2, "y": 1, "z": 2})
    dcp.save(sd, storage_writer=writer, checkpoint_id=url)
    index = json.loads(_files(url)["model.safetensors.index.json"])
    assert index["weight_map"] == {
        "x": "model-00002-of-00002.safetensors",
        "y": "model-00001-of-00002.safetensors",
        "z": "model-00002-of-00002.safetensors",
    }
    out = {k: torch.zeros(4) for k in sd}
    dcp.load(out, storage_reader=HFStorageReader(), checkpoint_id=url)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_direct_and_staged_paths_write_identical_bytes(tmp_path) -> None:
    sd = {
        "w": torch.randn(64, 33),
        "b": torch.randn(33, dtype=torch.float64),
        "s": torch.tensor(1, dtype=torch.int8),
        "t": torch.randn(9, 5).T,
    }
    dcp.save(sd, storage_writer=HFStorageWriter(str(tmp_path / "direct"), max_shard_size=2000))
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(
            str(tmp_path / "staged"), max_shard_size=2000, direct_write=False
        ),
    )
    direct, staged = _files(str(tmp_path / "direct")), _files(str(tmp_path / "staged"))
    assert len(direct) == 3 and direct == staged  # staging folder removed after the commit


def test_key_mapping_and_save_dtype_round_trip(url: str) -> None:
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
        storage_writer=HFStorageWriter(url),
        planner=HFSavePlanner(key_mapping=mapping, save_dtype=torch.bfloat16),
    )
    on_disk = _load_all(url)
    assert {k: v.dtype for k, v in on_disk.items()} == {
        "hf.embed": torch.bfloat16,
        "hf.h.0.w": torch.bfloat16,
        "hf.step": torch.int64,
    }
    assert torch.equal(on_disk["hf.embed"], sd["model"]["embed"].bfloat16())
    # Load converts to each destination's dtype (float32 and float64 here).
    out = {
        "model": {
            "embed": torch.zeros(8, 4),
            "layers": {"0": {"w": torch.zeros(4, 4, dtype=torch.float64)}},
            "step": torch.tensor(0),
        }
    }
    dcp.load(out, storage_reader=HFStorageReader(url), planner=HFLoadPlanner(key_mapping=mapping))
    assert torch.equal(out["model"]["embed"], sd["model"]["embed"].bfloat16().float())
    assert torch.equal(
        out["model"]["layers"]["0"]["w"], sd["model"]["layers"]["0"]["w"].bfloat16().double()
    )
    assert out["model"]["step"].item() == 3


def test_dict_key_mapping_renames_listed_keys_only(url: str) -> None:
    sd = {"a": torch.ones(2), "b": torch.zeros(2)}
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(url),
        planner=HFSavePlanner(key_mapping={"a": "renamed.a"}),
    )
    assert set(_load_all(url)) == {"renamed.a", "b"}


def test_reads_save_pretrained_style_folders(tmp_path) -> None:
    sd = {"w": torch.randn(5, 5), "b": torch.arange(5)}
    single = tmp_path / "single"
    single.mkdir()
    save_file(sd, str(single / "model.safetensors"), metadata={"format": "pt"})
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=HFStorageReader(str(single)))
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    # A sharded folder written by someone else, with tensors in an order of their choosing.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"w": sd["w"]}, str(sharded / "part-a.safetensors"))
    save_file({"b": sd["b"]}, str(sharded / "part-b.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "part-a.safetensors", "b": "part-b.safetensors"}})
    )
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=HFStorageReader(f"file://{sharded}"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_existing_checkpoint_is_refused_then_replaced_with_overwrite(url: str) -> None:
    first = {"a": torch.ones(100), "b": torch.ones(100)}
    dcp.save(first, storage_writer=HFStorageWriter(url, max_shard_size=400))
    before = _files(url)
    assert len(before) == 3
    with raises_in_checkpoint(
        FileExistsError,
        r"already holds a complete checkpoint \(model.safetensors.index.json\); pass "
        r"HFStorageWriter\(..., overwrite=True\)",
    ):
        dcp.save({"a": torch.zeros(100)}, storage_writer=HFStorageWriter(url))
    assert _files(url) == before
    second = {"a": torch.full((100,), 5.0)}
    dcp.save(second, storage_writer=HFStorageWriter(url, overwrite=True))
    assert sorted(_files(url)) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]  # stale shards gone
    assert torch.equal(_load_all(url)["a"], second["a"])


class _FailingPlanner(DefaultSavePlanner):
    """Raises while the writer pulls one tensor's data: a crash in the middle of write_data."""

    def resolve_data(self, write_item):
        if write_item.index.fqn == "boom":
            raise OSError("disk on fire")
        return super().resolve_data(write_item)


@pytest.mark.parametrize("direct_write", [None, False], ids=["direct", "staged"])
def test_failed_save_leaves_no_index_and_keeps_old_checkpoint(
    tmp_path, direct_write: bool | None
) -> None:
    url = str(tmp_path / "ck")
    sd = {"a": torch.randn(50), "boom": torch.randn(50), "z": torch.randn(50)}
    with raises_in_checkpoint(OSError, "disk on fire"):
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(url, direct_write=direct_write),
            planner=_FailingPlanner(),
        )
    assert "model.safetensors.index.json" not in os.listdir(url)
    with raises_in_checkpoint(
        AssertionError,
        r"has neither model.safetensors.index.json nor model.safetensors \(an unfinished save has "
        r"no index\)",
    ):
        dcp.load({"a": torch.zeros(50)}, storage_reader=HFStorageReader(url))
    # A later good save to the same folder succeeds and cleans the leftovers.
    dcp.save(sd, storage_writer=HFStorageWriter(url, direct_write=direct_write))
    assert sorted(os.listdir(url)) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert all(
        torch.equal(load_file(f"{url}/model-00001-of-00001.safetensors")[k], v)
        for k, v in sd.items()
    )


@pytest.mark.parametrize("direct_write", [None, False], ids=["auto", "staged"])
def test_empty_state_dict_still_commits_a_readable_checkpoint(
    tmp_path, direct_write: bool | None
) -> None:
    url = str(tmp_path / "ck")
    dcp.save({}, storage_writer=HFStorageWriter(url, direct_write=direct_write))
    assert sorted(os.listdir(url)) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert load_file(f"{url}/model-00001-of-00001.safetensors") == {}


@pytest.mark.parametrize("direct_write", [None, False], ids=["direct", "staged"])
def test_tensors_larger_than_one_slab(tmp_path, direct_write: bool | None) -> None:
    """Over 16 MiB per tensor: written and read in several slabs, with casts on both sides."""
    url = str(tmp_path / "ck")
    big = torch.randn(2100, 2100)  # 17.6 MB
    col = torch.randn(4100, 1100).T  # non-contiguous, 18 MB
    dcp.save(
        {"big": big, "col": col},
        storage_writer=HFStorageWriter(url, direct_write=direct_write),
        planner=HFSavePlanner(save_dtype=torch.float16),
    )
    on_disk = load_file(f"{url}/model-00001-of-00001.safetensors")
    assert torch.equal(on_disk["big"], big.half()) and torch.equal(on_disk["col"], col.half())
    out = {
        "big": torch.zeros(2100, 2100, dtype=torch.float64),
        "col": torch.zeros(1100, 4100, dtype=torch.float16),
    }
    dcp.load(out, storage_reader=HFStorageReader(url))
    assert torch.equal(out["big"], big.half().double()) and torch.equal(out["col"], col.half())
