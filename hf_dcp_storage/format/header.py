"""Safetensors header encoding and decoding: bytes in, bytes out, no file I/O.

The format (safetensors ``README.md``): an 8-byte little-endian ``u64`` N, then N bytes of
UTF-8 JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the end of the header) plus an optional string-to-string
``__metadata__``, padded with spaces so the data starts 8-byte aligned (or more: a reader
takes any amount of trailing whitespace); then the tensor data, row-major, little-endian, with
no holes between tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .strictjson import loads_strict

__all__ = [
    "DTYPE_TO_NAME",
    "MAX_HEADER_BYTES",
    "NAME_TO_DTYPE",
    "HeaderError",
    "TensorEntry",
    "decode_header",
    "dtype_name",
    "encode_header",
]

# Same cap as the safetensors reference implementation: a larger length prefix means a
# corrupt or hostile file, and we refuse it before allocating anything.
MAX_HEADER_BYTES = 100_000_000

_CANDIDATES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}
# Only the dtypes this torch build has: older builds lack the unsigned and float8 types.
NAME_TO_DTYPE: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _CANDIDATES.items() if hasattr(torch, attr)
}
DTYPE_TO_NAME: dict[torch.dtype, str] = {dtype: name for name, dtype in NAME_TO_DTYPE.items()}


class HeaderError(ValueError):
    """A safetensors header that is malformed, inconsistent with its file, or unsupported."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its name, dtype, shape and data byte range.

    ``begin``/``end`` are offsets relative to the start of the data section.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def dtype_name(dtype: torch.dtype, *, key: str | None = None) -> str:
    """Return the safetensors name of ``dtype``.

    Raises:
        ValueError: ``dtype`` has no safetensors equivalent (e.g. ``complex128``); the message
            names the key, the dtype and the supported set. Never falls back to a default.
    """
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        where = f" of {key!r}" if key is not None else ""
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_TO_NAME)
        raise ValueError(
            f"dtype {dtype}{where} cannot be stored in safetensors; supported dtypes are "
            f"{supported}. Cast the tensor (or pass save_dtype to HFSavePlanner) first."
        ) from None


def encode_header(
    entries: Iterable[TensorEntry], metadata: Mapping[str, str] | None = None, *, align: int = 8
) -> bytes:
    """Encode a complete header: length prefix, compact JSON, space padding to ``align`` bytes
    (a multiple of 8), so the data starts at a multiple of ``align``.

    Entries keep the given order (which is also the data order). With ``align=8`` the encoding
    matches what the safetensors library writes for the same names, order and metadata.

    Raises:
        ValueError: a dtype safetensors cannot store (``dtype_name``), or a name or metadata
            string UTF-8 cannot encode (a lone surrogate such as ``"\\ud800"``), named; or
            ``align`` not a positive multiple of 8.
    """
    if align <= 0 or align % 8:
        raise ValueError(
            f"encode_header(align={align}): the data's alignment must be a positive multiple of 8 "
            "(safetensors aligns to 8)"
        )
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {
            _utf8(k, "metadata key"): _utf8(v, f"metadata value of {k!r}")
            for k, v in metadata.items()
        }
    for e in entries:
        header[_utf8(e.name, "tensor name")] = {
            "dtype": dtype_name(e.dtype, key=e.name),
            "shape": list(e.shape),
            "data_offsets": [e.begin, e.end],
        }
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % align)
    return struct.pack("<Q", len(body)) + body


def _utf8(text: str, what: str) -> str:
    """``text``, checked to have a UTF-8 form (the header is UTF-8 JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{what} {text!r} holds a lone UTF-16 surrogate, which UTF-8 (the header's encoding) "
            "cannot encode; rename it to a valid Unicode string"
        ) from None
    return text


def header_length(prefix: bytes, *, file_size: int | None = None, where: str = "file") -> int:
    """Return N from the first 8 bytes of a safetensors file, after range checks."""
    if len(prefix) < 8:
        raise HeaderError(
            f"{where}: truncated, {len(prefix)} bytes is shorter than the 8-byte header length"
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(
            f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap; the file is "
            "corrupt"
        )
    if file_size is not None and 8 + n > file_size:
        raise HeaderError(
            f"{where}: header length {n} runs past the end of the {file_size}-byte file "
            "(truncated?)"
        )
    return n


def decode_header(
    raw: bytes, *, file_size: int | None = None, where: str = "file"
) -> tuple[list[TensorEntry], dict[str, str], int]:
    """Parse and validate the header at the start of ``raw`` (prefix + JSON, data optional).

    Args:
        raw: at least the first ``8 + N`` bytes of the file.
        file_size: the file's total size, to check that the data section fits.
        where: a name for error messages (the file's URL).

    Returns:
        ``(entries sorted by offset, metadata, data_start)`` where ``data_start = 8 + N``.

    Raises:
        HeaderError: truncated or oversize header, invalid JSON (or a name given twice in one
            object), ``__metadata__`` other than null or an object of strings, unknown dtype,
            shape and byte range disagreeing, overlapping or out-of-range offsets, holes, or
            data past EOF.
    """
    n = header_length(raw, file_size=file_size, where=where)
    if len(raw) < 8 + n:
        raise HeaderError(
            f"{where}: truncated, header needs {8 + n} bytes but only {len(raw)} are present"
        )
    parsed = _parse_json(raw[8 : 8 + n], where)
    if not isinstance(parsed, dict):
        raise HeaderError(f"{where}: header must be a JSON object, got {type(parsed).__name__}")
    metadata = parsed.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null is "no metadata"; 0, "" or [] are not
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderError(
            f"{where}: __metadata__ must map strings to strings, got {str(metadata)[:80]}"
        )
    entries = sorted(
        (_entry(name, spec, where) for name, spec in parsed.items()), key=lambda e: (e.begin, e.end)
    )
    _check_tiling(entries, file_size=file_size, data_start=8 + n, where=where)
    return entries, metadata, 8 + n


def _parse_json(body: bytes, where: str) -> object:
    """The header JSON decoded.

    Raises:
        HeaderError: not UTF-8, not JSON, a name given twice in one object (JSON would keep the
            last, another reader the first), or JSON Python will not build: an int of more than
            ``sys.get_int_max_str_digits()`` digits (``ValueError``), or nesting too deep to
            decode (``RecursionError``); a corrupt file, every time.
    """
    return loads_strict(
        body,
        duplicate=lambda name: HeaderError(
            f"{where}: header names {name!r} twice in one object; the file is corrupt: restore it "
            "from a copy or re-save"
        ),
        invalid=lambda exc: HeaderError(
            f"{where}: header is not valid UTF-8 JSON ({type(exc).__name__}: {str(exc)[:200]}); "
            "the file is corrupt"
        ),
    )


def _entry(name: str, spec: object, where: str) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise HeaderError(
            f"{where}: entry {name!r} must have exactly dtype, shape and data_offsets"
        )
    dtype = NAME_TO_DTYPE.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise HeaderError(
            f"{where}: tensor {name!r} has unsupported dtype {spec['dtype']!r}; known: "
            f"{', '.join(NAME_TO_DTYPE)}"
        )
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise HeaderError(f"{where}: tensor {name!r} has invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(f"{where}: tensor {name!r} has invalid data_offsets {offsets!r}")
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise HeaderError(
            f"{where}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but dtype "
            f"{spec['dtype']} and shape {shape} need {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_tiling(
    entries: list[TensorEntry], *, file_size: int | None, data_start: int, where: str
) -> None:
    """Sorted entries must tile ``[0, end)`` exactly and end inside the file."""
    pos = 0
    for e in entries:
        if e.begin != pos:
            kind = (
                "overlaps the previous tensor" if e.begin < pos else f"leaves a hole at byte {pos}"
            )
            raise HeaderError(
                f"{where}: tensor {e.name!r} at data_offsets [{e.begin}, {e.end}] {kind}"
            )
        pos = e.end
    if file_size is not None and data_start + pos > file_size:
        raise HeaderError(
            f"{where}: tensor data ends at byte {data_start + pos} but the file has {file_size} "
            "bytes (truncated)"
        )
