"""Lightning: ``HFModelParallelStrategy``, its ``ModelParallelStrategy`` saving our checkpoint
folders.

    from hf_dcp_storage.integrations.lightning import HFModelParallelStrategy

    strategy = HFModelParallelStrategy(
        data_parallel_size=8, tensor_parallel_size=1, storage_options=opts
    )
    checkpoints = ModelCheckpoint(
        dirpath="s3://bucket/run1", monitor="val_loss", save_top_k=3, save_last=True
    )
    trainer = L.Trainer(strategy=strategy, callbacks=[checkpoints])
    trainer.fit(model, ckpt_path="s3://bucket/run1/last.ckpt")   # or None for a fresh start

Each checkpoint Lightning names (``epoch=3-step=400.ckpt``, ``last.ckpt``) is a folder of
``hf_dcp_storage`` (``steps/folder.py``), at any fsspec URL: the weights as a consolidated HF
checkpoint, ``training_state/`` (each optimizer's sharded state, Lightning's loop, callback,
scheduler and hyper-parameter entries, and every rank's RNG states) and ``COMMITTED``, written
last. Saving to a path that holds a complete checkpoint (``last.ckpt``) writes the new one into
a version folder under it and switches ``CURRENT`` to it once committed, then removes the old
(``steps/named.py``): a crash while ``last.ckpt`` is overwritten leaves the previous one
loadable. ``ModelCheckpoint``'s ``save_top_k`` removes checkpoints through ``remove_checkpoint``,
markers first.

Against Lightning 2.6.6's ``ModelParallelStrategy``: the path stays a string (``Path`` would turn
``s3://b/x`` into ``s3:/b/x``) and reaches the store with ``storage_options``; the weights and
optimizer states are always saved sharded and consolidated by the writer
(``save_distributed_checkpoint`` does not apply); what Lightning pickles into ``meta.pt`` on rank 0
is rank 0's entries saved as JSON and tensors, so a value that is neither (an object in
``hyper_parameters``) is refused before anything is written, naming its key. Loading also
restores every rank's RNG states.

Lightning's own file operations (``ModelCheckpoint`` checking whether a name is taken, listing
``last`` checkpoints; loggers) open the store with fsspec's defaults for its protocol, not with
these options: for an endpoint or credentials given only here, set them there too, once per
process, e.g. ``fsspec.config.conf["s3"] = opts``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as exc:  # pragma: no cover - exercised where Lightning is absent
    raise ImportError(
        f"hf_dcp_storage.integrations.lightning needs Lightning ({exc}); install it with pip "
        "install 'hf_dcp_storage[lightning]' (lightning 2.6.6)"
    ) from exc

from ..steps import folder as ckpt_folder
from ..steps import named
from ..steps.control import Control
from ..writer import HFStorageWriter

__all__ = ["LIGHTNING_STATE", "HFModelParallelStrategy"]

# The training-state entry holding Lightning's own checkpoint entries (all but the weights and
# the optimizer states, which are ``optimizer_0``, ``optimizer_1``, ...).
LIGHTNING_STATE = "lightning"


class HFModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 and tensor parallelism) whose ``save_checkpoint`` and
    ``load_checkpoint`` write and read ``hf_dcp_storage`` checkpoint folders at any fsspec URL.

    Args:
        data_parallel_size, tensor_parallel_size, process_group_backend, timeout: as for
            ``ModelParallelStrategy``.
        storage_options: passed to fsspec for every checkpoint path (credentials, endpoint...).
        max_shard_size: most tensor bytes per safetensors file (``"5GB"``, ``"512MiB"``, an int).
        companions: where the module's state-dict keys are the HF model's, its ``config.json``
            and tokenizer files for every checkpoint's weights folder (a folder or a dict,
            ``HFStorageWriter(companions=...)``), so that each loads with ``from_pretrained``.

    Raises:
        ValueError: ``storage_options`` that are not a dict.
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        *,
        storage_options: dict[str, Any] | None = None,
        max_shard_size: int | str = "5GB",
        companions: str | os.PathLike[str] | dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ValueError(
                f"storage_options={storage_options!r} must be None or a dict of fsspec options"
            )
        self.storage_options = storage_options
        self.max_shard_size = max_shard_size
        HFStorageWriter(companions=companions)  # refuses bad ones now, not at the first save
        self.companions = companions
        self._control = Control()

    # -- what a checkpoint holds: sharded, on the tensors' devices (the writer copies to host) --

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict (DTensors), on every rank."""
        assert self.model is not None
        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s sharded state dict, keyed by parameter names, on every rank."""
        assert self.model is not None
        return get_optimizer_state_dict(
            self.model,
            optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer,
        )

    # -- save, load, remove ---------------------------------------------------------------------

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """(all ranks) Save Lightning's ``checkpoint`` as a checkpoint folder at ``filepath``,
        replacing one already there.

        Raises:
            TypeError: ``storage_options`` given here (they belong to the strategy), or a
                checkpoint entry that is neither a tensor nor JSON, before anything is written.
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not "
                f"supported: pass them once, as {type(self).__name__}(storage_options=...)"
            )
        fs, folder = ckpt_folder.locate(self.broadcast(os.fspath(filepath)), self.storage_options)
        weights = checkpoint.pop("state_dict")
        state: dict[str, Any] = {
            f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))
        }
        # Lightning keeps rank 0's entries (loops, callbacks, schedulers): so does this.
        state[LIGHTNING_STATE] = self.broadcast(checkpoint)
        step = int(checkpoint.get("global_step", 0))
        try:
            tensors, payload = ckpt_folder.prepare(self._control, step, state)
        except TypeError as exc:
            raise TypeError(
                f"{exc}. {type(self).__name__} saves Lightning's checkpoint entries as tensors "
                "and JSON: make that entry one of them (e.g. save_hyperparameters of plain "
                "values), or drop it in LightningModule.on_save_checkpoint"
            ) from None
        options = {"storage_options": self.storage_options, "max_shard_size": self.max_shard_size}
        named.save(
            self._control,
            fs,
            folder,
            step,
            weights,
            tensors,
            payload,
            options,
            companions=self.companions,
        )

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """(all ranks) Load a checkpoint folder into the model and the optimizers (resharded onto
        the current layout) and this rank's RNG states; returns Lightning's other entries.

        Raises:
            FileNotFoundError: ``checkpoint_path`` is not a complete checkpoint folder.
        """
        url = self.broadcast(os.fspath(checkpoint_path))
        fs, name = ckpt_folder.locate(url, self.storage_options)
        folder = self._control.broadcast(
            named.resolve(fs, name) if self._control.rank == 0 else None
        )
        if folder is None:
            raise FileNotFoundError(
                f"{url} is not a complete checkpoint of {type(self).__name__} (no COMMITTED "
                "marker, and no CURRENT naming a complete version): give the path of one it saved"
            )
        assert self.model is not None and self.lightning_module is not None
        weights = get_model_state_dict(self.model)
        state: dict[str, Any] = {
            f"optimizer_{i}": _OptimizerState(self.model, opt)
            for i, opt in enumerate(self.optimizers)
        }
        state[LIGHTNING_STATE] = None
        reader_io = {"storage_options": self.storage_options}
        ckpt_folder.load(fs, folder, weights, state, rank=self._control.rank, reader_io=reader_io)
        set_model_state_dict(
            self.model,
            weights,
            options=StateDictOptions(strict=self.lightning_module.strict_loading),
        )
        self._control.barrier()
        return state[LIGHTNING_STATE]

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """(rank 0; the others return) Delete a checkpoint and its versions, markers first."""
        if self.is_global_zero:
            fs, name = ckpt_folder.locate(os.fspath(filepath), self.storage_options)
            named.remove(fs, name)

    def teardown(self) -> None:
        super().teardown()
        self._control.close()


class _OptimizerState:
    """An optimizer's sharded state as a ``Stateful`` (DCP's ``get/set_optimizer_state_dict``,
    keyed by parameter names; asking for it creates the state of a fresh optimizer)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state)
