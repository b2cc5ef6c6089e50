"""Deterministic test tensors and checks shared by the distributed and transformers tests.

Every tensor is a pure function of its key name (the seed is ``crc32(name)``), so each rank,
each world size and the checking process rebuild exactly the same originals.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

__all__ = [
    "ALL_DTYPES",
    "DTYPE_IDS",
    "assert_same",
    "assert_same_files",
    "check_all",
    "folder_bytes",
    "random_tensor",
    "read_checkpoint",
    "same",
]


def _dtypes() -> list[torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "float8_e4m3fn", "float8_e5m2",
        "uint16", "uint32", "uint64",
    ]  # fmt: skip
    # uint16/32/64 and the float8 types exist only in newer torch builds.
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


ALL_DTYPES: list[torch.dtype] = _dtypes()
DTYPE_IDS: list[str] = [str(d).removeprefix("torch.") for d in ALL_DTYPES]


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A contiguous tensor of ``shape``/``dtype`` that depends only on ``seed``.

    Floats are normal samples (scaled so float8 uses its range, never NaN/inf); bool is 0/1;
    integers are random raw bytes, so every bit (sign bit, high bits of uint64) is exercised.
    """
    n = math.prod(shape)
    # Tests fill destinations with zeros before loading: an all-zero original (likely for a
    # 0-dim bool) could not reveal a missed read, so such draws are redrawn with the next seed.
    for attempt in range(64):
        out = _draw(n, dtype, seed + attempt).reshape(shape)
        if n == 0 or bool(_bytes(out).any()):
            return out
    raise AssertionError(f"no non-zero {dtype}{list(shape)} drawn from seed {seed}")


def _draw(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        src = torch.float64 if dtype == torch.float64 else torch.float32
        return (torch.randn(n, generator=g, dtype=src) * 4).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).to(torch.bool)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8).view(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements' raw bytes in row-major order (works for every dtype, 0-dim and views)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern (``torch.equal`` lacks float8/uint kernels on CPU)."""
    return (
        actual.dtype == expected.dtype
        and tuple(actual.shape) == tuple(expected.shape)
        and torch.equal(_bytes(actual), _bytes(expected))
    )


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, (
        f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    )
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}"
    )
    if not torch.equal(_bytes(actual), _bytes(expected)):
        diff = int((_bytes(actual) != _bytes(expected)).sum())
        raise AssertionError(
            f"{what}: {diff} of {_bytes(expected).numel()} bytes differ "
            f"({actual.dtype}{list(actual.shape)})"
        )


def read_checkpoint(folder: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of an HF sharded checkpoint, read with ``safetensors`` itself, and its index.

    Checks that the index and the files agree: each key sits in the file the index names,
    no file holds a key the index lacks, and ``total_size`` counts exactly the tensor bytes.
    """
    folder = Path(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        for key, t in load_file(str(folder / file)).items():
            assert weight_map.get(key) == file, (
                f"{file} holds {key!r}, but the index maps it to {weight_map.get(key)!r}"
            )
            assert key not in tensors, f"{key!r} is stored twice"
            tensors[key] = t
    assert set(tensors) == set(weight_map), (
        f"index keys missing from the files: {sorted(set(weight_map) - set(tensors))}"
    )
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total, (
        f"index total_size {index['metadata']['total_size']} != {total}"
    )
    assert_checksums(index, tensors)
    return tensors, index


def tensor_crc32(t: torch.Tensor) -> str:
    """``zlib.crc32`` of a tensor's bytes in row-major order, as the index writes it (8 hex
    digits)."""
    return f"{zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()):08x}"


def headers_of(files: Mapping[str, bytes]) -> dict[str, dict]:
    """``metadata.headers`` as the index should record it, from the files' own bytes: each
    ``.safetensors`` file's size and its header JSON (after the 8-byte length)."""
    out = {}
    for name, data in sorted(files.items()):
        if name.endswith(".safetensors"):
            n = struct.unpack("<Q", data[:8])[0]
            out[name] = {"size": len(data), "header": data[8 : 8 + n].decode()}
    return out


def assert_checksums(index: dict, tensors: Mapping[str, torch.Tensor]) -> None:
    """The index records, for every key, the CRC32 of exactly the bytes the file holds."""
    meta = index["metadata"]
    assert meta["checksum_algorithm"] == "crc32"
    expected = {key: tensor_crc32(t) for key, t in tensors.items()}
    assert meta["checksums"] == expected, {
        k: (meta["checksums"].get(k), v)
        for k, v in expected.items()
        if meta["checksums"].get(k) != v
    }


def folder_bytes(folder: str | os.PathLike[str]) -> dict[str, bytes]:
    """``relative path -> content`` of every file under ``folder`` (sub-folders included)."""
    folder = Path(folder)
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def assert_same_files(
    actual_folder: str | os.PathLike[str], expected_folder: str | os.PathLike[str]
) -> None:
    """The two folders hold the same file names with byte-identical contents."""
    actual, expected = folder_bytes(actual_folder), folder_bytes(expected_folder)
    assert sorted(actual) == sorted(expected), (
        f"{actual_folder} has files {sorted(actual)}, expected {sorted(expected)}"
    )
    differ = [name for name in expected if actual[name] != expected[name]]
    assert not differ, f"{actual_folder}: these files differ from {expected_folder}: {differ}"


def check_all(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], where: str
) -> list[str]:
    """Mismatch messages (empty when equal): same key set, and every tensor the same bits."""
    problems = []
    if set(actual) != set(expected):
        problems.append(
            f"{where}: keys missing {sorted(set(expected) - set(actual))}, unexpected "
            f"{sorted(set(actual) - set(expected))}"
        )
    for key in sorted(set(actual) & set(expected)):
        try:
            assert_same(actual[key], expected[key], f"{where}: {key!r}")
        except AssertionError as exc:
            problems.append(str(exc))
    return problems
