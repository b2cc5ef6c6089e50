"""The Hugging Face index (``model.safetensors.index.json``) and file names: encode, decode,
validate.

Pure: no filesystem (``io/files.py`` reads indexes and headers from a store). Shared by
``HFStorageReader`` (which stops at the first defect and raises it), and by ``inspect`` and
``verify`` (which describe a checkpoint, or list every defect it has). So each check lives here
once, as a small function that either raises with the message or returns the defects it found;
the strict entry points (``parse_index``, ``parse_checksums``) compose them and raise the first.

Messages start with ``where``: the reader passes the object's URL, the inspection tools a name
relative to the checkpoint folder.
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .header import TensorEntry, decode_header
from .strictjson import loads_strict

__all__ = [
    "ADAPTER_FILE_NAME",
    "CHECKSUMS_KEY",
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_ALGORITHM_KEY",
    "FORMAT_METADATA",
    "HEADERS_KEY",
    "INDEX_NAME",
    "SHARD_NAME_RE",
    "SINGLE_FILE_NAME",
    "FileHeader",
    "Index",
    "checksum_table",
    "decode_index_json",
    "file_name_problem",
    "index_json",
    "json_bytes",
    "parse_checksums",
    "parse_index",
    "recorded_headers",
    "shard_name",
    "weight_map_of",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
# PEFT's one adapter file (``save_pretrained`` of a ``PeftModel``): loadable without an index too.
ADAPTER_FILE_NAME = "adapter_model.safetensors"
SHARD_NAME_RE = re.compile(r"^model-(\d{5,})-of-(\d{5,})\.safetensors$")
# What every file's ``__metadata__`` says (transformers reads it).
FORMAT_METADATA = {"format": "pt"}
# Index metadata entries holding each tensor's CRC32 (8 hex digits) of its bytes in its file.
CHECKSUM_ALGORITHM_KEY = "checksum_algorithm"
CHECKSUM_ALGORITHM = "crc32"
CHECKSUMS_KEY = "checksums"
# The index's copy of every file's header (its size and header JSON), so that a loader reads
# one object, not every file.
HEADERS_KEY = "headers"


def shard_name(index: int, total: int) -> str:
    """``model-00001-of-00004.safetensors`` for the 1-based ``index`` of ``total`` files."""
    return f"model-{index:05d}-of-{total:05d}.safetensors"


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


def decode_index_json(raw: bytes, where: str) -> Any:
    """The index json decoded.

    Raises:
        ValueError: not valid (UTF-8) JSON; a name given twice in one object (``json`` would
            keep the last silently, another tool the first); or JSON Python will not build (an
            int past ``sys.get_int_max_str_digits()`` digits, nesting too deep to decode).
    """
    return loads_strict(
        raw,
        duplicate=lambda name: ValueError(
            f"{where}: names {name!r} twice in one object, so which value holds is ambiguous; "
            "keep one of them (an index written by a save never repeats a name)"
        ),
        invalid=lambda exc: ValueError(
            f"{where}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]}); restore the index "
            "from a copy or re-save"
        ),
    )


def weight_map_of(index: Any, where: str) -> dict[str, str]:
    """The index's ``weight_map``, checked to map strings to strings.

    Raises:
        ValueError: no such object, or one of another shape.
    """
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f'{where}: needs a "weight_map" object mapping tensor names to file names')
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
            f"{where}: weight_map names file {file!r}, which is not a plain relative path inside "
            "the checkpoint folder; only names like 'model-00001-of-00002.safetensors' are "
            "accepted"
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
        raise ValueError(
            f"{where}: metadata.{CHECKSUM_ALGORITHM_KEY} is {algorithm!r}; this version reads "
            f"only {CHECKSUM_ALGORITHM!r}"
        )
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


_TABLE_SHAPE = (
    "{where}: metadata." + CHECKSUMS_KEY + " must map tensor names to CRC32 values of 8 hex digits"
)


def parse_checksums(metadata: Any, where: str) -> dict[str, int] | None:
    """``checksum_table`` that refuses a table with any malformed entry.

    Raises:
        ValueError: as ``checksum_table``, or an entry that is not 8 hex digits.
    """
    checksums, malformed = checksum_table(metadata, where)
    if malformed:
        raise ValueError(_TABLE_SHAPE.format(where=where))
    return checksums


def recorded_headers(
    metadata: Any, files: Iterable[str], where: str
) -> dict[str, FileHeader] | None:
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
    rule = (
        f'metadata.{HEADERS_KEY} must map files to {{"size": its bytes, "header": its header JSON}}'
    )
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
            raise ValueError(
                f"{where}: {rule}; the entry of {file!r} is {str(entry)[:80]}. Re-save, or drop "
                f"metadata.{HEADERS_KEY} to read the files' headers"
            )
        try:
            body = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON) has no UTF-8 form
            raise ValueError(
                f"{where}: {rule}; the header of {file!r} holds a lone UTF-16 surrogate, which no "
                f"header can. Re-save, or drop metadata.{HEADERS_KEY} to read the files' headers"
            ) from None
        entries, meta, data_start = decode_header(
            struct.pack("<Q", len(body)) + body,
            file_size=size,
            where=f"{where}: metadata.{HEADERS_KEY}[{file!r}]",
        )
        out[file] = FileHeader(entries, meta, data_start, size)
    return out


def parse_index(raw: bytes, where: str) -> Index:
    """Validate an HF index json: JSON, the weight_map's shape, plain file names, the checksum
    table.

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
    return Index(
        weight_map, parse_checksums(metadata, where), metadata if isinstance(metadata, dict) else {}
    )


def index_json(
    total_size: int,
    weight_map: Mapping[str, str],
    files: Sequence[tuple[str, int, bytes]],
    checksums: Mapping[str, int],
) -> dict[str, Any]:
    """The index a save commits: the ``weight_map``, and in its metadata the data's size, each
    tensor's CRC32 and each file's size and header (``files``: ``(name, size, encoded header)``),
    which loaders read instead of the files': one object per loading rank, not one or two per
    file."""
    return {
        "metadata": {
            "total_size": total_size,
            CHECKSUM_ALGORITHM_KEY: CHECKSUM_ALGORITHM,
            CHECKSUMS_KEY: {key: f"{checksums[key]:08x}" for key in sorted(checksums)},
            HEADERS_KEY: {
                name: {"size": size, "header": header[8:].decode("utf-8")}
                for name, size, header in files
            },
        },
        "weight_map": dict(sorted(weight_map.items())),
    }


def json_bytes(obj: object) -> bytes:
    """``obj`` as the index file's bytes: indented UTF-8 JSON and a newline."""
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
