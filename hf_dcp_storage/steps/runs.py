"""The step checkpoints of a run folder: list them, prune them, remove one.

A run folder (``CheckpointManager``'s root) holds ``step_{N}`` folders; a step is complete only
once its commit marker ``COMMITTED`` exists (written last). ``CheckpointManager`` and the
``hf-dcp ls`` / ``hf-dcp prune`` commands share this module, so the tool and the training job
see the same steps and apply the same retention rules (``steps/retention.py``: ``RetentionPolicy``).

``list_steps`` (sizes, times: ``hf-dcp ls``) is one recursive listing of the whole run (on S3 one
paginated LIST, not one request per step). Retention and ``latest()`` need only which steps are
complete: ``step_status`` lists the run's top level and checks each step's marker, whatever the
number of files inside the steps (thousands per step at thousands of ranks). Names are parsed
strictly (``steps/retention.py``: ``parse_step``), so other folders and files (``logs``,
``step_01``, ``notes.txt``) are never listed, counted or touched.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from fsspec import AbstractFileSystem

from ..io import fsio
from ..io.parallel import parallel_map
from ..stores.registry import clear_leftovers_under
from .retention import COMMIT_MARKER, RetentionPolicy, parse_step, step_name, to_remove

__all__ = [
    "PruneResult",
    "StepInfo",
    "list_steps",
    "prune_run",
    "remove_folder",
    "remove_step",
    "scan_steps",
    "step_status",
]

# Commit-marker checks in flight at once (each is a request on an object store).
_MARKER_CHECKS = 16


@dataclass(frozen=True)
class StepInfo:
    """One ``step_{N}`` folder of a run.

    Attributes:
        step: the step number ``N``.
        name: the folder name, ``step_{N}``.
        url: the folder as the user would write it (local path or fsspec URL).
        complete: the commit marker exists, so the step can be loaded.
        size: bytes of all files under the folder (weights, training state, marker).
        files: number of files under the folder.
        modified: POSIX seconds: the commit marker's modification time when complete (when the
            step was committed), else the newest file's; ``None`` when the store reports none.
    """

    step: int
    name: str
    url: str
    complete: bool
    size: int
    files: int
    modified: float | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)


@dataclass(frozen=True)
class PruneResult:
    """What ``prune_run`` removed (or would remove, with ``dry_run``), all ascending.

    Attributes:
        removed: steps deleted (or that would be deleted).
        kept: complete steps retention keeps.
        in_progress: incomplete steps newer than the newest complete one, left alone because a
            save may still be writing them.
        dry_run: nothing was deleted.
    """

    removed: tuple[int, ...]
    kept: tuple[int, ...]
    in_progress: tuple[int, ...]
    dry_run: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields (tuples as lists)."""
        return {
            "removed": list(self.removed),
            "kept": list(self.kept),
            "in_progress": list(self.in_progress),
            "dry_run": self.dry_run,
        }


def list_steps(
    run_dir: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> list[StepInfo]:
    """Every step checkpoint in ``run_dir``, complete or not, ascending by step.

    Args:
        run_dir: the run folder, a local path or any fsspec URL (``s3://bucket/run1``).
        storage_options: passed to fsspec.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist (or is not a folder).
    """
    fs, root = fsio.resolve(run_dir, storage_options)
    return scan_steps(fs, root)


def scan_steps(fs: AbstractFileSystem, root: str, *, missing_ok: bool = False) -> list[StepInfo]:
    """``list_steps`` on a resolved filesystem and root path.

    One recursive listing, never from a cache (another process may have saved or pruned since
    this one last looked). With ``missing_ok`` a missing run folder is simply a run without
    steps (``CheckpointManager`` before its first save), and costs no extra request.

    Raises:
        FileNotFoundError: ``root`` does not exist and ``missing_ok`` is off.
    """
    groups: dict[int, list[tuple[str, Mapping[str, Any]]]] = {}
    for rel, info in _list_run(fs, root, missing_ok).items():
        first, _, rest = rel.partition("/")
        step = parse_step(first)
        is_dir = info.get("type") == "directory" or rel.endswith(
            "/"
        )  # S3 folder placeholders end in "/"
        if step is None or (not rest and not is_dir):
            continue  # not a step, or a file named like a step: neither is ours
        files = groups.setdefault(step, [])
        if not is_dir:
            files.append((rest, info))
    return [_step_info(fs, root, step, groups[step]) for step in sorted(groups)]


def step_status(fs: AbstractFileSystem, root: str, *, missing_ok: bool = False) -> dict[int, bool]:
    """``step -> complete?`` for every step folder under ``root``, cheaply.

    One listing of the run folder's top level and one existence check of each step's commit
    marker (in parallel), never a listing of every file: what retention and ``latest()`` need
    at any scale (a step saved by thousands of ranks holds thousands of files). Files named
    like steps are not steps.

    Raises:
        FileNotFoundError: ``root`` does not exist and ``missing_ok`` is off.
    """
    entries = fsio.list_entries(fs, root)
    if not entries and not missing_ok and not fsio.isdir(fs, root):
        raise FileNotFoundError(_missing(fs, root))
    steps = sorted(
        s
        for e in entries
        if e.get("type") == "directory"
        and (s := parse_step(posixpath.basename(e["name"].rstrip("/")))) is not None
    )
    done = parallel_map(
        lambda s: fsio.exists(fs, fsio.join(root, step_name(s), COMMIT_MARKER)),
        steps,
        _MARKER_CHECKS,
    )
    return dict(zip(steps, done, strict=True))


def remove_step(fs: AbstractFileSystem, root: str, step: int) -> None:
    """Delete the folder of ``step`` under ``root`` (nothing if it does not exist); see
    ``remove_folder``."""
    remove_folder(fs, fsio.join(root, step_name(step)))


def remove_folder(fs: AbstractFileSystem, folder: str) -> None:
    """Delete a checkpoint folder (nothing if it does not exist).

    The commit marker goes first, then the rest: a bulk delete (S3 deletes 1,000 keys per
    request, in any order) interrupted half-way must leave an incomplete folder, which nothing
    loads and retention removes later, never a "complete" one with files missing. What a killed
    save left that deleting the folder's objects does not remove goes too (the store's
    ``clear_leftovers_under``: S3's open multipart uploads, Azure's uncommitted blocks).
    """
    fsio.remove(fs, fsio.join(folder, COMMIT_MARKER))
    clear_leftovers_under(fs, folder)
    fsio.remove_tree(fs, folder)


def prune_run(
    run_dir: str | os.PathLike[str],
    *,
    keep_last_n: int,
    keep_every: int | None = None,
    dry_run: bool = False,
    include_unfinished: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> PruneResult:
    """Apply ``CheckpointManager``'s retention to ``run_dir`` from outside the training job.

    Kept: the newest ``keep_last_n`` complete steps and complete multiples of ``keep_every``.
    Removed: other complete steps and incomplete leftovers of crashed saves. A save in flight is
    always the newest step, and this process cannot know about it, so incomplete steps newer
    than the newest complete one (all incomplete steps when none is complete) are left alone and
    reported as ``in_progress``, unless ``include_unfinished``. Steps are removed oldest first,
    each with ``remove_step``; an error stops the pruning there.

    Args:
        run_dir: the run folder, a local path or any fsspec URL.
        keep_last_n, keep_every: the retention rule, as for ``CheckpointManager``.
        dry_run: remove nothing; the result says what would be removed.
        include_unfinished: also remove incomplete steps newer than the newest complete one
            (only when no save is running).
        storage_options: passed to fsspec.

    Raises:
        ValueError: a bad ``keep_last_n`` / ``keep_every``, before anything is listed.
        FileNotFoundError: ``run_dir`` does not exist.
    """
    policy = RetentionPolicy(keep_last_n, keep_every)
    fs, root = fsio.resolve(run_dir, storage_options)
    steps = step_status(fs, root)
    in_progress = () if include_unfinished else _newer_incomplete(steps)
    removed = to_remove(steps, policy, in_progress)
    if not dry_run:
        for step in removed:
            remove_step(fs, root, step)
    kept = sorted(set(steps) - set(removed) - set(in_progress))
    return PruneResult(
        removed=tuple(removed), kept=tuple(kept), in_progress=in_progress, dry_run=dry_run
    )


# -- helpers -----------------------------------------------------------------------------------


def _list_run(fs: AbstractFileSystem, root: str, missing_ok: bool) -> dict[str, Mapping[str, Any]]:
    """Every entry under ``root`` (files and folders), by path relative to it."""
    try:
        # Folders too: an empty step folder (a save that crashed before its first file) is an
        # incomplete step that retention must see. s3fs infers them from the keys, no extra request.
        found = fsio.find_entries(fs, root, withdirs=True)
    except FileNotFoundError as exc:  # s3fs: a missing bucket
        if missing_ok:
            return {}
        raise FileNotFoundError(_missing(fs, root)) from exc
    base = root.rstrip("/") + "/"
    under: dict[str, Mapping[str, Any]] = {
        path[len(base) :]: info for path, info in found.items() if path.startswith(base)
    }
    # An empty listing is either an empty run or no run at all; only then ask which.
    if not under and not missing_ok and not fsio.isdir(fs, root):
        raise FileNotFoundError(_missing(fs, root))
    return under


def _missing(fs: AbstractFileSystem, root: str) -> str:
    # On an object store a folder is only a key prefix: a run pruned to nothing is gone as well.
    return (
        f"{fsio.url_of(fs, root)}: no such run folder (nothing is stored under it); give the "
        "folder that holds the step_N checkpoints"
    )


def _step_info(
    fs: AbstractFileSystem, root: str, step: int, files: list[tuple[str, Mapping[str, Any]]]
) -> StepInfo:
    """The ``StepInfo`` of one step from its files (path inside the folder, listing entry)."""
    name = step_name(step)  # names are parsed strictly, so this is the folder's own name
    marker = next((info for rel, info in files if rel == COMMIT_MARKER), None)
    if marker is not None:
        modified = _posix_mtime(marker)
    else:
        times = [t for t in (_posix_mtime(info) for _, info in files) if t is not None]
        modified = max(times, default=None)
    return StepInfo(
        step=step,
        name=name,
        url=fsio.url_of(fs, fsio.join(root, name)),
        complete=marker is not None,
        size=sum(int(info.get("size") or 0) for _, info in files),
        files=len(files),
        modified=modified,
    )


# Where fsspec backends put a file's modification time, most specific first: local disk
# ``mtime`` (float); s3fs ``LastModified`` (aware datetime); adlfs ``last_modified``; gcsfs
# ``updated`` (ISO string); memory ``created`` (float; a memory file is only ever written whole).
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")


def _posix_mtime(info: Mapping[str, Any]) -> float | None:
    """A listing entry's modification time in POSIX seconds, or ``None`` if it has none.

    Naive datetimes are taken as UTC (what object stores report).
    """
    for key in _MTIME_KEYS:
        value = info.get(key)
        if isinstance(value, str) and value:
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _newer_incomplete(steps: Mapping[int, bool]) -> tuple[int, ...]:
    """Incomplete steps newer than the newest complete one: possibly a save still running."""
    newest = max((s for s, done in steps.items() if done), default=-1)
    return tuple(sorted(s for s, done in steps.items() if not done and s > newest))
