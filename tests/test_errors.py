"""Bad input: a clear error naming the value, the rule and the fix; nothing written, nothing
lost."""

from __future__ import annotations

import io
import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from hf_dcp_storage import HFLoadPlanner, HFSavePlanner, HFStorageReader, HFStorageWriter
from tests.support.checks import raises_in_checkpoint


def test_non_tensor_values_are_listed_before_anything_is_created(tmp_path) -> None:
    url = str(tmp_path / "ck")
    sd = {"w": torch.ones(2), "step": 3, "name": "run-1", "blob": io.BytesIO(b"x")}
    with raises_in_checkpoint(
        ValueError,
        r"these state-dict values are not tensors: \['blob', 'name', 'step'\]. Save them "
        r"separately",
    ):
        dcp.save(sd, storage_writer=HFStorageWriter(url))
    assert not os.path.exists(url)


def test_a_plan_without_its_chunks_is_refused_before_anything_is_created(tmp_path) -> None:
    from torch.distributed.checkpoint.planner import SavePlan

    writer = HFStorageWriter(str(tmp_path / "ck"))
    writer.set_up_storage_writer(True)
    sent = writer.prepare_local_plan(SavePlan([]))
    with pytest.raises(
        RuntimeError,
        match=r"1 of 2 ranks sent no compact plan: HFStorageWriter.prepare_local_plan must be the "
        r"last step",
    ):
        writer.prepare_global_plan([sent, SavePlan([], storage_data=("w",))])
    assert not (tmp_path / "ck").exists()


def test_unsupported_dtype_is_named_before_anything_is_created(tmp_path) -> None:
    url = str(tmp_path / "ck")
    with raises_in_checkpoint(
        ValueError, r"dtype torch.complex128 of 'z' cannot be stored in safetensors"
    ):
        dcp.save({"z": torch.zeros(2, dtype=torch.complex128)}, storage_writer=HFStorageWriter(url))
    assert not os.path.exists(url)


def test_key_mapping_collision_is_rejected(tmp_path) -> None:
    url = str(tmp_path / "ck")
    planner = HFSavePlanner(key_mapping={"a": "x", "b": "x"})
    with raises_in_checkpoint(
        ValueError,
        r"key_mapping maps both 'a' and 'b' to 'x'; each HF key must come from exactly one",
    ):
        dcp.save(
            {"a": torch.ones(1), "b": torch.ones(1)},
            storage_writer=HFStorageWriter(url),
            planner=planner,
        )
    assert not os.path.exists(url)


def test_key_mapping_must_return_a_string(tmp_path) -> None:
    with raises_in_checkpoint(
        ValueError, r"key_mapping maps 'a' to None; it must return a non-empty str"
    ):
        dcp.save(
            {"a": torch.ones(1)},
            storage_writer=HFStorageWriter(str(tmp_path)),
            planner=HFSavePlanner(key_mapping=lambda k: None),
        )


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: HFStorageWriter("x", max_shard_size="lots"),
            r"max_shard_size='lots' is not a positive size",
        ),
        (lambda: HFStorageWriter("x", thread_count=0), r"thread_count=0 must be an int >= 1"),
        (lambda: HFStorageReader("x", thread_count=-1), r"thread_count=-1 must be an int >= 1"),
        (
            lambda: HFStorageWriter("memory://x", direct_write=True),
            r"direct_write=True needs positioned writes, which memory://x does not support",
        ),
        (
            lambda: HFStorageWriter("x", fqn_to_index_mapping=[1]),
            r"fqn_to_index_mapping must be a dict of key -> 1-based file index, got list",
        ),
        (
            lambda: HFSavePlanner(save_dtype=torch.int8),
            r"save_dtype=torch.int8 must be a floating-point torch.dtype",
        ),
        (
            lambda: HFSavePlanner(key_mapping=5),
            r"key_mapping must be a dict or a callable FQN -> HF key, got int",
        ),
        (
            lambda: HFLoadPlanner(key_mapping=[("a", "b")]),
            r"key_mapping must be a dict or a callable FQN -> HF key, got list",
        ),
    ],
    ids=[
        "shard-size",
        "threads",
        "reader-threads",
        "direct-remote",
        "mapping-type",
        "save-dtype",
        "key-mapping",
        "load-key-mapping",
    ],
)
def test_bad_options_fail_at_construction(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_writer_without_path_says_where_to_give_it() -> None:
    with raises_in_checkpoint(
        ValueError,
        r"HFStorageWriter has no path: pass HFStorageWriter\(path\) or dcp.save\(..., "
        r"checkpoint_id=path\)",
    ):
        dcp.save({"a": torch.ones(1)}, storage_writer=HFStorageWriter())


# -- reading damaged or foreign checkpoints ------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> str:
    url = str(tmp_path / "ck")
    dcp.save(
        {"a": torch.arange(6.0), "b": torch.ones(3, 2)},
        storage_writer=HFStorageWriter(url, max_shard_size=24),
    )
    return url


def _load(url: str, **tensors: torch.Tensor) -> None:
    dcp.load(
        tensors or {"a": torch.zeros(6), "b": torch.zeros(3, 2)},
        storage_reader=HFStorageReader(url),
    )


def _edit_index(url: str, edit) -> None:
    path = os.path.join(url, "model.safetensors.index.json")
    index = json.loads(open(path).read())
    edit(index)
    open(path, "w").write(json.dumps(index))


@pytest.mark.parametrize(
    "bad", ["../x.safetensors", "/etc/passwd", "sub/../../x", "c:\\x", "s3://b/x"]
)
def test_weight_map_paths_outside_the_folder_are_refused(saved: str, bad: str) -> None:
    _edit_index(saved, lambda ix: ix["weight_map"].update(a=bad))
    with raises_in_checkpoint(
        AssertionError,
        r"weight_map names file .* which is not a plain relative path inside the checkpoint folder",
    ):
        _load(saved)


def test_weight_map_naming_a_missing_file(saved: str) -> None:
    _edit_index(saved, lambda ix: ix["weight_map"].update(a="model-00009-of-00009.safetensors"))
    with raises_in_checkpoint(
        AssertionError,
        r"model-00009-of-00009.safetensors: file named by the checkpoint index does not exist",
    ):
        _load(saved)


def test_weight_map_naming_a_key_the_file_lacks(saved: str) -> None:
    _edit_index(saved, lambda ix: ix["weight_map"].update(zzz="model-00001-of-00002.safetensors"))
    with raises_in_checkpoint(
        AssertionError, r"the index maps 'zzz' to this file, but its header has no such tensor"
    ):
        _load(saved)


def test_index_that_is_not_json(saved: str) -> None:
    open(os.path.join(saved, "model.safetensors.index.json"), "w").write("{oops")
    with raises_in_checkpoint(AssertionError, r"model.safetensors.index.json: not valid JSON"):
        _load(saved)


def _drop_recorded_headers(url: str) -> None:
    """As a checkpoint saved by other tools: the loader reads every file's header."""
    _edit_index(url, lambda ix: ix["metadata"].pop("headers"))


def test_truncated_file(saved: str) -> None:
    path = os.path.join(saved, "model-00002-of-00002.safetensors")
    os.truncate(path, os.path.getsize(path) - 1)
    # The index's copy of the header is read, not the file's: the data read finds the end.
    with raises_in_checkpoint(
        ValueError,
        r"model-00002-of-00002.safetensors: unexpected end of file at byte \d+; the file is "
        r"truncated",
    ):
        _load(saved)
    _drop_recorded_headers(saved)
    with raises_in_checkpoint(
        AssertionError,
        r"model-00002-of-00002.safetensors: tensor data ends at byte \d+ but the file has \d+ "
        r"bytes \(truncated\)",
    ):
        _load(saved)


def test_corrupt_and_oversize_headers(saved: str) -> None:
    path = os.path.join(saved, "model-00001-of-00002.safetensors")
    data = bytearray(open(path, "rb").read())
    data[8] = ord("#")  # the opening brace of the JSON
    open(path, "wb").write(bytes(data))
    # The loader reads the index's copy of the headers: the data is intact, so it loads (and
    # verify_checkpoint reports the broken header, tests/test_inspect_verify.py).
    out = {"a": torch.zeros(6), "b": torch.zeros(3, 2)}
    dcp.load(out, storage_reader=HFStorageReader(saved, verify=True))
    assert torch.equal(out["a"], torch.arange(6.0)) and torch.equal(out["b"], torch.ones(3, 2))
    _drop_recorded_headers(saved)
    with raises_in_checkpoint(
        AssertionError, r"model-00001-of-00002.safetensors: header is not valid UTF-8 JSON"
    ):
        _load(saved)
    data[:8] = struct.pack("<Q", 2**40)
    open(path, "wb").write(bytes(data))
    with raises_in_checkpoint(
        AssertionError,
        r"header length 1099511627776 exceeds the 100000000-byte cap; the file is corrupt",
    ):
        _load(saved)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda h: h.update({"model-00001-of-00002.safetensors": "x"}),
            r"the entry of 'model-00001-of-00002.safetensors' is x",
        ),
        (
            lambda h: h["model-00001-of-00002.safetensors"].update(header="{oops"),
            (
                r"metadata.headers\['model-00001-of-00002.safetensors'\]: header is not valid "
                r"UTF-8 "
                r"JSON"
            ),
        ),
        (
            lambda h: h["model-00001-of-00002.safetensors"].update(size=10),
            r"metadata.headers\['model-00001-of-00002.safetensors'\]: .*truncated",
        ),
    ],
    ids=["shape", "json", "size"],
)
def test_a_malformed_recorded_header_is_refused(saved: str, edit, message: str) -> None:
    _edit_index(saved, lambda ix: edit(ix["metadata"]["headers"]))
    with raises_in_checkpoint(AssertionError, message):
        _load(saved)


def test_overlapping_offsets(tmp_path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    body = json.dumps(header).encode()
    body += b" " * (-(8 + len(body)) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + bytes(12))
    with raises_in_checkpoint(
        AssertionError, r"tensor 'b' at data_offsets \[4, 12\] overlaps the previous tensor"
    ):
        _load(str(tmp_path), a=torch.zeros(2))


def test_requested_key_missing_lists_it_with_its_hf_name(saved: str) -> None:
    planner = HFLoadPlanner(key_mapping={"c": "hf.c"})
    with raises_in_checkpoint(
        KeyError,
        r"checkpoint has no tensor for 'c' \(as 'hf.c'\); it holds 2 keys such as \['a', 'b'\]",
    ):
        dcp.load(
            {"a": torch.zeros(6), "c": torch.zeros(1)},
            storage_reader=HFStorageReader(saved),
            planner=planner,
        )
    # With allow_partial_load the missing key is skipped and the rest loads.
    out = {"a": torch.zeros(6), "c": torch.zeros(1)}
    dcp.load(
        out,
        storage_reader=HFStorageReader(saved),
        planner=HFLoadPlanner(key_mapping={"c": "hf.c"}, allow_partial_load=True),
    )
    assert torch.equal(out["a"], torch.arange(6.0)) and out["c"].item() == 0


def test_shape_mismatch_names_both_shapes(saved: str) -> None:
    with raises_in_checkpoint(
        ValueError,
        r"shape mismatch for 'b': the checkpoint stores 'b' as \[3, 2\] but the destination is "
        r"\[2, 3\]",
    ):
        dcp.load(
            {"b": torch.zeros(2, 3)}, storage_reader=HFStorageReader(saved), planner=HFLoadPlanner()
        )
    # The default planner reports it too (DCP's own check).
    with raises_in_checkpoint(
        ValueError,
        r"Size mismatch between saved torch.Size\(\[3, 2\]\) and current: torch.Size\(\[2, 3\]\) "
        r"for b",
    ):
        dcp.load({"b": torch.zeros(2, 3)}, storage_reader=HFStorageReader(saved))


def test_reader_accepts_a_single_file_written_by_safetensors(tmp_path) -> None:
    save_file({"w": torch.arange(4.0).reshape(2, 2)}, str(tmp_path / "model.safetensors"))
    out = {"w": torch.zeros(2, 2)}
    _load(str(tmp_path), **out)
    assert torch.equal(out["w"], torch.arange(4.0).reshape(2, 2))
