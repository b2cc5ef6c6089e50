"""A tiny but complete FSDP2 training run for the exact-resume tests (``test_resume.py``).

``train(rank, world, configs)`` is a ``run_ranks`` target: it runs each config in turn (one
training run per config, built from scratch), so one spawn can produce several reference runs.

Everything that makes a real run hard to resume is here:

* FSDP2 (``fully_shard``) parameters and AdamW state, saved and loaded through
  ``get/set_optimizer_state_dict`` (DTensor shards, resharded by DCP on another world size);
* a LambdaLR schedule (linear warmup, then linear decay): a ``Stateful`` as it is;
* a shuffling ``DataLoader`` over a ``DistributedSampler(shuffle=True, seed=...)`` with
  ``set_epoch``, wrapped in ``ResumableLoader``, which records (epoch, batches consumed) and
  fast-forwards on load; the run crosses an epoch boundary (8 batches per epoch);
* randomness from all three global generators every step: dropout (torch), input noise (NumPy)
  and an input scale (Python ``random``). The manager restores them from its per-rank RNG capture.

World-size independence (for resuming on another number of ranks):

* data: the sampler's permutation depends only on (seed, epoch), and rank ``r`` of ``W`` takes
  positions ``r, r+W, ...`` of it. With a per-rank batch of ``GLOBAL_BATCH // W``, global batch
  ``b`` is exactly ``perm[b*G:(b+1)*G]`` for every ``W``, and rank ``r`` holds its rows ``r::W``;
* randomness: every random tensor is drawn for the whole global batch (``G`` rows) and each rank
  keeps rows ``r::W``. In ``mode="global"`` all ranks seed their generators identically, so the
  draws, and thus every sample's noise and dropout mask, are the same for every ``W`` (dropout
  is then a mask drawn with ``torch.rand`` for the global batch, applied by ``SharedDropout``).
  In ``mode="local"`` each rank seeds its generators differently (``seed + rank``) and dropout is
  plain ``F.dropout``: the per-rank RNG states must come back to the right ranks, but the run
  depends on the world size;
* loss: each rank's mean over its rows; FSDP averages the gradients over ranks, so the update is
  that of the mean over the global batch, whatever ``W``. Only the float summation order changes
  with ``W`` (row blocking in the matmuls, the gradient reduction), so across world sizes the run
  is equal within float tolerance, not bitwise.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hf_dcp_storage import CheckpointManager

GLOBAL_BATCH = 8
DATASET_SIZE = 64  # 8 global batches per epoch: a 12-step run crosses an epoch boundary
DATA_SEED = 1234
IN, HIDDEN, OUT = 16, 32, 4
DROPOUT_P = 0.25
WARMUP, TOTAL = 4, 12


def lr_lambda(step: int) -> float:
    """Linear warmup over ``WARMUP`` steps, then linear decay (to 10% at ``TOTAL``)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return max(0.1, 1.0 - 0.9 * (step - WARMUP) / (TOTAL - WARMUP))


class SharedDropout(torch.nn.Module):
    """Dropout; with ``mask`` set, applies that {0,1} mask (drawn for the global batch and sliced
    per rank) instead of drawing one, so that the masks do not depend on the world size."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        if self.mask is None:
            return F.dropout(x, self.p, training=True)
        return x * self.mask / (1.0 - self.p)


class OptimState(Stateful):
    """The FSDP2 optimizer state as DCP wants it (DTensor shards keyed by parameter name)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.opt, sd)


class ResumableLoader(Stateful):
    """A ``DataLoader`` + ``DistributedSampler`` whose position is part of the checkpoint.

    The state is (epoch, global batches consumed in it): both are world-size independent, since
    every rank consumes one per-rank batch per global batch. Loading sets the position; the next
    ``next()`` rebuilds the epoch's iterator (``set_epoch``) and skips the consumed batches.

    The DataLoader gets a private generator: without one, every ``iter(loader)`` draws its base
    seed from the *global* torch RNG, so a resumed run, which rebuilds the iterator mid-epoch,
    would draw once more than the uninterrupted one and every later dropout mask would shift.
    """

    def __init__(self, dataset: TensorDataset, rank: int, world: int) -> None:
        self.sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=DATA_SEED, drop_last=True
        )
        self.loader = DataLoader(
            dataset,
            batch_size=GLOBAL_BATCH // world,
            sampler=self.sampler,
            drop_last=True,
            generator=torch.Generator().manual_seed(0),
        )
        self.epoch = 0
        self.consumed = 0
        self._it: Any = None

    def next(self) -> list[torch.Tensor]:
        if self._it is None:
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            for _ in range(self.consumed):  # fast-forward after a load
                next(self._it)
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.consumed, self._it = self.epoch + 1, 0, None
            return self.next()
        self.consumed += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.consumed, self._it = sd["epoch"], sd["consumed"], None


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(DATASET_SIZE, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(DATASET_SIZE, OUT, generator=g))


def _crash_in_save(step: int) -> None:
    """Make this process die (``os._exit(1)``, no cleanup) in the save of ``step``: right after
    it has written its bytes of the model files, before the training state, the model index and
    the commit marker."""
    from hf_dcp_storage import writer

    original = writer.HFStorageWriter.write_data

    def write_data(self, plan, planner):
        fut = original(self, plan, planner)
        if str(self.root).rstrip("/").endswith(f"/step_{step}"):
            fut.wait()
            os._exit(1)
        return fut

    writer.HFStorageWriter.write_data = write_data


def _listing(root: str) -> dict[str, list[str]]:
    p = Path(root)
    return (
        {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(p.iterdir())}
        if p.exists()
        else {}
    )


def train(rank: int, world: int, configs: list[dict[str, Any]]) -> None:
    for cfg in configs:
        _train_one(rank, world, cfg)


def _train_one(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """One run, configured by ``cfg``:

    out: folder for rank 0's results (``result.json``: losses by step and what it saw;
        ``params.pt``: the final full parameters); mode: "local" or "global" (see the module doc);
    root: the run folder (None: no checkpoints); keep_last_n; save_every / save_at: the steps
        saved; async_save; resume: load ``mgr.latest()`` first, then ``mgr.prune()``;
    crash_at, crash_rank: that rank dies in the middle of saving that step; steps: the last step.
    """
    mode = cfg["mode"]
    torch.manual_seed(0)  # the same initial weights everywhere, whatever the world size
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        SharedDropout(DROPOUT_P),
        torch.nn.Linear(HIDDEN, OUT),
    )
    fully_shard(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    loader = ResumableLoader(_dataset(), rank, world)
    offset = rank if mode == "local" else 0
    torch.manual_seed(100 + offset)
    np.random.seed(200 + offset)
    random.seed(300 + offset)

    mgr = (
        CheckpointManager(cfg["root"], keep_last_n=cfg.get("keep_last_n", 2))
        if cfg.get("root")
        else None
    )
    state = {"optim": OptimState(model, opt), "sched": sched, "data": loader, "progress": None}
    result: dict[str, Any] = {"losses": {}}
    start = 0
    if cfg.get("resume"):
        assert mgr is not None
        result["latest"] = mgr.latest()
        result["before_prune"] = _listing(cfg["root"]) if rank == 0 else None
        start = mgr.load(get_model_state_dict(model), state)
        assert state["progress"] == {"step": start}, state["progress"]
        result["pruned"] = mgr.prune()
        result["after_prune"] = _listing(cfg["root"]) if rank == 0 else None
        result["lr_after_load"] = [g["lr"] for g in opt.param_groups]
        result["sched_after_load"] = sched.state_dict()["last_epoch"]
    if cfg.get("crash_at") is not None and rank == cfg["crash_rank"]:
        _crash_in_save(cfg["crash_at"])

    def should_save(step: int) -> bool:
        return mgr is not None and (
            (cfg.get("save_every") and step % cfg["save_every"] == 0)
            or step in cfg.get("save_at", ())
        )

    for step in range(start + 1, cfg["steps"] + 1):
        x, y = loader.next()
        # Drawn for the global batch; this rank keeps its rows (see the module doc).
        noise = torch.from_numpy(np.random.randn(GLOBAL_BATCH, IN).astype(np.float32))[rank::world]
        scale = 1.0 + 0.1 * random.random()
        model[2].mask = (
            (torch.rand(GLOBAL_BATCH, HIDDEN) >= DROPOUT_P).float()[rank::world]
            if mode == "global"
            else None
        )
        loss = F.mse_loss(model((x + 0.05 * noise) * scale), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        result["losses"][step] = (mean / world).item()
        if should_save(step):
            state["progress"] = {"step": step}
            mgr.save(
                step, get_model_state_dict(model), state, async_save=cfg.get("async_save", False)
            )
    if mgr is not None:
        mgr.wait()
        result["final_checkpoints"] = mgr.all_checkpoints()
    full = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}  # a collective
    if rank == 0:
        out = Path(cfg["out"])
        out.mkdir(parents=True, exist_ok=True)
        torch.save(full, out / "params.pt")
        (out / "result.json").write_text(json.dumps(result))
