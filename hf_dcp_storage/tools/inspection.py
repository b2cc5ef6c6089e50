"""``inspect_checkpoint``: what a checkpoint folder holds, from its index and file headers only.

Three kinds of folder are recognised:

* ``"hf"``: a Hugging Face checkpoint, ``model.safetensors.index.json`` plus shards (what
  ``HFStorageWriter`` writes), or a single ``model.safetensors`` (what ``save_pretrained`` writes);
* ``"dcp"``: PyTorch DCP's default format, a ``.metadata`` file plus ``.distcp`` files;
* ``"incomplete"``: neither, but the remains of a save (shards without an index, a staging
  folder, ``.distcp`` files without ``.metadata``, or a step folder's training state).

A step folder of ``CheckpointManager`` (``root/step_N/{model files, training_state/,
COMMITTED}``) is an HF checkpoint whose extras are reported too.

Cost: one recursive listing, one read of the index, and one small ranged read per file (two
for a header over 64 KiB), files in parallel; tensor data is never read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fsspec import AbstractFileSystem

from ..format.header import DTYPE_TO_NAME, HeaderError
from ..format.index import INDEX_NAME, SINGLE_FILE_NAME, FileHeader, parse_index
from ..io import fsio
from ..io.files import Folder, ReadRange, read_header, read_index, scan_folder
from ..io.parallel import parallel_map
from ..io.records import SAVE_RECORD, RecordError, SaveRecord, rank_record_name
from ..io.retry import RetryPolicy
from ..plan.layout import element_size, layout_from_files
from ..steps.folder import TRAINING_STATE_DIR
from ..steps.retention import COMMIT_MARKER, parse_step
from ..stores import ranges_for
from ..writer import STAGING_DIR

__all__ = [
    "FORMAT_HF",
    "FORMAT_DCP",
    "FORMAT_INCOMPLETE",
    "DCP_METADATA",
    "TensorInfo",
    "FileInfo",
    "Totals",
    "CheckpointInfo",
    "inspect_checkpoint",
    "open_checkpoint",
    "is_step_folder",
    "dcp_metadata",
    "range_reader",
    "safetensors_files",
]

FORMAT_HF = "hf"
FORMAT_DCP = "dcp"
FORMAT_INCOMPLETE = "incomplete"
# PyTorch DCP's default format: this pickled ``Metadata`` (written last) plus ``*.distcp`` files.
DCP_METADATA = ".metadata"
DCP_SUFFIX = ".distcp"
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
        return {"key": self.key, "dtype": self.dtype, "shape": shape, "numel": self.numel, "nbytes": self.nbytes, "file": self.file, "checksum": self.checksum}


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
        return {"tensors": self.tensors, "objects": self.objects, "parameters": self.parameters, "bytes": self.bytes, "bytes_per_dtype": dict(self.bytes_per_dtype)}


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


def inspect_checkpoint(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, thread_count: int = 8) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` from its index and file headers (never tensor data).

    Args:
        path: the checkpoint folder, a local path or any fsspec URL.
        storage_options: passed to fsspec (and to PyTorch's ``FsspecReader`` for a remote DCP
            checkpoint).
        thread_count: headers read at once.

    Returns:
        A :class:`CheckpointInfo`; ``to_dict()`` gives JSON.

    Raises:
        FileNotFoundError: ``path`` does not exist or is no checkpoint (see ``open_checkpoint``);
            a file the index names is missing.
        ValueError: a malformed index or header, or an index key its file lacks; use
            ``verify_checkpoint`` to list every defect instead.
    """
    _check_thread_count(thread_count)
    fs, root, folder, kind = open_checkpoint(path, storage_options)
    read_range = range_reader(fs)
    if kind == FORMAT_HF:
        files, tensors, notes = _inspect_hf(fs, root, folder, read_range, thread_count)
    elif kind == FORMAT_DCP:
        files, tensors, notes = _inspect_dcp(fs, root, folder, storage_options)
    else:
        files, tensors, notes = _inspect_incomplete(fs, root, folder, read_range, thread_count)
    return CheckpointInfo(
        url=fsio.url_of(fs, root),
        format=kind,
        committed=kind != FORMAT_INCOMPLETE,
        has_commit_marker=COMMIT_MARKER in folder.files,
        has_training_state=folder.has_dir(TRAINING_STATE_DIR),
        has_staging=folder.has_dir(STAGING_DIR),
        files=files,
        tensors=sorted(tensors, key=lambda t: t.key),
        totals=Totals.of(tensors),
        notes=notes,
    )


# -- shared with verify ---------------------------------------------------------------------------


def open_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> tuple[AbstractFileSystem, str, Folder, str]:
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
        what = "a file, not a checkpoint folder" if fsio.isfile(fs, root) else "no such checkpoint folder"
        raise FileNotFoundError(f"{url}: {what}; give the folder that holds {INDEX_NAME} (or {DCP_METADATA})")
    kind = _format_of(folder)
    if kind is None:
        steps = sorted((s, d) for d in folder.dirs if "/" not in d and (s := parse_step(d)) is not None)
        hint = (
            f"; it is a run folder with step folders ({', '.join(d for _, d in steps[:5])}{', ...' if len(steps) > 5 else ''}): give one of them"
            if steps
            else "; give the folder that holds them"
        )
        raise FileNotFoundError(f"{url} is not a checkpoint: it has no {INDEX_NAME}, {SINGLE_FILE_NAME} or {DCP_METADATA}, nor the files of an unfinished save{hint}")
    return fs, root, folder, kind


def is_step_folder(folder: Folder) -> bool:
    """Whether a listing looks like a ``CheckpointManager`` step folder (marker or training state)."""
    return COMMIT_MARKER in folder.files or folder.has_dir(TRAINING_STATE_DIR)


def dcp_metadata(fs: AbstractFileSystem, root: str, storage_options: dict[str, Any] | None) -> Any:
    """The unpickled ``.metadata`` of a DCP checkpoint, read by PyTorch's own reader.

    Raises:
        whatever PyTorch's reader raises for an unreadable file (``pickle`` errors, ``EOFError``, ...).
    """
    from torch.distributed.checkpoint import FileSystemReader

    if fsio.is_local(fs):
        return FileSystemReader(root).read_metadata()
    # torch's fsspec backend (its module public from torch 2.15, dcp_format.py imports the right one).
    from .dcp_format import FsspecReader

    return FsspecReader(fsio.url_of(fs, root), **(storage_options or {})).read_metadata()


def range_reader(fs: AbstractFileSystem, retry: RetryPolicy | None = None) -> ReadRange:
    """``read_range(path, start, end)`` on ``fs``, as loads read it (``stores.ranges_for``): S3's
    retried client path, else fsspec, retried."""
    return ranges_for(fs, retry or RetryPolicy()).get_range


def safetensors_files(folder: Folder) -> list[str]:
    """Names of the ``*.safetensors`` files directly in the folder, sorted."""
    return [n for n in folder.top_files() if n.endswith(".safetensors")]


# -- per format ------------------------------------------------------------------------------------


def _format_of(folder: Folder) -> str | None:
    if INDEX_NAME in folder.files or SINGLE_FILE_NAME in folder.files:
        return FORMAT_HF
    if DCP_METADATA in folder.files:
        return FORMAT_DCP
    leftovers = safetensors_files(folder) or [n for n in folder.top_files() if n.endswith(DCP_SUFFIX)]
    if leftovers or folder.has_dir(STAGING_DIR) or is_step_folder(folder):
        return FORMAT_INCOMPLETE
    return None


def _inspect_hf(fs: AbstractFileSystem, root: str, folder: Folder, read_range: ReadRange, threads: int) -> tuple[list[FileInfo], list[TensorInfo], list[str]]:
    raw = read_index(fs, root) if INDEX_NAME in folder.files else None
    notes: list[str] = []
    if raw is None:
        files = [SINGLE_FILE_NAME]
        weight_map, checksums = None, None
        notes.append(f"a single {SINGLE_FILE_NAME} without an index (as save_pretrained writes); no checksums recorded")
    else:
        index = parse_index(raw, fsio.url_of(fs, fsio.join(root, INDEX_NAME)))
        weight_map, checksums = index.weight_map, index.checksums
        files = sorted(set(weight_map.values()))
        if checksums is None:
            notes.append("the index records no checksums (not saved by HFStorageWriter)")
    headers = dict(zip(files, parallel_map(lambda f: read_header(fs, root, f, read_range, size=folder.files.get(f)), files, threads), strict=True))
    if weight_map is None:
        weight_map = {e.name: SINGLE_FILE_NAME for e in headers[SINGLE_FILE_NAME].entries}
    tensors = []
    for key, file in weight_map.items():
        entry = headers[file].by_name.get(key)
        if entry is None:
            raise ValueError(f"{fsio.url_of(fs, fsio.join(root, file))}: the index maps {key!r} to this file, but its header has no such tensor")
        crc = checksums.get(key) if checksums is not None else None
        tensors.append(_tensor_info(key, entry.dtype, entry.shape, entry.nbytes, file, crc))
    return [FileInfo(f, h.size, len(h.entries)) for f, h in headers.items()], tensors, notes


def _inspect_dcp(fs: AbstractFileSystem, root: str, folder: Folder, storage_options: dict[str, Any] | None) -> tuple[list[FileInfo], list[TensorInfo], list[str]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp_metadata(fs, root, storage_options)
    stored: dict[str, int] = {}  # key -> bytes over all its storage entries
    keys_per_file: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
        keys_per_file.setdefault(info.relative_path, set()).add(index.fqn)
    tensors = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            shape = tuple(md.size)
            tensors.append(_tensor_info(key, md.properties.dtype, shape, math.prod(shape) * element_size(md.properties.dtype), None, None))
        else:
            tensors.append(TensorInfo(key, OBJECT_DTYPE, None, stored.get(key, 0), None))
    files = []
    for name in sorted(keys_per_file):
        if name not in folder.files:
            raise FileNotFoundError(f"{fsio.url_of(fs, fsio.join(root, name))}: file named by {DCP_METADATA} does not exist")
        files.append(FileInfo(name, folder.files[name], len(keys_per_file[name])))
    return files, tensors, ["PyTorch DCP format: no checksums recorded; tensors are stored in pieces, so no entry has one file"]


def _inspect_incomplete(fs: AbstractFileSystem, root: str, folder: Folder, read_range: ReadRange, threads: int) -> tuple[list[FileInfo], list[TensorInfo], list[str]]:
    notes = [f"not committed: no {INDEX_NAME}, {SINGLE_FILE_NAME} or {DCP_METADATA}; nothing can load this folder as it is"]
    record = f"{STAGING_DIR}/{SAVE_RECORD}"
    if record in folder.files:
        planned = _planned_save(fs, root, folder, record)
        if not isinstance(planned, str):
            return *planned[:2], notes + planned[2]
        notes.append(planned)
    elif folder.has_dir(STAGING_DIR):
        notes.append(f"{STAGING_DIR}/ exists: an interrupted save (`hf-dcp consolidate` may finish it), or one still running")
    names = safetensors_files(folder)

    def header_or_error(name: str) -> FileHeader | str:
        try:
            return read_header(fs, root, name, read_range, size=folder.files.get(name), where=name)
        except (HeaderError, FileNotFoundError) as exc:
            return str(exc)

    files, tensors = [], []
    for name, header in zip(names, parallel_map(header_or_error, names, threads), strict=True):
        if isinstance(header, str):
            notes.append(f"unreadable header, left out: {header}")
            continue
        files.append(FileInfo(name, header.size, len(header.entries)))
        tensors += [_tensor_info(e.name, e.dtype, e.shape, e.nbytes, name, None) for e in header.entries]
    return files, tensors, notes


def _planned_save(fs: AbstractFileSystem, root: str, folder: Folder, record: str) -> tuple[list[FileInfo], list[TensorInfo], list[str]] | str:
    """An unfinished save described from its own record: the files and tensors it planned, and
    how many ranks recorded their writes. A note (str) instead when the record is damaged."""
    try:
        save = SaveRecord.decode(fsio.read_all(fs, fsio.join(root, record)), record)
        layout = layout_from_files(save.files, record)
    except (RecordError, HeaderError) as exc:
        return f"unreadable save record, left out: {exc}"
    done = [r for r in range(save.world_size) if f"{STAGING_DIR}/{rank_record_name(r)}" in folder.files]
    missing = sorted(set(range(save.world_size)) - set(done))
    if missing:
        shown = missing if len(missing) <= 16 else [*missing[:16], "..."]
        verdict = f"ranks {shown} have not recorded their writes: a save still running, or one that failed (save again)"
    else:
        verdict = "every rank recorded its writes: `hf-dcp consolidate` can finish it"
    note = f"an unfinished save ({save.mode} writes, {len(done)} of {save.world_size} ranks done); {verdict}; files and tensors below are as planned"
    files = [FileInfo(f.name, f.size, len(f.entries)) for f in layout.files]
    tensors = [_tensor_info(e.name, e.dtype, e.shape, e.nbytes, f.name, None) for f in layout.files for e in f.entries]
    return files, tensors, [note]


def _tensor_info(key: str, dtype: Any, shape: tuple[int, ...], nbytes: int, file: str | None, crc: int | None) -> TensorInfo:
    name = DTYPE_TO_NAME.get(dtype) or str(dtype).removeprefix("torch.")  # DCP may hold dtypes safetensors lacks
    return TensorInfo(key, name, tuple(shape), nbytes, file, f"{crc:08x}" if crc is not None else None)


def _check_thread_count(thread_count: int) -> None:
    if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
        raise ValueError(f"thread_count={thread_count!r} must be an int >= 1")
