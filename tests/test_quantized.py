"""Dequantization (``format/quantized.py``) against PyTorch's ``QuantizedHuggingFaceStorageReader``
as the oracle: the same files (FP8 block-wise with ``weight_scale_inv``; MXFP4 ``_blocks`` and
``_scales``), uneven shapes (not multiples of 128), and slices that cross blocks and groups, each
dequantized from its own scale blocks only, bit-identical to the oracle's full tensor sliced.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

from hf_dcp_storage.format.quantized import (
    fp8_block_dequantize,
    fp8_scale_blocks,
    mxfp4_dequantize,
    mxfp4_groups,
)

FP8_MAX = 448.0


def _write(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir()
    save_file(tensors, folder / "model-00001-of-00001.safetensors")
    index = {
        "metadata": {},
        "weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors"),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _oracle(folder: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict:
    out = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    reader = QuantizedHuggingFaceStorageReader(str(folder), target_dtype=dtype)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _fp8(shape: tuple[int, int], block: int, seed: int, scale_dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """A weight quantized block by block as DeepSeek's are: ``w = round(x / s)``, ``s`` the
    block's amax / 448, stored as ``weight_scale_inv``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 3
    rb, cb = -(-shape[0] // block), -(-shape[1] // block)
    pad = torch.zeros(rb * block, cb * block)
    pad[: shape[0], : shape[1]] = x.abs()
    amax = pad.reshape(rb, block, cb, block).amax(dim=(1, 3)).clamp(min=1e-4)
    scale = (amax / FP8_MAX).to(scale_dtype)
    full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    w = (x / full[: shape[0], : shape[1]]).to(torch.float8_e4m3fn)
    return w, scale


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_dequantization_equals_torchs_reader_on_every_slice(
    tmp_path, dtype, scale_dtype
) -> None:
    shape, block = (300, 270), 128
    w, scale = _fp8(shape, block, 1, scale_dtype)
    _write(tmp_path / "ckpt", {"layers.0.mlp.weight": w, "layers.0.mlp.weight_scale_inv": scale})
    expected = _oracle(tmp_path / "ckpt", {"layers.0.mlp.weight": shape}, dtype)[
        "layers.0.mlp.weight"
    ]
    assert expected.abs().sum() > 0
    slices = [
        ((0, 0), shape),  # whole
        ((0, 0), (150, 270)),  # FSDP's row halves, the cut inside a block
        ((150, 0), (150, 270)),
        ((0, 135), (300, 135)),  # TP's column halves
        ((127, 1), (3, 257)),  # a sliver across block edges both ways
        ((256, 256), (44, 14)),  # the ragged last block alone
    ]
    for (r0, c0), (nr, nc) in slices:
        rows, cols = fp8_scale_blocks((r0, c0), (nr, nc), block)
        got = fp8_block_dequantize(
            w[r0 : r0 + nr, c0 : c0 + nc], scale[rows, cols], (r0, c0), block=block, dtype=dtype
        )
        want = expected[r0 : r0 + nr, c0 : c0 + nc]
        assert got.dtype == dtype and torch.equal(got, want), ((r0, c0), (nr, nc))


def test_fp8_scales_that_do_not_cover_the_slice_are_refused() -> None:
    w, scale = _fp8((200, 200), 128, 2, torch.float32)
    with pytest.raises(ValueError, match=r"blocks \[1, 2\] do not cover the weight slice"):
        fp8_block_dequantize(w, scale[:1], (0, 0))
    with pytest.raises(ValueError, match="are 2-D"):
        fp8_block_dequantize(w.reshape(-1), scale, (0, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantization_equals_torchs_reader_on_every_slice(tmp_path, dtype) -> None:
    """The oracle here is the reader's own MXFP4 dequantization, given the slice's groups and
    the full scales as its read path gives them: in torch 2.13 a ``dcp.load`` through it reads
    only the first ``G`` values of each row (the planner sees the quantized chunk's sizes)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(3)
    experts, rows, groups, width = 3, 5, 7, 16
    blocks = torch.randint(0, 256, (experts, rows, groups, width), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 134, (experts, rows, groups), dtype=torch.uint8, generator=g)
    _write(tmp_path / "ckpt", {"experts.up_blocks": blocks, "experts.up_scales": scales})
    reader = QuantizedHuggingFaceStorageReader(str(tmp_path / "ckpt"), target_dtype=dtype)
    reader.read_metadata()
    per_group = 2 * width
    # Whole, expert-parallel and column slices, across group edges: only the groups each needs.
    for e0, ne, start, n in [(0, 3, 0, 224), (0, 1, 0, 224), (1, 2, 5, 40), (2, 1, 31, 2)]:
        groups_needed, skip = mxfp4_groups(start, n, per_group)
        req = SimpleNamespace(storage_offsets=(e0, 0, start), lengths=(ne, rows, n))
        want = reader._dequantize_tensor_mxfp4(
            blocks[e0 : e0 + ne, :, groups_needed], scales, req, groups_needed.start, skip
        )
        got = mxfp4_dequantize(
            blocks[e0 : e0 + ne, :, groups_needed],
            scales[e0 : e0 + ne, :, groups_needed],
            dtype=dtype,
        )[..., skip : skip + n]
        assert want.shape == (ne, rows, n) and want.abs().sum() > 0
        assert got.dtype == dtype and torch.equal(got, want), (e0, start, n)


def test_mxfp4_scales_of_another_shape_are_refused() -> None:
    blocks = torch.zeros((2, 3, 16), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scales \[2, 4\] do not match blocks \[2, 3, 16\]"):
        mxfp4_dequantize(blocks, torch.zeros((2, 4), dtype=torch.uint8))
