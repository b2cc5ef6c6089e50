"""A torchtune training loop on gloo ranks, checkpointed through torchtune's own
``CheckpointClient`` driving ``HFCheckpointer`` (the order of torchtune 0.6.1's
``full_finetune_distributed`` recipe, without its tokenizer and dataset).

A tiny torchtune Llama 3 (``llama3`` with small dims), FSDP2-sharded per layer and at the root,
float32; AdamW; torchtune's cosine schedule with warmup, rebuilt from ``epochs_run`` on resume as
the recipe does; token batches drawn from a seed per (epoch, step, rank). Each epoch ends with
``CheckpointClient.save_checkpoint`` (intermediate until the last epoch). A resuming run does what
the recipe does: with async checkpointing, ``load_base_checkpoint`` (the base model) then
``load_distributed_checkpoint``; without, ``load_base_checkpoint`` returns the newest step's full
weights and optimizer, which it shards.

``job(rank, world, run, out)`` writes ``out/<run.name>/rank<r>.pt``: the full weights and
optimizer state at the end, the LR history, the recipe state it resumed with, the loss history.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DIMS = {
    "vocab_size": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "max_seq_len": 64,
    "intermediate_dim": 128,
}
STEPS_PER_EPOCH, EPOCHS, SEQ, BATCH = 2, 3, 16, 2


@dataclass
class Run:
    name: str
    checkpointer: dict[str, Any] = field(default_factory=dict)  # None: no checkpoints
    stop_after_epochs: int | None = None  # leave after this many epochs (their save done)
    resume: bool = False
    async_checkpointing: bool = True
    steps_run: bool = False  # progress carries steps_run (torchtune's later TrainingProgress)
    init_seed: int = 0
    expect_error: bool = False


def hf_config(rope_theta: float = 500000.0) -> dict[str, Any]:
    """The tiny model's ``config.json``, as ``transformers`` writes it (RoPE base: Llama 3's
    by default)."""
    import transformers

    d = DIMS
    return transformers.LlamaConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["embed_dim"],
        intermediate_size=d["intermediate_dim"],
        num_hidden_layers=d["num_layers"],
        num_attention_heads=d["num_heads"],
        num_key_value_heads=d["num_kv_heads"],
        head_dim=d["embed_dim"] // d["num_heads"],
        max_position_embeddings=d["max_seq_len"],
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        tie_word_embeddings=False,
        torch_dtype="float32",
    ).to_dict()


def new_model(seed: int) -> torch.nn.Module:
    from torchtune.models.llama3 import llama3

    torch.manual_seed(seed)
    return llama3(**DIMS)


def write_base(folder: Path) -> dict[str, torch.Tensor]:
    """The base model (seed 0) as an HF folder in HF keys, with its ``config.json``; its
    torchtune state dict."""
    import json

    from safetensors.torch import save_file
    from torchtune.models import convert_weights

    model = new_model(0)
    tune = {k: v.detach().clone() for k, v in model.state_dict().items()}
    c = hf_config()
    hf = convert_weights.tune_to_hf(
        dict(tune),
        num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        dim=c["hidden_size"],
        head_dim=c["head_dim"],
    )
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(c))
    return tune


def batch(epoch: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * epoch + 10 * step + rank)
    return torch.randint(0, DIMS["vocab_size"], (BATCH, SEQ), generator=g)


def _progress_cls(steps_run: bool) -> Any:
    from torchtune import training
    from torchtune.training.checkpointing._checkpoint_client import TrainingProgress

    if not steps_run:
        return TrainingProgress

    @dataclass
    class WithSteps(TrainingProgress):  # what later torchtune releases send
        steps_run: int = 0

        def state_dict(self) -> dict[str, object]:
            return {**super().state_dict(), training.STEPS_KEY: self.steps_run}

    return WithSteps


def job(rank: int, world: int, runs: list[Run], out: str) -> None:
    for run in runs:
        try:
            record = _train(rank, world, run)
        except Exception as exc:  # recorded, checked by the test
            if not run.expect_error:
                raise
            record = {"error": f"{type(exc).__name__}: {exc}"}
        folder = Path(out) / run.name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(record, folder / f"rank{rank}.pt")
        dist.barrier()


def _train(rank: int, world: int, run: Run) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training.checkpointing._checkpoint_client import CheckpointClient
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    import hf_dcp_storage.integrations.torchtune  # noqa: F401 - the _component_ below

    cfg = OmegaConf.create(
        {
            "device": "cpu",
            "resume_from_checkpoint": run.resume,
            "enable_async_checkpointing": run.async_checkpointing,
            "checkpointer": {
                "_component_": "hf_dcp_storage.integrations.torchtune.HFCheckpointer",
                "model_type": "LLAMA3",
                **run.checkpointer,
            },
        }
    )
    client = CheckpointClient(cfg)
    base = client.load_base_checkpoint()
    model = new_model(run.init_seed)
    for layer in model.layers:
        assert isinstance(layer, TransformerSelfAttentionLayer)
        fully_shard(layer)
    fully_shard(model)
    training.load_from_full_model_state_dict(
        model, base[training.MODEL_KEY], torch.device("cpu"), strict=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    seed, epochs_run, resumed = 7, 0, None
    if run.resume:
        if run.async_checkpointing:  # the recipe's sharded resume
            ckpt = client.load_distributed_checkpoint(model, optimizer)
        else:  # its synchronous one: full state from load_base_checkpoint, sharded here
            ckpt = base
            training.load_from_full_optimizer_state_dict(
                model, optimizer, ckpt[training.OPT_KEY], torch.device("cpu")
            )
        seed, epochs_run = ckpt[training.SEED_KEY], ckpt[training.EPOCHS_KEY]
        resumed = {
            k: ckpt.get(k)
            for k in (
                training.SEED_KEY,
                training.EPOCHS_KEY,
                training.TOTAL_EPOCHS_KEY,
                training.MAX_STEPS_KEY,
                training.STEPS_KEY,
                training.DATALOADER_KEY,
            )
        }
    global_step = epochs_run * STEPS_PER_EPOCH
    # The recipe rebuilds the schedule from the step count instead of checkpointing it.
    if global_step:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, 2, EPOCHS * STEPS_PER_EPOCH, last_epoch=global_step - 1
    )
    progress = _progress_cls(run.steps_run)
    lrs, losses = [], []
    for epoch in range(epochs_run, EPOCHS):
        for step in range(STEPS_PER_EPOCH):
            tokens = batch(epoch, step, rank)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            lrs.append(optimizer.param_groups[0]["lr"])
            scheduler.step()
            losses.append(loss.item())
            global_step += 1
        extra = {"steps_run": global_step} if run.steps_run else {}
        client.save_checkpoint(
            model=model,
            optimizer=optimizer,
            training_progress=progress(
                seed=seed,
                epochs_run=epoch + 1,
                total_epochs=EPOCHS,
                max_steps_per_epoch=STEPS_PER_EPOCH,
                dataloader_state_dict={"epoch": epoch + 1, "sampler": [epoch, rank]},
                **extra,
            ),
            epoch=epoch,
        )
        if run.stop_after_epochs is not None and epoch + 1 >= run.stop_after_epochs:
            break
    checkpointer = client._get_checkpointer()
    checkpointer.manager.close()  # an async save in flight commits before the run's record

    def full(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    opt = optimizer.state_dict()
    return {
        "weights": {k: full(v).detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {
            pid: {k: full(v).clone() for k, v in s.items()} for pid, s in opt["state"].items()
        },
        "lrs": lrs,
        "last_lr": optimizer.param_groups[0]["lr"],
        "losses": losses,
        "resumed": resumed,
        "global_step": global_step,
        "pid": os.getpid(),
    }


__all__ = ["DIMS", "EPOCHS", "STEPS_PER_EPOCH", "Run", "batch", "hf_config", "job", "new_model"]
