"""A load's DCP metadata from an HF checkpoint's index and headers: one whole-tensor chunk per
key, and where each tensor's bytes are (``Stored``, ``Metadata.storage_data``); quantized weights
presented dequantized where the load asks (``dequantize``). Pure: headers in, metadata out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ..format.header import TensorEntry
from ..format.index import INDEX_NAME
from ..format.quantscheme import Quantized, quantized_tensors

__all__ = ["Stored", "dequantize", "load_metadata"]


@dataclass(frozen=True)
class Stored:
    """``Metadata.storage_data`` value: where one whole tensor's bytes are."""

    file: str
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    key: str = ""
    crc: int | None = None  # CRC32 the index records for the tensor's bytes, if any
    quant: Quantized | None = None  # how it dequantizes, where the load dequantizes


def load_metadata(
    weight_map: Mapping[str, str],
    headers: Mapping[str, tuple[Mapping[str, TensorEntry], int]],
    checksums: Mapping[str, int] | None,
    *,
    verify: bool,
    url_of: Callable[[str], str],
) -> tuple[dict[str, TensorStorageMetadata], dict[str, Stored]]:
    """``(state_dict_metadata, storage_data)`` of the tensors ``weight_map`` (key -> file) names,
    from each file's ``headers`` (``(entries by name, data start)``); ``url_of(name)``: a file's
    URL, for errors.

    Raises:
        ValueError: the index maps a key to a file whose header lacks it; with ``verify``, a key
            the index records no checksum for.
    """
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[str, Stored] = {}
    # Few objects per tensor (one size, zero offsets and properties shared where equal): at
    # thousands of tensors they are what pushes a process into a full garbage collection,
    # which costs ~0.5 us per live object of the whole process (0.15 s with torch imported).
    zeros: dict[int, torch.Size] = {}
    properties: dict[torch.dtype, TensorProperties] = {}
    for key, file in weight_map.items():
        entries, data_start = headers[file]
        entry = entries.get(key)
        if entry is None:
            raise ValueError(
                f"{url_of(file)}: the index maps {key!r} to this file, but its header has no such "
                "tensor"
            )
        ndim, shape = len(entry.shape), torch.Size(entry.shape)
        props = properties.get(entry.dtype) or properties.setdefault(
            entry.dtype, TensorProperties(dtype=entry.dtype)
        )
        if ndim not in zeros:
            zeros[ndim] = torch.Size([0] * ndim)
        state[key] = TensorStorageMetadata(props, shape, [ChunkStorageMetadata(zeros[ndim], shape)])
        crc = checksums.get(key) if checksums is not None else None
        if verify and crc is None:
            raise ValueError(
                f"{url_of(INDEX_NAME)}: verify=True, but the index records no checksum for {key!r}"
            )
        # Keyed by name: each tensor is one chunk at the origin, so the name says which.
        storage[key] = Stored(file, data_start + entry.begin, entry.dtype, entry.shape, key, crc)
    return state, storage


def dequantize(
    state: dict[str, TensorStorageMetadata],
    storage: dict[str, Stored],
    dtype: torch.dtype,
    block: tuple[int, int],
) -> None:
    """Present each quantized weight of ``storage`` as dequantized, in place: ``dtype`` and its
    dequantized shape in ``state``, how it dequantizes in ``storage`` (``format/quantscheme.py``).

    Raises:
        ValueError: a quantized tensor that does not dequantize, naming it.
    """
    found = quantized_tensors({k: (s.dtype, s.shape) for k, s in storage.items()}, block)
    props = TensorProperties(dtype=dtype)
    for key, quant in found.items():
        shape = torch.Size(quant.shape)
        origin = torch.Size([0] * len(shape))
        state[key] = TensorStorageMetadata(props, shape, [ChunkStorageMetadata(origin, shape)])
        storage[key] = dataclasses.replace(storage[key], quant=quant)
