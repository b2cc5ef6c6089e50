"""The checks ``verify_checkpoint`` runs on an HF checkpoint folder (``tools/verify.py`` says
what they are, in order), each adding the defects it finds to a :class:`VerifyReport`; a step
folder, a DCP checkpoint and an unfinished save are ``tools/folderchecks.py``, the checksum pass
``tools/crcpass.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from ..writer import STAGING_DIR
from .configcheck import CONFIG_NAME, config_problems
from .crcpass import FileJob, Tensor
from .folders import range_reader, safetensors_files
from .verify_report import Problem, VerifyReport

__all__ = ["HfChecks", "HfDir"]


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
    whether one was recorded at all; ``malformed`` holds keys whose value was not a CRC32
    (reported).
    """

    weight_map: dict[str, str]
    complete: bool
    metadata: dict[str, Any]
    checksums: dict[str, int] | None
    has_table: bool
    malformed: frozenset[str]


class HfChecks:
    """The context of one run of ``verify_checkpoint``, and the checks of an HF checkpoint
    folder (steps 1-5 of ``tools/verify.py``), each adding to ``report``."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        report: VerifyReport,
        storage_options: dict[str, Any] | None,
        threads: int,
        checksums: bool,
    ) -> None:
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
        self._config(d, headers)
        return self._jobs(d, index, headers)

    def _single_file(self, d: HfDir) -> list[FileJob]:
        header = self._headers(d, [SINGLE_FILE_NAME]).get(SINGLE_FILE_NAME)
        if header is not None:
            self.report.tensors_checked += len(header.entries)
            self._config(d, {SINGLE_FILE_NAME: header})
        self._strays(d, {SINGLE_FILE_NAME})
        self._staging(d)
        self.report.notes.append(
            f"{d.name(SINGLE_FILE_NAME)}: a single file without an index records no checksums; "
            "structure checked only"
        )
        return []

    def _config(self, d: HfDir, headers: dict[str, FileHeader]) -> None:
        """Where the folder holds a ``config.json``: it describes the weights (``configcheck``)."""
        if CONFIG_NAME not in d.folder.files:
            return
        shapes = {e.name: e.shape for h in headers.values() for e in h.entries}
        data = fsio.read_all(self.fs, fsio.join(d.root, CONFIG_NAME))
        problems, note = config_problems(data, shapes)
        for key, message in problems:
            self.problem(d.name(CONFIG_NAME), key, f"{d.prefix}{message}")
        if note is not None:
            self.report.notes.append(d.name(note))

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
            self.problem(
                where, None, f'{where}: "metadata" must be an object, got {type(metadata).__name__}'
            )
        metadata = metadata if isinstance(metadata, dict) else {}
        checksums, malformed = self._checksum_table(where, metadata, full_map)
        weight_map = {k: f for k, f in full_map.items() if f not in refused}
        return _IndexView(
            weight_map,
            not refused,
            metadata,
            checksums,
            CHECKSUMS_KEY in metadata,
            frozenset(malformed),
        )

    def _checksum_table(
        self, where: str, metadata: dict[str, Any], weight_map: dict[str, str]
    ) -> tuple[dict[str, int] | None, list[str]]:
        try:
            checksums, malformed = checksum_table(metadata, where)
        except ValueError as exc:
            self.problem(where, None, str(exc))
            return None, []
        for key, value in malformed.items():
            self.problem(
                where,
                key,
                f"{where}: metadata.{CHECKSUMS_KEY}[{key!r}] is {value!r}, not a CRC32 of 8 hex "
                "digits",
            )
        for key in sorted(set(checksums or ()) - set(weight_map)):
            self.problem(
                where,
                key,
                f"{where}: metadata.{CHECKSUMS_KEY} records tensor {key!r}, which the weight_map "
                "does not name",
            )
        return checksums, list(malformed)

    def _headers(self, d: HfDir, files: list[str]) -> dict[str, FileHeader]:
        """Step 2: read and check each file's header, in parallel; the readable ones by file."""

        def read(file: str) -> FileHeader | Exception:
            try:
                return read_header(
                    self.fs,
                    d.root,
                    file,
                    self.read_range,
                    size=d.folder.files.get(file),
                    where=d.name(file),
                )
            except (FileNotFoundError, HeaderError) as exc:
                return exc

        headers = {}
        for file, result in zip(files, parallel_map(read, files, self.threads), strict=True):
            name = d.name(file)
            if isinstance(result, FileNotFoundError):
                self.problem(
                    name,
                    None,
                    f"{name}: missing: the index names this file, but it does not exist; restore "
                    "it from a copy or re-save",
                )
            elif isinstance(result, Exception):
                self.problem(name, None, str(result))
            else:
                headers[file] = result
                self.report.files_checked += 1
                extra = result.size - result.data_end
                if extra > 0:
                    self.problem(
                        name,
                        None,
                        f"{name}: {extra} trailing bytes after the last tensor (the data ends at "
                        f"byte {result.data_end}, the file has {result.size}); no complete save "
                        "leaves any: restore the file from a copy or re-save",
                    )
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
            if (copy[file].entries, copy[file].metadata, copy[file].data_start) != (
                actual.entries,
                actual.metadata,
                actual.data_start,
            ):
                self.problem(
                    where,
                    None,
                    f"{where}: metadata.{HEADERS_KEY}[{file!r}] differs from the header of "
                    f"{d.name(file)} (a file replaced after the save?), and loaders read the "
                    f"index's copy; re-save, or drop metadata.{HEADERS_KEY} so that they read the "
                    "files",
                )
            # A file with trailing bytes is reported by file already; this is a sound file the
            # copy misdescribes.
            elif copy[file].size != actual.size and actual.size == actual.data_end:
                self.problem(
                    where,
                    None,
                    f"{where}: metadata.{HEADERS_KEY}[{file!r}] records a size of "
                    f"{copy[file].size} bytes, but {d.name(file)} has {actual.size}; re-save, or "
                    f"drop metadata.{HEADERS_KEY} so that loaders read the files' headers",
                )

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
                self.problem(
                    name,
                    key,
                    f"{name}: the index maps tensor {key!r} to this file, but its header has no "
                    "such tensor",
                )
        for file, header in sorted(headers.items()):
            name = d.name(file)
            for entry in header.entries:
                owner = index.weight_map.get(entry.name)
                if owner is None:
                    self.problem(
                        name,
                        entry.name,
                        f"{name}: tensor {entry.name!r} is in this file but not in the index, so "
                        "no loader reaches it",
                    )
                elif owner != file:
                    self.problem(
                        name,
                        entry.name,
                        f"{name}: tensor {entry.name!r} is stored here too, but the index maps it "
                        f"to {owner} (a key in two files)",
                    )

    def _total_size(self, d: HfDir, index: _IndexView, headers: dict[str, FileHeader]) -> None:
        """Step 1, the part that needs the headers: ``total_size`` counts the tensors' bytes."""
        if "total_size" not in index.metadata:
            return
        where, value = d.name(INDEX_NAME), index.metadata["total_size"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.problem(
                where, None, f"{where}: metadata.total_size is {value!r}, not a byte count"
            )
            return
        entries = [
            headers[f].by_name.get(k) if f in headers else None for k, f in index.weight_map.items()
        ]
        if not index.complete or None in entries:
            return  # some sizes are unknown; those tensors are reported already
        total = sum(e.nbytes for e in entries if e is not None)
        if value != total:
            self.problem(
                where,
                None,
                f"{where}: metadata.total_size is {value}, but the tensors the index names hold "
                f"{total} bytes",
            )

    def _strays(self, d: HfDir, named: set[str]) -> None:
        """Step 4: ``*.safetensors`` files that nothing reads."""
        for file in safetensors_files(d.folder):
            if file not in named:
                name = d.name(file)
                self.problem(
                    name,
                    None,
                    f"{name}: stray file: the index does not name it, so no loader reads it (a "
                    "leftover of an earlier save?); delete it if it is not needed",
                )

    def _staging(self, d: HfDir) -> None:
        """Step 4: the staging folder of a save, which its commit should have removed."""
        if d.folder.has_dir(STAGING_DIR):
            name = d.name(STAGING_DIR + "/")
            self.problem(
                name,
                None,
                f"{name}: a save's staging folder is left over (the save stopped after its "
                "commit, before removing it, or another save to this folder is running); delete "
                "it once no save is running",
            )

    def _jobs(self, d: HfDir, index: _IndexView, headers: dict[str, FileHeader]) -> list[FileJob]:
        """Step 5's work: the tensors whose bytes to checksum, by file."""
        where = d.name(INDEX_NAME)
        if not self.want_checksums:
            return []
        if index.checksums is None:
            if not index.has_table:
                self.report.notes.append(f"{where}: no checksums recorded; structure checked only")
            else:
                self.report.notes.append(
                    f"{where}: checksums not checked: the checksum table is malformed"
                )
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
                    self.problem(
                        where,
                        key,
                        f"{where}: records no checksum for tensor {key!r} (in {file}), so its "
                        "bytes cannot be checked",
                    )
                continue
            per_file.setdefault(file, []).append(
                Tensor(key, headers[file].data_start + entry.begin, entry.nbytes, crc)
            )
        return [
            FileJob(
                d.name(file), fsio.join(d.root, file), tuple(sorted(tensors, key=lambda t: t.start))
            )
            for file, tensors in sorted(per_file.items())
        ]
