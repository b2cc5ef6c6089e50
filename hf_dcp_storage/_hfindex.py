"""Reading an HF checkpoint folder: its listing, its index json and its file headers.

Shared by ``HFStorageReader`` (which stops at the first defect and raises it), and by
``inspect_checkpoint`` / ``verify_checkpoint`` (which describe a checkpoint, or list every
defect it has). So each check lives here once, as a small function that either raises with the
message or returns the defects it found; the strict entry points (``parse_index``,
``parse_checksums``, ``load_weight_map``) compose them and raise the first.

Messages start with ``where``: the reader passes the object's URL, the inspection tools a name
relative to the checkpoint folder.
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from . import _fsio
from ._header import TensorEntry, decode_header, header_length
from ._layout import CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHM_KEY, CHECKSUMS_KEY, HEADERS_KEY, INDEX_NAME, SINGLE_FILE_NAME
from ._retry import RetryPolicy
from ._s3 import S3

__all__ = [
    "HEADER_PROBE",
    "ReadRange",
    "Index",
    "FileHeader",
    "Folder",
    "read_bytes",
    "read_index",
    "decode_index_json",
    "weight_map_of",
    "file_name_problem",
    "checksum_table",
    "parse_checksums",
    "parse_index",
    "recorded_headers",
    "read_header",
    "load_weight_map",
    "scan_folder",
]

# First ranged read of every file: most headers fit, so one request usually gets the whole header.
HEADER_PROBE = 64 << 10

# ``read_range(path, start, end) -> bytes [start, end)`` (fewer only if the file is shorter).
ReadRange = Callable[[str, int, int], bytes]


@dataclass(frozen=True)
class Index:
    """A validated ``model.safetensors.index.json``.

    Attributes:
        weight_map: tensor name -> file name (plain names inside the folder).
        checksums: tensor name -> recorded CRC32, or ``None`` when the index records none.
        metadata: the index's ``"metadata"`` object (``{}`` when absent).
    """

    weight_map: dict[str, str]
    checksums: dict[str, int] | None
    metadata: dict[str, Any]


@dataclass(frozen=True)
class FileHeader:
    """The decoded header of one safetensors file.

    Attributes:
        entries: the tensors, sorted by data offset (they tile ``[0, data_end)``).
        metadata: the header's ``__metadata__``.
        data_start: byte where the data section starts (``8 + N``).
        size: the file's size in bytes.
    """

    entries: list[TensorEntry]
    metadata: dict[str, str]
    data_start: int
    size: int

    @functools.cached_property
    def by_name(self) -> dict[str, TensorEntry]:
        """The entries by tensor name."""
        return {e.name: e for e in self.entries}

    @property
    def data_end(self) -> int:
        """Byte just past the last tensor (``data_start`` for a file without tensors)."""
        return self.data_start + (self.entries[-1].end if self.entries else 0)


@dataclass(frozen=True)
class Folder:
    """One listing of a folder: every file under it (recursively) with its size, and its sub-folders.

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


def read_bytes(fs: AbstractFileSystem, path: str, start: int, end: int, *, retry: RetryPolicy, s3: S3 | None = None) -> bytes:
    """Bytes ``[start, end)`` of ``path`` (fewer only if the file is shorter), retried on
    transient failures: S3's own client when ``s3`` is given, else fsspec."""
    if s3 is not None:
        return s3.get_range(path, start, end)
    return retry.call(lambda: _fsio.read_range(fs, path, start, end), operation=f"read bytes {start}-{end - 1} of", url=_fsio.url_of(fs, path))


def read_index(fs: AbstractFileSystem, root: str) -> bytes | None:
    """The raw index json of the checkpoint at ``root``, or ``None`` if it has none."""
    try:
        return _fsio.read_all(fs, _fsio.join(root, INDEX_NAME))
    except FileNotFoundError:
        return None


class _DuplicateName(ValueError):
    """A JSON object of the index names one key twice."""


def decode_index_json(raw: bytes, where: str) -> Any:
    """The index json decoded.

    Raises:
        ValueError: not valid (UTF-8) JSON; a name given twice in one object (``json`` would
            keep the last silently, another tool the first); or JSON Python will not build (an
            int past ``sys.get_int_max_str_digits()`` digits, nesting too deep to decode).
    """
    try:
        return json.loads(raw, object_pairs_hook=lambda pairs: _unique(pairs, where))
    except _DuplicateName:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{where}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]}); restore the index from a copy or re-save") from None


def _unique(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a name given twice is refused."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise _DuplicateName(
                f"{where}: names {name!r} twice in one object, so which value holds is ambiguous; "
                f"keep one of them (an index written by a save never repeats a name)"
            )
        out[name] = value
    return out


def weight_map_of(index: Any, where: str) -> dict[str, str]:
    """The index's ``weight_map``, checked to map strings to strings.

    Raises:
        ValueError: no such object, or one of another shape.
    """
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"{where}: needs a \"weight_map\" object mapping tensor names to file names")
    return weight_map


def file_name_problem(file: str, where: str) -> str | None:
    """Why ``file`` (a weight_map value) is refused, or ``None`` when it is a plain name inside the
    folder: absolute paths, ``..``, backslashes, URLs and un-normalized paths could make a loader
    read outside the checkpoint; ``.`` is the folder itself, and a NUL, another control character
    or a lone UTF-16 surrogate (``"\\ud800"`` in the JSON) is no file name a store accepts
    (``os.open`` refuses them with a message that names no file)."""
    norm = posixpath.normpath(file)
    if (
        file.startswith("/")
        or "\\" in file
        or norm == ".."
        or norm.startswith("../")
        or norm != file
        or norm == "."
        or ":" in file
        or any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in file)
    ):
        return (
            f"{where}: weight_map names file {file!r}, which is not a plain relative path inside the "
            f"checkpoint folder; only names like 'model-00001-of-00002.safetensors' are accepted"
        )
    return None


def checksum_table(metadata: Any, where: str) -> tuple[dict[str, int] | None, dict[str, Any]]:
    """The recorded CRC32 of each tensor, and the entries that are not 8 hex digits.

    Returns:
        ``(checksums, malformed)``: ``checksums`` is ``None`` when the index records no table;
        ``malformed`` maps each key whose value is not a CRC32 (8 hex digits) to that value.

    Raises:
        ValueError: an algorithm other than CRC32, or a table that is not an object.
    """
    if not isinstance(metadata, dict) or CHECKSUMS_KEY not in metadata:
        return None, {}
    algorithm, table = metadata.get(CHECKSUM_ALGORITHM_KEY), metadata[CHECKSUMS_KEY]
    if algorithm != CHECKSUM_ALGORITHM:
        raise ValueError(f"{where}: metadata.{CHECKSUM_ALGORITHM_KEY} is {algorithm!r}; this version reads only {CHECKSUM_ALGORITHM!r}")
    if not isinstance(table, dict):
        raise ValueError(_TABLE_SHAPE.format(where=where))
    out: dict[str, int] = {}
    malformed: dict[str, Any] = {}
    for key, value in table.items():
        # Not int(value, 16) alone: it also takes "0x00001f", " 000001f", "+0000001", "0000_001"
        # and non-ASCII digits, and "-0000001" gives -1.
        if isinstance(value, str) and _CRC32_HEX.fullmatch(value):
            out[key] = int(value, 16)
        else:
            malformed[key] = value
    return out, malformed


_CRC32_HEX = re.compile(r"[0-9a-fA-F]{8}")


_TABLE_SHAPE = "{where}: metadata." + CHECKSUMS_KEY + " must map tensor names to CRC32 values of 8 hex digits"


def parse_checksums(metadata: Any, where: str) -> dict[str, int] | None:
    """``checksum_table`` that refuses a table with any malformed entry.

    Raises:
        ValueError: as ``checksum_table``, or an entry that is not 8 hex digits.
    """
    checksums, malformed = checksum_table(metadata, where)
    if malformed:
        raise ValueError(_TABLE_SHAPE.format(where=where))
    return checksums


def recorded_headers(metadata: Any, files: Iterable[str], where: str) -> dict[str, FileHeader] | None:
    """The headers the index records of ``files`` (``metadata.headers``: per file its size and
    header JSON, as ``HFStorageWriter`` writes them), decoded and checked exactly as if read from
    the files; ``None`` when the index records none (a checkpoint saved by other tools). A file
    the table does not name is left out: its header is read from the file.

    A loader then reads one object instead of one or two per file on every rank: at 405B over
    8,192 ranks, 8,192 reads of the index instead of some three million requests.

    Raises:
        ValueError: a table or an entry of another shape.
        HeaderError: a recorded header that does not decode against its recorded size.
    """
    if not isinstance(metadata, dict) or HEADERS_KEY not in metadata:
        return None
    table = metadata[HEADERS_KEY]
    rule = f'metadata.{HEADERS_KEY} must map files to {{"size": its bytes, "header": its header JSON}}'
    if not isinstance(table, dict):
        raise ValueError(f"{where}: {rule}; it is a {type(table).__name__}")
    out = {}
    for file in files:
        entry = table.get(file)
        if entry is None:
            continue
        size = entry.get("size") if isinstance(entry, dict) else None
        text = entry.get("header") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or not isinstance(text, str):
            raise ValueError(f"{where}: {rule}; the entry of {file!r} is {str(entry)[:80]}. Re-save, or drop metadata.{HEADERS_KEY} to read the files' headers")
        try:
            body = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON) has no UTF-8 form
            raise ValueError(f"{where}: {rule}; the header of {file!r} holds a lone UTF-16 surrogate, which no header can. Re-save, or drop metadata.{HEADERS_KEY} to read the files' headers") from None
        entries, meta, data_start = decode_header(struct.pack("<Q", len(body)) + body, file_size=size, where=f"{where}: metadata.{HEADERS_KEY}[{file!r}]")
        out[file] = FileHeader(entries, meta, data_start, size)
    return out


def parse_index(raw: bytes, where: str) -> Index:
    """Validate an HF index json: JSON, the weight_map's shape, plain file names, the checksum table.

    Raises:
        ValueError: the first defect found, naming ``where`` and the rule.
    """
    index = decode_index_json(raw, where)
    weight_map = weight_map_of(index, where)
    for file in set(weight_map.values()):
        problem = file_name_problem(file, where)
        if problem is not None:
            raise ValueError(problem)
    metadata = index.get("metadata")
    return Index(weight_map, parse_checksums(metadata, where), metadata if isinstance(metadata, dict) else {})


def read_header(
    fs: AbstractFileSystem, root: str, file: str, read_range: ReadRange, *, size: int | None = None, where: str | None = None
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
    path = _fsio.join(root, file)
    where = where or _fsio.url_of(fs, path)
    if size is None:
        try:
            size = _fsio.size(fs, path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{where}: file named by the checkpoint index does not exist") from None
    raw = read_range(path, 0, min(size, HEADER_PROBE))
    n = header_length(raw, file_size=size, where=where)
    if len(raw) < 8 + n:
        raw += read_range(path, len(raw), 8 + n)
    entries, metadata, data_start = decode_header(raw, file_size=size, where=where)
    return FileHeader(entries, metadata, data_start, size)


def load_weight_map(fs: AbstractFileSystem, root: str, read_range: ReadRange) -> tuple[dict[str, str], dict[str, int] | None, dict[str, FileHeader] | None]:
    """``key -> file``, the recorded checksums and the recorded headers (``recorded_headers``)
    from the index json, or from the single ``model.safetensors`` (no checksums; its header), for
    a loader.

    Raises:
        FileNotFoundError: neither an index nor ``model.safetensors``.
        ValueError: a malformed index or header.
    """
    raw = read_index(fs, root)
    if raw is None:
        if not _fsio.exists(fs, _fsio.join(root, SINGLE_FILE_NAME)):
            raise FileNotFoundError(
                f"{_fsio.url_of(fs, root)} is not an HF checkpoint: it has neither {INDEX_NAME} "
                f"nor {SINGLE_FILE_NAME} (an unfinished save has no index); point to the folder that holds them"
            )
        header = read_header(fs, root, SINGLE_FILE_NAME, read_range)
        return {e.name: SINGLE_FILE_NAME for e in header.entries}, None, {SINGLE_FILE_NAME: header}
    where = _fsio.url_of(fs, _fsio.join(root, INDEX_NAME))
    index = parse_index(raw, where)
    return index.weight_map, index.checksums, recorded_headers(index.metadata, sorted(set(index.weight_map.values())), where)


def scan_folder(fs: AbstractFileSystem, root: str) -> Folder | None:
    """One recursive listing of ``root`` with sizes (on S3 one paginated LIST), never from a
    cache: another process may have changed the folder since this one last looked.

    Returns:
        The listing, or ``None`` when ``root`` does not exist or is a file.
    """
    try:
        found: Mapping[str, Mapping[str, Any]] = _fsio.find_entries(fs, root, withdirs=True)
    except FileNotFoundError:  # s3fs: a missing bucket
        return None
    base = root.rstrip("/") + "/"
    files: dict[str, int] = {}
    dirs: set[str] = set()
    for path, info in found.items():
        if not path.startswith(base):
            continue  # the root itself
        rel = path[len(base) :]
        if info.get("type") == "directory" or rel.endswith("/"):  # S3 folder placeholders end in "/"
            dirs.add(rel.rstrip("/"))
        else:
            files[rel] = int(info.get("size") or 0)
    # An empty listing is an empty folder or no folder at all; only then ask which.
    if not files and not dirs and not _fsio.isdir(fs, root):
        return None
    return Folder(files, frozenset(dirs))
