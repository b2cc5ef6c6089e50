"""PEFT adapters (LoRA and the others ``peft`` saves) of sharded models, in PEFT's own folder:
``adapter_model.safetensors`` and ``adapter_config.json``, written from every rank, to any store.

``PeftModel.save_pretrained`` under FSDP2 or TP keeps one rank's shards (or needs the whole
adapter gathered on one rank first); ``save_adapter`` saves every rank's shards of the adapter's
tensors through ``HFStorageWriter``, consolidated into PEFT's one file (``file_name=``), the
config next to it, the index last (the commit marker; PEFT ignores it).
``PeftModel.from_pretrained(base, folder)`` loads the result; ``load_adapter`` loads a folder that
either wrote (ours, or ``save_pretrained``'s) into a sharded model, resharded. The keys and the
tensors chosen are PEFT's own (``get_peft_model_state_dict``: the adapter name taken out of each
key, and whatever else the adapter type saves, as ``save_pretrained`` does).

Every rank calls both, with the same model (``peft`` is imported here alone).
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

try:
    from peft import get_peft_model_state_dict
except ImportError as exc:  # pragma: no cover - exercised where peft is absent
    raise ImportError(
        f"hf_dcp_storage.integrations.peft needs peft ({exc}); install it with pip install "
        "'hf_dcp_storage[peft]'"
    ) from exc

from ..reader import HFStorageReader
from ..writer import HFStorageWriter

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_FILE_NAME",
    "adapter_state_dict",
    "load_adapter",
    "save_adapter",
]

ADAPTER_FILE_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def adapter_state_dict(model: Any, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """(every rank) ``adapter_name``'s tensors of the ``PeftModel`` ``model`` under the keys PEFT
    saves them with; the model's own tensors (DTensors where it is sharded), not copies, so that
    a load into them loads the model."""
    return get_peft_model_state_dict(
        model, state_dict=model.state_dict(), adapter_name=adapter_name
    )


def adapter_config(model: Any, adapter_name: str = "default") -> bytes:
    """``adapter_config.json`` of ``adapter_name``, as ``PeftModel.save_pretrained`` writes it
    (by the config's own ``save_pretrained``, ``inference_mode`` set)."""
    config = copy.deepcopy(model.peft_config[adapter_name])
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None:
        # What AutoPeftModel builds the base from, as save_pretrained records it.
        base = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto_mapping = {"base_model_class": base.__name__, "parent_library": base.__module__}
    with tempfile.TemporaryDirectory(prefix="hf_dcp_peft_") as tmp:
        config.save_pretrained(tmp, auto_mapping_dict=auto_mapping)
        with open(os.path.join(tmp, ADAPTER_CONFIG_NAME), "rb") as f:
            return f.read()


def save_adapter(
    model: Any,
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    storage_options: dict[str, Any] | None = None,
    **writer_options: Any,
) -> None:
    """(every rank) Save ``adapter_name`` of ``model`` (a ``PeftModel``, sharded or not) to
    ``path`` as PEFT's folder; ``writer_options`` go to ``HFStorageWriter`` (``overwrite``,
    ``thread_count``...).

    Raises:
        ValueError: the model has no adapter of that name (naming those it has).
    """
    _check_adapter(model, adapter_name)
    writer = HFStorageWriter(
        path,
        storage_options=storage_options,
        file_name=ADAPTER_FILE_NAME,
        companions={ADAPTER_CONFIG_NAME: adapter_config(model, adapter_name)},
        **writer_options,
    )
    dcp.save(adapter_state_dict(model, adapter_name), storage_writer=writer)


def load_adapter(
    model: Any,
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    storage_options: dict[str, Any] | None = None,
    **reader_options: Any,
) -> None:
    """(every rank) Load the adapter folder at ``path`` (ours, or ``save_pretrained``'s) into
    ``adapter_name`` of ``model``, whatever its sharding; ``reader_options`` go to
    ``HFStorageReader``.

    Raises (wrapped by DCP):
        KeyError: the folder lacks a tensor the adapter has (another ``r`` or
            ``target_modules``), listing them. ValueError: a tensor of another shape.
    """
    _check_adapter(model, adapter_name)
    reader = HFStorageReader(path, storage_options=storage_options, **reader_options)
    dcp.load(adapter_state_dict(model, adapter_name), storage_reader=reader)


def _check_adapter(model: Any, adapter_name: str) -> None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or adapter_name not in configs:
        have = sorted(configs) if isinstance(configs, dict) else "none (not a PeftModel)"
        raise ValueError(
            f"adapter_name={adapter_name!r}: the model's adapters are {have}; pass a PeftModel "
            "and one of its adapter names"
        )
