"""FP8 block-wise export during a distributed save (``HFSavePlanner(quantize="fp8_block")``): on
2 gloo ranks, FSDP row shards cut inside a block and unevenly, TP column shards, a replicated
weight, the files equal one process quantizing the whole tensors bit for bit
(``fp8_block_quantize``), the tensors kept in bf16 are untouched, ``config.json`` carries the
``quantization_config``, and PyTorch's ``QuantizedHuggingFaceStorageReader`` and ours read the
export back to the same values, close to the originals. Local disk and S3 (moto).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hf_dcp_storage import HFSavePlanner, HFStorageReader, HFStorageWriter
from hf_dcp_storage.format.quantized import fp8_block_dequantize, fp8_block_quantize
from hf_dcp_storage.plan.fp8export import cut_blocks, default_filter, scale_region
from tests.support.dist import run_ranks

# key -> (shape, placement dim or None for replicated)
_TENSORS = {
    "layers.0.attn.q_proj.weight": ((300, 270), 0),  # rows 150 / 150: the cut inside block 1
    "layers.0.mlp.down_proj.weight": ((257, 200), 0),  # uneven rows, 129 / 128
    "layers.0.mlp.up_proj.weight": ((257, 129), 1),  # TP columns 65 / 64, across blocks
    "layers.0.mlp.gate_proj.weight": ((130, 140), None),  # replicated: one writer
    "layers.0.mlp.gate.weight": ((8, 270), 0),  # the router: kept
    "embed_tokens.weight": ((64, 270), 0),  # kept
    "layers.0.input_layernorm.weight": ((270,), None),  # kept
}
CONFIG = {"model_type": "deepseek_v3", "hidden_size": 270}


def _full(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(3) * 2
    if key.endswith("down_proj.weight"):
        x[:128, :128] = 0  # an all-zero block stays zero
    return x.to(torch.bfloat16)


def _save_on_ranks(rank: int, world: int, url: str, options: dict | None) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = {
        k: distribute_tensor(_full(k, s), mesh, [Replicate() if d is None else Shard(d)])
        for k, (s, d) in _TENSORS.items()
    }
    writer = HFStorageWriter(url, storage_options=options, companions={"config.json": CONFIG})
    dcp.save(state, storage_writer=writer, planner=HFSavePlanner(quantize="fp8_block"))
    dist.barrier()


def _files(url: str, options: dict | None, tmp: Path) -> Path:
    if options is None:
        return Path(url)
    import s3fs

    s3fs.S3FileSystem(**options).get(url + "/", str(tmp / "copy") + "/", recursive=True)
    return tmp / "copy"


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_sharded_fp8_export_equals_one_process_quantizing_the_whole_tensors(
    tmp_path, store, request
) -> None:
    url, options = str(tmp_path / "ckpt"), None
    if store == "s3":
        url, options = request.getfixturevalue("moto_s3")
        url += "/ckpt"
    run_ranks(_save_on_ranks, 2, url, options)
    folder = _files(url, options, tmp_path)
    saved = {}
    for file in folder.glob("*.safetensors"):
        saved.update(load_file(file))
    quantized = [k for k in _TENSORS if default_filter(k, _TENSORS[k][0])]
    assert sorted(quantized) == sorted(
        k for k in _TENSORS if k.endswith(("proj.weight",))
    )  # the router, embeddings and norms are kept
    for key, (shape, _) in _TENSORS.items():
        full = _full(key, shape)
        if key in quantized:
            want_w, want_s = fp8_block_quantize(full)
            assert saved[key].dtype == torch.float8_e4m3fn
            assert torch.equal(saved[key].view(torch.uint8), want_w.view(torch.uint8)), key
            assert torch.equal(saved[key + "_scale_inv"], want_s), key
        else:
            assert torch.equal(saved[key], full) and key + "_scale_inv" not in saved, key
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert config["hidden_size"] == 270
    # Read back by torch's reader and by ours: the same values, close to the originals.
    shapes = {k: s for k, (s, _) in _TENSORS.items()}
    theirs = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    reader = QuantizedHuggingFaceStorageReader(str(folder), target_dtype=torch.bfloat16)
    dcp.load(theirs, storage_reader=reader, no_dist=True)
    ours = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    ours_reader = HFStorageReader(url, storage_options=options, dequantize=torch.bfloat16)
    dcp.load(ours, storage_reader=ours_reader, no_dist=True)
    for key, shape in shapes.items():
        assert torch.equal(ours[key], theirs[key]), key
        full = _full(key, shape).float()
        error = (ours[key].float() - full).abs().max() / full.abs().max()
        assert error < 0.07, (key, float(error))
    assert torch.count_nonzero(ours["layers.0.mlp.down_proj.weight"][:128, :128]) == 0


def test_the_block_geometry_of_the_export() -> None:
    # Chunks that tile a 300 x 270 weight (rows cut at 150) give scale regions that tile 3 x 3.
    assert scale_region((0, 0), (150, 270), (128, 128)) == ([0, 0], [2, 3])
    assert scale_region((150, 0), (150, 270), (128, 128)) == ([2, 0], [1, 3])
    assert scale_region((130, 0), (10, 270), (128, 128)) == ([2, 0], [0, 3])  # no block starts
    assert cut_blocks((0, 0), (150, 270), (300, 270), (128, 128)) == [(1, 0), (1, 1), (1, 2)]
    assert cut_blocks((0, 0), (300, 270), (300, 270), (128, 128)) == []  # ragged edges: whole


def test_one_process_quantization_round_trips_within_fp8_precision() -> None:
    x = _full("layers.0.mlp.down_proj.weight", (257, 200)).float()
    w, scale = fp8_block_quantize(x)
    assert scale.shape == (3, 2) and scale.dtype == torch.float32
    back = fp8_block_dequantize(w, scale, (0, 0))
    assert torch.count_nonzero(back[:128, :128]) == 0
    # e4m3: 3 mantissa bits (relative error <= 2**-4), subnormals spaced 2**-9 scaled units.
    per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:257, :200]
    assert ((back - x).abs() <= x.abs() * 2**-4 + per_element * 2**-10).all()


def test_bad_export_options_and_a_clashing_scale_key_are_refused_before_writing(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"quantize='fp4': the one export is 'fp8_block'"):
        HFSavePlanner(quantize="fp4")
    state = {"p.weight": torch.ones(4, 4), "p.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(BaseException, match=r"would write 'p.weight_scale_inv' for 'p.weight'"):
        dcp.save(
            state,
            storage_writer=HFStorageWriter(tmp_path / "a"),
            planner=HFSavePlanner(quantize="fp8_block"),
            no_dist=True,
        )
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").glob("*.safetensors"))
    quantized = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    with pytest.raises(BaseException, match=r"has quantization_config .* but the save quantizes"):
        dcp.save(
            {"p.weight": torch.ones(4, 4)},
            storage_writer=HFStorageWriter(
                tmp_path / "b", companions={"config.json": {"quantization_config": quantized}}
            ),
            planner=HFSavePlanner(quantize="fp8_block"),
            no_dist=True,
        )
    assert not any((tmp_path / "b").glob("*.safetensors")) if (tmp_path / "b").exists() else True


def test_hf_dcp_verify_takes_an_fp8_export_with_its_config(tmp_path) -> None:
    """The scales beside the FP8 weights are parts of the model's tensors, not strays; a key
    that is nobody's part still is one."""
    from hf_dcp_storage import verify_checkpoint
    from tests.support.models import tiny_llama

    model = tiny_llama()
    config = model.config.to_dict()
    dcp.save(
        model.state_dict(),
        storage_writer=HFStorageWriter(tmp_path / "fp8", companions={"config.json": config}),
        planner=HFSavePlanner(quantize="fp8_block"),
        no_dist=True,
    )
    assert "quantization_config" in json.loads((tmp_path / "fp8" / "config.json").read_text())
    report = verify_checkpoint(tmp_path / "fp8")
    assert report.ok, report.problems
    state = dict(model.state_dict()) | {"model.stray.weight_scale_inv": torch.ones(1, 1)}
    dcp.save(
        state,
        storage_writer=HFStorageWriter(tmp_path / "stray", companions={"config.json": config}),
        planner=HFSavePlanner(quantize="fp8_block"),
        no_dist=True,
    )
    report = verify_checkpoint(tmp_path / "stray")
    assert [p.key for p in report.problems] == ["model.stray.weight_scale_inv"]
