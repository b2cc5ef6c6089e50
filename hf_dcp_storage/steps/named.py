"""A checkpoint under a name a trainer gives it (Lightning's ``last.ckpt``, ``epoch=3.ckpt``),
saved over in place with no moment at which the name holds no loadable checkpoint.

    NAME/COMMITTED, model-*.safetensors, ...   the first checkpoint saved under NAME: a checkpoint
                                               folder (``steps/folder.py``) itself
    NAME/CURRENT                               {"version": "v-...", "step": N}: once NAME has been
                                               saved over, its checkpoint is NAME/v-.../
    NAME/v-<step>-<id>/                        a checkpoint folder

Saving over a complete NAME writes the new checkpoint into a version folder of its own and
commits it there (its ``COMMITTED``); then rank 0 points ``CURRENT`` at it (one atomic write:
the moment the new checkpoint replaces the old) and only then removes the old one. A kill at any
moment leaves NAME loadable: the old checkpoint until ``CURRENT`` is written, the new one from
then on. What a killed save left (a version never pointed at, an old one not yet removed) goes
at the next save under NAME. Nothing is renamed: on object stores a rename is a copy and a
delete, and two ranks' views of a folder during one are undefined.

Call sequence: (all ranks) ``folder.prepare``, then ``save``; (all ranks, rank 0 asking the
store) ``resolve`` before a load; (rank 0) ``remove``.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem

from ..io import fsio
from ..io.companions import Companions
from . import folder as ckpt_folder
from .control import Control
from .retention import COMMIT_MARKER
from .runs import remove_folder

__all__ = ["CURRENT_MARKER", "VERSION_PREFIX", "remove", "resolve", "save"]

CURRENT_MARKER = "CURRENT"
VERSION_PREFIX = "v-"


def resolve(fs: AbstractFileSystem, name: str) -> str | None:
    """The folder of the complete checkpoint saved under ``name`` now (``name`` itself, or the
    version ``CURRENT`` names), or ``None``; asked of the store, never of a cache.

    Raises:
        ValueError: a ``CURRENT`` that is not this module's, naming the file.
    """
    pointer = fsio.join(name, CURRENT_MARKER)
    try:
        data = fsio.read_all(fs, pointer)
    except FileNotFoundError:
        return name if ckpt_folder.is_complete(fs, name) else None
    try:
        version = json.loads(data)["version"]
        if not isinstance(version, str) or not version.startswith(VERSION_PREFIX) or "/" in version:
            raise ValueError(version)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{fsio.url_of(fs, pointer)}: not a pointer to a checkpoint version ({exc!r}); it "
            "must be "
            f'{{"version": "{VERSION_PREFIX}...", ...}} as hf_dcp_storage writes it: remove the '
            "file, or the folder"
        ) from None
    folder = fsio.join(name, version)
    return folder if ckpt_folder.is_complete(fs, folder) else None


def save(
    control: Control,
    fs: AbstractFileSystem,
    name: str,
    step: int,
    weights: Mapping[str, Any],
    tensors: dict[str, torch.Tensor],
    payload: bytes,
    writer_options: Mapping[str, Any],
    *,
    companions: Companions | None = None,
) -> str:
    """(all ranks, with what ``folder.prepare`` returned) Save a checkpoint under ``name``, over
    the one there; returns the folder it was written to, complete on every rank on return.

    Rank 0 picks the folder (``name`` if nothing complete is there, else a new version) and
    clears what killed saves left; every rank writes its state and runs the DCP saves; rank 0
    commits the folder, then points ``CURRENT`` at a version and removes what it replaced.
    ``companions``: the model's config and tokenizer files, into the weights' folder
    (``HFStorageWriter(companions=...)``).
    """
    folder = control.broadcast(_start(fs, name, step) if control.rank == 0 else None)
    control.barrier()  # the folder is clear before anyone writes into it
    ckpt_folder.write_rank_state(fs, folder, control.rank, payload)
    model_writer, state_writer = ckpt_folder.writers(
        fs, folder, bool(tensors), writer_options, companions=companions
    )
    dcp.save(dict(weights), storage_writer=model_writer)
    if state_writer is not None:
        dcp.save(tensors, storage_writer=state_writer)
    control.barrier()
    if control.rank == 0:
        ckpt_folder.commit(fs, folder, step, control.world)
        if folder != name:
            _switch(fs, name, folder, step)
    control.barrier()  # complete for every rank once this returns
    return folder


def remove(fs: AbstractFileSystem, name: str) -> None:
    """(rank 0) Delete ``name`` and every version under it; nothing if it does not exist.

    The markers go first: a flat checkpoint's ``COMMITTED``, then ``CURRENT`` (an interrupted
    removal leaves either the newest checkpoint or none, never an older one), then the rest.
    """
    fsio.remove(fs, fsio.join(name, COMMIT_MARKER))
    fsio.remove(fs, fsio.join(name, CURRENT_MARKER))
    remove_folder(fs, name)


def _start(fs: AbstractFileSystem, name: str, step: int) -> str:
    """(rank 0) The folder this save writes, made clear: ``name`` where nothing complete is
    there (a killed save's leftovers removed), else a new version beside the current one."""
    current = resolve(fs, name)
    if current is None:
        ckpt_folder.clear(fs, name, overwrite=True, fix="")
        return name
    keep = posixpath.basename(current)
    # Versions of killed saves (never pointed at) or not yet removed after a switch.
    _remove_entries(fs, name, lambda base: base.startswith(VERSION_PREFIX) and base != keep)
    return fsio.join(name, f"{VERSION_PREFIX}{step}-{uuid.uuid4().hex[:12]}")


def _switch(fs: AbstractFileSystem, name: str, folder: str, step: int) -> None:
    """(rank 0, ``folder`` committed) Make ``folder`` the checkpoint of ``name``, then remove
    the one it replaces: a flat checkpoint's marker first, so it is never half-removed yet
    complete."""
    version = posixpath.basename(folder)
    marker = {"version": version, "step": step, "format": 1}
    fsio.write_atomic(fs, fsio.join(name, CURRENT_MARKER), json.dumps(marker).encode())
    fsio.remove(fs, fsio.join(name, COMMIT_MARKER))
    _remove_entries(fs, name, lambda base: base not in (CURRENT_MARKER, version))


def _remove_entries(fs: AbstractFileSystem, name: str, which: Callable[[str], bool]) -> None:
    """(rank 0) Remove the entries of ``name`` whose base names ``which`` picks: folders as
    checkpoint folders (marker first, a killed save's uploads aborted), files one by one."""
    for entry in fsio.list_entries(fs, name):
        base = posixpath.basename(entry["name"].rstrip("/"))
        if not which(base):
            continue
        path = fsio.join(name, base)
        if entry.get("type") == "directory":
            remove_folder(fs, path)
        else:
            fsio.remove(fs, path)
