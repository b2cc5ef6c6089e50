"""The checks ``verify_checkpoint`` runs (``tools/verify.py`` says what they are, in order), each
adding the defects it finds to a :class:`VerifyReport`; the checksum pass is ``tools/crcpass.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from ..format.header import HeaderError
from ..format.index import (
    CHECKSUMS_KEY,
    HEADERS_KEY,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    FileHeader,
    checksum_table,
    decode_index_json,
    file_name_problem,
    recorded_headers,
    weight_map_of,
)
from ..io import fsio
from ..io.files import Folder, read_header, read_index
from ..io.parallel import parallel_map
from ..steps.folder import TRAINING_STATE_DIR, rank_file
from ..steps.retention import COMMIT_MARKER
from ..writer import STAGING_DIR
from .crcpass import FileJob, Tensor
from .inspection import DCP_METADATA, dcp_metadata, range_reader, safetensors_files

__all__ = ["Problem", "VerifyReport", "Verification", "HfDir"]


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


# -- internals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HfDir:
    """An HF checkpoint folder under check: its path, its listing, and the prefix of its names in
    messages (``""``, or ``"training_state/"`` inside a step folder)."""

    root: str
    folder: Folder
    prefix: str

    def name(self, rel: str) -> str:
        return self.prefix + rel


@dataclass(frozen=True)
class _IndexView:
    """What of an index the later checks can use.

    ``weight_map`` leaves out entries naming unacceptable files (reported); ``complete`` says
    none were left out. ``checksums`` is ``None`` without a usable table; ``has_table`` says
    whether one was recorded at all; ``malformed`` holds keys whose value was not a CRC32 (reported).
    """

    weight_map: dict[str, str]
    complete: bool
    metadata: dict[str, Any]
    checksums: dict[str, int] | None
    has_table: bool
    malformed: frozenset[str]


class Verification:
    """One run of ``verify_checkpoint``: the context, and the checks, each adding to ``report``."""

    def __init__(self, fs: AbstractFileSystem, root: str, report: VerifyReport, storage_options: dict[str, Any] | None, threads: int, checksums: bool) -> None:
        self.fs = fs
        self.root = root
        self.report = report
        self.storage_options = storage_options
        self.threads = threads
        self.want_checksums = checksums
        self.read_range = range_reader(fs)

    def problem(self, file: str | None, key: str | None, message: str) -> None:
        self.report.problems.append(Problem(file, key, message))

    # -- HF ---------------------------------------------------------------------------------------

    def hf(self, d: HfDir) -> list[FileJob]:
        """Steps 1-4 on one HF checkpoint folder; returns its files' checksum jobs (step 5)."""
        if INDEX_NAME not in d.folder.files:
            return self._single_file(d)
        index = self._index(d)
        if index is None:
            # No usable map: still check each file's own structure, which needs none.
            self._headers(d, safetensors_files(d.folder))
            self._staging(d)
            return []
        headers = self._headers(d, sorted(set(index.weight_map.values())))
        self._recorded(d, index, headers)
        self._coverage(d, index, headers)
        self._total_size(d, index, headers)
        self._strays(d, set(index.weight_map.values()))
        self._staging(d)
        return self._jobs(d, index, headers)

    def _single_file(self, d: HfDir) -> list[FileJob]:
        header = self._headers(d, [SINGLE_FILE_NAME]).get(SINGLE_FILE_NAME)
        if header is not None:
            self.report.tensors_checked += len(header.entries)
        self._strays(d, {SINGLE_FILE_NAME})
        self._staging(d)
        self.report.notes.append(f"{d.name(SINGLE_FILE_NAME)}: a single file without an index records no checksums; structure checked only")
        return []

    def _index(self, d: HfDir) -> _IndexView | None:
        """Step 1; ``None`` when the index is unusable (not JSON, no weight_map)."""
        where = d.name(INDEX_NAME)
        raw = read_index(self.fs, d.root)
        try:
            if raw is None:
                raise ValueError(f"{where}: listed, but gone when read (is a save running?)")
            index = decode_index_json(raw, where)
            full_map = weight_map_of(index, where)
        except ValueError as exc:
            self.problem(where, None, str(exc))
            return None
        refused = set()
        for file in sorted(set(full_map.values())):
            message = file_name_problem(file, where)
            if message is not None:
                self.problem(where, None, message)
                refused.add(file)
        metadata = index.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            self.problem(where, None, f"{where}: \"metadata\" must be an object, got {type(metadata).__name__}")
        metadata = metadata if isinstance(metadata, dict) else {}
        checksums, malformed = self._checksum_table(where, metadata, full_map)
        weight_map = {k: f for k, f in full_map.items() if f not in refused}
        return _IndexView(weight_map, not refused, metadata, checksums, CHECKSUMS_KEY in metadata, frozenset(malformed))

    def _checksum_table(self, where: str, metadata: dict[str, Any], weight_map: dict[str, str]) -> tuple[dict[str, int] | None, list[str]]:
        try:
            checksums, malformed = checksum_table(metadata, where)
        except ValueError as exc:
            self.problem(where, None, str(exc))
            return None, []
        for key, value in malformed.items():
            self.problem(where, key, f"{where}: metadata.{CHECKSUMS_KEY}[{key!r}] is {value!r}, not a CRC32 of 8 hex digits")
        for key in sorted(set(checksums or ()) - set(weight_map)):
            self.problem(where, key, f"{where}: metadata.{CHECKSUMS_KEY} records tensor {key!r}, which the weight_map does not name")
        return checksums, list(malformed)

    def _headers(self, d: HfDir, files: list[str]) -> dict[str, FileHeader]:
        """Step 2: read and check each file's header, in parallel; the readable ones by file."""

        def read(file: str) -> FileHeader | Exception:
            try:
                return read_header(self.fs, d.root, file, self.read_range, size=d.folder.files.get(file), where=d.name(file))
            except (FileNotFoundError, HeaderError) as exc:
                return exc

        headers = {}
        for file, result in zip(files, parallel_map(read, files, self.threads), strict=True):
            name = d.name(file)
            if isinstance(result, FileNotFoundError):
                self.problem(name, None, f"{name}: missing: the index names this file, but it does not exist; restore it from a copy or re-save")
            elif isinstance(result, Exception):
                self.problem(name, None, str(result))
            else:
                headers[file] = result
                self.report.files_checked += 1
                extra = result.size - result.data_end
                if extra > 0:
                    self.problem(
                        name, None,
                        f"{name}: {extra} trailing bytes after the last tensor (the data ends at byte {result.data_end}, "
                        f"the file has {result.size}); no complete save leaves any: restore the file from a copy or re-save",
                    )  # fmt: skip
        return headers

    def _recorded(self, d: HfDir, index: _IndexView, headers: dict[str, FileHeader]) -> None:
        """Step 2, where the index records its files' headers (which loaders read instead of
        the files'): each copy decodes and equals the file's own header."""
        if HEADERS_KEY not in index.metadata:
            return
        where = d.name(INDEX_NAME)
        for file in sorted(set(index.weight_map.values())):
            try:
                copy = recorded_headers(index.metadata, [file], where)
            except (ValueError, HeaderError) as exc:
                self.problem(where, None, str(exc))
                continue
            actual = headers.get(file)
            if not copy or actual is None:
                continue  # not recorded; or a missing or unreadable file, reported once, by file
            if (copy[file].entries, copy[file].metadata, copy[file].data_start) != (actual.entries, actual.metadata, actual.data_start):
                self.problem(
                    where, None,
                    f"{where}: metadata.{HEADERS_KEY}[{file!r}] differs from the header of {d.name(file)} (a file replaced "
                    f"after the save?), and loaders read the index's copy; re-save, or drop metadata.{HEADERS_KEY} so that they read the files",
                )  # fmt: skip
            # A file with trailing bytes is reported by file already; this is a sound file the copy misdescribes.
            elif copy[file].size != actual.size and actual.size == actual.data_end:
                self.problem(
                    where, None,
                    f"{where}: metadata.{HEADERS_KEY}[{file!r}] records a size of {copy[file].size} bytes, but {d.name(file)} has "
                    f"{actual.size}; re-save, or drop metadata.{HEADERS_KEY} so that loaders read the files' headers",
                )  # fmt: skip

    def _coverage(self, d: HfDir, index: _IndexView, headers: dict[str, FileHeader]) -> None:
        """Step 3: the index and the headers name the same tensors, each in one file."""
        for key, file in sorted(index.weight_map.items()):
            header = headers.get(file)
            if header is None:
                continue  # a missing or unreadable file: reported once, by file
            if key in header.by_name:
                self.report.tensors_checked += 1
            else:
                name = d.name(file)
                self.problem(name, key, f"{name}: the index maps tensor {key!r} to this file, but its header has no such tensor")
        for file, header in sorted(headers.items()):
            name = d.name(file)
            for entry in header.entries:
                owner = index.weight_map.get(entry.name)
                if owner is None:
                    self.problem(name, entry.name, f"{name}: tensor {entry.name!r} is in this file but not in the index, so no loader reaches it")
                elif owner != file:
                    self.problem(name, entry.name, f"{name}: tensor {entry.name!r} is stored here too, but the index maps it to {owner} (a key in two files)")

    def _total_size(self, d: HfDir, index: _IndexView, headers: dict[str, FileHeader]) -> None:
        """Step 1, the part that needs the headers: ``total_size`` counts the tensors' bytes."""
        if "total_size" not in index.metadata:
            return
        where, value = d.name(INDEX_NAME), index.metadata["total_size"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.problem(where, None, f"{where}: metadata.total_size is {value!r}, not a byte count")
            return
        entries = [headers[f].by_name.get(k) if f in headers else None for k, f in index.weight_map.items()]
        if not index.complete or None in entries:
            return  # some sizes are unknown; those tensors are reported already
        total = sum(e.nbytes for e in entries if e is not None)
        if value != total:
            self.problem(where, None, f"{where}: metadata.total_size is {value}, but the tensors the index names hold {total} bytes")

    def _strays(self, d: HfDir, named: set[str]) -> None:
        """Step 4: ``*.safetensors`` files that nothing reads."""
        for file in safetensors_files(d.folder):
            if file not in named:
                name = d.name(file)
                self.problem(name, None, f"{name}: stray file: the index does not name it, so no loader reads it (a leftover of an earlier save?); delete it if it is not needed")

    def _staging(self, d: HfDir) -> None:
        """Step 4: the staging folder of a save, which its commit should have removed."""
        if d.folder.has_dir(STAGING_DIR):
            name = d.name(STAGING_DIR + "/")
            self.problem(
                name, None,
                f"{name}: a save's staging folder is left over (the save stopped after its commit, before removing "
                f"it, or another save to this folder is running); delete it once no save is running",
            )  # fmt: skip

    def _jobs(self, d: HfDir, index: _IndexView, headers: dict[str, FileHeader]) -> list[FileJob]:
        """Step 5's work: the tensors whose bytes to checksum, by file."""
        where = d.name(INDEX_NAME)
        if not self.want_checksums:
            return []
        if index.checksums is None:
            if not index.has_table:
                self.report.notes.append(f"{where}: no checksums recorded; structure checked only")
            else:
                self.report.notes.append(f"{where}: checksums not checked: the checksum table is malformed")
            return []
        self.report.checksums_checked = True
        per_file: dict[str, list[Tensor]] = {}
        for key, file in sorted(index.weight_map.items()):
            entry = headers[file].by_name.get(key) if file in headers else None
            if entry is None:
                continue  # reported by the coverage check
            crc = index.checksums.get(key)
            if crc is None:
                if key not in index.malformed:
                    self.problem(where, key, f"{where}: records no checksum for tensor {key!r} (in {file}), so its bytes cannot be checked")
                continue
            per_file.setdefault(file, []).append(Tensor(key, headers[file].data_start + entry.begin, entry.nbytes, crc))
        return [
            FileJob(d.name(file), fsio.join(d.root, file), tuple(sorted(tensors, key=lambda t: t.start)))
            for file, tensors in sorted(per_file.items())
        ]

    # -- step folders, DCP, unfinished saves ---------------------------------------------------------

    def step(self, folder: Folder) -> list[FileJob]:
        """A ``CheckpointManager`` step folder: its commit marker, and its training state."""
        if COMMIT_MARKER not in folder.files:
            self.problem(
                COMMIT_MARKER, None,
                f"{COMMIT_MARKER}: step not committed: the marker CheckpointManager writes last is missing, so it neither "
                f"lists nor loads this step (an interrupted save; retention removes it)",
            )  # fmt: skip
        else:
            self._marker(folder)
        if not folder.has_dir(TRAINING_STATE_DIR):
            return []
        sub = HfDir(fsio.join(self.root, TRAINING_STATE_DIR), folder.sub(TRAINING_STATE_DIR), TRAINING_STATE_DIR + "/")
        if INDEX_NAME in sub.folder.files or SINGLE_FILE_NAME in sub.folder.files:
            return self.hf(sub)
        if safetensors_files(sub.folder) or sub.folder.has_dir(STAGING_DIR):
            name = sub.name("")
            self.problem(name, None, f"{name}: holds tensor files but no {INDEX_NAME}: the training state's save did not finish")
        return []

    def _marker(self, folder: Folder) -> None:
        """The marker names the world size; each rank's training-state file must exist."""
        try:
            marker = json.loads(fsio.read_all(self.fs, fsio.join(self.root, COMMIT_MARKER)))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self.problem(COMMIT_MARKER, None, f"{COMMIT_MARKER}: not valid JSON ({exc}); CheckpointManager cannot load this step's training state")
            return
        world = marker.get("world_size") if isinstance(marker, dict) else None
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            self.problem(COMMIT_MARKER, None, f"{COMMIT_MARKER}: \"world_size\" is {world!r}, not a rank count; CheckpointManager cannot load this step's training state")
            return
        for rank in range(world):
            name = f"{TRAINING_STATE_DIR}/{rank_file(rank)}"
            if name not in folder.files:
                self.problem(name, None, f"{name}: missing: the step was saved by {world} ranks, and loading restores rank {rank}'s training state and RNG from it")

    def dcp(self, folder: Folder) -> list[FileJob]:
        """PyTorch DCP format: ``.metadata`` unpickles and every file it names holds its bytes."""
        try:
            metadata = dcp_metadata(self.fs, self.root, self.storage_options)
            needed = _dcp_extents(metadata.storage_data or {})
            entries = len(metadata.state_dict_metadata)
        except OSError:
            raise  # the store, not the file
        except Exception as exc:  # noqa: BLE001 - unpickling a damaged file can raise almost anything
            self.problem(DCP_METADATA, None, f"{DCP_METADATA}: cannot be read as DCP metadata ({type(exc).__name__}: {exc}); the file is damaged: restore it or re-save")
            return []
        for name, end in sorted(needed.items()):
            size = folder.files.get(name)
            if size is None:
                self.problem(name, None, f"{name}: missing: {DCP_METADATA} places data in it, but it does not exist")
            elif size < end:
                self.problem(name, None, f"{name}: {size} bytes, but {DCP_METADATA} places data up to byte {end} (truncated)")
            else:
                self.report.files_checked += 1
        self.report.tensors_checked += entries
        self.report.notes.append("PyTorch DCP format records no checksums; structure checked only")
        return []

    def incomplete(self, folder: Folder) -> list[FileJob]:
        """Neither format's commit marker: one problem, saying what happened and what to do."""
        message = (
            f"not committed: there is no {INDEX_NAME} (the commit marker, written last), {SINGLE_FILE_NAME} "
            f"or {DCP_METADATA}, so no loader accepts this folder"
        )
        if folder.has_dir(STAGING_DIR):
            message += (
                f"; {STAGING_DIR}/ is left: an interrupted save; `hf-dcp consolidate` can finish it if every rank "
                f"finished writing, else save again"
            )
        else:
            message += "; save it again"
        self.problem(None, None, message)
        return []


def _dcp_extents(storage_data: dict[Any, Any]) -> dict[str, int]:
    """File -> the end of the last byte range ``.metadata`` places in it."""
    needed: dict[str, int] = {}
    for info in storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed
