"""torchtitan: ``HFCheckpointManager``, its ``CheckpointManager`` saving our step checkpoints.

Select it in a trainer config; everything else in torchtitan stays as it is::

    from hf_dcp_storage.integrations.torchtitan import HFCheckpointManager

    config.checkpoint = HFCheckpointManager.Config(
        enable=True, folder="s3://bucket/run1", interval=500, keep_latest_k=3,
        async_mode="async", storage_options={"client_kwargs": {"endpoint_url": "https://..."}},
    )

What changes against torchtitan's own manager (0.3.0, ``components/checkpointer/dcp.py``):

* A periodic save is a step of ``hf_dcp_storage.CheckpointManager``: ``folder/step_N/`` holds
  the weights as a consolidated HF checkpoint, in HF keys through the model's state-dict adapter
  when it has one (so ``transformers`` loads the folder once given the model's ``config.json``),
  ``training_state/`` (optimizers, lr schedulers, dataloader, train state and any other entry of
  ``states``, plus every rank's RNG states) and ``COMMITTED``, written last. Any fsspec URL works
  for ``folder``; ``storage_options`` reach the store.
* ``async_mode``: ``"disabled"`` saves in the call; ``"async"`` stages the tensors in the call and
  writes on a thread (``CheckpointManager(async_mode="thread")``); ``"async_with_pinned_mem"``
  writes in DCP's background process of each rank, from a staging copy (shared memory, pinned
  when CUDA is present) that is kept and refilled between saves (``async_mode="process"``,
  ``reuse_staging=True``). Staging is done when ``save`` returns, so ``maybe_wait_for_staging``
  has nothing to wait for.
* ``keep_latest_k`` is the manager's ``keep_last_n`` (0 keeps every step), applied on rank 0
  right after each commit, on any store; a step is removed marker first. A step saved again
  (after ``load_step`` of an earlier one) replaces the old one.
* The last step (``last_step=True``) is saved synchronously. With ``last_save_model_only`` it
  holds the weights alone, cast to ``export_dtype``: with an adapter that is the HF export
  (``last_save_in_hf``), which now works on remote folders too.
* Loading (``load(step)``): ``step=-1`` takes the newest complete step, else exactly ``step``
  (``FileNotFoundError`` naming the complete steps). Step 0 (a seed checkpoint) loads the model
  only, as torchtitan does; other steps load every state except ``exclude_from_loading``. With
  no step in ``folder``: ``initial_load_in_hf`` reads any HF folder (``initial_load_path``, or
  the adapter's ``hf_assets_path``) through our reader, local or remote; otherwise an
  ``initial_load_path`` in torchtitan's own DCP format loads through torchtitan's loader.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

try:
    from torchtitan.components.checkpointer import MODEL, AsyncMode
    from torchtitan.components.checkpointer import CheckpointManager as _TitanCheckpointManager
except ImportError as exc:  # pragma: no cover - exercised where torchtitan is absent
    raise ImportError(
        f"hf_dcp_storage.integrations.torchtitan needs torchtitan ({exc}); install it with pip "
        "install 'hf_dcp_storage[torchtitan]' (torchtitan 0.3.0, whose model code also imports "
        "triton)"
    ) from exc

from ..reader import HFStorageReader
from ..steps.manager import CheckpointManager
from ..steps.retention import step_name

__all__ = ["HFCheckpointManager"]

logger = logging.getLogger(__name__)


class HFCheckpointManager(_TitanCheckpointManager):
    """torchtitan's ``CheckpointManager`` whose checkpoints are ``hf_dcp_storage`` step
    checkpoints (see the module docstring). Built by torchtitan from ``HFCheckpointManager.Config``
    with the same arguments as its own manager; every rank makes one.

    Raises:
        ValueError: from ``Config``: a setting torchtitan refuses (other than HF folders on
            remote stores, which work here), or ``storage_options`` that are not a dict.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanCheckpointManager.Config):
        if TYPE_CHECKING:
            # torchtitan's own fields that this class sets or replaces (torchtitan ships no type
            # hints, so the checker would know none of its Config's fields).
            last_save_in_hf: bool
            initial_load_in_hf: bool
            initial_load_in_hf_quantized: bool
            async_mode: Literal["disabled", "async", "async_with_pinned_mem"]
            keep_latest_k: int

        storage_options: dict[str, Any] | None = None
        """Passed to fsspec for ``folder`` and ``initial_load_path`` (credentials, endpoint...)."""

        max_shard_size: int | str = "5GB"
        """Most tensor bytes per safetensors file (``"5GB"``, ``"512MiB"`` or an int)."""

        hf_companions: str | dict[str, Any] | None = None
        """The model's ``config.json``, generation config and tokenizer files for every step's
        weights folder (HF keys, through the state-dict adapter), so that each step, the HF
        export included, loads with ``from_pretrained``: a folder (e.g. the model's
        ``hf_assets_path``; local or a URL) or a dict of file name -> content
        (``HFStorageWriter(companions=...)``). ``None``: the weights only."""

        def __post_init__(self) -> None:
            # torchtitan refuses last_save_in_hf / initial_load_in_hf with a remote folder because
            # its own HF writer and reader are local-only; ours are not. Its other rules still
            # hold: hide the two flags (and the quantized one, which depends on them) from its
            # checks, then check the rules they take part in here.
            flags = (
                self.last_save_in_hf,
                self.initial_load_in_hf,
                self.initial_load_in_hf_quantized,
            )
            self.last_save_in_hf = self.initial_load_in_hf = self.initial_load_in_hf_quantized = (
                False
            )
            try:
                _TitanCheckpointManager.Config.__post_init__(self)
            finally:
                self.last_save_in_hf, self.initial_load_in_hf, self.initial_load_in_hf_quantized = (
                    flags
                )
            if self.last_save_in_hf and not self.last_save_model_only:
                raise ValueError(
                    "last_save_in_hf=True requires last_save_model_only=True: an HF export holds "
                    "the weights only"
                )
            if self.initial_load_in_hf and not self.initial_load_model_only:
                raise ValueError(
                    "initial_load_in_hf=True requires initial_load_model_only=True: an HF folder "
                    "holds the weights only"
                )
            if self.initial_load_in_hf_quantized and not (
                self.initial_load_in_hf and self.initial_load_path
            ):
                raise ValueError(
                    "initial_load_in_hf_quantized=True requires initial_load_in_hf=True and an "
                    "initial_load_path"
                )
            if self.storage_options is not None and not isinstance(self.storage_options, dict):
                raise ValueError(
                    f"storage_options={self.storage_options!r} must be None or a dict of fsspec "
                    "options"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        # torchtitan's __init__ sets the states, the policies and its adapter check. Its async
        # process group and purge thread are left out (disabled here): our manager saves, stages
        # and prunes.
        super().__init__(
            dataclasses.replace(config, async_mode="disabled", keep_latest_k=0),
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        if not self.enable:
            return
        if config.hf_companions is not None and sd_adapter is None:
            raise ValueError(
                "checkpoint.hf_companions needs the model's state-dict adapter: without one the "
                "steps hold torchtitan's own keys, which no config.json describes"
            )
        self.async_mode = AsyncMode(config.async_mode)
        self.keep_latest_k = config.keep_latest_k
        self.storage_options = config.storage_options
        pinned = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        self.steps = CheckpointManager(
            self.folder,
            keep_last_n=config.keep_latest_k or sys.maxsize,  # torchtitan's 0: keep every step
            storage_options=config.storage_options,
            max_shard_size=config.max_shard_size,
            async_mode="process" if pinned else "thread",
            reuse_staging=pinned,
            companions=config.hf_companions,
            # A step saved again (training on after load_step of an earlier one) replaces the old
            # one, as with torchtitan's own manager.
            overwrite=True,
        )

    # -- save ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """(all ranks) Save ``curr_step`` if torchtitan's policy says so (interval, first step,
        last step, not ``load_only``); returns whether it saved (or staged, when async)."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        if last_step:
            self._save_last_step(curr_step)
        elif self.async_mode == AsyncMode.DISABLED:
            self.steps.save(curr_step, self._weights_to_save(), self._training_states())
        else:
            self.save_future = self.steps.save(
                curr_step, self._weights_to_save(), self._training_states(), async_save=True
            )
        logger.info(
            "step %d: checkpoint %s in %.2f s",
            curr_step,
            "saved" if self.save_future is None else "staged",
            time.monotonic() - begin,
        )
        return True

    def _save_last_step(self, curr_step: int) -> None:
        """The last step, synchronously: the weights alone in ``export_dtype`` when
        ``last_save_model_only`` (the HF export, with an adapter), else a full step."""
        if not self.last_save_model_only:
            self.steps.save(curr_step, self._weights_to_save(), self._training_states())
            return
        dtype = self.export_dtype
        weights = {
            k: v.to(dtype)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype
            else v
            for k, v in self.states[MODEL].state_dict().items()
        }
        self.steps.save(curr_step, self._to_hf(weights))

    def _weights_to_save(self) -> dict[str, Any]:
        return self._to_hf(self.states[MODEL].state_dict())

    def _to_hf(self, weights: dict[str, Any]) -> dict[str, Any]:
        return self.sd_adapter.to_hf(weights) if self.sd_adapter is not None else dict(weights)

    def _training_states(self) -> dict[str, Any]:
        return {k: v for k, v in self.states.items() if k != MODEL}

    # -- load ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """(all ranks) Load ``step`` (``-1``: the newest complete one; with none, the initial
        load, if configured). Returns whether anything was loaded.

        Raises:
            FileNotFoundError: ``step`` is not a complete step of ``folder``.
            ValueError: ``exclude_from_loading`` names a state that is not checkpointed.
        """
        steps = self.steps.all_checkpoints()
        if step != -1 and step not in steps:
            raise FileNotFoundError(
                f"checkpoint.load_step={step}: {self.steps.url} has no complete step {step}; "
                f"complete steps: {steps}"
            )
        if step == -1 and not steps:
            return self._initial_load()
        step = step if step != -1 else steps[-1]
        begin = time.monotonic()
        hf = self._to_hf(self.states[MODEL].state_dict())
        training = (
            None if step == 0 else self._states_to_restore()
        )  # step 0: a seed checkpoint, the model only
        try:
            self.steps.load(hf, training, step=step)
        except KeyError as exc:
            raise KeyError(
                f"{exc.args[0]}; step {step} of {self.steps.url} does not hold the training state "
                "(a last step saved with last_save_model_only=True holds the weights only): "
                "resume from an earlier step (checkpoint.load_step) or load its weights alone "
                "(initial_load_path=... with initial_load_in_hf=True, in an empty folder)"
            ) from None
        self._restore_model(hf)
        for key, value in (training or {}).items():
            if not isinstance(self.states[key], Stateful):
                self.states[key] = value  # a plain value: the loaded one replaces it
        logger.info(
            "loaded step %d from %s in %.2f s", step, self.steps.url, time.monotonic() - begin
        )
        return True

    def _states_to_restore(self) -> dict[str, Any]:
        unknown = [k for k in self.exclude_from_loading if k not in self.states]
        if unknown:
            raise ValueError(
                f"checkpoint.exclude_from_loading={self.exclude_from_loading}: {unknown} not "
                f"among the checkpointed states {sorted(self.states)}"
            )
        return {
            k: v
            for k, v in self.states.items()
            if k != MODEL and k not in self.exclude_from_loading
        }

    def _restore_model(self, hf: dict[str, Any]) -> None:
        """Hand loaded (HF-keyed) weights to the model: through the adapter's ``from_hf``, then
        the model wrapper's ``load_state_dict`` (which also refills fused parameters)."""
        self.states[MODEL].load_state_dict(
            self.sd_adapter.from_hf(hf) if self.sd_adapter is not None else hf
        )

    def _initial_load(self) -> bool:
        """The load of a fresh run (no step in ``folder``): an HF folder's weights, or a
        checkpoint in torchtitan's own DCP format, or nothing."""
        path = self.initial_load_path
        if self.initial_load_in_hf and path is None:
            path = getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise ValueError(
                    "initial_load_in_hf=True needs initial_load_path, or a state-dict adapter "
                    "with hf_assets_path (model.hf_assets_path)"
                )
        if path is None:
            logger.info(
                "no checkpoint in %s and no initial_load_path: a fresh start", self.steps.url
            )
            return False
        if self.initial_load_in_hf:
            # A quantized folder (FP8 block-wise, MXFP4) dequantized into float32, as torchtitan's
            # DeepSeek-V3 adapter's reader does, but from any store and each rank its own blocks.
            quantized = torch.float32 if self.initial_load_in_hf_quantized else None
            hf = self._to_hf(self.states[MODEL].state_dict())
            reader = HFStorageReader(
                path, storage_options=self.storage_options, dequantize=quantized
            )
            dcp.load(hf, storage_reader=reader)
            self._restore_model(hf)
        else:
            # torchtitan's own DCP format (a .metadata file): its own loader.
            self.dcp_load(
                self._states_to_load(self.initial_load_model_only),
                checkpoint_id=path,
                from_hf=False,
                from_quantized=False,
            )
        logger.info("initial load from %s", path)
        return True

    # -- the rest of torchtitan's manager interface ----------------------------------------------

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: every async mode stages the tensors before ``save`` returns."""

    def _wait_for_saving(self) -> None:
        """Wait until the async save in flight is committed (re-raising its error, if any)."""
        try:
            self.steps.wait()
        finally:
            self.save_future = None

    def _close(self) -> None:
        """Wait for the save in flight, then free the staging copy and the process groups."""
        self.steps.close()
        super()._close()

    def _should_purge(self) -> bool:
        return False  # retention is the step manager's, after each commit

    def _find_load_step(self, folder: str = "") -> int:
        """(all ranks) The newest complete step of ``folder`` (only this manager's), or -1."""
        if folder and folder != self.folder:
            raise ValueError(
                f"HFCheckpointManager lists its own folder {self.folder!r} only, not {folder!r}"
            )
        latest = self.steps.latest()
        return -1 if latest is None else latest

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """Where step ``step`` lives: ``folder/step_N`` (our step names, not torchtitan's
        ``step-N``)."""
        return posixpath.join(folder or self.folder, step_name(step))
