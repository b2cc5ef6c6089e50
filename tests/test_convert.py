"""DCP <-> HF conversion (``hf_dcp_storage.tools.convert``) on real checkpoints.

DCP sources are written by ``dcp.save`` itself: one spawn of 2 gloo ranks (the module fixture
``dist_ckpt``: ``Shard(0)`` and ``Shard(1)`` DTensors, even and uneven, a replicated plain
tensor, a 0-dim tensor and non-tensor entries; plus a 128 MiB checkpoint of 1 MiB chunks for the
memory test), and single-process saves with no process group. Outputs are read back with
``safetensors`` itself (local) or ``HFStorageReader(verify=True)`` (remote), and DCP outputs
with plain ``dcp.load``; every tensor must be byte-equal to its original.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.tools import convert
from hf_dcp_storage.tools.convert import (
    ConvertReport,
    KeyMapping,
    KeyMappingError,
    convert_dcp_to_hf,
    convert_hf_to_dcp,
    load_key_mapping,
    parse_dtype,
)
from hf_dcp_storage.tools.dcp_format import FsspecReader
from tests.support.data import (
    assert_checksums,
    assert_same,
    folder_bytes,
    random_tensor,
    read_checkpoint,
    seed_of,
)
from tests.support.dist import run_ranks

INDEX = "model.safetensors.index.json"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# name -> (shape, dtype, how the 2 ranks hold it: Shard(0), Shard(1) DTensor, or the same plain
# tensor)
DIST_KEYS: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
    "tok_embeddings.weight": ((10, 4), BF16, "shard0"),
    "layers.0.attention.wq.weight": ((8, 6), F32, "shard0"),
    "layers.1.attention.wq.weight": ((7, 6), F32, "shard0"),  # uneven: 4 + 3 rows
    "layers.0.feed_forward.w2.weight": ((6, 10), F32, "shard1"),
    "layers.1.feed_forward.w2.weight": ((6, 9), F16, "shard1"),  # uneven: 5 + 4 columns
    "norm.weight": ((6,), F32, "replicated"),
    "output.weight": ((10, 4), F32, "shard0"),
    "counts": ((5,), torch.int64, "shard0"),
    "scalar": ((), F32, "replicated"),
}
DIST_OBJECTS = ("step", "extra.lr")  # non-tensor entries, skipped by dcp -> hf
# The memory test's checkpoint: BIG_N tensors of 2 MiB, each stored as two 1 MiB chunks.
BIG_N, BIG_SHAPE = 64, (512, 1024)


def original(name: str) -> torch.Tensor:
    shape, dtype, _ = DIST_KEYS[name]
    return random_tensor(shape, dtype, seed_of(name))


def _save_on_ranks(rank: int, world: int, small: str, big: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    placement = {"shard0": [Shard(0)], "shard1": [Shard(1)]}
    sd: dict[str, object] = {
        name: original(name)
        if kind == "replicated"
        else distribute_tensor(original(name), mesh, placement[kind], src_data_rank=None)
        for name, (_, _, kind) in DIST_KEYS.items()
    }
    sd["step"] = 12345
    sd["extra"] = {"lr": 0.125}
    dcp.save(sd, checkpoint_id=small)
    chunks = {
        f"big.{i}": distribute_tensor(
            torch.full(BIG_SHAPE, float(i)), mesh, [Shard(0)], src_data_rank=None
        )
        for i in range(BIG_N)
    }
    dcp.save(chunks, checkpoint_id=big)


@pytest.fixture(scope="module")
def dist_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """``(small, big)``: two DCP checkpoints saved by ``dcp.save`` on 2 gloo ranks."""
    root = tmp_path_factory.mktemp("dist")
    small, big = str(root / "small"), str(root / "big")
    run_ranks(_save_on_ranks, 2, small, big)
    return small, big


def _save_single(path: str | Path, sd: dict) -> None:
    """``dcp.save`` in this process, with no process group."""
    dcp.save(sd, checkpoint_id=str(path))


def _zeros_like(expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in expected.items()}


def _check_hf(
    url: str, expected: Mapping[str, torch.Tensor], storage_options: dict | None = None
) -> dict:
    """The HF checkpoint at ``url`` holds exactly ``expected``, byte for byte, with correct
    checksums in its index; returns the index. Local: read with ``safetensors`` itself."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if "file" in fs.protocol:
        tensors, index = read_checkpoint(root)  # also checks checksums and total_size
        assert sorted(tensors) == sorted(expected)
        for key, t in expected.items():
            assert_same(tensors[key], t, key)
        return index
    index = json.loads(fs.cat_file(f"{root}/{INDEX}"))
    assert_checksums(index, expected)
    out = _zeros_like(expected)
    dcp.load(out, storage_reader=HFStorageReader(url, storage_options=storage_options, verify=True))
    for key, t in expected.items():
        assert_same(out[key], t, key)
    return index


def _check_dcp(
    url: str, expected: Mapping[str, torch.Tensor], storage_options: dict | None = None
) -> None:
    """Plain ``dcp.load`` of the DCP checkpoint at ``url`` gives ``expected``, byte for byte."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    local = "file" in fs.protocol
    reader = FileSystemReader(root) if local else FsspecReader(url, **(storage_options or {}))
    out = _zeros_like(expected)
    dcp.load(out, storage_reader=reader)
    for key, t in expected.items():
        assert_same(out[key], t, key)


def _names(url: str, storage_options: dict | None = None) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(root))


def _upload(local: str, url: str, storage_options: dict | None) -> None:
    """Copy the files of a local folder to ``url`` (``.metadata`` included)."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    for name in os.listdir(local):
        fs.put_file(os.path.join(local, name), f"{root}/{name}")


class _Recorder:
    def __init__(self) -> None:
        self.starts: list[tuple[int, str]] = []
        self.advanced = 0

    def start(self, total_bytes: int, description: str) -> None:
        self.starts.append((total_bytes, description))

    def advance(self, nbytes: int) -> None:
        self.advanced += nbytes


# -- dcp -> hf ----------------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_rank_dcp_checkpoint_to_hf(dist_ckpt: tuple[str, str], url: str) -> None:
    small, _ = dist_ckpt
    expected = {name: original(name) for name in DIST_KEYS}
    progress = _Recorder()
    report = convert_dcp_to_hf(small, url, max_shard_size=200, progress=progress)
    index = _check_hf(url, expected)
    total = sum(t.numel() * t.element_size() for t in expected.values())
    data_files = sorted(set(index["weight_map"].values()))
    assert len(data_files) >= 3  # split at 200 bytes
    assert isinstance(report, ConvertReport)
    assert (report.tensors, report.bytes, report.skipped, report.unused_rules) == (
        len(DIST_KEYS),
        total,
        DIST_OBJECTS,
        (),
    )
    assert report.files == (*data_files, INDEX) and sorted(report.files) == _names(url)
    assert progress.starts == [(total, "dcp -> hf")] and progress.advanced == total
    # Keys keep the state dict's order in the files.
    assert list(index["weight_map"]) == sorted(DIST_KEYS)


@pytest.mark.distributed
def test_two_rank_dcp_checkpoint_on_s3_to_hf_on_s3(
    dist_ckpt: tuple[str, str], s3: tuple[str, dict]
) -> None:
    small, _ = dist_ckpt
    bucket, options = s3
    expected = {name: original(name) for name in DIST_KEYS}
    _upload(small, f"{bucket}/dcp", options)
    report = convert_dcp_to_hf(f"{bucket}/dcp", f"{bucket}/from_s3", storage_options=options)
    _check_hf(f"{bucket}/from_s3", expected, options)
    assert report.files == ("model-00001-of-00001.safetensors", INDEX)


def test_single_process_dcp_checkpoint_on_memory_to_hf(tmp_path: Path) -> None:
    sd = {
        "w": random_tensor((33, 7), F32, 1),
        "b": random_tensor((7,), F16, 2),
        "e": torch.empty(0, 3),
        "i": torch.tensor(7),
    }
    _save_single(tmp_path / "dcp", {**sd, "note": "a string"})
    src = f"memory://{tmp_path.name}/dcp"
    _upload(str(tmp_path / "dcp"), src, None)
    try:
        # S3 options reach both sides; memory:// and local paths ignore them.
        options = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        }
        report = convert_dcp_to_hf(src, tmp_path / "hf", storage_options=options, thread_count=1)
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)
    _check_hf(str(tmp_path / "hf"), sd)
    assert report.skipped == ("note",) and report.tensors == 4


TITAN = {
    "tok_embeddings.weight": ((12, 4), F32),
    "layers.0.attention.wq.weight": ((4, 4), F32),
    "layers.11.attention.wq.weight": ((4, 4), F32),
    "layers.0.attention_norm.weight": ((4,), F32),
    "layers.11.attention_norm.weight": ((4,), F32),
    "freqs_cis": ((8, 2), F32),
    "output.weight": ((12, 4), F32),
    "norm.weight": ((4,), F32),
}
TITAN_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "freqs_cis": None,
    "output.weight": "lm_head.weight",
}


@pytest.fixture
def titan_ckpt(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    sd = {
        name: random_tensor(shape, dtype, seed_of(name)) for name, (shape, dtype) in TITAN.items()
    }
    _save_single(tmp_path / "titan", sd)
    return str(tmp_path / "titan"), sd


def test_key_mapping_with_templates_and_drops(
    titan_ckpt: tuple[str, dict], url: str, tmp_path: Path
) -> None:
    src, sd = titan_ckpt
    mapping_file = tmp_path / "map.json"
    mapping_file.write_text(json.dumps(TITAN_TO_HF))
    report = convert_dcp_to_hf(src, url, key_mapping=str(mapping_file))
    expected = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.layers.0.self_attn.q_proj.weight": sd["layers.0.attention.wq.weight"],
        "model.layers.11.self_attn.q_proj.weight": sd["layers.11.attention.wq.weight"],
        "model.layers.0.input_layernorm.weight": sd["layers.0.attention_norm.weight"],
        "model.layers.11.input_layernorm.weight": sd["layers.11.attention_norm.weight"],
        "lm_head.weight": sd["output.weight"],
        "norm.weight": sd["norm.weight"],  # no rule: keeps its name
    }
    _check_hf(url, expected)
    assert report.skipped == ("freqs_cis",)
    assert report.unused_rules == ("layers.{}.feed_forward.w1.weight",)


def test_key_mapping_object_semantics() -> None:
    mapping = KeyMapping(
        {"a.{}.b": "x.{}.y", "a.7.b": "exact", "l.{}.{}": "m.{}.n.{}", "gone": None}
    )
    assert mapping("a.12.b") == "x.12.y" and mapping("a.7.b") == "exact"  # exact wins
    assert (
        mapping("l.3.45") == "m.3.n.45" and mapping("gone") is None and mapping("a.x.b") == "a.x.b"
    )
    renaming = mapping.apply(["a.1.b", "gone", "other"])
    assert dict(renaming.targets) == {"a.1.b": "x.1.y", "other": "other"}
    assert renaming.dropped == ("gone",) and renaming.unused_rules == ("a.7.b", "l.{}.{}")
    assert load_key_mapping({"p": "q"}).rules == {"p": "q"}


# (mapping file content, expected message) for mappings refused when read ...
BAD_MAPPING_FILES = {
    "bad_json": (
        '{"a": "b",',
        r"map.json: not valid JSON \(.*\); a key mapping is one object such as",
    ),
    "not_object": (
        '["a", "b"]',
        (
            r"map.json must be a JSON object mapping source keys to target keys \(or null to drop "
            r"a "
            r"key\), got list"
        ),
    ),
    "not_string": (
        '{"a": 3}',
        r"map.json: 'a' maps to 3; a target must be a non-empty string, or null to drop the key",
    ),
    "placeholders": (
        '{"layers.{}.w": "model.w"}',
        (
            r"rule 'layers.{}.w': 'model.w' has 1 {} placeholder\(s\) on the left and 0 on the "
            r"right; "
            r"both sides need the same number"
        ),
    ),
    "braces": (
        '{"layers.{0}.w": "m.{0}.w"}',
        r"has braces other than {}; the only placeholder is {}",
    ),
    "duplicate": ('{"a": "b", "a": "c"}', r"map.json: key 'a' appears twice"),
}
# ... and mappings refused against the checkpoint's actual keys.
BAD_MAPPINGS = {
    "collision": (
        {"output.weight": "norm.weight"},
        (
            r"both 'output.weight' and 'norm.weight' would become 'norm.weight'; each target key "
            r"must "
            r"come from one source key"
        ),
    ),
    "collision_two_rules": (
        {"output.weight": "head", "tok_embeddings.weight": "head"},
        r"both 'tok_embeddings.weight' and 'output.weight' would become 'head'",
    ),
    "ambiguous": (
        {"layers.{}.attention_norm.weight": "a.{}", "layers.1{}.attention_norm.weight": "b.{}"},
        (
            r"key 'layers.11.attention_norm.weight' matches several templates "
            r"\['layers.{}.attention_norm.weight', 'layers.1{}.attention_norm.weight'\]"
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_MAPPING_FILES) + sorted(BAD_MAPPINGS))
def test_bad_key_mappings_are_refused_before_writing(
    titan_ckpt: tuple[str, dict], tmp_path: Path, case: str
) -> None:
    src, _ = titan_ckpt
    dst = tmp_path / "hf"
    if case in BAD_MAPPING_FILES:
        content, message = BAD_MAPPING_FILES[case]
        (tmp_path / "map.json").write_text(content)
        mapping: object = str(tmp_path / "map.json")
    else:
        mapping, message = BAD_MAPPINGS[case]
    with pytest.raises(KeyMappingError, match=message):
        convert_dcp_to_hf(src, dst, key_mapping=mapping)  # type: ignore[arg-type]
    assert not dst.exists()


def test_unreadable_key_mapping_file(tmp_path: Path) -> None:
    with pytest.raises(
        KeyMappingError,
        match=r"cannot read key mapping .*missing.json: .*; pass the path of a JSON file",
    ):
        load_key_mapping(tmp_path / "missing.json")


def test_dtype_casts_floating_point_tensors_only(tmp_path: Path) -> None:
    sd = {
        "f32": random_tensor((5, 3), F32, 1),
        "f64": random_tensor((4,), torch.float64, 2),
        "f16": random_tensor((2, 2), F16, 3),
        "bf16": random_tensor((3,), BF16, 4),
        "i64": random_tensor((3,), torch.int64, 5),
        "u8": random_tensor((6,), torch.uint8, 6),
        "flag": random_tensor((4,), torch.bool, 7),
    }
    _save_single(tmp_path / "dcp", sd)
    report = convert_dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", dtype="bf16")
    expected = {k: v.to(BF16) if v.is_floating_point() else v for k, v in sd.items()}
    _check_hf(str(tmp_path / "hf"), expected)
    assert report.bytes == sum(t.numel() * t.element_size() for t in expected.values())
    # The same, the other way.
    convert_hf_to_dcp(tmp_path / "hf", tmp_path / "back", dtype=torch.float32)
    _check_dcp(
        str(tmp_path / "back"),
        {k: v.float() if v.is_floating_point() else v for k, v in expected.items()},
    )


def test_bad_dtypes_are_refused() -> None:
    assert (
        parse_dtype("BF16") is BF16
        and parse_dtype("torch.float16") is F16
        and parse_dtype(None) is None
    )
    with pytest.raises(
        ValueError,
        match=r"dtype='int4' is not a known dtype; pass one of bf16, bfloat16, fp16, float16, "
        r".*fp32, float32",
    ):
        parse_dtype("int4")
    with pytest.raises(
        ValueError, match=r"dtype=torch.int8 must be a floating-point dtype that safetensors holds"
    ):
        parse_dtype(torch.int8)


# -- hf -> dcp ----------------------------------------------------------------------------------


def _hf_sample() -> dict[str, torch.Tensor]:
    return {
        "model.embed.weight": random_tensor((40, 8), F32, 1),  # 1280 bytes: several slabs below
        "model.layers.0.w": random_tensor((9, 5), BF16, 2),
        "model.layers.0.b": random_tensor((5,), F16, 3),
        "model.ids": random_tensor((30,), torch.int64, 4),
        "model.scalar": random_tensor((), torch.float64, 5),
        "model.empty": torch.empty(0, 4),
        "model.mask": random_tensor((3, 3), torch.bool, 6),
    }


def test_hf_checkpoint_to_dcp_loads_with_plain_dcp_load(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _hf_sample()
    dcp.save(sd, storage_writer=HFStorageWriter(str(tmp_path / "hf"), max_shard_size=300))
    assert len(os.listdir(tmp_path / "hf")) >= 4
    # Small slabs and files, so tensors span several chunks and files as a large model's do.
    monkeypatch.setattr(convert, "HF_TO_DCP_CHUNK_BYTES", 256)
    progress = _Recorder()
    report = convert_hf_to_dcp(tmp_path / "hf", url, progress=progress)
    _check_dcp(url, sd)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    assert (report.tensors, report.bytes, report.skipped) == (len(sd), total, ())
    assert (
        report.files[-1] == ".metadata"
        and len(report.files) > 5
        and sorted(report.files) == _names(url)
    )
    assert progress.starts == [(total, "hf -> dcp")] and progress.advanced == total
    # DCP's own tool for a whole checkpoint reads it too (it needs planner_data).
    if "://" not in url or url.startswith("file://"):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        root = url.removeprefix("file://")
        dcp_to_torch_save(root, str(tmp_path / "all.pt"))
        everything = torch.load(tmp_path / "all.pt", weights_only=True)
        assert sorted(everything) == sorted(sd)


def test_hf_to_dcp_with_key_mapping(tmp_path: Path) -> None:
    sd = _hf_sample()
    dcp.save(sd, storage_writer=HFStorageWriter(str(tmp_path / "hf")))
    report = convert_hf_to_dcp(
        tmp_path / "hf",
        tmp_path / "dcp",
        key_mapping={"model.layers.{}.w": "layers.{}.weight", "model.mask": None},
    )
    expected = {
        ("layers.0.weight" if k == "model.layers.0.w" else k): v
        for k, v in sd.items()
        if k != "model.mask"
    }
    _check_dcp(str(tmp_path / "dcp"), expected)
    assert report.skipped == ("model.mask",)


def test_hf_on_s3_to_dcp_on_s3(s3: tuple[str, dict]) -> None:
    bucket, options = s3
    sd = _hf_sample()
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(f"{bucket}/hf", storage_options=options, max_shard_size=300),
    )
    report = convert_hf_to_dcp(f"{bucket}/hf", f"{bucket}/dcp", storage_options=options)
    _check_dcp(f"{bucket}/dcp", sd, options)
    assert sorted(report.files) == _names(f"{bucket}/dcp", options)


def test_hf_to_dcp_refuses_a_missing_bucket(s3: tuple[str, dict]) -> None:
    _, options = s3
    with pytest.raises(
        FileNotFoundError,
        match=r"s3://no-such-bucket-hf-dcp does not exist; create the bucket first",
    ):
        convert_hf_to_dcp("/nonexistent", "s3://no-such-bucket-hf-dcp/dcp", storage_options=options)


@pytest.mark.distributed
def test_two_rank_dcp_to_hf_to_dcp(dist_ckpt: tuple[str, str], tmp_path: Path) -> None:
    small, _ = dist_ckpt
    convert_dcp_to_hf(small, tmp_path / "hf", max_shard_size=100)
    convert_hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    expected = {name: original(name) for name in DIST_KEYS}
    _check_dcp(str(tmp_path / "dcp"), expected)
    _check_dcp(small, expected)  # the same load of the original agrees


# -- refusals ---------------------------------------------------------------------------------


def test_existing_destinations_are_refused_then_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = {"a": random_tensor((64,), F32, 1), "b": random_tensor((64,), F32, 2)}
    _save_single(tmp_path / "dcp", sd)
    hf, back = tmp_path / "hf", tmp_path / "back"
    convert_dcp_to_hf(tmp_path / "dcp", hf, max_shard_size=300)
    monkeypatch.setattr(convert, "HF_TO_DCP_CHUNK_BYTES", 100)
    convert_hf_to_dcp(hf, back)
    hf_before, back_before = folder_bytes(hf), folder_bytes(back)
    assert len(back_before) == 7  # 6 files of <= 100 bytes of data, and .metadata
    with pytest.raises(
        FileExistsError,
        match=rf"{re.escape(str(hf))} already holds a complete HF checkpoint \({INDEX}\); pass "
        r"overwrite=True to replace it",
    ):
        convert_dcp_to_hf(tmp_path / "dcp", hf, dtype="bf16")
    with pytest.raises(
        FileExistsError,
        match=rf"{re.escape(str(back))} already holds a DCP checkpoint \(.metadata\); pass "
        r"overwrite=True to replace it",
    ):
        convert_hf_to_dcp(hf, back, dtype="bf16")
    assert folder_bytes(hf) == hf_before and folder_bytes(back) == back_before
    # overwrite=True replaces both; the stale files of the old checkpoints go.
    convert_dcp_to_hf(tmp_path / "dcp", hf, dtype="bf16", overwrite=True)
    _check_hf(str(hf), {k: v.to(BF16) for k, v in sd.items()})
    monkeypatch.setattr(convert, "HF_TO_DCP_CHUNK_BYTES", 64 << 20)
    report = convert_hf_to_dcp(hf, back, overwrite=True)
    assert sorted(os.listdir(back)) == sorted(report.files) == [".metadata", "__0_0.distcp"]
    _check_dcp(str(back), {k: v.to(BF16) for k, v in sd.items()})


def test_sources_that_are_not_dcp_checkpoints(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    with pytest.raises(
        FileNotFoundError,
        match=r"missing is not a DCP checkpoint: the folder does not exist or is empty; pass the "
        r"folder dcp.save wrote",
    ):
        convert_dcp_to_hf(tmp_path / "missing", dst)
    dcp.save({"w": torch.ones(3)}, storage_writer=HFStorageWriter(str(tmp_path / "hf")))
    with pytest.raises(
        FileNotFoundError,
        match=r"hf is not a DCP checkpoint: it is a Hugging Face safetensors checkpoint; convert "
        r"it the other way with convert_hf_to_dcp",
    ):
        convert_dcp_to_hf(tmp_path / "hf", dst)
    _save_single(tmp_path / "dcp", {"w": torch.ones(3)})
    with pytest.raises(
        FileNotFoundError,
        match=r"dcp is a DCP checkpoint \(it has .metadata\), not a Hugging Face one; convert it "
        r"the other way with convert_dcp_to_hf",
    ):
        convert_hf_to_dcp(tmp_path / "dcp", dst)
    os.remove(tmp_path / "dcp" / ".metadata")
    with pytest.raises(
        FileNotFoundError, match=r"it has .distcp files but no .metadata: the save did not finish"
    ):
        convert_dcp_to_hf(tmp_path / "dcp", dst)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    with pytest.raises(
        FileNotFoundError,
        match=r"it has no .metadata \(found: notes.txt\); pass the folder dcp.save wrote",
    ):
        convert_dcp_to_hf(tmp_path / "other", dst)
    assert not dst.exists()


def test_broken_dcp_sources_are_refused_before_writing(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    src = tmp_path / "dcp"
    _save_single(
        src,
        {
            "w": random_tensor((6, 2), F32, 1),
            "z": torch.zeros(3, dtype=torch.complex128),
            "step": 3,
        },
    )
    # complex128 has no safetensors dtype: refused by name; dropping it converts the rest.
    with pytest.raises(
        ValueError,
        match=r"safetensors cannot hold the dtype of {'z': 'complex128'} .*drop these keys with "
        r"key_mapping",
    ):
        convert_dcp_to_hf(src, dst)
    assert not dst.exists()
    assert convert_dcp_to_hf(src, dst, key_mapping={"z": None}).skipped == ("z", "step")
    with pytest.raises(ValueError, match=r"nothing to convert"):
        convert_dcp_to_hf(src, tmp_path / "none", key_mapping={"w": None, "z": None})
    # A data file missing: refused before anything is written, naming it.
    _save_single(tmp_path / "lost", {"w": torch.ones(3)})
    os.remove(tmp_path / "lost" / "__0_0.distcp")
    with pytest.raises(
        FileNotFoundError,
        match=r"lost: the .metadata places chunks in \['__0_0.distcp'\], which the folder lacks",
    ):
        convert_dcp_to_hf(tmp_path / "lost", tmp_path / "out2")
    # A chunk missing from the metadata: the tensor would have a hole.
    metadata = pickle.loads((src / ".metadata").read_bytes())
    metadata.state_dict_metadata["w"].chunks.clear()
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        ValueError,
        match=r"the stored chunks of 'w' do not cover its shape \[6, 2\] exactly once \(0 of 12 "
        r"elements\)",
    ):
        convert_dcp_to_hf(src, tmp_path / "out2", key_mapping={"z": None})
    (src / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(
        ValueError,
        match=r"/.metadata cannot be unpickled \(.*\); it is corrupt, or was written by an "
        r"incompatible torch",
    ):
        convert_dcp_to_hf(src, tmp_path / "out2")
    assert not (tmp_path / "out2").exists() and not (tmp_path / "none").exists()


# -- memory -----------------------------------------------------------------------------------

_MEASURE = textwrap.dedent(
    """
    import json, sys
    import hf_dcp_storage.tools.convert as convert

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def peak_growth(fn, *args, **kwargs):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        before = status("VmRSS:")
        report = fn(*args, **kwargs)
        return status("VmHWM:") - before, report.bytes

    src, hf, dcp = sys.argv[1:4]
    to_hf = peak_growth(convert.convert_dcp_to_hf, src, hf, thread_count=4)
    convert.HF_TO_DCP_CHUNK_BYTES = 2 << 20  # 2 MiB slabs and files: 4 threads hold about 8 MiB
    to_dcp = peak_growth(convert.convert_hf_to_dcp, hf, dcp, thread_count=4)
    print(json.dumps({"to_hf": to_hf, "to_dcp": to_dcp}))
    """
)


@pytest.mark.distributed
@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS"
)
def test_memory_stays_bounded_by_chunks_not_checkpoint(
    dist_ckpt: tuple[str, str], tmp_path: Path
) -> None:
    """Converting 128 MiB stored as 1 MiB chunks raises the peak RSS of a fresh process by far
    less than 128 MiB (measured: about 25 MiB either way, most of it fixed costs)."""
    _, big = dist_ckpt
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, big, str(tmp_path / "hf"), str(tmp_path / "dcp")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    for direction, (growth, total) in measured.items():
        assert total == BIG_N * 2 * 2**20
        assert growth < total / 2, (
            f"{direction}: peak RSS grew by {growth / 2**20:.0f} MiB converting "
            f"{total / 2**20:.0f} MiB"
        )
    # And the data made it: spot-check two tensors in each output.
    hf = read_checkpoint(tmp_path / "hf")[0]
    for i in (0, BIG_N - 1):
        assert torch.equal(hf[f"big.{i}"], torch.full(BIG_SHAPE, float(i)))
    _check_dcp(
        str(tmp_path / "dcp"), {f"big.{i}": torch.full(BIG_SHAPE, float(i)) for i in (0, BIG_N - 1)}
    )
