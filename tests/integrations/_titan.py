"""The ranks' side of ``test_torchtitan.py``: torchtitan's training loop at the checkpoint-manager
level, on CPU gloo ranks (torchtitan's ``Trainer`` itself needs CUDA).

``job(rank, world, runs, out)`` is a ``run_ranks`` target that runs each ``Run`` in turn, each built
from scratch as a fresh job would build it, from torchtitan's own parts:

* the llama3 ``debugmodel`` (its config from torchtitan's registry, fused QKV, weights from
  ``init_states`` under one seed), ``fully_shard`` per block and at the root, as torchtitan's
  FSDP does. One change: each block's parameter-free inner attention is torchtitan's causal
  ``ScaledDotProductAttention`` instead of ``FlexAttention``, which has no backward on CPU;
  parameters and their keys are the same;
* torchtitan's ``OptimizersContainer`` (``default_adamw``; ``foreach``, as ``fused`` is CUDA's) and
  ``LRSchedulersContainer`` (warmup, linear decay), and its ``ParallelAwareDataloader``
  (``StatefulDataLoader``, whose state is a pickle) over a synthetic, position-keyed token stream;
* a train state like the ``Trainer``'s (``step``, ``ntokens_seen``) and the ``Trainer.train`` loop
  order: ``load(load_step)``, then per step forward/backward, ``maybe_wait_for_staging``, optimizer
  and scheduler steps, ``save(step, last_step=step == STEPS)``, and ``close`` at the end.

Each run leaves ``out/<name>/rank<r>.pt``: its losses by step, and this rank's local shards of
every parameter and optimizer tensor at the end (compared bitwise by the test). The reference
run also leaves ``full.pt`` (rank 0): the full weights in torchtitan's keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

from hf_dcp_storage.integrations.torchtitan import HFCheckpointManager

STEPS = 6  # a run's training.steps: step 6 is the last step (the HF export)
SEQ_LEN, LOCAL_BATCH = 32, 2


@dataclasses.dataclass(frozen=True)
class Run:
    """One training job: up to ``stop_at`` (a stop before the end is a job that ended there)."""

    name: str
    stop_at: int = STEPS
    checkpoint: dict[str, Any] | None = None  # HFCheckpointManager.Config fields; None: disabled
    load_step: int = -1
    init_seed: int = 0  # the model's init before any load (a resumed job starts elsewhere)
    load_only: bool = False  # only load (no training); records what was restored
    expect_error: bool = False  # the load must fail: its message is recorded as "error"


def model_spec() -> Any:
    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


class TokenStream(IterableDataset, Stateful):
    """Endless synthetic sequences: sample ``i`` of data rank ``r`` depends on ``(r, i)`` only."""

    def __init__(self, dp_rank: int, vocab: int) -> None:
        self.dp_rank, self.vocab, self.position = dp_rank, vocab, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(100_003 * self.dp_rank + self.position)
            self.position += 1
            tokens = torch.randint(0, self.vocab, (SEQ_LEN + 1,), generator=g)
            yield tokens[:-1], tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class TrainState(Stateful):
    """What torchtitan's ``Trainer`` checkpoints as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def job(rank: int, world: int, runs: list[Run], out: str) -> None:
    for run in runs:
        train(rank, world, run, out)


@dataclasses.dataclass
class Parts:
    """What a torchtitan job hands its checkpoint manager, built as a fresh job builds it."""

    spec: Any
    model: torch.nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: ParallelAwareDataloader
    state: TrainState

    def manager_parts(self) -> dict[str, Any]:
        """The keyword arguments of a checkpoint manager's ``Config.build``."""
        return {
            "dataloader": self.dataloader,
            "model_parts": [self.model],
            "optimizers": self.optimizers,
            "lr_schedulers": self.lr_schedulers,
            "states": {"train_state": self.state},
            "sd_adapter": self.spec.state_dict_adapter(self.spec.model, None),
            "base_folder": "",
        }


def build(rank: int, world: int, init_seed: int) -> Parts:
    """(every rank) The debug model under FSDP, its optimizer, scheduler, data loader and train
    state, the model initialised under ``init_seed``."""
    spec = model_spec()
    torch.manual_seed(init_seed)
    model = spec.model.build()
    model.init_states()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer_config = default_adamw(lr=8e-4)
    optimizer_config.implementation = "foreach"
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=STEPS)
    dataloader = ParallelAwareDataloader(
        TokenStream(rank, spec.model.vocab_size),
        dp_rank=rank,
        dp_world_size=world,
        batch_size=LOCAL_BATCH,
    )
    return Parts(spec, model, optimizers, lr_schedulers, dataloader, TrainState())


def step(
    parts: Parts,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    before_optimizer: Callable[[], None] = lambda: None,
) -> float:
    """One training step in the ``Trainer``'s order, up to (not including) the checkpoint save:
    forward, backward, ``before_optimizer()`` (the manager's ``maybe_wait_for_staging``), the
    optimizer and scheduler steps. Returns the loss."""
    parts.state.step += 1
    tokens, labels = next(batches)
    loss = F.cross_entropy(parts.model(tokens).flatten(0, 1).float(), labels.flatten())
    loss.backward()
    before_optimizer()
    parts.optimizers.step()
    parts.lr_schedulers.step()
    parts.optimizers.zero_grad()
    parts.state.ntokens_seen += tokens.numel()
    return loss.item()


def train(rank: int, world: int, run: Run, out: str) -> None:
    parts = build(rank, world, run.init_seed)
    spec, model, optimizers = parts.spec, parts.model, parts.optimizers
    lr_schedulers, dataloader, state = parts.lr_schedulers, parts.dataloader, parts.state
    config = HFCheckpointManager.Config(
        enable=run.checkpoint is not None, load_step=run.load_step, **(run.checkpoint or {})
    )
    checkpointer = config.build(**parts.manager_parts())
    record: dict[str, Any] = {"losses": {}}
    try:
        try:
            checkpointer.load(step=run.load_step)
        except (KeyError, FileNotFoundError, ValueError) as exc:
            if not run.expect_error:
                raise
            record["error"] = str(exc)
        else:
            assert not run.expect_error, f"{run.name}: the load was expected to fail"
        batches = iter(dataloader)  # a StatefulDataLoader hands its dataset the loaded state here
        record["loaded"] = {
            "step": state.step,
            "last_epoch": lr_schedulers.schedulers[0].last_epoch,
            "position": dataloader.dataset.position,
        }
        while not run.load_only and state.step < run.stop_at:
            loss = step(parts, batches, checkpointer.maybe_wait_for_staging)
            record["losses"][state.step] = loss
            checkpointer.save(state.step, last_step=state.step == STEPS)
    finally:
        checkpointer.close()
    record["params"] = {k: _local(v) for k, v in model.state_dict().items()}
    record["optimizer"] = {
        k: _local(v) for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)
    }
    folder = os.path.join(out, run.name)
    os.makedirs(folder, exist_ok=True)
    torch.save(record, os.path.join(folder, f"rank{rank}.pt"))
    full = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    if rank == 0 and run.checkpoint is None:
        torch.save(full, os.path.join(folder, "full.pt"))
        with open(os.path.join(folder, "dims.json"), "w") as f:
            json.dump(llama_dims(spec), f)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def llama_dims(spec: Any) -> dict[str, Any]:
    """The debug model's dimensions, as a ``transformers`` ``LlamaConfig`` takes them."""
    cfg = spec.model
    attention = cfg.layers[0].attention
    rope = attention.rope
    w1 = cfg.layers[0].feed_forward.w1
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": w1.out_features,
        "num_hidden_layers": len(cfg.layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads or attention.n_heads,
        "rms_norm_eps": cfg.norm.eps,
        "tie_word_embeddings": cfg.enable_weight_tying,
        "rope_theta": rope.theta,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        },
        "max_position_embeddings": rope.max_seq_len,
    }
