"""torchtune: ``HFCheckpointer``, a checkpointer torchtune's recipes take that saves HF folders
from every rank, in step folders, on any store.

In a recipe's config::

    checkpointer:
      _component_: hf_dcp_storage.integrations.torchtune.HFCheckpointer
      checkpoint_dir: s3://bucket/base/Llama-3.2-1B     # the base model: an HF folder, any store
      output_dir: s3://bucket/runs/run1
      model_type: LLAMA3_2
      keep_last_n: 3
    enable_async_checkpointing: True   # background saves; a resume reads sharded
    resume_from_checkpoint: False      # True: resume, exactly, from the newest complete step

The run folder is a ``CheckpointManager`` run (``steps/manager.py``): ``step_N/`` holds the
weights as a consolidated HF checkpoint in HF's key names (torchtune's own converter for
``model_type``, e.g. ``convert_weights.tune_to_hf`` for Llama), the base folder's
``config.json``, generation config and tokenizer files (``from_pretrained`` loads the step as it
is), ``training_state/`` (the optimizer's sharded state, ``seed``, ``epochs_run``,
``steps_run``, ``total_epochs``, ``max_steps_per_epoch``, the dataloader's state) and
``COMMITTED``, written last. ``N`` is the ``step`` the caller passes, else the state's
``steps_run``, else the epochs run (``epoch + 1``) times the steps per epoch that earlier saves
of the run showed: torchtune 0.6.1's recipes pass no step count (folders then count epochs), and
its client's final save carries no progress at all. Retention keeps the last ``keep_last_n``
complete steps.

Why these hooks, against torchtune 0.6.1 (``training/checkpointing/_checkpoint_client.py``):

- ``CheckpointClient`` keeps the model sharded and calls the checkpointer on every rank only when
  the checkpointer is a ``DistributedCheckpointer`` (any other is handed a full state dict that
  rank 0 gathered). ``HFCheckpointer`` is one, so every rank saves its own shards.
- The client sends async intermediate saves and ``load_distributed_checkpoint`` (the recipe's
  exact resume) to a stock ``DistributedCheckpointer`` it builds itself in
  ``_get_dcp_checkpointer``, a private method with no option to pass one in. Importing this
  module replaces that one method (``_route_client``, after a version check that fails loudly)
  with one that returns the configured checkpointer when it is an ``HFCheckpointer`` and
  otherwise does what torchtune's does: both paths then go through ours, with no change to the
  recipe.

Which ranks call what: the client calls ``save_checkpoint``, ``load_checkpoint(state_dict)``
(the sharded resume) and ``load_checkpoint()`` on every rank at the same points. The last
returns full tensors on every rank, which torchtune's recipes then shard, as its own HF
checkpointer does: the base model, or, for a synchronous resume, the newest step's weights and
optimizer (keyed by parameter name: the optimizer's parameter numbers are paired with the
model's keys when saving, ``_param_names``). ``load_base_into(model)`` reads each rank's own
slices of the base model instead, for loops that build the sharded model first.
"""

from __future__ import annotations

import importlib
import posixpath
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_model_state_dict

try:
    import torchtune
    from torchtune import training
    from torchtune.training.checkpointing._checkpoint_client import CheckpointClient
    from torchtune.training.checkpointing._checkpointer import DistributedCheckpointer
except ImportError as exc:  # pragma: no cover - exercised where torchtune is absent
    raise ImportError(
        f"hf_dcp_storage.integrations.torchtune needs torchtune ({exc}); install it with pip "
        "install 'hf_dcp_storage[torchtune]' (torchtune 0.6.1 with torchao 0.10-0.14.1)"
    ) from exc

from .. import RetryPolicy
from ..reader import HFStorageReader
from ..steps.folder import missing, read_config
from ..steps.manager import CheckpointManager
from ..steps.retention import step_name

__all__ = ["SUPPORTED_MODEL_TYPES", "HFCheckpointer"]

# The training-state entry that names the optimizer's parameter numbers (``_param_names``).
_PARAM_NAMES = "hf_dcp_param_names"
# What a synchronous resume returns besides the weights (``_load_full_step``).
_PROGRESS_KEYS = [training.OPT_KEY, training.SEED_KEY, training.EPOCHS_KEY, training.STEPS_KEY]
_PROGRESS_KEYS += [training.TOTAL_EPOCHS_KEY, training.MAX_STEPS_KEY, training.DATALOADER_KEY]

# torchtune's releases whose CheckpointClient this module's one override was written against.
_SUPPORTED_TORCHTUNE = ("0.6.",)

Converter = Callable[[dict[str, Any]], dict[str, Any]]


def _pair(
    module_name: str, to_hf: str, from_hf: str, *, tied: bool = False
) -> Callable[[Mapping[str, Any]], tuple[Converter, Converter]]:
    """torchtune's converter pair ``module_name.to_hf`` / ``from_hf``, given the shape
    parameters of a ``config.json``: head_dim, or (``tied``) tie_word_embeddings as well."""

    def make(cfg: Mapping[str, Any]) -> tuple[Converter, Converter]:
        module = importlib.import_module(module_name)
        args = {
            "num_heads": cfg["num_attention_heads"],
            "num_kv_heads": cfg["num_key_value_heads"],
            "dim": cfg["hidden_size"],
        }
        if tied:
            args["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)
        else:
            args["head_dim"] = cfg.get("head_dim")
        return (
            lambda sd: getattr(module, to_hf)(sd, **args),
            lambda sd: getattr(module, from_hf)(sd, **args),
        )

    return make


_LLAMA = _pair("torchtune.models.convert_weights", "tune_to_hf", "hf_to_tune")
# The model types whose converters rename keys and permute rows within a tensor, which works on
# sharded DTensors; the others (PHI3_MINI/PHI4 fuse q, k and v into one tensor, the vision and
# reward models) are refused by name.
_CONVERTERS = {
    "LLAMA2": _LLAMA,
    "LLAMA3": _LLAMA,
    "LLAMA3_2": _LLAMA,
    "MISTRAL": _LLAMA,
    "GEMMA": _LLAMA,
    "QWEN2": _pair(
        "torchtune.models.qwen2._convert_weights", "qwen2_tune_to_hf", "qwen2_hf_to_tune", tied=True
    ),
    "GEMMA2": _pair(
        "torchtune.models.gemma2._convert_weights", "gemma2_tune_to_hf", "gemma2_hf_to_tune"
    ),
}
SUPPORTED_MODEL_TYPES = tuple(_CONVERTERS)


class HFCheckpointer(DistributedCheckpointer):
    """A torchtune checkpointer (``checkpointer._component_``) saving HF step folders from
    every rank, to any store (see the module docstring).

    Args:
        checkpoint_dir: the base model, an HF folder (local path or fsspec URL) holding
            ``config.json`` (its shape parameters drive the key converter) and the weights.
        output_dir: the run folder; ``step_N`` folders go under it.
        model_type: torchtune's ``ModelType`` name, one of ``SUPPORTED_MODEL_TYPES``.
        checkpoint_files: accepted for torchtune configs; when given as a list, each must be a
            file of the base folder (the weights are found through its index either way).
        should_load_recipe_state: set by torchtune's client (``resume_from_checkpoint`` with
            ``enable_async_checkpointing: False``): ``load_checkpoint()`` then returns the newest
            complete step as full tensors on every rank, weights and optimizer, which the recipe
            shards (torchtune's own synchronous resume). With ``enable_async_checkpointing:
            True`` the client resumes through ``load_checkpoint(state_dict)`` instead: sharded,
            each rank reading its own slices.
        async_save: save the client's synchronous intermediate checkpoints in the background
            too (the final one stays synchronous), for where ``enable_async_checkpointing`` is
            not an option (torchtune 0.6.1 on CPU: see docs/trainers.md).
        keep_last_n, keep_every, storage_options, max_shard_size, thread_count, retry,
        async_mode: passed to ``CheckpointManager``.
        companions: files written into every step folder (``HFStorageWriter(companions=)``);
            ``None``: the base folder's ``config.json``, generation config and tokenizer files;
            ``{}``: none.

    Raises:
        ValueError: an unsupported ``model_type``, naming the supported ones.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        output_dir: str,
        model_type: str,
        checkpoint_files: list[str] | dict[str, Any] | None = None,
        *,
        should_load_recipe_state: bool = False,
        resume_from_checkpoint: bool = False,
        keep_last_n: int = 3,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        max_shard_size: int | str = "5GB",
        thread_count: int = 4,
        retry: RetryPolicy | None = None,
        async_mode: str = "thread",
        async_save: bool = False,
        companions: Any = None,
    ) -> None:
        if model_type not in _CONVERTERS:
            raise ValueError(
                f"model_type={model_type!r}: HFCheckpointer converts {list(_CONVERTERS)} (their "
                "converters rename keys and permute rows, which works on sharded tensors); for "
                "another model use torchtune's FullModelHFCheckpointer"
            )
        # What the client reads off a checkpointer (it builds paths from these two).
        self._checkpoint_dir, self._output_dir = str(checkpoint_dir), str(output_dir)
        self._checkpoint_files = checkpoint_files
        self._should_load_recipe_state = should_load_recipe_state or resume_from_checkpoint
        # OmegaConf hands a config's mappings over as DictConfig: plain dicts go on to fsspec.
        self._storage_options = storage_options = _plain(storage_options)
        self._thread_count, self._retry = thread_count, retry
        config = read_config(self._checkpoint_dir, storage_options)
        if config is None:
            raise FileNotFoundError(
                f"checkpoint_dir={self._checkpoint_dir!r} has no config.json: HFCheckpointer reads "
                "the model's shape from it (num_attention_heads, num_key_value_heads, "
                "hidden_size) for torchtune's key converter; copy the model's config.json there"
            )
        self._config = config
        self._to_hf, self._from_hf = _CONVERTERS[model_type](self._config)
        self._steps_per_epoch: int | None = None
        self._async_save = async_save
        self.manager = CheckpointManager(
            self._output_dir,
            keep_last_n=keep_last_n,
            keep_every=keep_every,
            storage_options=storage_options,
            max_shard_size=max_shard_size,
            thread_count=thread_count,
            retry=retry,
            async_mode=async_mode,
            companions=self._checkpoint_dir if companions is None else _plain(companions),
        )

    # -- save ---------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        state_dict: dict[str, Any],
        epoch: int,
        intermediate_checkpoint: bool = False,
        adapter_only: bool = False,
        *,
        save_async: bool = False,
        step: int | None = None,
    ) -> None:
        """(every rank) Save ``state_dict[MODEL_KEY]`` (sharded, torchtune's keys) as ``step_N``
        with the rest of ``state_dict`` (optimizer, progress) as its training state; the
        client's two call shapes (``intermediate_checkpoint=`` from its synchronous path,
        ``save_async=`` from its asynchronous one) both land here. With ``save_async`` the call
        returns once the tensors are staged; the next save or load waits for it."""
        if adapter_only:
            raise ValueError(
                "adapter_only=True: HFCheckpointer saves full models; save LoRA adapters with "
                "hf_dcp_storage.integrations.peft.save_adapter"
            )
        model = state_dict[training.MODEL_KEY]
        state = {k: v for k, v in state_dict.items() if k != training.MODEL_KEY}
        if step is not None:
            state.setdefault(training.STEPS_KEY, step)
        number = self._step_number(state, epoch)
        # Always present (None when unknown), so that a resume can ask for them.
        state.setdefault(training.STEPS_KEY, None)
        state.setdefault(training.DATALOADER_KEY, None)
        if training.OPT_KEY in state:
            state[_PARAM_NAMES] = _param_names(model, state[training.OPT_KEY])
        background = save_async or (self._async_save and intermediate_checkpoint)
        self.manager.save(number, self._to_hf(dict(model)), state, async_save=background)

    def _step_number(self, state: Mapping[str, Any], epoch: int) -> int:
        """``steps_run`` when the caller gives it, else the epochs run times the steps per
        epoch the run's earlier saves showed (torchtune 0.6.1's final save carries no progress),
        else the epochs run."""
        self._learn_steps_per_epoch(state)
        if state.get(training.STEPS_KEY) is not None:
            return int(state[training.STEPS_KEY])
        return (epoch + 1) * (self._steps_per_epoch or 1)

    def _learn_steps_per_epoch(self, state: Mapping[str, Any]) -> None:
        steps, epochs = state.get(training.STEPS_KEY), state.get(training.EPOCHS_KEY)
        if steps is not None and epochs and int(steps) % int(epochs) == 0:
            self._steps_per_epoch = int(steps) // int(epochs)

    # -- load ---------------------------------------------------------------------------------

    def load_checkpoint(
        self, state_dict: dict[str, Any] | None = None, checkpoint_path: str | None = None
    ) -> dict[str, Any]:
        """(every rank) Without ``state_dict``: the base model as full tensors in torchtune's keys,
        ``{MODEL_KEY: ...}`` (the client's ``load_base_checkpoint``). With one (the client's
        ``load_distributed_checkpoint``: the sharded model's and optimizer's state dicts and the
        progress entries): the newest complete step (or ``checkpoint_path``'s ``step_N``)
        loaded into it in place, resharded, plus the dataloader's state it saved.

        Raises:
            FileNotFoundError: no complete step to resume from, or the step is a final one
                (weights only: torchtune saves no recipe state with it).
            ValueError: a ``checkpoint_path`` that is not a ``step_N`` folder; a synchronous
                resume from a step whose optimizer numbers do not pair with the model's keys.
        """
        if state_dict is None:
            if self._should_load_recipe_state:
                return self._load_full_step()
            self._check_files()
            base = self._full(self._checkpoint_dir)
            dcp.load(base, storage_reader=self._reader(self._checkpoint_dir))
            return {training.MODEL_KEY: self._from_hf(base)}
        step = _step_of(checkpoint_path)
        model = state_dict[training.MODEL_KEY]
        weights = self._to_hf(dict(model))
        state = {k: v for k, v in state_dict.items() if k != training.MODEL_KEY}
        # The client's template leaves out the dataloader's state and the step count.
        state.setdefault(training.DATALOADER_KEY, None)
        state.setdefault(training.STEPS_KEY, None)
        self._load_step(weights, state, step)
        # The converters return new tensors where they permute rows (q and k); those hold the
        # loaded values and go back under torchtune's keys for the client to copy into the model.
        state_dict.update(state)
        self._learn_steps_per_epoch(state)
        state_dict[training.MODEL_KEY] = self._from_hf(weights)
        return state_dict

    def load_base_into(self, model: torch.nn.Module) -> None:
        """(every rank) Load the base model into an already sharded ``model``: each rank reads
        only the slices its shards hold."""
        weights = self._to_hf(model.state_dict())
        dcp.load(weights, storage_reader=self._reader(self._checkpoint_dir))
        set_model_state_dict(model, self._from_hf(weights))

    def _load_full_step(self) -> dict[str, Any]:
        """The newest complete step as full tensors, for torchtune's synchronous resume (its
        recipes shard them): the weights in torchtune's keys, the optimizer keyed by parameter
        name as ``get_optimizer_state_dict(full_state_dict=True)`` gives it, the progress."""
        step = self.manager.latest()
        if step is None:
            raise FileNotFoundError(f"{self.manager.url}: no complete step_N to resume from")
        weights = self._full(posixpath.join(self.manager.url, step_name(step)))
        state: dict[str, Any] = dict.fromkeys((*_PROGRESS_KEYS, _PARAM_NAMES))
        self._load_step(weights, state, step)
        names = state.pop(_PARAM_NAMES)
        optim = state[training.OPT_KEY]
        if names is None:
            raise ValueError(
                f"step_{step}: its optimizer state is keyed by parameter number and the numbers do "
                "not pair with the model's keys (an optimizer not built from model.parameters(), "
                "or one per parameter), so it cannot be handed to torchtune's synchronous resume; "
                "set enable_async_checkpointing: True to resume through "
                "load_distributed_checkpoint"
            )
        state[training.OPT_KEY] = {
            "state": {names[int(i)]: v for i, v in optim["state"].items()},
            "param_groups": [
                {**g, "params": [names[int(i)] for i in g["params"]]} for g in optim["param_groups"]
            ],
        }
        self._learn_steps_per_epoch(state)
        return {training.MODEL_KEY: self._from_hf(weights), **state}

    def _load_step(self, weights: dict[str, Any], state: dict[str, Any], step: int | None) -> None:
        try:
            self.manager.load(weights, state, step=step)
        except KeyError as exc:
            raise FileNotFoundError(
                f"{self._output_dir}: the step to resume from holds no recipe state ({exc}): it "
                "is a run's final checkpoint, which torchtune saves as weights only"
            ) from exc

    def _full(self, folder: str) -> dict[str, torch.Tensor]:
        """Empty full tensors of every weight of the HF folder ``folder``, to load into."""
        full: dict[str, torch.Tensor] = {}
        for key, md in self._reader(folder).read_metadata().state_dict_metadata.items():
            assert isinstance(md, TensorStorageMetadata)  # an HF folder holds tensors only
            full[key] = torch.empty(md.size, dtype=md.properties.dtype)
        return full

    def _reader(self, folder: str) -> HFStorageReader:
        return HFStorageReader(
            folder,
            storage_options=self._storage_options,
            thread_count=self._thread_count,
            retry=self._retry,
        )

    def _check_files(self) -> None:
        # torchtune's dict form ({"filename_format": ..., "max_filename": ...}) names a pattern,
        # not files; the list form names files, each of which must be in the folder.
        if not isinstance(self._checkpoint_files, list):
            return
        absent = missing(self._checkpoint_dir, self._storage_options, self._checkpoint_files)
        if absent:
            raise ValueError(
                f"checkpoint_files {absent} are not in {self._checkpoint_dir}; leave "
                "checkpoint_files out: the folder's index names its weights files"
            )


def _plain(value: Any) -> Any:
    """``value`` with every mapping a ``dict`` and every other sequence a ``list`` (OmegaConf's
    ``DictConfig`` and ``ListConfig`` are neither); strings and bytes as they are."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _param_names(model: Mapping[str, Any], optim: Any) -> list[str] | None:
    """The model keys of an optimizer state's parameter numbers (0, 1, ...), or None where they
    do not pair up. torchtune's recipes build the optimizer from ``model.parameters()``, and its
    decoders' state dicts hold parameters only, in that order; the count and every state
    tensor's shape are checked against the keys."""
    if not isinstance(optim, Mapping) or "param_groups" not in optim:
        return None  # e.g. torchtune's optimizer-in-backward wrapper
    names = list(model)
    if [i for g in optim["param_groups"] for i in g["params"]] != list(range(len(names))):
        return None
    for i, values in optim.get("state", {}).items():
        for v in values.values():
            if isinstance(v, torch.Tensor) and v.dim() and v.shape != model[names[i]].shape:
                return None
    return names


def _step_of(checkpoint_path: str | None) -> int | None:
    if checkpoint_path is None:
        return None
    name = posixpath.basename(str(checkpoint_path).rstrip("/"))
    if not name.startswith("step_") or not name[5:].isdigit():
        raise ValueError(
            f"checkpoint_path={checkpoint_path!r}: name a step folder of the run (…/step_N), or "
            "leave it out for the newest complete step"
        )
    return int(name[5:])


def _route_client() -> None:
    """Make ``CheckpointClient._get_dcp_checkpointer`` return the configured checkpointer when
    it is an ``HFCheckpointer`` (see the module docstring); torchtune's own otherwise."""
    version = getattr(torchtune, "__version__", "unknown")
    original = getattr(CheckpointClient, "_get_dcp_checkpointer", None)
    if not version.startswith(_SUPPORTED_TORCHTUNE) or original is None:
        raise ImportError(
            f"hf_dcp_storage.integrations.torchtune supports torchtune 0.6.x, found {version}: "
            "it routes CheckpointClient._get_dcp_checkpointer (async saves, "
            "load_distributed_checkpoint) to HFCheckpointer, a private method that other "
            "releases may not have; pip install 'torchtune==0.6.1'"
        )
    if getattr(original, "_routes_hf_checkpointer", False):
        return

    def _get_dcp_checkpointer(self: CheckpointClient) -> Any:
        checkpointer = self._get_checkpointer()
        if isinstance(checkpointer, HFCheckpointer):
            return checkpointer
        return original(self)

    _get_dcp_checkpointer._routes_hf_checkpointer = True  # type: ignore[attr-defined]
    CheckpointClient._get_dcp_checkpointer = _get_dcp_checkpointer


_route_client()
