"""One Lightning fit on 2 CPU gloo ranks with ``HFModelParallelStrategy`` (for
``test_lightning.py``).

    python tests/integrations/_lightning_fit.py SPEC.json

A script, not a function: Lightning starts rank 1 by running ``sys.argv`` again. ``SPEC.json``:

* ``out``: a local folder for this run's records (``rank<r>.pt``: the final local shards of every
  parameter and optimizer tensor, epoch losses, the checkpoint callbacks' state; ``full.pt``
  from rank 0: the full weights);
* ``best_dir`` / ``all_dirpath``: ``ModelCheckpoint`` folders (a local path or an ``s3://`` URL),
  or null for none: ``best`` keeps the 2 epochs of lowest ``train_loss`` and ``last.ckpt``,
  ``all`` keeps every epoch;
* ``ckpt_path``: passed to ``Trainer.fit`` (null: a fresh start);
* ``storage_options``: for the strategy and, as fsspec's defaults for ``s3``, for Lightning's own
  file operations.

The model is a small MLP, ``fully_shard`` per layer and at the root in ``configure_model``
(FSDP2 over the data-parallel mesh), trained with AdamW and a per-step LambdaLR for 4 epochs
of 4 steps on a fixed random regression set (DistributedSampler, shuffled per epoch).
"""

from __future__ import annotations

import json
import os
import sys

import fsspec
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from hf_dcp_storage.integrations.lightning import HFModelParallelStrategy

EPOCHS, SAMPLES, BATCH = 4, 64, 8  # 2 ranks x 32 samples: 4 steps per epoch


class Net(L.LightningModule):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 4),
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.layers, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 1.0 / (1.0 + 0.05 * step)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(SAMPLES, 16, generator=g)
        return DataLoader(TensorDataset(x, torch.tanh(x[:, :4] * x[:, 4:8])), batch_size=BATCH)


class EpochLosses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.losses[trainer.current_epoch] = float(trainer.callback_metrics["train_loss"])


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    options = spec.get("storage_options")
    if options:
        fsspec.config.conf["s3"] = options  # Lightning's own file operations use fsspec's defaults
    callbacks: list[Callback] = [losses := EpochLosses()]
    if spec.get("best_dir"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=spec["best_dir"],
                filename="best-{epoch}",
                monitor="train_loss",
                mode="min",
                save_top_k=2,
                save_last=True,
                every_n_epochs=1,
            )
        )
    if spec.get("all_dir"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=spec["all_dir"], filename="all-{epoch}", save_top_k=-1, every_n_epochs=1
            )
        )
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=HFModelParallelStrategy(
            data_parallel_size=2,
            tensor_parallel_size=1,
            storage_options=options,
            companions=spec.get("companions"),
        ),
        max_epochs=EPOCHS,
        callbacks=callbacks,
        enable_checkpointing=len(callbacks) > 1,  # else Lightning adds a ModelCheckpoint of its own
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=spec["out"],
        deterministic=True,
    )
    module = Net()
    trainer.fit(module, ckpt_path=spec.get("ckpt_path"))
    record_run(trainer, module, losses.losses, spec["out"])


def record_run(trainer: L.Trainer, module: Net, losses: dict[int, float], out: str) -> None:
    rank = trainer.global_rank
    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    optimizer = trainer.optimizers[0]
    optimizer_state = get_optimizer_state_dict(module, optimizer)["state"]
    record = {
        "losses": losses,
        "global_step": trainer.global_step,
        "params": {k: local(v) for k, v in module.state_dict().items()},
        "optimizer": {
            f"{fqn}.{k}": local(v)
            for fqn, state in optimizer_state.items()
            for k, v in state.items()
        },
        "lr": [g["lr"] for g in optimizer.param_groups],
        "checkpoints": {
            cb.dirpath: {
                "best_k": sorted(cb.best_k_models),
                "last": cb.last_model_path,
                "best": cb.best_model_path,
            }
            for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint)
        },
    }
    os.makedirs(out, exist_ok=True)
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))
    trainer.strategy.barrier()  # rank 1's record is written before rank 0's process ends


if __name__ == "__main__":
    main(sys.argv[1])
