"""Safetensors header encoding/decoding: exact bytes, alignment, round trip, malformed input."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as st_save

from hf_dcp_storage.format.header import (
    MAX_HEADER_BYTES,
    NAME_TO_DTYPE,
    HeaderError,
    TensorEntry,
    decode_header,
    dtype_name,
    encode_header,
)


def _raw(header: dict, data: bytes = b"", pad: bool = True) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body + data


def test_exact_bytes_match_safetensors_reference() -> None:
    # Same bytes as safetensors' own test_simple.py case for {"test": zeros((2, 2), int32)}.
    entries = [TensorEntry("test", torch.int32, (2, 2), 0, 16)]
    expected = (
        b"@\x00\x00\x00\x00\x00\x00\x00"
        b'{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}    '
    )
    assert encode_header(entries) == expected
    assert encode_header(entries) + bytes(16) == st_save(
        {"test": torch.zeros((2, 2), dtype=torch.int32)}
    )


def test_exact_bytes_with_metadata_match_safetensors() -> None:
    tensors = {"a.bias": torch.arange(3, dtype=torch.float32), "b.weight": torch.ones(2, 5)}
    entries, pos = [], 0
    for name, t in tensors.items():
        entries.append(TensorEntry(name, t.dtype, tuple(t.shape), pos, pos + t.numel() * 4))
        pos += t.numel() * 4
    data = b"".join(t.numpy().tobytes() for t in tensors.values())
    assert encode_header(entries, {"format": "pt"}) + data == st_save(
        tensors, metadata={"format": "pt"}
    )


@pytest.mark.parametrize("name", ["a", "ab", "abc" * 7, "ünïcødé.weight", "x" * 100])
def test_header_is_8_byte_aligned_and_round_trips(name: str) -> None:
    entries = [
        TensorEntry(name, torch.bfloat16, (3, 1), 0, 6),
        TensorEntry("z", torch.bool, (), 6, 7),
    ]
    raw = encode_header(entries, {"format": "pt"})
    assert len(raw) % 8 == 0
    decoded, metadata, data_start = decode_header(raw + bytes(7))
    assert decoded == entries
    assert metadata == {"format": "pt"}
    assert data_start == len(raw)


def test_every_dtype_round_trips() -> None:
    entries, pos = [], 0
    for name, dtype in NAME_TO_DTYPE.items():
        size = torch.empty((), dtype=dtype).element_size() * 6
        entries.append(TensorEntry(f"t_{name}", dtype, (2, 3), pos, pos + size))
        pos += size
    decoded, _, _ = decode_header(encode_header(entries) + bytes(pos))
    assert decoded == entries


def test_unknown_dtype_names_key_dtype_and_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"dtype torch.complex128 of 'w' cannot be stored in safetensors; supported dtypes "
        r"are .*bfloat16.*save_dtype",
    ):
        dtype_name(torch.complex128, key="w")


ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x10\x00\x00", r"truncated, 3 bytes is shorter than the 8-byte header length"),
        (
            struct.pack("<Q", MAX_HEADER_BYTES + 1),
            r"header length 100000001 exceeds the 100000000-byte cap",
        ),
        (struct.pack("<Q", 64) + b"{}", r"header length 64 runs past the end of the 10-byte file"),
        (struct.pack("<Q", 8) + b"not json", r"header is not valid UTF-8 JSON"),
        (_raw([1, 2]), r"header must be a JSON object, got list"),
        (
            _raw({"t": {**ENTRY, "dtype": "F128"}}, bytes(8)),
            r"tensor 't' has unsupported dtype 'F128'",
        ),
        (_raw({"t": {**ENTRY, "shape": [-2]}}, bytes(8)), r"tensor 't' has invalid shape \[-2\]"),
        (
            _raw({"t": {**ENTRY, "data_offsets": [8, 0]}}, bytes(8)),
            r"invalid data_offsets \[8, 0\]",
        ),
        (
            _raw({"t": {**ENTRY, "shape": [3]}}, bytes(8)),
            r"spans 8 bytes but dtype F32 and shape \[3\] need 12",
        ),
        (
            _raw({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)),
            r"entry 't' must have exactly dtype, shape and data_offsets",
        ),
        (
            _raw({"a": ENTRY, "b": {**ENTRY, "data_offsets": [4, 12]}}, bytes(12)),
            r"tensor 'b' at data_offsets \[4, 12\] overlaps",
        ),
        (
            _raw({"a": ENTRY, "b": {**ENTRY, "data_offsets": [12, 20]}}, bytes(20)),
            r"tensor 'b' at data_offsets \[12, 20\] leaves a hole at byte 8",
        ),
        (
            _raw({"t": ENTRY}, bytes(5)),
            r"tensor data ends at byte \d+ but the file has \d+ bytes \(truncated\)",
        ),
        (_raw({"__metadata__": {"format": 1}}), r"__metadata__ must map strings to strings"),
    ],
    ids=[
        "short-prefix",
        "oversize",
        "past-eof",
        "bad-json",
        "not-object",
        "dtype",
        "shape",
        "offsets",
        "size-mismatch",
        "keys",
        "overlap",
        "hole",
        "truncated-data",
        "metadata",
    ],
)
def test_malformed_headers_are_rejected_with_clear_messages(raw: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message) as info:
        decode_header(raw, file_size=len(raw), where="f.safetensors")
    assert str(info.value).startswith("f.safetensors: ")


@pytest.mark.parametrize("align", [4096, 64])
def test_a_wider_alignment_pads_the_same_json_to_it(align: int) -> None:
    entries = [TensorEntry("w", torch.float32, (2, 2), 0, 16)]
    raw = encode_header(entries, align=align)
    assert len(raw) % align == 0
    assert raw[8:].rstrip(b" ") == encode_header(entries)[8:].rstrip(b" ")
    assert decode_header(raw + bytes(16))[2] == len(raw)


@pytest.mark.parametrize("align", [0, 12, -8])
def test_an_alignment_safetensors_cannot_take_is_refused_naming_it(align: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"encode_header\(align={align}\): the data's alignment must be a positive multiple "
        r"of 8",
    ):
        encode_header([], align=align)
