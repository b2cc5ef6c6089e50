"""A DeepSeek-V3-like MoE state dict at a realistic expert count, through torchtitan's own
``DeepSeekV3StateDictAdapter`` (its grouped experts split into per-expert HF keys), on 4 gloo
ranks, local disk and S3 (moto).

64 routed experts in each of 4 MoE layers (768 expert tensors in HF keys) and a dense first
layer. Saved from a 2-D EP x FSDP mesh, the experts ``[_StridedShard(0), Shard(0)]`` as
torchtitan's EP with FSDP places them (each rank then holds 16 experts as plain tensors under
their own keys), the dense weights FSDP ``Shard(0)`` over the 4 ranks, the output head tied to the
embedding and saved once, as ``save_pretrained`` saves it. Every HF tensor in the files equals
its expert's slice of the grouped weight; loaded resharded onto another layout (EP 4 alone for
the experts, TP columns replicated twice for the dense weights) and through ``from_hf`` back into
grouped DTensors, every weight is exact, the embedding and head both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed in this interpreter: tests/test_integrations.py runs "
    "tests/integrations in .venv-integrations (created by scripts/setup/integrations_venv.sh)",
)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hf_dcp_storage import (
    TIED_EMBEDDINGS,
    HFLoadPlanner,
    HFSavePlanner,
    HFStorageReader,
    HFStorageWriter,
)
from tests.support.dist import run_ranks

WORLD, EXPERTS, MOE_LAYERS = 4, 64, 4
D, F, DENSE_F, VOCAB = 32, 16, 48, 96
_EXPERT_SHAPES = {"w1_EFD": (EXPERTS, F, D), "w3_EFD": (EXPERTS, F, D), "w2_EDF": (EXPERTS, D, F)}
_HF_EXPERT = {"w1_EFD": "gate_proj", "w3_EFD": "up_proj", "w2_EDF": "down_proj"}


def _titan_shapes() -> dict[str, tuple[int, ...]]:
    """torchtitan's DeepSeek-V3 keys (q_lora_rank 0), at small dims."""
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (VOCAB, D),
        "norm.weight": (D,),
        "lm_head.weight": (VOCAB, D),
    }
    for layer in range(1 + MOE_LAYERS):
        at = f"layers.{layer}."
        shapes |= {
            at + "attention.wq.weight": (48, D),
            at + "attention.wkv_a.weight": (40, D),
            at + "attention.kv_norm.weight": (24,),
            at + "attention.wkv_b.weight": (64, 24),
            at + "attention.wo.weight": (D, 48),
            at + "attention_norm.weight": (D,),
            at + "ffn_norm.weight": (D,),
        }
        if layer == 0:
            for w, shape in (("w1", (DENSE_F, D)), ("w2", (D, DENSE_F)), ("w3", (DENSE_F, D))):
                shapes[at + f"feed_forward.{w}.weight"] = shape
            continue
        for name, shape in _EXPERT_SHAPES.items():
            shapes[at + f"moe.routed_experts.inner_experts.{name}"] = shape
        shapes |= {
            at + "moe.router.gate.weight": (EXPERTS, D),
            at + "moe.expert_bias_E": (EXPERTS,),
            at + "moe.shared_experts.w1.weight": (F, D),
            at + "moe.shared_experts.w2.weight": (D, F),
            at + "moe.shared_experts.w3.weight": (F, D),
        }
    return shapes


def _full(key: str) -> torch.Tensor:
    key = "tok_embeddings.weight" if key == "lm_head.weight" else key  # tied
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 7919)
    return torch.randn(_titan_shapes()[key], generator=g).to(torch.bfloat16)


def _adapter() -> Any:
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    return DeepSeekV3StateDictAdapter(model_registry("debugmodel").model, None)


def _state(layout: str, zeros: bool) -> dict[str, torch.Tensor]:
    """torchtitan's state dict on this rank: ``save`` (EP x FSDP) or ``load`` (EP 4; TP x 2)."""
    rank = dist.get_rank()
    if layout == "save":
        ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        experts = (ep, [_StridedShard(0, split_factor=2), Shard(0)])
        dense_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        dense = {2: [Shard(0)], 1: [Shard(0)]}
        # The slice torchtitan's placements give rank (efsdp i, ep j): experts 16 (2 j + i) on.
        block = EXPERTS // WORLD
        first = block * (2 * ep["ep"].get_local_rank() + ep["efsdp"].get_local_rank())
    else:
        ep = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        experts = (ep, [Shard(0)])
        dense_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dense = {2: [Replicate(), Shard(1)], 1: [Replicate(), Replicate()]}
        first = EXPERTS // WORLD * rank
    state: dict[str, torch.Tensor] = {}
    for key in _titan_shapes():
        if key == "lm_head.weight":
            continue
        full = _full(key)
        if zeros:
            full = torch.zeros_like(full)
        if "inner_experts" in key:
            mesh, placements = experts
            local = full[first : first + EXPERTS // WORLD].contiguous()
            state[key] = DTensor.from_local(local, mesh, placements, run_check=False)
        else:
            state[key] = distribute_tensor(full, dense_mesh, dense[full.dim()])
    state["lm_head.weight"] = state["tok_embeddings.weight"]  # tied: one DTensor, two keys
    return state


def _on_ranks(rank: int, world: int, url: str, options: dict | None) -> None:
    # The save layout's DTensors are what torchtitan's placements say they are.
    saved = _state("save", zeros=False)
    for key, value in saved.items():
        assert torch.equal(value.full_tensor(), _full(key)), key
    hf = _adapter().to_hf(saved)
    experts = [k for k in hf if ".mlp.experts." in k]
    assert len(experts) == MOE_LAYERS * 3 * EXPERTS // WORLD  # this rank's 16 experts' tensors
    assert not any(isinstance(hf[k], DTensor) for k in experts)  # plain: keys of their own
    writer = HFStorageWriter(url, storage_options=options, max_shard_size="256KB")
    dcp.save(hf, storage_writer=writer, planner=HFSavePlanner(tied=TIED_EMBEDDINGS))

    adapter = _adapter()
    target = _state("load", zeros=True)
    hf_target = adapter.to_hf(target)
    reader = HFStorageReader(url, storage_options=options)
    dcp.load(hf_target, storage_reader=reader, planner=HFLoadPlanner(tied=TIED_EMBEDDINGS))
    loaded = adapter.from_hf(hf_target)
    assert sorted(loaded) == sorted(_titan_shapes())
    for key, value in loaded.items():
        assert torch.equal(value.full_tensor(), _full(key)), key
    dist.barrier()


def _files(url: str, options: dict | None, tmp: Path) -> dict[str, torch.Tensor]:
    if options is not None:
        import s3fs

        s3fs.S3FileSystem(**options).get(url + "/", str(tmp / "copy") + "/", recursive=True)
        url = str(tmp / "copy")
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(url).glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("store", ["local", "s3"])
def test_deepseek_experts_through_torchtitans_adapter_save_and_reshard_exactly(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    url, options = str(tmp_path / "ckpt"), None
    if store == "s3":
        url, options = request.getfixturevalue("moto_s3")
        url += "/ckpt"
    run_ranks(_on_ranks, WORLD, url, options)
    files = _files(url, options, tmp_path)
    experts = {k for k in files if ".mlp.experts." in k}
    assert len(experts) == MOE_LAYERS * 3 * EXPERTS
    assert "lm_head.weight" not in files  # tied: saved once, as save_pretrained does
    assert torch.equal(files["model.embed_tokens.weight"], _full("tok_embeddings.weight"))
    for layer in range(1, 1 + MOE_LAYERS):
        for name, hf_name in _HF_EXPERT.items():
            grouped = _full(f"layers.{layer}.moe.routed_experts.inner_experts.{name}")
            for e in range(EXPERTS):
                key = f"model.layers.{layer}.mlp.experts.{e}.{hf_name}.weight"
                assert torch.equal(files[key], grouped[e]), key
    router = files["model.layers.1.mlp.gate.weight"]
    assert torch.equal(router, _full("layers.1.moe.router.gate.weight"))
