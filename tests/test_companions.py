"""Companion files: ``HFStorageWriter(companions=...)`` makes the checkpoint a complete HF model
folder (config, generation config, tokenizer), so ``from_pretrained`` needs no extra step.

* 2 gloo ranks save a tiny ``transformers`` Llama as Shard(0) DTensors with the folder that
  ``save_pretrained`` wrote for its config and tokenizer as ``companions``, on local disk (a local
  folder) and on S3 (moto, radosgw; the folder on S3 too): ``from_pretrained`` of the checkpoint
  (``AutoModelForCausalLM``, ``AutoTokenizer``) gives the model's logits and the tokenizer's ids,
  and the companion files are the source's bytes.
* A dict of contents (bytes, text, dict as JSON, a local path) is written as given.
* Bad names and values are refused where the writer is made; a missing file fails the save
  before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import HFStorageWriter
from tests.support.checks import raises_in_checkpoint
from tests.support.dist import run_ranks
from tests.support.models import tiny_llama

INDEX = "model.safetensors.index.json"


def _tiny_tokenizer():  # type: ignore[no-untyped-def]
    """A word-level tokenizer of 128 ids (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1} | {f"w{i}": i for i in range(2, 128)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _source_folder(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The model, and a folder with what ``save_pretrained`` writes besides the weights."""
    model = tiny_llama(seed=4321)
    source = tmp_path / "source"
    model.config.save_pretrained(source)
    model.generation_config.save_pretrained(source)
    _tiny_tokenizer().save_pretrained(source)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    return model, source


def _save(rank: int, world: int, sd_file: str, url: str, options: dict | None, src: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.load(sd_file, weights_only=True)
    sd = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options, companions=src))


def _check_complete_folder(folder: Path, source: Path, model) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in [p.name for p in source.iterdir()]:
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([[1, 5, 17, 42, 99, 127, 0, 64, 3, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    text = "w5 w17 w99 unknown w3"
    assert (
        AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
        == _tiny_tokenizer()(text)["input_ids"]
    )


@pytest.mark.distributed
def test_a_folder_of_companions_makes_a_complete_model_folder_on_local_disk(tmp_path) -> None:
    model, source = _source_folder(tmp_path)
    out = tmp_path / "ckpt"
    run_ranks(_save, 2, str(tmp_path / "sd.pt"), str(out), None, str(source))
    assert {"config.json", "generation_config.json", "tokenizer.json", INDEX} <= {
        p.name for p in out.iterdir()
    }
    _check_complete_folder(out, source, model)


@pytest.mark.distributed
def test_a_remote_folder_of_companions_makes_a_complete_model_folder_on_s3(s3, tmp_path) -> None:
    import s3fs

    bucket, options = s3
    model, source = _source_folder(tmp_path)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    # The companions from a folder on the store too (a hub snapshot kept next to the runs).
    remote = f"{bucket}/assets"
    for p in source.iterdir():
        fs.pipe_file(f"{remote.removeprefix('s3://')}/{p.name}", p.read_bytes())
    url = f"{bucket}/run/step_1"
    run_ranks(_save, 2, str(tmp_path / "sd.pt"), url, options, remote)
    root = url.removeprefix("s3://")
    local = tmp_path / "downloaded"
    local.mkdir()
    for path in fs.find(root):
        if "/.hf_dcp_staging/" not in path:
            (local / path.removeprefix(root + "/")).write_bytes(fs.cat_file(path))
    _check_complete_folder(local, source, model)


def test_a_dict_of_companions_is_written_as_given(tmp_path) -> None:
    extra = tmp_path / "notes.md"
    extra.write_bytes(b"# trained here\n")
    config = {"model_type": "llama", "hidden_size": 8, "name": "caf\u00e9"}
    companions = {
        "config.json": config,
        "chat_template.jinja": "{{ messages }}",
        "tokenizer.model": b"\x00\x01binary",
        "README.md": extra,
    }
    out = tmp_path / "ckpt"
    dcp.save(
        {"w": torch.arange(6.0).reshape(2, 3)},
        storage_writer=HFStorageWriter(str(out), companions=companions),
    )
    assert json.loads((out / "config.json").read_text()) == config
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (out / "tokenizer.model").read_bytes() == b"\x00\x01binary"
    assert (out / "README.md").read_bytes() == b"# trained here\n"
    assert (out / INDEX).exists()


@pytest.mark.parametrize(
    ("companions", "match"),
    [
        ({"sub/config.json": b"{}"}, "not a plain file name"),
        ({"..": b"{}"}, "not a plain file name"),
        ({INDEX: b"{}"}, "the checkpoint's own"),
        ({"model-00001-of-00002.safetensors": b""}, "the checkpoint's own"),
        ({".hf_dcp_staging": b""}, "the checkpoint's own"),
        ({"config.json": 3}, r"companions\['config.json'\] is a int"),
        (["config.json"], "companions=list"),
    ],
)
def test_bad_companions_are_refused_where_the_writer_is_made(tmp_path, companions, match) -> None:
    with pytest.raises(ValueError, match=match):
        HFStorageWriter(str(tmp_path / "ckpt"), companions=companions)


@pytest.mark.parametrize("missing", ["file", "folder"])
def test_a_missing_companion_fails_the_save_before_anything_is_written(tmp_path, missing) -> None:
    out = tmp_path / "ckpt"
    if missing == "file":
        companions: object = {"config.json": tmp_path / "nowhere.json"}
        match = "no file at .*nowhere.json"
    else:
        (tmp_path / "empty").mkdir()
        companions, match = str(tmp_path / "empty"), "holds none of the model files"
    writer = HFStorageWriter(str(out), companions=companions)  # type: ignore[arg-type]
    with raises_in_checkpoint(FileNotFoundError, match):
        dcp.save({"w": torch.ones(4)}, storage_writer=writer)
    assert not out.exists() or not any(out.iterdir())


def test_checkpoint_manager_writes_the_companions_into_each_steps_weights_folder(tmp_path) -> None:
    """Every step's weights folder is a complete model folder; the training state's is not
    given the model's files."""
    from hf_dcp_storage import CheckpointManager

    config = {"model_type": "llama", "hidden_size": 8}
    with CheckpointManager(str(tmp_path / "run"), companions={"config.json": config}) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step))}, {"lr": torch.ones(2)})
    steps = sorted(p for p in (tmp_path / "run").iterdir() if p.is_dir())
    assert [p.name for p in steps] == ["step_1", "step_2"]
    for folder in steps:
        assert json.loads((folder / "config.json").read_text()) == config
        assert (folder / INDEX).exists()
        assert not (folder / "training_state" / "config.json").exists()
        assert (folder / "training_state").is_dir()


def test_verify_checks_config_json_against_the_weights(tmp_path) -> None:
    """``verify_checkpoint`` builds the model ``config.json`` describes (meta device) and
    compares names and shapes: the right config passes (``lm_head`` tied to the embedding may be
    absent), a wider, deeper or unknown model is reported, naming the tensors."""
    from hf_dcp_storage import verify_checkpoint

    model = tiny_llama(seed=4321)
    sd = model.state_dict()
    config = model.config.to_dict()

    def saved(name: str, cfg: dict, state: dict) -> Path:
        out = tmp_path / name
        writer = HFStorageWriter(str(out), companions={"config.json": cfg})
        dcp.save(state, storage_writer=writer)
        return out

    right = verify_checkpoint(saved("right", config, sd))
    assert right.ok, right.problems
    assert not [n for n in right.notes if "config.json" in n], right.notes

    tied = verify_checkpoint(
        saved(
            "tied",
            config | {"tie_word_embeddings": True},
            {k: v for k, v in sd.items() if k != "lm_head.weight"},
        )
    )
    assert tied.ok, tied.problems

    wider = verify_checkpoint(saved("wider", config | {"intermediate_size": 256}, sd))
    shapes = [p for p in wider.problems if "from_pretrained refuses it" in p.message]
    assert {p.key for p in shapes} >= {"model.layers.0.mlp.up_proj.weight"}, wider.problems
    assert "[128, 64] in the files, [256, 64]" in shapes[0].message or any(
        "[64, 128] in the files, [64, 256]" in p.message for p in shapes
    ), [p.message for p in shapes]

    deeper = verify_checkpoint(saved("deeper", config | {"num_hidden_layers": 3}, sd))
    missing = {p.key for p in deeper.problems if "held by no file" in p.message}
    assert "model.layers.2.self_attn.q_proj.weight" in missing, deeper.problems

    renamed = {("base." + k if k.startswith("model.") else k): v for k, v in sd.items()}
    mapped = verify_checkpoint(saved("renamed", config, renamed))
    assert any("key-mapping mistake" in p.message for p in mapped.problems), mapped.problems

    unknown = verify_checkpoint(saved("unknown", {"model_type": "no-such-model"}, sd))
    assert unknown.ok and any("not checked against the weights" in n for n in unknown.notes)
