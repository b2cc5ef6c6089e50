"""Interoperability with ``transformers``: a tiny Llama, nothing downloaded.

* Saved by 2 gloo ranks as Shard(0) DTensors with ``HFStorageWriter``, the folder loads with
  ``LlamaForCausalLM.from_pretrained`` and gives bit-identical logits.
* A folder written by ``model.save_pretrained`` (one ``model.safetensors``, or sharded with an
  index) loads with ``HFStorageReader`` into a state dict equal to the model's.

Both with ``tie_word_embeddings`` off and on: with it on, ``lm_head.weight`` and
``model.embed_tokens.weight`` are one tensor; DCP saves both keys, ``save_pretrained`` only one.
``transformers`` is imported lazily, so the spawned ranks do not pay for importing it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import (
    TIED_EMBEDDINGS,
    HFLoadPlanner,
    HFSavePlanner,
    HFStorageReader,
    HFStorageWriter,
)
from tests.support.dist import run_ranks
from tests.support.models import tiny_llama

TIES = [False, True]
TIE_IDS = ["untied", "tied"]
# ~360 KB of float32 weights: 100 KB files make several shards.
MAX_SHARD = "100KB"


def _load_pretrained(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    return model.eval(), info


def _logits(model) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids = torch.tensor([[1, 5, 17, 42, 99, 127, 0, 64, 3, 8]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _assert_state_dicts_equal(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: keys differ"
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), (
            f"{what}: {key!r} differs"
        )


# -- rank function: 2 ranks save the model's state dict as Shard(0) DTensors -----------------------


def _save_sharded_llama(
    rank: int, world: int, jobs: list[tuple[str, str, bool | None, bool]]
) -> None:
    """For each ``(state_dict_file, out_folder, direct_write, tied_once)``: shard over ``world``
    ranks and save (``tied_once``: the tied head left out, as ``save_pretrained`` does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for sd_file, out, direct_write, tied_once in jobs:
        full = torch.load(sd_file, weights_only=True)  # keeps tied keys sharing one storage
        sharded: dict[str, torch.Tensor] = {}
        by_storage: dict[int, torch.Tensor] = {}
        for key, tensor in full.items():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in by_storage:  # tied weights stay one DTensor under both keys
                by_storage[ptr] = distribute_tensor(tensor, mesh, [Shard(0)], src_data_rank=None)
            sharded[key] = by_storage[ptr]
        dcp.save(
            sharded,
            storage_writer=HFStorageWriter(
                out, max_shard_size=MAX_SHARD, direct_write=direct_write
            ),
            planner=HFSavePlanner(tied=TIED_EMBEDDINGS if tied_once else None),
        )


# -- tests -----------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_dcp_save_on_2_ranks_loads_with_from_pretrained(tmp_path: Path) -> None:
    models = {tie: tiny_llama(tie) for tie in TIES}
    jobs = []
    for tie, tag in zip(TIES, TIE_IDS, strict=True):
        sd = models[tie].state_dict()
        if tie:
            assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
        torch.save(sd, tmp_path / f"{tag}.pt")
        # the untied model takes the direct path, the tied one the staged (object-store) path
        jobs.append(
            (str(tmp_path / f"{tag}.pt"), str(tmp_path / tag), None if not tie else False, False)
        )
    jobs.append((str(tmp_path / "tied.pt"), str(tmp_path / "tied_once"), None, True))
    run_ranks(_save_sharded_llama, 2, jobs)

    for tie, tag in zip(TIES, TIE_IDS, strict=True):
        folder = tmp_path / tag
        original = models[tie]
        original.config.save_pretrained(folder)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) >= 3, (
            f"{tag}: max_shard_size={MAX_SHARD} should give several files, got {files}"
        )
        assert sorted(index["weight_map"]) == sorted(original.state_dict())

        loaded, info = _load_pretrained(folder)
        assert not info["missing_keys"] and not info["mismatched_keys"], f"{tag}: {info}"
        _assert_state_dicts_equal(loaded.state_dict(), original.state_dict(), tag)
        expected, actual = _logits(original), _logits(loaded)
        assert torch.equal(actual, expected), (
            f"{tag}: logits differ by up to {(actual - expected).abs().max()}"
        )

    # HFSavePlanner(tied=...): the head left out as save_pretrained leaves it; from_pretrained
    # ties it back, and HFLoadPlanner(tied=...) loads the one stored tensor into both keys.
    folder, original = tmp_path / "tied_once", models[True]
    original.config.save_pretrained(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(set(original.state_dict()) - {"lm_head.weight"})
    loaded, info = _load_pretrained(folder)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert torch.equal(_logits(loaded), _logits(original))
    dest = {k: torch.zeros_like(v) for k, v in original.state_dict().items()}
    dcp.load(
        dest,
        storage_reader=HFStorageReader(folder),
        planner=HFLoadPlanner(tied=TIED_EMBEDDINGS),
        no_dist=True,
    )
    _assert_state_dicts_equal(dest, dict(original.state_dict()), "tied_once")


def test_a_tied_key_left_out_must_hold_the_same_tensor(tmp_path: Path) -> None:
    sd = {"model.embed_tokens.weight": torch.ones(4, 2), "lm_head.weight": torch.zeros(4, 2)}
    with pytest.raises(BaseException, match=r"'lm_head.weight' is to be saved as .* a different"):
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(tmp_path / "x"),
            planner=HFSavePlanner(tied=TIED_EMBEDDINGS),
            no_dist=True,
        )
    with pytest.raises(ValueError, match=r"tied=\['lm_head.weight'\] must map an HF key"):
        HFLoadPlanner(tied=["lm_head.weight"])  # type: ignore[arg-type]


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single_file", "sharded"])
@pytest.mark.parametrize("tie", TIES, ids=TIE_IDS)
def test_reader_loads_save_pretrained_folder(
    tmp_path: Path, tie: bool, max_shard_size: str | None
) -> None:
    original = tiny_llama(tie)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    original.save_pretrained(tmp_path, **kwargs)
    if max_shard_size is None:
        assert (tmp_path / "model.safetensors").exists() and not (
            tmp_path / "model.safetensors.index.json"
        ).exists()
    else:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 3

    # save_pretrained writes a tied weight once; the reader must see exactly what is in the files.
    expected = dict(original.state_dict())
    if tie:
        del expected["lm_head.weight"]
    reader = HFStorageReader(tmp_path)
    assert sorted(reader.read_metadata().state_dict_metadata) == sorted(expected)

    dest = {key: torch.zeros_like(value) for key, value in expected.items()}
    dcp.load(dest, storage_reader=HFStorageReader(tmp_path))
    _assert_state_dicts_equal(dest, expected, f"save_pretrained({max_shard_size})")

    # Loading in place into another model's parameters reproduces the original's logits.
    other = tiny_llama(tie)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other_sd = other.state_dict()
    dcp.load({key: other_sd[key] for key in expected}, storage_reader=HFStorageReader(tmp_path))
    assert torch.equal(_logits(other), _logits(original))
