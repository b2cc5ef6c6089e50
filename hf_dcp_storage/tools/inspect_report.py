"""What ``inspect_checkpoint`` reports: each entry (:class:`TensorInfo`), each data file
(:class:`FileInfo`), their sums (:class:`Totals`) and the whole (:class:`CheckpointInfo`),
each with a JSON-ready ``to_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["OBJECT_DTYPE", "CheckpointInfo", "FileInfo", "TensorInfo", "Totals"]

# ``dtype`` of a DCP entry that is not a tensor (pickled bytes).
OBJECT_DTYPE = "object"


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a checkpoint.

    Attributes:
        key: the saved name.
        dtype: the safetensors dtype name (``"BF16"``, ``"I64"``, ...); for a DCP entry that is not
            a tensor, ``"object"``.
        shape: the global shape; ``None`` for an object.
        nbytes: bytes the entry occupies in its file(s).
        file: the file that holds it; ``None`` in a DCP checkpoint, where a tensor may span files.
        checksum: the CRC32 the index records for its bytes (8 hex digits), or ``None``.
    """

    key: str
    dtype: str
    shape: tuple[int, ...] | None
    nbytes: int
    file: str | None
    checksum: str | None = None

    @property
    def numel(self) -> int:
        """Elements of a tensor (1 for a scalar); 0 for an object."""
        return math.prod(self.shape) if self.shape is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """``{"key", "dtype", "shape" (list or null), "numel", "nbytes", "file", "checksum"}``."""
        shape = list(self.shape) if self.shape is not None else None
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": shape,
            "numel": self.numel,
            "nbytes": self.nbytes,
            "file": self.file,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class FileInfo:
    """One data file: its name (relative to the checkpoint folder), size in bytes, and entries."""

    name: str
    size: int
    tensors: int

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "size", "tensors"}``."""
        return {"name": self.name, "size": self.size, "tensors": self.tensors}


@dataclass(frozen=True)
class Totals:
    """Sums over a checkpoint's entries.

    Attributes:
        tensors: number of tensors.
        objects: number of non-tensor entries (DCP only).
        parameters: elements of all tensors.
        bytes: bytes of all entries (tensor data, and objects' pickled bytes).
        bytes_per_dtype: ``bytes`` split by dtype name, largest first.
    """

    tensors: int
    objects: int
    parameters: int
    bytes: int
    bytes_per_dtype: dict[str, int]

    @classmethod
    def of(cls, entries: Iterable[TensorInfo]) -> Totals:
        entries = list(entries)
        per_dtype: dict[str, int] = {}
        for e in entries:
            per_dtype[e.dtype] = per_dtype.get(e.dtype, 0) + e.nbytes
        return cls(
            tensors=sum(e.dtype != OBJECT_DTYPE for e in entries),
            objects=sum(e.dtype == OBJECT_DTYPE for e in entries),
            parameters=sum(e.numel for e in entries),
            bytes=sum(e.nbytes for e in entries),
            bytes_per_dtype=dict(sorted(per_dtype.items(), key=lambda kv: (-kv[1], kv[0]))),
        )

    def to_dict(self) -> dict[str, Any]:
        """``{"tensors", "objects", "parameters", "bytes", "bytes_per_dtype": {dtype: bytes}}``."""
        return {
            "tensors": self.tensors,
            "objects": self.objects,
            "parameters": self.parameters,
            "bytes": self.bytes,
            "bytes_per_dtype": dict(self.bytes_per_dtype),
        }


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``inspect_checkpoint`` found.

    Attributes:
        url: the folder, as the user would write it.
        format: ``"hf"``, ``"dcp"`` or ``"incomplete"`` (``FORMAT_*``).
        committed: the commit marker of the format exists: the HF index (or single
            ``model.safetensors``), or DCP's ``.metadata``. Always ``False`` for ``"incomplete"``.
        has_commit_marker: a ``CheckpointManager`` step marker ``COMMITTED`` exists.
        has_training_state: a ``training_state/`` sub-folder exists (a step folder's).
        has_staging: a save's staging folder ``.hf_dcp_staging/`` exists (a save that is running,
            or was interrupted).
        files: the data files, by name.
        tensors: every entry, by key.
        totals: sums over ``tensors``.
        notes: facts worth a line (no index, no checksums, unreadable leftovers, ...).
    """

    url: str
    format: str
    committed: bool
    has_commit_marker: bool
    has_training_state: bool
    has_staging: bool
    files: list[FileInfo]
    tensors: list[TensorInfo]
    totals: Totals
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the keys ``url, format, committed, has_commit_marker,
        has_training_state, has_staging, files, tensors, totals, notes`` (files, tensors and totals
        as their own ``to_dict``). The command line prints it with ``--json``."""
        return {
            "url": self.url,
            "format": self.format,
            "committed": self.committed,
            "has_commit_marker": self.has_commit_marker,
            "has_training_state": self.has_training_state,
            "has_staging": self.has_staging,
            "files": [f.to_dict() for f in self.files],
            "tensors": [t.to_dict() for t in self.tensors],
            "totals": self.totals.to_dict(),
            "notes": list(self.notes),
        }
