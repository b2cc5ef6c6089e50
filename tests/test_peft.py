"""PEFT adapters of a sharded ``transformers`` Llama on 2 gloo ranks (FSDP2, and the LoRA
matrices split as tensor parallelism splits them), with the ``peft`` package as the oracle, local
disk and S3 (moto):

* saved by every rank (``integrations.peft.save_adapter``): the folder is what
  ``PeftModel.save_pretrained`` writes (the same keys and tensors in ``adapter_model.safetensors``,
  the same ``adapter_config.json``), and ``PeftModel.from_pretrained(base, folder)`` gives the
  sharded model's logits bit for bit;
* a folder ``save_pretrained`` wrote loads into the sharded model (``load_adapter``), resharded:
  every adapter tensor equal to the one saved, the base weights untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.support.dist import run_ranks
from tests.support.models import tiny_llama

peft = pytest.importorskip("peft")


def _peft_model(lora_seed: int) -> Any:
    """The tiny Llama with LoRA on q/v projections, B drawn (not zero) under ``lora_seed``."""
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    base = tiny_llama(seed=1234)
    torch.manual_seed(lora_seed)
    return peft.get_peft_model(base, config).eval()


def _logits(model: Any) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 17, 42, 99, 127, 0, 64, 3, 8]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _shard(model: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tensor_parallel(model: Any) -> Any:
    """The LoRA matrices as tensor parallelism splits them: A by its input features (row-wise),
    B by its output features (column-wise); the base stays whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    split = 0
    for name, module in model.named_modules():
        if name.endswith(("lora_A.default", "lora_B.default")):
            dim = 1 if ".lora_A." in name else 0
            weight = distribute_tensor(module.weight.detach(), mesh, [Shard(dim)])
            module.weight = torch.nn.Parameter(weight)
            split += 1
    assert split == 8  # 2 layers x (q, v) x (A, B)
    return model


def _on_ranks(
    rank: int, world: int, ours: str, theirs: str, options: dict | None, out: str, layout: str
) -> None:
    from torch.distributed.tensor import DTensor

    from hf_dcp_storage.integrations.peft import load_adapter, save_adapter

    shard = _shard if layout == "fsdp" else _tensor_parallel
    trained = shard(_peft_model(lora_seed=7))
    save_adapter(trained, ours, storage_options=options)
    # Another job: the same base, another LoRA init, then the folder save_pretrained wrote.
    other = shard(_peft_model(lora_seed=99))
    load_adapter(other, theirs, storage_options=options)
    full = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in other.state_dict().items()
    }
    if rank == 0:
        torch.save(full, out)
    dist.barrier()


@pytest.mark.parametrize(("store", "layout"), [("local", "fsdp"), ("s3", "fsdp"), ("local", "tp")])
def test_adapters_of_a_sharded_model_save_and_load_as_peft_folders(
    tmp_path: Path, store: str, layout: str, request: pytest.FixtureRequest
) -> None:
    trained = _peft_model(lora_seed=7)
    reference = tmp_path / "save_pretrained"
    trained.save_pretrained(reference)  # what peft itself writes, one process
    saved_by_peft = load_file(reference / "adapter_model.safetensors")
    assert saved_by_peft and all(".lora_" in k for k in saved_by_peft)
    pretrained_other = _peft_model(lora_seed=21)  # the folder the sharded job loads
    pretrained_other.save_pretrained(tmp_path / "theirs")

    ours, theirs, options = str(tmp_path / "ours"), str(tmp_path / "theirs"), None
    if store == "s3":
        import s3fs

        bucket, options = request.getfixturevalue("moto_s3")
        ours, theirs = f"{bucket}/ours", f"{bucket}/theirs"
        s3fs.S3FileSystem(**options).put(
            str(tmp_path / "theirs") + "/", theirs + "/", recursive=True
        )
    run_ranks(_on_ranks, 2, ours, theirs, options, str(tmp_path / "loaded.pt"), layout)

    folder = Path(ours)
    if store == "s3":
        import s3fs

        s3fs.S3FileSystem(**options).get(ours + "/", str(tmp_path / "copy") + "/", recursive=True)
        folder = tmp_path / "copy"
    ours_tensors = load_file(folder / "adapter_model.safetensors")
    assert sorted(ours_tensors) == sorted(saved_by_peft)
    for key, value in saved_by_peft.items():
        assert torch.equal(ours_tensors[key], value), key
    config = json.loads((folder / "adapter_config.json").read_text())
    want = json.loads((reference / "adapter_config.json").read_text())
    # peft keeps target_modules as a set: its JSON order is the process's string hashing.
    config["target_modules"], want["target_modules"] = (
        sorted(config["target_modules"]),
        sorted(want["target_modules"]),
    )
    assert config == want
    loaded = peft.PeftModel.from_pretrained(tiny_llama(seed=1234), str(folder)).eval()
    assert torch.equal(_logits(loaded), _logits(trained))

    # The save_pretrained folder, loaded into the sharded model: its adapter, the base as it was.
    full = torch.load(tmp_path / "loaded.pt", weights_only=True)
    expected = pretrained_other.state_dict()
    assert sorted(full) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(full[key], value), key


def test_save_and_load_refuse_a_model_without_that_adapter(tmp_path: Path) -> None:
    from hf_dcp_storage.integrations.peft import save_adapter

    with pytest.raises(
        ValueError, match=r"adapter_name='other': the model's adapters are \['default'\]"
    ):
        save_adapter(_peft_model(1), tmp_path / "x", adapter_name="other")
    with pytest.raises(ValueError, match=r"adapters are none \(not a PeftModel\)"):
        save_adapter(tiny_llama(), tmp_path / "x")


def test_checkpoint_manager_steps_of_adapter_weights_are_peft_folders(tmp_path: Path) -> None:
    from hf_dcp_storage import CheckpointManager
    from hf_dcp_storage.integrations.peft import (
        ADAPTER_CONFIG_NAME,
        ADAPTER_FILE_NAME,
        adapter_config,
        adapter_state_dict,
    )

    trained = _peft_model(lora_seed=7)
    companions = {ADAPTER_CONFIG_NAME: adapter_config(trained)}
    with CheckpointManager(
        tmp_path / "run", file_name=ADAPTER_FILE_NAME, companions=companions
    ) as mgr:
        mgr.save(10, adapter_state_dict(trained), training_state={"step": 10})
        step_folder = tmp_path / "run" / "step_10"
        loaded = peft.PeftModel.from_pretrained(tiny_llama(seed=1234), str(step_folder)).eval()
        assert torch.equal(_logits(loaded), _logits(trained))
        other = _peft_model(lora_seed=99)
        state: dict[str, Any] = {"step": 0}
        assert mgr.load(adapter_state_dict(other), training_state=state) == 10
    assert state["step"] == 10 and torch.equal(_logits(other), _logits(trained))
