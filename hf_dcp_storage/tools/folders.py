"""Opening a checkpoint folder, shared by ``inspect_checkpoint``, ``verify_checkpoint`` and the
checks: resolve it, list it once, and tell its format (``FORMAT_*``); and the small helpers
both read it with.
"""

from __future__ import annotations

import os
from typing import Any

from fsspec import AbstractFileSystem

from ..format.index import INDEX_NAME, SINGLE_FILE_NAME
from ..io import fsio
from ..io.files import Folder, ReadRange, scan_folder
from ..io.parallel import check_thread_count
from ..steps.folder import TRAINING_STATE_DIR
from ..steps.retention import COMMIT_MARKER, parse_step
from ..stores import ranges_for
from ..stores.retry import RetryPolicy
from ..writer import STAGING_DIR
from .dcp_format import DCP_METADATA, DCP_SUFFIX

__all__ = [
    "FORMAT_DCP",
    "FORMAT_HF",
    "FORMAT_INCOMPLETE",
    "check_thread_count",
    "is_step_folder",
    "open_checkpoint",
    "range_reader",
    "safetensors_files",
]

FORMAT_HF = "hf"
FORMAT_DCP = "dcp"
FORMAT_INCOMPLETE = "incomplete"


def open_checkpoint(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> tuple[AbstractFileSystem, str, Folder, str]:
    """Resolve ``path``, list it once, and tell its format.

    Returns:
        ``(fs, root, listing, format)`` with ``format`` one of ``FORMAT_*``.

    Raises:
        FileNotFoundError: ``path`` does not exist, is a file, or holds neither a checkpoint nor
            the remains of a save; the message says what it holds instead when that helps (a
            run folder's steps).
    """
    fs, root = fsio.resolve(path, storage_options)
    url = fsio.url_of(fs, root)
    folder = scan_folder(fs, root)
    if folder is None:
        what = (
            "a file, not a checkpoint folder"
            if fsio.isfile(fs, root)
            else "no such checkpoint folder"
        )
        raise FileNotFoundError(
            f"{url}: {what}; give the folder that holds {INDEX_NAME} (or {DCP_METADATA})"
        )
    kind = _format_of(folder)
    if kind is None:
        steps = sorted(
            (s, d) for d in folder.dirs if "/" not in d and (s := parse_step(d)) is not None
        )
        hint = (
            "; it is a run folder with step folders "
            f"({', '.join(d for _, d in steps[:5])}{', ...' if len(steps) > 5 else ''}): give one "
            "of them"
            if steps
            else "; give the folder that holds them"
        )
        raise FileNotFoundError(
            f"{url} is not a checkpoint: it has no {INDEX_NAME}, {SINGLE_FILE_NAME} or "
            f"{DCP_METADATA}, nor the files of an unfinished save{hint}"
        )
    return fs, root, folder, kind


def is_step_folder(folder: Folder) -> bool:
    """Whether a listing looks like a ``CheckpointManager`` step folder (marker or training
    state)."""
    return COMMIT_MARKER in folder.files or folder.has_dir(TRAINING_STATE_DIR)


def range_reader(fs: AbstractFileSystem, retry: RetryPolicy | None = None) -> ReadRange:
    """``read_range(path, start, end)`` on ``fs``, as loads read it (``stores.ranges_for``): S3's
    retried client path, else fsspec, retried."""
    return ranges_for(fs, retry or RetryPolicy()).get_range


def safetensors_files(folder: Folder) -> list[str]:
    """Names of the ``*.safetensors`` files directly in the folder, sorted."""
    return [n for n in folder.top_files() if n.endswith(".safetensors")]


def _format_of(folder: Folder) -> str | None:
    """One of ``FORMAT_*``; ``None`` for a folder that holds no checkpoint at all."""
    if INDEX_NAME in folder.files or SINGLE_FILE_NAME in folder.files:
        return FORMAT_HF
    if DCP_METADATA in folder.files:
        return FORMAT_DCP
    leftovers = safetensors_files(folder) or [
        n for n in folder.top_files() if n.endswith(DCP_SUFFIX)
    ]
    if leftovers or folder.has_dir(STAGING_DIR) or is_step_folder(folder):
        return FORMAT_INCOMPLETE
    return None
