"""One checkpoint folder: the weights, the training state, and a commit marker written last.

    folder/model-0000k-of-0000M.safetensors   the weights: a consolidated HF checkpoint
    folder/model.safetensors.index.json       (loadable by transformers as it is)
    folder/training_state/                    tensors of the training state (HF safetensors,
                                              resharded on load) and rank_NNNNN.json per rank
                                              (its other values and its RNG states)
    folder/COMMITTED                          {"step", "world_size", ...}: the folder is complete

``CheckpointManager`` keeps one such folder per step (``root/step_N``); the trainer integrations
(``integrations/``) save one wherever the trainer names a checkpoint.

A save, every rank calling the same functions in this order: ``prepare`` (refuses, on every rank
alike, a training-state value that is neither a tensor nor JSON); rank 0 ``clear``s the folder and
broadcasts the answer, then a barrier; ``write_rank_state``; the DCP saves of ``writers``; a
barrier; rank 0 ``commit``s. A load is ``load`` on every rank. ``runs.remove_folder`` deletes
one, marker first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ..io import files, fsio
from ..io.companions import Companions
from ..reader import HFStorageReader
from ..writer import HFStorageWriter
from .control import Control
from .retention import COMMIT_MARKER
from .runs import remove_folder
from .trainstate import capture_rng, join, restore_rng, split

__all__ = [
    "TRAINING_STATE_DIR",
    "clear",
    "commit",
    "entries",
    "is_complete",
    "load",
    "locate",
    "missing",
    "prepare",
    "rank_file",
    "read_config",
    "read_file",
    "write_rank_state",
    "writers",
]

TRAINING_STATE_DIR = "training_state"


def locate(url: str, storage_options: dict[str, Any] | None) -> tuple[AbstractFileSystem, str]:
    """``(filesystem, path)`` of a checkpoint folder given as a local path or any fsspec URL."""
    return fsio.resolve(url, storage_options)


def read_config(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``config.json`` of the folder at ``url``, read from the store, or ``None`` if it has
    none."""
    fs, root = locate(url, storage_options)
    return files.read_config(fs, root)


def missing(url: str, storage_options: dict[str, Any] | None, names: list[str]) -> list[str]:
    """Those of ``names`` (file names) that the folder at ``url`` does not hold, asked of the
    store."""
    fs, root = locate(url, storage_options)
    return [n for n in names if not fsio.exists(fs, fsio.join(root, n))]


def read_file(fs: AbstractFileSystem, path: str) -> bytes:
    """The whole of a small file as it is now, asked of the store (for the integrations, which
    reach the store through ``steps/`` only)."""
    return fsio.read_all(fs, path)


def entries(fs: AbstractFileSystem, directory: str) -> list[dict[str, Any]]:
    """The listing entries (``name``, ``type``, ...) of ``directory`` now, asked of the store;
    empty if it does not exist."""
    return fsio.list_entries(fs, directory)


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s JSON file in ``training_state/``."""
    return f"rank_{rank:05d}.json"


def prepare(
    control: Control, step: int, training_state: Mapping[str, Any] | None
) -> tuple[dict[str, torch.Tensor], bytes]:
    """(all ranks) ``(tensors, this rank's JSON file)`` of a training state, with its RNG states.

    Everything that can be refused is checked before the first byte is written, and every rank
    learns what any rank refused: a rank raising alone would leave the others waiting in the
    next collective.

    Raises:
        TypeError: a value that is neither a tensor nor JSON, on any rank (naming rank and key).
        ValueError: the ranks save different steps.
    """
    problem = None
    tensors: dict[str, torch.Tensor] = {}
    tree: dict[str, Any] = {}
    try:
        values = {
            k: v.state_dict() if isinstance(v, Stateful) else v
            for k, v in (training_state or {}).items()
        }
        tensors, tree = split(values)
    except TypeError as exc:
        problem = str(exc)
    reports = control.all_gather((step, problem))
    problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(reports) if p]
    if problems:
        raise TypeError("; ".join(problems))
    if len({s for s, _ in reports}) > 1:
        raise ValueError(
            f"ranks save different steps {[s for s, _ in reports]}; all ranks must save the same "
            "step"
        )
    return tensors, json.dumps({"values": tree, "rng": capture_rng()}, allow_nan=False).encode()


def clear(fs: AbstractFileSystem, folder: str, *, overwrite: bool, fix: str) -> str | None:
    """(rank 0) Make ``folder`` empty, or say why not: it is complete and ``overwrite`` is off
    (``fix`` tells the caller's way out). An incomplete folder is removed, marker first."""
    if not overwrite and is_complete(fs, folder):  # with overwrite, no request to ask
        return f"{fsio.url_of(fs, folder)} is already a complete checkpoint; {fix}"
    if fsio.exists(fs, folder):
        # The marker goes first (remove_folder): from here on the folder is incomplete, never
        # half-replaced.
        remove_folder(fs, folder)
    return None


def write_rank_state(fs: AbstractFileSystem, folder: str, rank: int, payload: bytes) -> None:
    """(every rank) This rank's JSON file (``prepare``'s payload) into ``folder/training_state``."""
    state_folder = fsio.join(folder, TRAINING_STATE_DIR)
    if fsio.is_local(fs):
        fs.makedirs(state_folder, exist_ok=True)
    fsio.write_atomic(fs, fsio.join(state_folder, rank_file(rank)), payload)


def writers(
    fs: AbstractFileSystem,
    folder: str,
    has_tensors: bool,
    options: Mapping[str, Any],
    *,
    companions: Companions | None = None,
    file_name: str | None = None,
) -> tuple[HFStorageWriter, HFStorageWriter | None]:
    """``(weights' writer, training state's writer or None)`` for a save into ``folder``;
    ``options`` go to both ``HFStorageWriter``s, ``companions`` (the model's config and
    tokenizer files) and ``file_name`` (one weights file of that name) to the weights' only."""
    # Writers and readers take URLs: a bare path of a remote store would mean local disk.
    model_writer = HFStorageWriter(
        fsio.url_of(fs, folder), **options, companions=companions, file_name=file_name
    )
    state_writer = (
        HFStorageWriter(fsio.url_of(fs, fsio.join(folder, TRAINING_STATE_DIR)), **options)
        if has_tensors
        else None
    )
    return model_writer, state_writer


def commit(fs: AbstractFileSystem, folder: str, step: int, world_size: int) -> None:
    """(rank 0, after every rank's saves returned) Write the commit marker: the folder is
    complete."""
    marker = {"step": step, "world_size": world_size, "saved_at": time.time(), "format": 1}
    fsio.write_atomic(fs, fsio.join(folder, COMMIT_MARKER), json.dumps(marker).encode())


def is_complete(fs: AbstractFileSystem, folder: str) -> bool:
    """Whether ``folder`` holds its commit marker (asked of the store, not of a cache)."""
    return fsio.exists(fs, fsio.join(folder, COMMIT_MARKER))


def load(
    fs: AbstractFileSystem,
    folder: str,
    model_state_dict: MutableMapping[str, Any],
    training_state: MutableMapping[str, Any] | None,
    *,
    rank: int,
    reader_io: Mapping[str, Any],
) -> None:
    """(all ranks) Load a complete folder in place: the weights, then (when ``training_state`` is
    given) the entries it names and this rank's RNG states, last.

    Weights and training-state tensors reshard onto the current layout. ``Stateful`` entries get
    ``load_state_dict``; plain entries are replaced by the saved values. With another world size,
    rank ``r`` takes the saved rank ``r % saved_world_size``'s JSON file. ``reader_io`` goes to
    ``HFStorageReader``.

    Raises:
        KeyError: a training-state entry the checkpoint does not hold.
    """
    dcp.load(model_state_dict, storage_reader=HFStorageReader(fsio.url_of(fs, folder), **reader_io))
    if training_state is None:
        return
    marker = json.loads(fsio.read_all(fs, fsio.join(folder, COMMIT_MARKER)))
    state_folder = fsio.join(folder, TRAINING_STATE_DIR)
    saved = json.loads(
        fsio.read_all(fs, fsio.join(state_folder, rank_file(rank % marker["world_size"])))
    )
    _load_training_state(training_state, saved["values"], fsio.url_of(fs, state_folder), reader_io)
    restore_rng(saved["rng"])


def _load_training_state(
    training_state: MutableMapping[str, Any],
    tree: dict[str, Any],
    folder: str,
    reader_io: Mapping[str, Any],
) -> None:
    missing = [k for k in training_state if k not in tree]
    if missing:
        raise KeyError(
            f"training state {missing} is not in the checkpoint, which holds {sorted(tree)}"
        )
    current, _ = split(
        {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in training_state.items()}
    )
    wanted = _tensor_keys({k: tree[k] for k in training_state})
    dest: dict[str, torch.Tensor] = {}
    if wanted:
        meta = HFStorageReader(folder, **reader_io).read_metadata().state_dict_metadata
        for key in wanted:
            if key in current:
                dest[key] = current[key]
                continue
            # A destination this process does not have yet (e.g. optimizer state before the
            # first step) is loaded whole, as a plain tensor.
            md = meta[key]
            assert isinstance(md, TensorStorageMetadata)  # an HF checkpoint holds tensors only
            dest[key] = torch.empty(md.size, dtype=md.properties.dtype)
        dcp.load(dest, storage_reader=HFStorageReader(folder, **reader_io))
    for key, obj in training_state.items():
        value = join(tree[key], dest)
        if isinstance(obj, Stateful):
            obj.load_state_dict(value)
        else:
            training_state[key] = value


def _tensor_keys(tree: Any) -> list[str]:
    if isinstance(tree, list):
        return [k for v in tree for k in _tensor_keys(v)]
    if not isinstance(tree, dict):
        return []
    if "__tensor__" in tree:
        return [tree["__tensor__"]]
    return [k for v in tree.values() for k in _tensor_keys(v)]
