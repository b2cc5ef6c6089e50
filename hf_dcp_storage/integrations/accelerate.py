"""accelerate (and HF ``Trainer``, which checkpoints through it) under FSDP2: the model and the
optimizer saved through ``HFStorageWriter`` from every rank, to any store.

Two entry points; every rank calls them alike:

    from hf_dcp_storage.integrations.accelerate import route_fsdp_checkpoints

    route_fsdp_checkpoints(companions="path/to/hf_model_folder", storage_options=opts)
    accelerator.save_state(out)   # or trainer.train(): checkpoint-N through ours
    accelerator.load_state(out)   # or trainer.train(resume_from_checkpoint=True)

    from hf_dcp_storage.integrations.accelerate import AcceleratorCheckpoints

    ckpts = AcceleratorCheckpoints("s3://bucket/run1", keep_last_n=3, companions=..., ...)
    ckpts.save(step, model, optimizer, scheduler)        # step_N: COMMITTED last, keep-last-N
    step = ckpts.load(model, optimizer, scheduler)        # the newest complete step

**Why an override, not a hook.** Under FSDP, ``Accelerator.save_state`` / ``load_state`` call
``save_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_model`` / ``load_fsdp_optimizer``
(``accelerate/utils/fsdp_utils.py``) for every model and optimizer *before* running the
``register_save_state_pre_hook`` / ``register_load_state_pre_hook`` hooks, and the hooks are
handed neither the optimizers nor a way to skip those calls; ``Trainer`` calls the same four
functions directly (``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``) and offers no callback between. Those four hardcode
``dist_cp.FileSystemWriter`` (``.distcp``, local paths) or a rank-0 gather, so they are the one
place the writer can be chosen: ``route_fsdp_checkpoints`` replaces them, with the same
signatures, where accelerate and transformers bound them, after checking that the accelerate
installed is the one whose signatures it was written against (1.16.x; anything else fails
loudly). Everything else of a checkpoint (schedulers, RNG, samplers, ``trainer_state.json``) is
still accelerate's and transformers' own.

What the routed functions write, under accelerate's names (``Trainer`` spots an FSDP checkpoint
by them): ``output_dir/pytorch_model_fsdp_{i}/``, the model as a consolidated HF checkpoint with
``companions`` (``config.json``, tokenizer: ``from_pretrained`` loads it), or with
``adapter_only`` and a PEFT model PEFT's own folder (``PeftModel.from_pretrained`` loads it); and
``output_dir/optimizer_{i}/``, the optimizer's sharded state (keyed by parameter names) as
safetensors plus ``optimizer_state.json``. Each folder's index is written last. The plugin's
``state_dict_type`` and ``use_dcp`` do not matter: the state is always taken sharded. The
functions take any fsspec URL, but ``save_state`` and ``Trainer`` ``os.makedirs`` their
``output_dir`` and write their own files there: a local folder, which
``integrations.accelerate_trainer``'s mirror stages for a store (or: ``AcceleratorCheckpoints``).

**Step checkpoints on any store.** ``save_state``'s ``total_limit`` and ``Trainer``'s
``save_total_limit`` list and delete with ``os`` / ``shutil`` (local folders only; there they
remove routed checkpoints like their own), and neither marks a checkpoint complete.
``AcceleratorCheckpoints`` is ``hf_dcp_storage.CheckpointManager`` given accelerate's objects:
``root/step_N/`` holds the model (a consolidated HF folder, ``companions`` included),
``training_state/`` (optimizer, scheduler, ``extra`` values, every rank's RNG states) and
``COMMITTED``, written last; keep-last-N runs on rank 0 after each commit, on any fsspec store;
a kill during a save leaves the previous step complete and ``latest``.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:
    import accelerate
    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.fsdp_utils
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError as exc:  # pragma: no cover - exercised where accelerate is absent
    raise ImportError(
        f"hf_dcp_storage.integrations.accelerate needs accelerate ({exc}); install it with pip "
        "install 'hf_dcp_storage[accelerate]' (accelerate 1.16.x)"
    ) from exc

from ..reader import HFStorageReader
from ..steps import folder as ckpt_folder
from ..steps.manager import CheckpointManager
from ..steps.trainstate import join, split
from ..writer import HFStorageWriter

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_FILE_NAME",
    "OPTIMIZER_STATE_NAME",
    "SUPPORTED_ACCELERATE",
    "AcceleratorCheckpoints",
    "FSDPRouting",
    "route_fsdp_checkpoints",
]

# The accelerate releases whose four FSDP checkpoint functions have the signatures replaced here.
SUPPORTED_ACCELERATE = ((1, 16),)
# The non-tensor part of an optimizer's state (param_groups, tensor references), in its folder.
OPTIMIZER_STATE_NAME = "optimizer_state.json"
ADAPTER_FILE_NAME = "adapter_model.safetensors"  # PEFT's names, as integrations.peft writes them
ADAPTER_CONFIG_NAME = "adapter_config.json"
# accelerate's own folder names (``FSDP_MODEL_NAME``, ``OPTIMIZER_NAME`` in utils/constants.py).
_MODEL_DIR, _OPTIMIZER_DIR = "pytorch_model_fsdp", "optimizer"
_ROUTED = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
# Where accelerate 1.16 and transformers bind them (``from ..utils import save_fsdp_model``).
_BINDERS = ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator")
_TRAINER_MODULE = "transformers.trainer"
_Path = str | os.PathLike[str]


class FSDPRouting:
    """The replacement of accelerate's FSDP checkpoint functions made by
    ``route_fsdp_checkpoints``; ``remove()`` (or leaving a ``with`` block) puts accelerate's own
    back."""

    def __init__(self, io: dict[str, Any], companions: Any) -> None:
        self._io, self._companions = io, companions
        self._reader_io = {k: io[k] for k in ("storage_options", "thread_count")}
        self._originals: dict[str, Any] = {}
        self.redirect(lambda p: os.fspath(p), lambda p: None)  # noqa: PLW0108 (str only)

    def redirect(self, url: Callable[[_Path], str], before_save: Callable[[_Path], None]) -> None:
        """Where the functions write and read each folder they are given (``url(folder)``) and
        what every rank runs before a model save (``before_save(output_dir)``): by default the
        folder itself and nothing; ``integrations.accelerate_trainer`` redirects to a store."""
        self._url, self._before_save = url, before_save

    def __enter__(self) -> FSDPRouting:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Put accelerate's functions back wherever this routing's are bound (idempotent)."""
        for module in _binders():
            for name, original in self._originals.items():
                if getattr(module, name, None) == getattr(self, name):
                    setattr(module, name, original)

    def _install(self) -> None:
        fsdp_utils = accelerate.utils.fsdp_utils
        bound = [getattr(getattr(fsdp_utils, name), "__self__", None) for name in _ROUTED]
        if any(isinstance(owner, FSDPRouting) for owner in bound):
            raise RuntimeError(
                "accelerate's FSDP checkpoint functions are routed already: remove() that "
                "routing first (one routing at a time, so that removing it restores accelerate's)"
            )
        self._originals = {name: getattr(fsdp_utils, name) for name in _ROUTED}
        for module in _binders():
            for name in _ROUTED:
                if hasattr(module, name):
                    setattr(module, name, getattr(self, name))

    # -- accelerate's four functions, same signatures (transformers inspects ``adapter_only``) --

    def save_fsdp_model(
        self,
        fsdp_plugin: Any,
        accelerator: Any,
        model: torch.nn.Module,
        output_dir: str | os.PathLike[str],
        model_index: int = 0,
        adapter_only: bool = False,
        use_dcp: bool = True,
    ) -> None:
        """(every rank) ``model`` into ``output_dir/pytorch_model_fsdp_{model_index}``."""
        if model_index == 0:
            self._before_save(output_dir)
        url = _join(self._url(output_dir), f"{_MODEL_DIR}_{model_index}")
        if adapter_only and hasattr(model, "peft_config"):
            writer = HFStorageWriter(
                url, **self._io, file_name=ADAPTER_FILE_NAME, companions=_peft_config(model)
            )
            dcp.save(_peft_tensors(model), storage_writer=writer)
        else:
            writer = HFStorageWriter(url, **self._io, companions=self._companions)
            dcp.save(get_model_state_dict(model), storage_writer=writer)

    def load_fsdp_model(
        self,
        fsdp_plugin: Any,
        accelerator: Any,
        model: torch.nn.Module,
        input_dir: str | os.PathLike[str],
        model_index: int = 0,
        adapter_only: bool = False,
        use_dcp: bool = True,
    ) -> Any:
        """(every rank) Load what ``save_fsdp_model`` wrote into ``model``, resharded.
        ``input_dir`` may be that folder itself, as accelerate allows."""
        url = self._url(_model_folder(input_dir, model_index))
        reader = HFStorageReader(url, **self._reader_io)
        if adapter_only and hasattr(model, "peft_config"):
            dcp.load(_peft_tensors(model), storage_reader=reader)  # into the adapter's tensors
            return None
        weights = get_model_state_dict(model)
        dcp.load(weights, storage_reader=reader)
        return set_model_state_dict(model, weights)

    def save_fsdp_optimizer(
        self,
        fsdp_plugin: Any,
        accelerator: Any,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        output_dir: str | os.PathLike[str],
        optimizer_index: int = 0,
        use_dcp: bool = True,
    ) -> None:
        """(every rank) ``optimizer``'s sharded state into ``output_dir/optimizer_{i}``."""
        state = get_optimizer_state_dict(model, _unwrap(optimizer))
        tensors, tree = split({"optimizer": state})
        # param_groups are alike on every rank: the coordinator's copy is the one written.
        tree_json = json.dumps(tree, allow_nan=False)
        writer = HFStorageWriter(
            _join(self._url(output_dir), f"{_OPTIMIZER_DIR}_{optimizer_index}"),
            **self._io,
            companions={OPTIMIZER_STATE_NAME: tree_json},
        )
        dcp.save(tensors, storage_writer=writer)

    def load_fsdp_optimizer(
        self,
        fsdp_plugin: Any,
        accelerator: Any,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        input_dir: str | os.PathLike[str],
        optimizer_index: int = 0,
        adapter_only: bool = False,
        use_dcp: bool = True,
    ) -> None:
        """(every rank) Load what ``save_fsdp_optimizer`` wrote into ``optimizer``, resharded.

        Raises:
            KeyError: the saved state holds a tensor this optimizer has none of, naming it
                (one this optimizer has and the folder lacks fails in DCP's load).
        """
        url = _join(self._url(input_dir), f"{_OPTIMIZER_DIR}_{optimizer_index}")
        fs, folder = ckpt_folder.locate(url, self._io["storage_options"])
        tree = json.loads(ckpt_folder.read_file(fs, f"{folder.rstrip('/')}/{OPTIMIZER_STATE_NAME}"))
        plain = _unwrap(optimizer)
        # Asking for the state creates a fresh optimizer's (torch steps it once with lr 0), so
        # every saved tensor has its sharded destination here.
        current, _ = split({"optimizer": get_optimizer_state_dict(model, plain)})
        dcp.load(current, storage_reader=HFStorageReader(url, **self._reader_io))
        try:
            state = join(tree, current)["optimizer"]
        except KeyError as exc:
            raise KeyError(
                f"{url} holds optimizer state {exc} that this optimizer lacks: load it into the "
                "model and optimizer type that saved it"
            ) from None
        set_optimizer_state_dict(model, plain, optim_state_dict=state)


def route_fsdp_checkpoints(
    *,
    storage_options: dict[str, Any] | None = None,
    companions: Any = None,
    max_shard_size: int | str = "5GB",
    thread_count: int = 4,
) -> FSDPRouting:
    """(every rank, before the first save or load) Route accelerate's FSDP checkpoint functions,
    and so ``Accelerator.save_state`` / ``load_state`` and ``Trainer`` checkpoints under FSDP,
    through ``HFStorageWriter`` / ``HFStorageReader`` until the returned routing is removed.

    Args:
        storage_options: for fsspec, for every folder the functions are given as a URL.
        companions: the model's ``config.json`` and tokenizer files (a folder or a dict,
            ``HFStorageWriter(companions=...)``), into every model folder.
        max_shard_size, thread_count: passed to ``HFStorageWriter``.

    Raises:
        RuntimeError: the accelerate installed is not 1.16.x, or its functions' signatures are
            not those this replaces (naming the version found and the one supported), or a
            routing is in place already.
        ValueError: bad ``storage_options`` or ``companions``, before anything is replaced.
    """
    _check_accelerate()
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ValueError(
            f"storage_options={storage_options!r} must be None or a dict of fsspec options"
        )
    HFStorageWriter(companions=companions)  # refuses bad ones now, not at the first save
    io = {
        "storage_options": storage_options,
        "max_shard_size": max_shard_size,
        "thread_count": thread_count,
        "overwrite": True,  # as accelerate's own functions do: a save replaces the folder
    }
    routing = FSDPRouting(io, companions)
    routing._install()
    return routing


class AcceleratorCheckpoints:
    """Step checkpoints of an accelerate training loop at any fsspec URL: ``CheckpointManager``
    (its arguments: ``keep_last_n``, ``storage_options``, ``companions``, ...) given a model, its
    optimizer and scheduler as accelerate prepared them. Every rank makes one and calls
    ``save`` / ``load`` alike."""

    def __init__(self, root: str | os.PathLike[str], **manager_options: Any) -> None:
        self.manager = CheckpointManager(root, **manager_options)

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """(every rank) Save ``root/step_{step}``: the model's weights, and the optimizer's,
        the scheduler's and ``extra``'s state (``Stateful`` objects or tensors and JSON values).

        Raises:
            FileExistsError, TypeError, ValueError: as ``CheckpointManager.save``.
        """
        self.manager.save(
            step, get_model_state_dict(model), self._state(model, optimizer, scheduler, extra)
        )

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        step: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> int:
        """(every rank) Load the newest complete step (or ``step``) into the objects given,
        resharded, and this rank's RNG states; plain ``extra`` values are replaced in place.
        Returns the step.

        Raises:
            FileNotFoundError: no complete step (or not ``step``), listing the complete ones.
        """
        weights = get_model_state_dict(model)
        state = self._state(model, optimizer, scheduler, extra)
        loaded = self.manager.load(weights, state, step=step)
        set_model_state_dict(model, weights)
        if extra is not None:
            extra.update({k: state[f"extra.{k}"] for k in extra})
        return loaded

    def latest(self) -> int | None:
        """(every rank) The newest complete step, or ``None``."""
        return self.manager.latest()

    def close(self) -> None:
        self.manager.close()

    @staticmethod
    def _state(model: Any, optimizer: Any, scheduler: Any, extra: Any) -> dict[str, Any]:
        state: dict[str, Any] = {"optimizer": _OptimizerState(model, _unwrap(optimizer))}
        if scheduler is not None:
            state["scheduler"] = scheduler
        state.update({f"extra.{k}": v for k, v in (extra or {}).items()})
        return state


class _OptimizerState:
    """An optimizer's sharded state as a ``Stateful`` (keyed by parameter names)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state)


def _check_accelerate() -> None:
    """Refuse an accelerate whose FSDP checkpoint functions this was not written against."""
    found = accelerate.__version__
    major_minor = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
    supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_ACCELERATE)
    if major_minor not in SUPPORTED_ACCELERATE:
        raise RuntimeError(
            f"route_fsdp_checkpoints replaces accelerate's FSDP checkpoint functions and supports "
            f"accelerate {supported}; found accelerate {found}: install a supported one (pip "
            "install 'hf_dcp_storage[accelerate]'), or use AcceleratorCheckpoints, which "
            "replaces nothing"
        )
    for name in _ROUTED:
        params = list(inspect.signature(getattr(accelerate.utils.fsdp_utils, name)).parameters)
        expected = list(inspect.signature(getattr(FSDPRouting, name)).parameters)[1:]
        if params != expected:
            raise RuntimeError(
                f"accelerate {found}: {name}{tuple(params)} is not the {name}{tuple(expected)} "
                f"of accelerate {supported} that route_fsdp_checkpoints replaces; nothing was "
                "replaced"
            )


def _peft_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The active adapter's tensors of a ``PeftModel`` under PEFT's keys (the model's own,
    DTensors where sharded). peft is taken from ``sys.modules``: the model is a ``PeftModel``, so
    it is imported; an import statement would make this module import a second trainer package."""
    name = model.active_adapter
    return sys.modules["peft"].get_peft_model_state_dict(
        model, state_dict=model.state_dict(), adapter_name=name
    )


def _peft_config(model: Any) -> dict[str, bytes]:
    """``{adapter_config.json: ...}`` as ``PeftModel.save_pretrained`` writes it."""
    config = copy.deepcopy(model.peft_config[model.active_adapter])
    config.inference_mode = True
    with tempfile.TemporaryDirectory(prefix="hf_dcp_peft_") as tmp:
        config.save_pretrained(tmp)
        with open(os.path.join(tmp, ADAPTER_CONFIG_NAME), "rb") as f:
            return {ADAPTER_CONFIG_NAME: f.read()}


def _binders() -> list[Any]:
    """The modules holding the four functions: accelerate's, and ``transformers.trainer`` once
    imported (imported later, it binds whatever ``accelerate.utils`` holds then)."""
    names = [*_BINDERS, _TRAINER_MODULE]
    return [sys.modules[name] for name in names if name in sys.modules]


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` under accelerate's wrappers (stepping the wrapper would
    also step its grad scaler, as accelerate's ``_unwrap_optimizer`` notes)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _join(base: str | os.PathLike[str], name: str) -> str:
    # A string join: os.path.join would do too, but Path would turn s3://b/x into s3:/b/x.
    return f"{os.fspath(base).rstrip('/')}/{name}"


def _model_folder(input_dir: str | os.PathLike[str], model_index: int) -> str:
    base = os.fspath(input_dir).rstrip("/")
    name = f"{_MODEL_DIR}_{model_index}"
    return base if base.rsplit("/", 1)[-1] == name else _join(base, name)
