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
from typing import Any

from fsspec import AbstractFileSystem

from ..format.geometry import element_size
from ..format.header import DTYPE_TO_NAME, HeaderError
from ..format.index import INDEX_NAME, SINGLE_FILE_NAME, FileHeader, parse_index
from ..io import fsio
from ..io.files import Folder, ReadRange, read_header, read_index
from ..io.parallel import parallel_map
from ..plan.layout import layout_from_files
from ..session.records import SAVE_RECORD, RecordError, SaveRecord, rank_record_name
from ..steps.folder import TRAINING_STATE_DIR
from ..steps.retention import COMMIT_MARKER
from ..writer import STAGING_DIR
from .dcp_format import DCP_METADATA, dcp_metadata
from .folders import (
    FORMAT_DCP,
    FORMAT_HF,
    FORMAT_INCOMPLETE,
    check_thread_count,
    open_checkpoint,
    range_reader,
    safetensors_files,
)
from .inspect_report import OBJECT_DTYPE, CheckpointInfo, FileInfo, TensorInfo, Totals

# The report's types and the format names are importable from here, where they are documented.
__all__ = [
    "FORMAT_DCP",
    "FORMAT_HF",
    "FORMAT_INCOMPLETE",
    "CheckpointInfo",
    "FileInfo",
    "TensorInfo",
    "Totals",
    "inspect_checkpoint",
]


def inspect_checkpoint(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    thread_count: int = 8,
) -> CheckpointInfo:
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
    check_thread_count(thread_count)
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


def _inspect_hf(
    fs: AbstractFileSystem, root: str, folder: Folder, read_range: ReadRange, threads: int
) -> tuple[list[FileInfo], list[TensorInfo], list[str]]:
    raw = read_index(fs, root) if INDEX_NAME in folder.files else None
    notes: list[str] = []
    if raw is None:
        files = [SINGLE_FILE_NAME]
        weight_map, checksums = None, None
        notes.append(
            f"a single {SINGLE_FILE_NAME} without an index (as save_pretrained writes); no "
            "checksums recorded"
        )
    else:
        index = parse_index(raw, fsio.url_of(fs, fsio.join(root, INDEX_NAME)))
        weight_map, checksums = index.weight_map, index.checksums
        files = sorted(set(weight_map.values()))
        if checksums is None:
            notes.append("the index records no checksums (not saved by HFStorageWriter)")
    headers = dict(
        zip(
            files,
            parallel_map(
                lambda f: read_header(fs, root, f, read_range, size=folder.files.get(f)),
                files,
                threads,
            ),
            strict=True,
        )
    )
    if weight_map is None:
        weight_map = {e.name: SINGLE_FILE_NAME for e in headers[SINGLE_FILE_NAME].entries}
    tensors = []
    for key, file in weight_map.items():
        entry = headers[file].by_name.get(key)
        if entry is None:
            raise ValueError(
                f"{fsio.url_of(fs, fsio.join(root, file))}: the index maps {key!r} to this file, "
                "but its header has no such tensor"
            )
        crc = checksums.get(key) if checksums is not None else None
        tensors.append(_tensor_info(key, entry.dtype, entry.shape, entry.nbytes, file, crc))
    return [FileInfo(f, h.size, len(h.entries)) for f, h in headers.items()], tensors, notes


def _inspect_dcp(
    fs: AbstractFileSystem, root: str, folder: Folder, storage_options: dict[str, Any] | None
) -> tuple[list[FileInfo], list[TensorInfo], list[str]]:
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
            tensors.append(
                _tensor_info(
                    key,
                    md.properties.dtype,
                    shape,
                    math.prod(shape) * element_size(md.properties.dtype),
                    None,
                    None,
                )
            )
        else:
            tensors.append(TensorInfo(key, OBJECT_DTYPE, None, stored.get(key, 0), None))
    files = []
    for name in sorted(keys_per_file):
        if name not in folder.files:
            raise FileNotFoundError(
                f"{fsio.url_of(fs, fsio.join(root, name))}: file named by {DCP_METADATA} does not "
                "exist"
            )
        files.append(FileInfo(name, folder.files[name], len(keys_per_file[name])))
    note = (
        "PyTorch DCP format: no checksums recorded; tensors are stored in pieces, so no entry "
        "has one file"
    )
    return files, tensors, [note]


def _inspect_incomplete(
    fs: AbstractFileSystem, root: str, folder: Folder, read_range: ReadRange, threads: int
) -> tuple[list[FileInfo], list[TensorInfo], list[str]]:
    notes = [
        (
            f"not committed: no {INDEX_NAME}, {SINGLE_FILE_NAME} or {DCP_METADATA}; nothing can "
            "load this folder as it is"
        )
    ]
    record = f"{STAGING_DIR}/{SAVE_RECORD}"
    if record in folder.files:
        planned = _planned_save(fs, root, folder, record)
        if not isinstance(planned, str):
            return *planned[:2], notes + planned[2]
        notes.append(planned)
    elif folder.has_dir(STAGING_DIR):
        notes.append(
            f"{STAGING_DIR}/ exists: an interrupted save (`hf-dcp consolidate` may finish it), or "
            "one still running"
        )
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
        tensors += [
            _tensor_info(e.name, e.dtype, e.shape, e.nbytes, name, None) for e in header.entries
        ]
    return files, tensors, notes


def _planned_save(
    fs: AbstractFileSystem, root: str, folder: Folder, record: str
) -> tuple[list[FileInfo], list[TensorInfo], list[str]] | str:
    """An unfinished save described from its own record: the files and tensors it planned, and
    how many ranks recorded their writes. A note (str) instead when the record is damaged."""
    try:
        save = SaveRecord.decode(fsio.read_all(fs, fsio.join(root, record)), record)
        layout = layout_from_files(save.files, record)
    except (RecordError, HeaderError) as exc:
        return f"unreadable save record, left out: {exc}"
    done = [
        r for r in range(save.world_size) if f"{STAGING_DIR}/{rank_record_name(r)}" in folder.files
    ]
    missing = sorted(set(range(save.world_size)) - set(done))
    if missing:
        shown = missing if len(missing) <= 16 else [*missing[:16], "..."]
        verdict = (
            f"ranks {shown} have not recorded their writes: a save still running, or one that "
            "failed (save again)"
        )
    else:
        verdict = "every rank recorded its writes: `hf-dcp consolidate` can finish it"
    note = (
        f"an unfinished save ({save.mode} writes, {len(done)} of {save.world_size} ranks done); "
        f"{verdict}; files and tensors below are as planned"
    )
    files = [FileInfo(f.name, f.size, len(f.entries)) for f in layout.files]
    tensors = [
        _tensor_info(e.name, e.dtype, e.shape, e.nbytes, f.name, None)
        for f in layout.files
        for e in f.entries
    ]
    return files, tensors, [note]


def _tensor_info(
    key: str, dtype: Any, shape: tuple[int, ...], nbytes: int, file: str | None, crc: int | None
) -> TensorInfo:
    name = DTYPE_TO_NAME.get(dtype) or str(dtype).removeprefix(
        "torch."
    )  # DCP may hold dtypes safetensors lacks
    return TensorInfo(
        key, name, tuple(shape), nbytes, file, f"{crc:08x}" if crc is not None else None
    )
