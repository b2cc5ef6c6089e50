"""``verify_checkpoint``: every defect of a checkpoint folder, each named by file and key.

A broken checkpoint is the expected input here, so nothing about it raises: each defect becomes
one :class:`Problem` and the checks go on, to find them all. Only a path that is no checkpoint at
all, or a store that cannot be read, raises.

For an HF checkpoint (``model.safetensors.index.json`` plus shards, or a single
``model.safetensors``), in order:

1. the index: valid JSON, a ``weight_map`` of strings, file names that stay inside the folder,
   a well-formed checksum table (``crc32``, 8 hex digits per key, only keys the map names) and
   ``metadata.total_size`` equal to the bytes of the tensors it names;
2. every file the index names: it exists, its header decodes against the real file size
   (tiling, offsets, dtype and shape agreement, truncation), and nothing follows the last tensor;
   where the index records the files' headers (``metadata.headers``), each copy equals the file's;
3. coverage: each index key is in its file's header, each header key is in the index (mapped to
   that file), no key is in two files;
4. leftovers: ``*.safetensors`` files the index does not name, a ``.hf_dcp_staging/`` folder;
5. checksums: every tensor's bytes read once, their CRC32 compared with the recorded value.

A ``CheckpointManager`` step folder also gets its ``COMMITTED`` marker and its ``training_state/``
checked (the latter as an HF checkpoint of its own). A PyTorch DCP checkpoint gets its
``.metadata`` and the sizes of the ``.distcp`` files it names checked; it records no checksums.

The checksum pass reads each file in ``BLOCK_BYTES`` ranged reads, ``thread_count`` at a time
across all files and within each file, so memory stays ``thread_count * BLOCK_BYTES`` whatever the
checkpoint's size; each block yields the CRC32 of its share of every tensor it overlaps, and the
shares are combined in order (``format/crc.py``: ``crc32_combine``).
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from ..format.crc import crc32_combine
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
from ..steps.manager import TRAINING_STATE_DIR, _rank_file
from ..steps.retention import COMMIT_MARKER
from ..writer import STAGING_DIR
from .inspection import DCP_METADATA, FORMAT_DCP, FORMAT_HF, _check_thread_count, dcp_metadata, is_step_folder, open_checkpoint, range_reader, safetensors_files
from .progress import NO_PROGRESS, Progress

__all__ = ["BLOCK_BYTES", "Problem", "VerifyReport", "verify_checkpoint"]

# Bytes per ranged read of the checksum pass: large enough that a request's latency is small
# next to its transfer (S3), small enough that thread_count of them in memory stay modest.
BLOCK_BYTES = 8 << 20


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


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    thread_count: int = 8,
    checksums: bool = True,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``path`` and report every defect (see the module docstring).

    Args:
        path: the checkpoint folder (or a ``CheckpointManager`` step folder), local or any fsspec URL.
        storage_options: passed to fsspec.
        thread_count: reads in flight (headers, then checksum blocks); memory of the checksum
            pass is about ``thread_count * BLOCK_BYTES``.
        checksums: read every tensor and compare its CRC32 with the index's; ``False`` checks the
            structure only (index and headers: no tensor data is read).
        progress: told the checksum pass's total bytes once (``start``), then each block read.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` when no problem was found.

    Raises:
        FileNotFoundError: ``path`` does not exist or is no checkpoint (not even an unfinished one).
        ValueError: a bad ``thread_count``.
        OSError: the store failed to answer (after retries), e.g. access denied.
    """
    _check_thread_count(thread_count)
    fs, root, folder, kind = open_checkpoint(path, storage_options)
    report = VerifyReport(url=fsio.url_of(fs, root), format=kind)
    run = _Verification(fs, root, report, storage_options, thread_count, checksums)
    if kind == FORMAT_HF:
        jobs = run.hf(_Dir(root, folder, ""))
    elif kind == FORMAT_DCP:
        jobs = run.dcp(folder)
    else:
        jobs = run.incomplete(folder)
    if is_step_folder(folder):
        jobs += run.step(folder)
    if not checksums:
        report.notes.append("checksums not checked (checksums=False): structure only")
    if jobs:
        run.checksums(jobs, progress or NO_PROGRESS)
    return report


# -- internals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dir:
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


@dataclass(frozen=True)
class _Tensor:
    """A tensor the checksum pass reads: its bytes ``[start, start + nbytes)`` in its file."""

    key: str
    start: int
    nbytes: int
    crc: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class _FileJob:
    """One file of the checksum pass: its name in messages, its path, its tensors by offset."""

    name: str
    path: str
    tensors: tuple[_Tensor, ...]

    @functools.cached_property
    def _bounds(self) -> tuple[list[int], list[int]]:
        return [t.start for t in self.tensors], [t.end for t in self.tensors]

    def overlapping(self, start: int, end: int) -> range:
        """Indices of the tensors that share bytes with ``[start, end)`` (tensors do not overlap,
        so both their starts and their ends ascend)."""
        starts, ends = self._bounds
        return range(bisect.bisect_right(ends, start), bisect.bisect_left(starts, end))


class _Verification:
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

    def hf(self, d: _Dir) -> list[_FileJob]:
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

    def _single_file(self, d: _Dir) -> list[_FileJob]:
        header = self._headers(d, [SINGLE_FILE_NAME]).get(SINGLE_FILE_NAME)
        if header is not None:
            self.report.tensors_checked += len(header.entries)
        self._strays(d, {SINGLE_FILE_NAME})
        self._staging(d)
        self.report.notes.append(f"{d.name(SINGLE_FILE_NAME)}: a single file without an index records no checksums; structure checked only")
        return []

    def _index(self, d: _Dir) -> _IndexView | None:
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

    def _headers(self, d: _Dir, files: list[str]) -> dict[str, FileHeader]:
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

    def _recorded(self, d: _Dir, index: _IndexView, headers: dict[str, FileHeader]) -> None:
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

    def _coverage(self, d: _Dir, index: _IndexView, headers: dict[str, FileHeader]) -> None:
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

    def _total_size(self, d: _Dir, index: _IndexView, headers: dict[str, FileHeader]) -> None:
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

    def _strays(self, d: _Dir, named: set[str]) -> None:
        """Step 4: ``*.safetensors`` files that nothing reads."""
        for file in safetensors_files(d.folder):
            if file not in named:
                name = d.name(file)
                self.problem(name, None, f"{name}: stray file: the index does not name it, so no loader reads it (a leftover of an earlier save?); delete it if it is not needed")

    def _staging(self, d: _Dir) -> None:
        """Step 4: the staging folder of a save, which its commit should have removed."""
        if d.folder.has_dir(STAGING_DIR):
            name = d.name(STAGING_DIR + "/")
            self.problem(
                name, None,
                f"{name}: a save's staging folder is left over (the save stopped after its commit, before removing "
                f"it, or another save to this folder is running); delete it once no save is running",
            )  # fmt: skip

    def _jobs(self, d: _Dir, index: _IndexView, headers: dict[str, FileHeader]) -> list[_FileJob]:
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
        per_file: dict[str, list[_Tensor]] = {}
        for key, file in sorted(index.weight_map.items()):
            entry = headers[file].by_name.get(key) if file in headers else None
            if entry is None:
                continue  # reported by the coverage check
            crc = index.checksums.get(key)
            if crc is None:
                if key not in index.malformed:
                    self.problem(where, key, f"{where}: records no checksum for tensor {key!r} (in {file}), so its bytes cannot be checked")
                continue
            per_file.setdefault(file, []).append(_Tensor(key, headers[file].data_start + entry.begin, entry.nbytes, crc))
        return [
            _FileJob(d.name(file), fsio.join(d.root, file), tuple(sorted(tensors, key=lambda t: t.start)))
            for file, tensors in sorted(per_file.items())
        ]

    # -- step 5: checksums ------------------------------------------------------------------------

    def checksums(self, jobs: list[_FileJob], progress: Progress) -> None:
        """Read every tensor of ``jobs`` once, in blocks, in parallel; report each mismatch."""
        blocks = [(j, start, end) for j, job in enumerate(jobs) for start, end in _blocks(job.tensors)]
        progress.start(sum(t.nbytes for job in jobs for t in job.tensors), "verify checksums")

        def read(block: tuple[int, int, int]) -> list[tuple[int, int, int]] | None:
            j, start, end = block
            pieces = self._block_crcs(jobs[j], start, end)
            progress.advance(end - start)
            return pieces

        # (file, tensor) -> (crc32 of its bytes so far, their count); None once a read came up short.
        state: dict[tuple[int, int], tuple[int, int] | None] = {}
        for (j, start, end), pieces in zip(blocks, parallel_map(read, blocks, self.threads), strict=True):
            if pieces is None:
                state.update(dict.fromkeys(((j, i) for i in jobs[j].overlapping(start, end)), None))
                continue
            self.report.bytes_checked += end - start
            for i, crc, n in pieces:  # blocks come in file order, so each tensor's shares do too
                so_far = state.get((j, i), (0, 0))
                if so_far is not None:
                    state[j, i] = (crc32_combine(so_far[0], crc, n), so_far[1] + n)
        for j, job in enumerate(jobs):
            for i, tensor in enumerate(job.tensors):
                self._compare(job, tensor, state.get((j, i), (0, 0)))

    def _block_crcs(self, job: _FileJob, start: int, end: int) -> list[tuple[int, int, int]] | None:
        """``(tensor index, crc32, length)`` of each tensor's share of bytes ``[start, end)``;
        ``None`` if the file ended before ``end``."""
        data = self.read_range(job.path, start, end)
        if len(data) < end - start:
            return None
        view = memoryview(data)
        out = []
        for i in job.overlapping(start, end):
            t = job.tensors[i]
            a, b = max(start, t.start), min(end, t.end)
            out.append((i, zlib.crc32(view[a - start : b - start]), b - a))
        return out

    def _compare(self, job: _FileJob, tensor: _Tensor, state: tuple[int, int] | None) -> None:
        if state is None or state[1] != tensor.nbytes:
            self.problem(job.name, tensor.key, f"{job.name}: tensor {tensor.key!r} could not be read whole: the file ended early (did it change during the check?)")
        elif state[0] != tensor.crc:
            self.problem(
                job.name, tensor.key,
                f"{job.name}: tensor {tensor.key!r} fails its checksum (crc32 of the bytes read {state[0]:08x}, "
                f"the index records {tensor.crc:08x}); the file is corrupt: restore it from a copy or re-save",
            )  # fmt: skip

    # -- step folders, DCP, unfinished saves ---------------------------------------------------------

    def step(self, folder: Folder) -> list[_FileJob]:
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
        sub = _Dir(fsio.join(self.root, TRAINING_STATE_DIR), folder.sub(TRAINING_STATE_DIR), TRAINING_STATE_DIR + "/")
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
            name = f"{TRAINING_STATE_DIR}/{_rank_file(rank)}"
            if name not in folder.files:
                self.problem(name, None, f"{name}: missing: the step was saved by {world} ranks, and loading restores rank {rank}'s training state and RNG from it")

    def dcp(self, folder: Folder) -> list[_FileJob]:
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

    def incomplete(self, folder: Folder) -> list[_FileJob]:
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


def _blocks(tensors: Iterable[_Tensor]) -> list[tuple[int, int]]:
    """Byte ranges to read: runs of adjacent tensors, cut into ``BLOCK_BYTES`` pieces, so each
    byte of each tensor is read exactly once and nothing else is read."""
    runs: list[list[int]] = []
    for t in tensors:
        if t.nbytes == 0:
            continue
        if runs and runs[-1][1] == t.start:
            runs[-1][1] = t.end
        else:
            runs.append([t.start, t.end])
    return [(s, min(s + BLOCK_BYTES, end)) for start, end in runs for s in range(start, end, BLOCK_BYTES)]


def _dcp_extents(storage_data: dict[Any, Any]) -> dict[str, int]:
    """File -> the end of the last byte range ``.metadata`` places in it."""
    needed: dict[str, int] = {}
    for info in storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed
