"""The checks ``verify_checkpoint`` runs beyond an HF folder's own: a ``CheckpointManager`` step
folder (its ``COMMITTED`` marker and training state), a PyTorch DCP checkpoint, and a folder
that is neither (an unfinished save). :class:`Verification` is one whole run's checks.
"""

from __future__ import annotations

import json
from typing import Any

from ..format.index import INDEX_NAME, SINGLE_FILE_NAME
from ..io import fsio
from ..io.files import Folder
from ..steps.folder import TRAINING_STATE_DIR, rank_file
from ..steps.retention import COMMIT_MARKER
from ..writer import STAGING_DIR
from .checks import HfChecks, HfDir
from .crcpass import FileJob
from .dcp_format import DCP_METADATA, dcp_metadata
from .folders import safetensors_files

__all__ = ["Verification"]


class Verification(HfChecks):
    """One run of ``verify_checkpoint``: the HF checks, and those of step folders, DCP
    checkpoints and unfinished saves."""

    def step(self, folder: Folder) -> list[FileJob]:
        """A ``CheckpointManager`` step folder: its commit marker, and its training state."""
        if COMMIT_MARKER not in folder.files:
            self.problem(
                COMMIT_MARKER,
                None,
                f"{COMMIT_MARKER}: step not committed: the marker CheckpointManager writes last "
                "is missing, so it neither lists nor loads this step (an interrupted save; "
                "retention removes it)",
            )
        else:
            self._marker(folder)
        if not folder.has_dir(TRAINING_STATE_DIR):
            return []
        sub = HfDir(
            fsio.join(self.root, TRAINING_STATE_DIR),
            folder.sub(TRAINING_STATE_DIR),
            TRAINING_STATE_DIR + "/",
        )
        if INDEX_NAME in sub.folder.files or SINGLE_FILE_NAME in sub.folder.files:
            return self.hf(sub)
        if safetensors_files(sub.folder) or sub.folder.has_dir(STAGING_DIR):
            name = sub.name("")
            self.problem(
                name,
                None,
                f"{name}: holds tensor files but no {INDEX_NAME}: the training state's save did "
                "not finish",
            )
        return []

    def _marker(self, folder: Folder) -> None:
        """The marker names the world size; each rank's training-state file must exist."""
        try:
            marker = json.loads(fsio.read_all(self.fs, fsio.join(self.root, COMMIT_MARKER)))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self.problem(
                COMMIT_MARKER,
                None,
                f"{COMMIT_MARKER}: not valid JSON ({exc}); CheckpointManager cannot load this "
                "step's training state",
            )
            return
        world = marker.get("world_size") if isinstance(marker, dict) else None
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            self.problem(
                COMMIT_MARKER,
                None,
                f'{COMMIT_MARKER}: "world_size" is {world!r}, not a rank count; CheckpointManager '
                "cannot load this step's training state",
            )
            return
        for rank in range(world):
            name = f"{TRAINING_STATE_DIR}/{rank_file(rank)}"
            if name not in folder.files:
                self.problem(
                    name,
                    None,
                    f"{name}: missing: the step was saved by {world} ranks, and loading restores "
                    f"rank {rank}'s training state and RNG from it",
                )

    def dcp(self, folder: Folder) -> list[FileJob]:
        """PyTorch DCP format: ``.metadata`` unpickles and every file it names holds its bytes."""
        try:
            metadata = dcp_metadata(self.fs, self.root, self.storage_options)
            needed = _dcp_extents(metadata.storage_data or {})
            entries = len(metadata.state_dict_metadata)
        except OSError:
            raise  # the store, not the file
        except Exception as exc:  # noqa: BLE001 - unpickling a damaged file can raise almost anything
            self.problem(
                DCP_METADATA,
                None,
                f"{DCP_METADATA}: cannot be read as DCP metadata ({type(exc).__name__}: {exc}); "
                "the file is damaged: restore it or re-save",
            )
            return []
        for name, end in sorted(needed.items()):
            size = folder.files.get(name)
            if size is None:
                self.problem(
                    name,
                    None,
                    f"{name}: missing: {DCP_METADATA} places data in it, but it does not exist",
                )
            elif size < end:
                self.problem(
                    name,
                    None,
                    f"{name}: {size} bytes, but {DCP_METADATA} places data up to byte {end} "
                    "(truncated)",
                )
            else:
                self.report.files_checked += 1
        self.report.tensors_checked += entries
        self.report.notes.append("PyTorch DCP format records no checksums; structure checked only")
        return []

    def incomplete(self, folder: Folder) -> list[FileJob]:
        """Neither format's commit marker: one problem, saying what happened and what to do."""
        message = (
            f"not committed: there is no {INDEX_NAME} (the commit marker, written last), "
            f"{SINGLE_FILE_NAME} or {DCP_METADATA}, so no loader accepts this folder"
        )
        if folder.has_dir(STAGING_DIR):
            message += (
                f"; {STAGING_DIR}/ is left: an interrupted save; `hf-dcp consolidate` can finish "
                "it if every rank finished writing, else save again"
            )
        else:
            message += "; save it again"
        self.problem(None, None, message)
        return []


def _dcp_extents(storage_data: dict[Any, Any]) -> dict[str, int]:
    """File -> the end of the last byte range ``.metadata`` places in it."""
    needed: dict[str, int] = {}
    for info in storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    return needed
