"""Reading an HF checkpoint from a store: its listing, its index json and its files' headers
(``read_header``; ``read_head`` for a load, which keeps the bytes after the header).

What is read is decoded and checked by ``format/`` (``format/index.py``, ``format/header.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from ..format.compare import header_difference
from ..format.header import HeaderError, TensorEntry, decode_header, header_length
from ..format.index import (
    ADAPTER_FILE_NAME,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    FileHeader,
    parse_index,
    recorded_headers,
)
from ..format.strictjson import loads_strict
from . import fsio
from .parallel import parallel_map

CONFIG_NAME = "config.json"

__all__ = [
    "CONFIG_NAME",
    "HEADER_PREFIX",
    "HEADER_PROBE",
    "Folder",
    "Head",
    "ReadRange",
    "check_recorded",
    "load_weight_map",
    "read_config",
    "read_head",
    "read_header",
    "read_index",
    "scan_folder",
]

# First ranged read of every file: most headers fit, so one request usually gets the whole header.
HEADER_PROBE = 64 << 10

# What a load's one request per file reads (``read_head``): the header and the first tensors. A
# megabyte: by the rule that joins a load's runs across gaps (``plan/reads.READ_GAP_BYTES``), a
# megabyte more on a request already sent costs less than one more request; and it holds the
# header of a file of ~9,000 tensors (~105 bytes of JSON each, measured on transformers-style
# names; a Qwen3-MoE shard of 1,152 tensors has a 119 KB header, two requests at HEADER_PROBE).
HEADER_PREFIX = 1 << 20

# ``read_range(path, start, end) -> bytes [start, end)`` (fewer only if the file is shorter).
ReadRange = Callable[[str, int, int], bytes]


@dataclass(frozen=True)
class Folder:
    """One listing of a folder: every file under it (recursively) with its size, and its
    sub-folders.

    Paths are relative to the folder (``a``, ``sub/b``). Object stores have no real folders: a
    sub-folder there is any prefix that some file name has.
    """

    files: dict[str, int]
    dirs: frozenset[str] = field(default_factory=frozenset)

    def top_files(self) -> list[str]:
        """Names of the files directly in the folder, sorted."""
        return sorted(name for name in self.files if "/" not in name)

    def has_dir(self, name: str) -> bool:
        """Whether sub-folder ``name`` exists (an empty one only where the store keeps folders)."""
        return name in self.dirs or any(f.startswith(name + "/") for f in self.files)

    def sub(self, name: str) -> Folder:
        """The listing of sub-folder ``name``, from this one (no request)."""
        base = name + "/"
        return Folder(
            {f[len(base) :]: size for f, size in self.files.items() if f.startswith(base)},
            frozenset(d[len(base) :] for d in self.dirs if d.startswith(base)),
        )


def read_index(fs: AbstractFileSystem, root: str) -> bytes | None:
    """The raw index json of the checkpoint at ``root``, or ``None`` if it has none."""
    try:
        return fsio.read_all(fs, fsio.join(root, INDEX_NAME))
    except FileNotFoundError:
        return None


def read_config(fs: AbstractFileSystem, root: str) -> dict[str, Any] | None:
    """The folder's ``config.json`` as a dict, or ``None`` if it has none.

    Raises:
        ValueError: a ``config.json`` that is not a JSON object, naming it.
    """
    try:
        raw = fsio.read_all(fs, fsio.join(root, CONFIG_NAME))
    except FileNotFoundError:
        return None
    url = fsio.url_of(fs, fsio.join(root, CONFIG_NAME))

    def invalid(exc: Exception | None = None) -> ValueError:
        return ValueError(f"{url}: not a JSON object ({exc or 'another value'}); fix or remove it")

    config = loads_strict(
        raw, duplicate=lambda name: invalid(ValueError(f"{name!r} twice")), invalid=invalid
    )
    if not isinstance(config, dict):
        raise invalid()
    return config


def read_header(
    fs: AbstractFileSystem,
    root: str,
    file: str,
    read_range: ReadRange,
    *,
    size: int | None = None,
    where: str | None = None,
) -> FileHeader:
    """Read and validate the header of ``root/file``: one ``HEADER_PROBE`` ranged read, and a
    second only for a larger header. Never reads tensor data.

    Args:
        size: the file's size when a listing already gave it (saves a request), else asked for.
        where: the name in messages; default the file's URL.

    Raises:
        FileNotFoundError: the file does not exist.
        HeaderError: a malformed header, or one that does not fit the file (truncated).
    """
    path = fsio.join(root, file)
    where = where or fsio.url_of(fs, path)
    if size is None:
        try:
            size = fsio.size(fs, path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where}: file named by the checkpoint index does not exist"
            ) from None
    raw = read_range(path, 0, min(size, HEADER_PROBE))
    n = header_length(raw, file_size=size, where=where)
    if len(raw) < 8 + n:
        raw += read_range(path, len(raw), 8 + n)
    entries, metadata, data_start = decode_header(raw, file_size=size, where=where)
    return FileHeader(entries, metadata, data_start, size)


@dataclass(frozen=True)
class Head:
    """A file's header read with the bytes after it (``read_head``).

    Attributes:
        entries: the tensors, sorted by data offset. data_start: byte where the data starts.
        size: the file's size where the read reached its end, else ``None`` (the header's
            tensors are then checked against the file when their bytes are read).
        kept: the file's bytes from ``data_start`` that the read brought: the first tensors'
            (at most ``HEADER_PREFIX - data_start`` bytes; none where the header alone took a
            second request).
    """

    entries: list[TensorEntry]
    data_start: int
    size: int | None
    kept: bytes

    @functools.cached_property
    def by_name(self) -> dict[str, TensorEntry]:
        """The entries by tensor name."""
        return {e.name: e for e in self.entries}


def read_head(
    fs: AbstractFileSystem,
    root: str,
    file: str,
    read_range: ReadRange,
    *,
    prefix: int = HEADER_PREFIX,
) -> Head:
    """Read and validate the header of ``root/file`` for a load: one ranged read of its first
    ``prefix`` bytes (no request for its size), and exactly one more only for a header longer
    than that. The bytes past the header are kept (``Head.kept``), so that a load is served its
    first tensors from them.

    Raises:
        FileNotFoundError: the file does not exist.
        HeaderError: a malformed header, or one that does not fit the file (where its end was
            read: a longer file truncated fails when the missing bytes are read).
    """
    path = fsio.join(root, file)
    where = fsio.url_of(fs, path)
    try:
        raw = read_range(path, 0, prefix)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{where}: file named by the checkpoint index does not exist"
        ) from None
    size = len(raw) if len(raw) < prefix else None  # a short answer is the whole file
    n = header_length(raw, file_size=size, where=where)
    if len(raw) < 8 + n:
        raw += read_range(path, len(raw), 8 + n)
    entries, _, data_start = decode_header(raw, file_size=size, where=where)
    return Head(entries, data_start, size, raw[data_start:])


def load_weight_map(
    fs: AbstractFileSystem, root: str, read_range: ReadRange, *, keep: bool = False
) -> tuple[dict[str, str], dict[str, int] | None, Mapping[str, FileHeader | Head] | None]:
    """``key -> file``, the recorded checksums and the recorded headers (``recorded_headers``)
    from the index json, or from the single ``model.safetensors`` (or PEFT's
    ``adapter_model.safetensors``; no checksums; its header, a
    ``Head`` with the bytes after it where ``keep``: ``read_head``), for a loader.

    Raises:
        FileNotFoundError: neither an index nor ``model.safetensors``.
        ValueError: a malformed index or header.
    """
    raw = read_index(fs, root)
    if raw is None:
        single = next(
            (
                n
                for n in (SINGLE_FILE_NAME, ADAPTER_FILE_NAME)
                if fsio.exists(fs, fsio.join(root, n))
            ),
            None,
        )
        if single is None:
            raise FileNotFoundError(
                f"{fsio.url_of(fs, root)} is not an HF checkpoint: it has neither {INDEX_NAME} "
                f"nor {SINGLE_FILE_NAME} (an unfinished save has no index), nor PEFT's "
                f"{ADAPTER_FILE_NAME}; point to the folder that holds them"
            )
        read = read_head if keep else read_header
        header = read(fs, root, single, read_range)
        return {e.name: single for e in header.entries}, None, {single: header}
    where = fsio.url_of(fs, fsio.join(root, INDEX_NAME))
    index = parse_index(raw, where)
    return (
        index.weight_map,
        index.checksums,
        recorded_headers(index.metadata, sorted(set(index.weight_map.values())), where),
    )


def scan_folder(fs: AbstractFileSystem, root: str) -> Folder | None:
    """One recursive listing of ``root`` with sizes (on S3 one paginated LIST), never from a
    cache: another process may have changed the folder since this one last looked.

    Returns:
        The listing, or ``None`` when ``root`` does not exist or is a file.
    """
    try:
        found: Mapping[str, Mapping[str, Any]] = fsio.find_entries(fs, root, withdirs=True)
    except FileNotFoundError:  # s3fs: a missing bucket
        return None
    base = root.rstrip("/") + "/"
    files: dict[str, int] = {}
    dirs: set[str] = set()
    for path, info in found.items():
        if not path.startswith(base):
            continue  # the root itself
        rel = path[len(base) :]
        if info.get("type") == "directory" or rel.endswith(
            "/"
        ):  # S3 folder placeholders end in "/"
            dirs.add(rel.rstrip("/"))
        else:
            files[rel] = int(info.get("size") or 0)
    # An empty listing is an empty folder or no folder at all; only then ask which.
    if not files and not dirs and not fsio.isdir(fs, root):
        return None
    return Folder(files, frozenset(dirs))


def check_recorded(
    recorded: Mapping[str, FileHeader | Head],
    read: Callable[[str], FileHeader | Head],
    url_of: Callable[[str], str],
    threads: int,
) -> None:
    """(a load with ``verify``) Each file's own header (``read(file)``), where it decodes, must
    equal the index's copy of it, which the load trusts: a dtype changed there (``F32`` to
    ``I32``) reinterprets bytes whose CRC32 still matches. Two headers that disagree mean one is
    corrupt, and nothing tells which. A file header that does not decode leaves the copy as the
    only description of the file, so the load goes on with it, and the CRC32s check the bytes.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file's header and the index's copy differ; the message names the first
            difference.
    """

    def actual(file: str) -> tuple[Mapping[str, TensorEntry], int] | None:
        try:
            header = read(file)
        except HeaderError:
            return None
        return header.by_name, header.data_start

    files = sorted(recorded)
    for file, found in zip(files, parallel_map(actual, files, threads), strict=True):
        if found is None:
            continue
        difference = header_difference(recorded[file].by_name, recorded[file].data_start, *found)
        if difference is not None:
            raise ValueError(
                f"{url_of(file)}: the file's header differs from the copy in {INDEX_NAME} "
                f"(metadata.headers): {difference}; the file or the index is corrupt: restore "
                "both from a copy, or re-save"
            )
