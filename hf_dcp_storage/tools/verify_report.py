"""What ``verify_checkpoint`` reports: each defect found (:class:`Problem`) and the run's
summary (:class:`VerifyReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem", "VerifyReport"]


@dataclass(frozen=True)
class Problem:
    """One defect of a checkpoint.

    Attributes:
        file: the file (or folder, ending in ``/``) it concerns, relative to the checkpoint folder;
            ``None`` when it concerns the folder as a whole.
        key: the tensor it concerns, if one.
        message: what is wrong and what to do, starting with the file's name.
    """

    file: str | None
    key: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        """``{"file", "key", "message"}``."""
        return {"file": self.file, "key": self.key, "message": self.message}


@dataclass
class VerifyReport:
    """What ``verify_checkpoint`` checked and found.

    Attributes:
        url: the checkpoint folder, as the user would write it.
        format: ``"hf"``, ``"dcp"`` or ``"incomplete"`` (as ``inspect_checkpoint``).
        files_checked: data files found and checked (headers, sizes).
        tensors_checked: entries found where the index (or ``.metadata``) places them.
        bytes_checked: tensor bytes read and checksummed.
        checksums_checked: a checksum pass ran (``checksums=True`` and a table was recorded).
        problems: every defect found, in the order of the checks.
        notes: what was not checked, and why (no checksums recorded, DCP format, ...).
    """

    url: str
    format: str
    files_checked: int = 0
    tensors_checked: int = 0
    bytes_checked: int = 0
    checksums_checked: bool = False
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problems were found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the keys ``url, format, ok, files_checked, tensors_checked,
        bytes_checked, checksums_checked, problems, notes`` (problems as their ``to_dict``)."""
        return {
            "url": self.url,
            "format": self.format,
            "ok": self.ok,
            "files_checked": self.files_checked,
            "tensors_checked": self.tensors_checked,
            "bytes_checked": self.bytes_checked,
            "checksums_checked": self.checksums_checked,
            "problems": [p.to_dict() for p in self.problems],
            "notes": list(self.notes),
        }
