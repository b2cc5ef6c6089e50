"""Quantized checkpoints loaded dequantized (``HFStorageReader(dequantize=dtype)``) into DTensor
shardings on 2 gloo ranks, from local disk and S3: FP8 block-wise (uneven shapes, a scale in
another file than its weight, float32 and bfloat16 scales) and MXFP4, bit-identical to PyTorch's
``QuantizedHuggingFaceStorageReader`` (FP8: its ``dcp.load``; MXFP4: its own dequantization of the
whole tensor, as torch 2.13's ``dcp.load`` through it fills only part of each row); each rank
reads its own blocks and every scale once. Bad files are refused naming the tensor, before any
destination changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hf_dcp_storage import HFStorageReader
from hf_dcp_storage.format.quantized import fp8_block_dequantize
from tests.support.dist import run_ranks

FP8_MAX = 448.0
DTYPE = torch.bfloat16  # what the loads dequantize into


def _fp8(shape: tuple[int, int], block: tuple[int, int], seed: int, scale_dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """A weight quantized block by block as DeepSeek's are: ``w = x / s``, ``s`` the block's
    amax / 448, stored as ``weight_scale_inv``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 3
    (br, bc), (rb, cb) = block, (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    pad = torch.zeros(rb * br, cb * bc)
    pad[: shape[0], : shape[1]] = x.abs()
    amax = pad.reshape(rb, br, cb, bc).amax(dim=(1, 3)).clamp(min=1e-4)
    scale = (amax / FP8_MAX).to(scale_dtype)
    full = scale.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return (x / full[: shape[0], : shape[1]]).to(torch.float8_e4m3fn), scale


def _mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return blocks, torch.randint(118, 134, shape[:-1], dtype=torch.uint8, generator=g)


def _write(folder: Path, files: dict[str, dict[str, torch.Tensor]], config: dict | None) -> None:
    folder.mkdir(parents=True)
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def _checkpoint(folder: Path) -> dict[str, tuple[int, ...]]:
    """A DeepSeek-like (FP8) and gpt-oss-like (MXFP4) folder; returns the dequantized shapes."""
    a, a_s = _fp8((300, 270), (128, 128), 1, torch.float32)
    b, b_s = _fp8((257, 129), (128, 128), 2, torch.bfloat16)
    blocks, scales = _mxfp4((4, 6, 5, 16), 3)
    g = torch.Generator().manual_seed(4)
    plain = {
        "norm.weight": torch.randn(270, generator=g).to(torch.bfloat16),
        "embed.weight": torch.randn(64, 270, generator=g).to(torch.bfloat16),
    }
    files = {
        "model-00001-of-00002.safetensors": {
            "a.weight": a,
            "a.weight_scale_inv": a_s,
            "b.weight_scale_inv": b_s,  # b's scales live in the other file than b
            **plain,
        },
        "model-00002-of-00002.safetensors": {
            "b.weight": b,
            "experts.up_blocks": blocks,
            "experts.up_scales": scales,
        },
    }
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    _write(folder, files, config)
    return {
        "a.weight": (300, 270),
        "b.weight": (257, 129),
        "experts.up_blocks": (4, 6, 160),
        "norm.weight": (270,),
        "embed.weight": (64, 270),
    }


def _oracle(folder: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """PyTorch's reader, whole tensors: its ``dcp.load`` for FP8 and plain tensors, its MXFP4
    dequantization given the whole blocks and scales (what its read path hands it)."""
    fp8 = {k: s for k, s in shapes.items() if not k.endswith("_blocks")}
    out = {k: torch.zeros(s, dtype=DTYPE) for k, s in fp8.items()}
    dcp.load(
        out,
        storage_reader=QuantizedHuggingFaceStorageReader(str(folder), target_dtype=DTYPE),
        no_dist=True,
    )
    from safetensors.torch import load_file

    stored = load_file(folder / "model-00002-of-00002.safetensors")
    reader = QuantizedHuggingFaceStorageReader(str(folder), target_dtype=DTYPE)
    blocks, scales = stored["experts.up_blocks"], stored["experts.up_scales"]
    req = SimpleNamespace(storage_offsets=(0, 0, 0), lengths=(4, 6, 160))
    out["experts.up_blocks"] = reader._dequantize_tensor_mxfp4(blocks, scales, req, 0, 0)
    return out


# Two loads of the same folder, each key sharded differently (dim, and the destination's dtype):
# rows cut inside a block, columns across block and group edges, experts split.
_LAYOUTS = [
    {"a.weight": 0, "b.weight": 1, "experts.up_blocks": 0, "norm.weight": 0, "embed.weight": 1},
    {"a.weight": 1, "b.weight": 0, "experts.up_blocks": 2, "embed.weight": 0},
]
_FLOAT32_DEST = {"b.weight"}  # converted again from the dequantized dtype, as torch's reader does


def _load_on_ranks(rank: int, world: int, url: str, options: dict | None, oracle: str) -> None:
    expected = torch.load(oracle)
    mesh = init_device_mesh("cpu", (world,))
    for layout in _LAYOUTS:
        state = {
            k: distribute_tensor(
                torch.full(
                    expected[k].shape, -7.0, dtype=torch.float32 if k in _FLOAT32_DEST else DTYPE
                ),
                mesh,
                [Shard(dim)],
            )
            for k, dim in layout.items()
        }
        reader = HFStorageReader(url, storage_options=options, dequantize=DTYPE)
        dcp.load(state, storage_reader=reader)
        for key, tensor in state.items():
            want = expected[key].to(tensor.dtype)
            got = tensor.full_tensor()
            assert got.dtype == tensor.dtype and torch.equal(got, want), (rank, layout, key)
        stats = reader.load_stats
        if options is None and layout is _LAYOUTS[0]:
            # Local reads are exact runs: the rank's own stored bytes, plus every scale once.
            scales = 3 * 3 * 4 + 3 * 2 * 2 + 4 * 6 * 5
            own = {
                "a.weight": 150 * 270,  # rows of FP8
                "b.weight": 257 * (65 if rank == 0 else 64),
                "experts.up_blocks": 2 * 6 * 5 * 16,  # two experts' whole groups
                "norm.weight": 135 * 2,
                "embed.weight": 64 * 135 * 2,
            }
            assert stats.bytes_wanted == sum(own.values()), (rank, stats)
            assert stats.bytes_read == stats.bytes_wanted + scales, (rank, stats)
    dist.barrier()


@pytest.mark.parametrize("store", ["local", "s3"])
def test_quantized_folders_load_dequantized_into_shards_bit_identical_to_torchs_reader(
    tmp_path, store, request
) -> None:
    folder = tmp_path / "ckpt"
    shapes = _checkpoint(folder)
    expected = _oracle(folder, shapes)
    assert all(t.abs().sum() > 0 for t in expected.values())
    torch.save(expected, tmp_path / "oracle.pt")
    url, options = str(folder), None
    if store == "s3":
        import s3fs

        url, options = request.getfixturevalue("moto_s3")
        s3fs.S3FileSystem(**options).put(str(folder) + "/", url + "/ckpt/", recursive=True)
        url += "/ckpt"
    run_ranks(_load_on_ranks, 2, url, options, str(tmp_path / "oracle.pt"))


def test_non_square_blocks_from_the_config_dequantize_block_by_block(tmp_path) -> None:
    w, scale = _fp8((100, 300), (32, 128), 5, torch.float32)
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 128]}}
    _write(
        tmp_path / "ckpt", {"m.safetensors": {"p.weight": w, "p.weight_scale_inv": scale}}, config
    )
    out = {"p.weight": torch.zeros(100, 300, dtype=torch.float32)}
    dcp.load(
        out,
        storage_reader=HFStorageReader(tmp_path / "ckpt", dequantize=torch.float32),
        no_dist=True,
    )
    full = scale.repeat_interleave(32, 0).repeat_interleave(128, 1)[:100, :300]
    assert torch.equal(out["p.weight"], w.to(torch.float32) * full)
    # The same slice math, one block row and column off the origin.
    got = fp8_block_dequantize(w[40:90, 130:250], scale[1:3, 1:2], (40, 130), block=(32, 128))
    assert torch.equal(got, out["p.weight"][40:90, 130:250])


def test_without_dequantize_quantized_tensors_load_as_stored(tmp_path) -> None:
    w, scale = _fp8((130, 140), (128, 128), 6, torch.float32)
    _write(tmp_path / "ckpt", {"m.safetensors": {"p.weight": w, "p.weight_scale_inv": scale}}, None)
    out = {
        "p.weight": torch.zeros(130, 140, dtype=torch.float8_e4m3fn),
        "p.weight_scale_inv": torch.zeros(2, 2),
    }
    dcp.load(out, storage_reader=HFStorageReader(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(out["p.weight"].view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(out["p.weight_scale_inv"], scale)


def _bad(folder: Path, case: str) -> None:
    w, scale = _fp8((200, 200), (128, 128), 7, torch.float32)
    blocks, scales = _mxfp4((2, 3, 16), 8)
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    tensors = {"p.weight": w, "p.weight_scale_inv": scale, "norm.weight": torch.ones(4)}
    if case == "missing scale":
        del tensors["p.weight_scale_inv"]
    elif case == "wrong scale shape":
        tensors["p.weight_scale_inv"] = scale[:1]
    elif case == "per-tensor scale":
        del tensors["p.weight_scale_inv"]
        tensors["p.weight_scale"] = torch.ones(())
    elif case == "unknown method":
        config["quantization_config"]["quant_method"] = "awq"
    elif case == "blocks without scales":
        tensors["x_blocks"] = blocks
    elif case == "mxfp4 scales of another shape":
        tensors["x_blocks"], tensors["x_scales"] = blocks, scales[:, :2].clone()
    elif case == "block size disagrees":
        config["quantization_config"]["weight_block_size"] = [64, 64]
    _write(folder, {"m.safetensors": tensors}, config)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing scale", r"tensor 'p.weight' is torch.float8_e4m3fn with no 'p.weight_scale_inv'"),
        (
            "wrong scale shape",
            r"tensor 'p.weight' \[200, 200\] has scales 'p.weight_scale_inv' \[1, 2\].*= \[2, 2\]",
        ),
        (
            "per-tensor scale",
            r"tensor 'p.weight' is torch.float8_e4m3fn with no 'p.weight_scale_inv'",
        ),
        ("unknown method", r"quant_method is 'awq'; the reader dequantizes fp8 and mxfp4 only"),
        (
            "blocks without scales",
            r"tensor 'x_blocks' is MXFP4 blocks \(uint8\) with no 'x_scales'",
        ),
        (
            "mxfp4 scales of another shape",
            r"tensor 'x_blocks' \[2, 3, 16\] has scales 'x_scales' \[2, 2\]",
        ),
        (
            "block size disagrees",
            r"'p.weight' \[200, 200\] has scales .* \[ceil\(rows / 64\), ceil\(cols / 64\)\]",
        ),
    ],
)
def test_bad_quantized_files_are_refused_naming_the_tensor_before_any_weight_changes(
    tmp_path, case, message
) -> None:
    _bad(tmp_path / "ckpt", case)
    out = {
        "norm.weight": torch.full((4,), 3.0),
        "p.weight": torch.full((200, 200), 3.0, dtype=DTYPE),
    }
    with pytest.raises(BaseException, match=message) as info:  # DCP may wrap it
        dcp.load(
            out, storage_reader=HFStorageReader(tmp_path / "ckpt", dequantize=DTYPE), no_dist=True
        )
    assert "load with dequantize=None" in str(info.value) or case == "block size disagrees"
    assert torch.equal(out["norm.weight"], torch.full((4,), 3.0))  # nothing was read
    assert torch.equal(out["p.weight"], torch.full((200, 200), 3.0, dtype=DTYPE))


def test_a_block_size_other_than_the_configs_and_bad_options_are_refused(tmp_path) -> None:
    _bad(tmp_path / "ckpt", "none")
    with pytest.raises(BaseException, match=r"block_size=64 but config.json's .* is \[128, 128\]"):
        dcp.load(
            {"p.weight": torch.zeros(200, 200)},
            storage_reader=HFStorageReader(tmp_path / "ckpt", dequantize=DTYPE, block_size=64),
            no_dist=True,
        )
    with pytest.raises(
        ValueError, match=r"dequantize=torch.int8: give the dtype to dequantize into"
    ):
        HFStorageReader(tmp_path / "ckpt", dequantize=torch.int8)
    with pytest.raises(ValueError, match=r"block_size is \(128, 0\); it must be a positive int"):
        HFStorageReader(tmp_path / "ckpt", dequantize=DTYPE, block_size=(128, 0))


def test_verify_checks_weights_and_scales_of_a_quantized_checkpoint_we_saved(tmp_path) -> None:
    from hf_dcp_storage import HFStorageWriter

    w, scale = _fp8((300, 270), (128, 128), 9, torch.float32)
    folder = tmp_path / "ckpt"
    dcp.save(
        {"p.weight": w, "p.weight_scale_inv": scale},
        storage_writer=HFStorageWriter(folder),
        no_dist=True,
    )
    expected = {"p.weight": torch.zeros(300, 270, dtype=DTYPE)}
    dcp.load(
        expected,
        storage_reader=QuantizedHuggingFaceStorageReader(str(folder), target_dtype=DTYPE),
        no_dist=True,
    )
    out = {"p.weight": torch.zeros(300, 270, dtype=DTYPE)}
    reader = HFStorageReader(folder, dequantize=DTYPE, verify=True)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["p.weight"], expected["p.weight"])
    # One scale byte flipped: the scales' own checksum fails, naming them.
    (file,) = folder.glob("*.safetensors")
    data = bytearray(file.read_bytes())
    at = data.rfind(scale.numpy().tobytes())
    assert at > 0
    data[at] ^= 0x40
    file.write_bytes(bytes(data))
    with pytest.raises(BaseException, match=r"tensor 'p.weight_scale_inv' fails its checksum"):
        dcp.load(
            out, storage_reader=HFStorageReader(folder, dequantize=DTYPE, verify=True), no_dist=True
        )
