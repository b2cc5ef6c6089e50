"""The write items of a conversion and reading their data: for ``dcp -> hf``, one item per
stored chunk of the DCP source (:func:`chunk_items`), loaded through DCP's own reader
(:class:`DcpChunks`); for ``hf -> dcp``, row slabs of each HF tensor (:func:`slab_items`)
packed into ``.distcp`` files (:func:`pack_files`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader

from ..format.geometry import element_size
from ..format.header import DTYPE_TO_NAME
from ..io import fsio
from .dcp_format import DcpSource, check_chunks
from .keymap import Renaming
from .progress import Progress

__all__ = [
    "DcpChunks",
    "StoredChunk",
    "cast_to",
    "check_data_files",
    "chunk_items",
    "item_bytes",
    "pack_files",
    "read_into",
    "row_slabs",
    "slab_items",
    "tensor_bytes",
]


class _Into:
    """The part of a ``LoadPlanner`` a storage reader calls for one tensor read: where it goes.

    Duck-typed on purpose: ``FileSystemReader`` and ``HFStorageReader`` call only these methods.
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.buffer

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the buffer is the result; nothing to hand on

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise RuntimeError(
            f"{read_item.storage_index.fqn!r}: only tensors are converted, yet a non-tensor was "
            "read"
        )


def read_into(reader: StorageReader, read_item: ReadItem, buffer: torch.Tensor) -> torch.Tensor:
    reader.read_data(LoadPlan([read_item]), cast(LoadPlanner, _Into(buffer))).wait()
    return buffer


@dataclass(frozen=True)
class StoredChunk:
    """Where one write item's data is in the DCP source: its key, chunk and stored dtype."""

    fqn: str
    chunk: ChunkStorageMetadata
    dtype: torch.dtype


def check_data_files(source: DcpSource, chunks: Iterable[StoredChunk]) -> None:
    """Every ``.distcp`` file holding a chunk to convert exists (one listing of the folder)."""
    storage = source.metadata.storage_data
    needed = {
        getattr(storage[MetadataIndex(c.fqn, c.chunk.offsets)], "relative_path", None)
        for c in chunks
    }
    missing = sorted(
        n for n in needed - set(fsio.list_names(source.fs, source.root)) if n is not None
    )
    if missing:
        raise FileNotFoundError(
            f"{source.url}: the .metadata places chunks in "
            f"{missing[:5]}{' and more' if len(missing) > 5 else ''}, which the folder lacks; the "
            "checkpoint is incomplete: copy the missing files, or re-save it"
        )


def cast_to(stored: torch.dtype, cast_dtype: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors take ``cast_dtype``; integer and bool tensors keep theirs."""
    return cast_dtype if cast_dtype is not None and stored.is_floating_point else stored


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * element_size(dtype)


def item_bytes(item: WriteItem) -> int:
    """Bytes of a write item's chunk in its planned dtype."""
    td = item.tensor_data
    assert td is not None  # every item we plan is a tensor chunk
    return tensor_bytes(td.chunk.sizes, td.properties.dtype)


class DcpChunks:
    """The planner ``HFStorageWriter.write_data`` reads from: ``resolve_data`` loads one stored
    chunk through DCP's own reader (the writer casts it to the planned dtype, slab by slab)."""

    def __init__(
        self, reader: StorageReader, chunks: Mapping[MetadataIndex, StoredChunk], progress: Progress
    ) -> None:
        self._reader = reader
        self._chunks = chunks
        self._progress = progress

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        stored = self._chunks[item.index]
        sizes = stored.chunk.sizes
        zeros = torch.Size([0] * len(sizes))
        read = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=item.index,
            dest_offsets=zeros,
            storage_index=MetadataIndex(stored.fqn, stored.chunk.offsets),
            storage_offsets=zeros,
            lengths=sizes,
        )
        tensor = read_into(self._reader, read, torch.empty(sizes, dtype=stored.dtype))
        self._progress.advance(item_bytes(item))
        return tensor


def chunk_items(
    tensors: Mapping[str, TensorStorageMetadata],
    renaming: Renaming,
    cast_dtype: torch.dtype | None,
    storage_data: Mapping[Any, Any],
    where: str,
) -> tuple[list[WriteItem], dict[MetadataIndex, StoredChunk]]:
    """One ``SHARD`` write item per stored chunk of every kept tensor, and where each one's data is.

    Raises:
        ValueError: dtypes safetensors cannot hold (all listed), chunks that do not tile their
            tensor or lack a storage entry, or no tensor left to convert.
    """
    if not renaming.targets:
        raise ValueError(
            f"{where}: nothing to convert: the checkpoint has no tensors, or key_mapping drops "
            "them all (non-tensor entries cannot be stored in safetensors)"
        )
    unsupported = {
        k: str(cast_to(tensors[k].properties.dtype, cast_dtype)).removeprefix("torch.")
        for k in renaming.targets
        if cast_to(tensors[k].properties.dtype, cast_dtype) not in DTYPE_TO_NAME
    }
    if unsupported:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_TO_NAME)
        raise ValueError(
            f"{where}: safetensors cannot hold the dtype of {unsupported} (it holds {supported}); "
            f"drop these keys with key_mapping {{key: null}}, or convert them some other way"
        )
    items: list[WriteItem] = []
    chunks: dict[MetadataIndex, StoredChunk] = {}
    for src_key, target in renaming.targets.items():
        md = tensors[src_key]
        check_chunks(src_key, md, storage_data, where)
        properties = TensorProperties(dtype=cast_to(md.properties.dtype, cast_dtype))
        for chunk in md.chunks:
            index = MetadataIndex(target, chunk.offsets)
            data = TensorWriteData(
                chunk=ChunkStorageMetadata(chunk.offsets, chunk.sizes),
                properties=properties,
                size=md.size,
            )
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
            chunks[index] = StoredChunk(src_key, chunk, md.properties.dtype)
    return items, chunks


def pack_files(items: list[WriteItem], limit: int) -> list[list[WriteItem]]:
    """Consecutive items in groups of at most ``limit`` bytes (an item larger alone) (pure)."""
    groups: list[list[WriteItem]] = []
    size = 0
    for item in items:
        nbytes = item_bytes(item)
        if not groups or size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def slab_items(
    stored: Mapping[str, TensorStorageMetadata],
    renaming: Renaming,
    cast_dtype: torch.dtype | None,
    limit: int,
) -> tuple[list[WriteItem], dict[str, TensorStorageMetadata]]:
    """Write items (row slabs) of every kept tensor, and each target key's DCP metadata."""
    items: list[WriteItem] = []
    state: dict[str, TensorStorageMetadata] = {}
    for src_key, target in renaming.targets.items():
        md = stored[src_key]
        dtype = cast_to(md.properties.dtype, cast_dtype)
        itemsize = max(element_size(dtype), element_size(md.properties.dtype))
        chunks = [
            ChunkStorageMetadata(torch.Size(o), torch.Size(s))
            for o, s in row_slabs(tuple(md.size), itemsize, limit)
        ]
        properties = TensorProperties(dtype=dtype)
        kind = WriteItemType.TENSOR if len(chunks) == 1 else WriteItemType.SHARD
        for chunk in chunks:
            data = TensorWriteData(chunk=chunk, properties=properties, size=md.size)
            items.append(
                WriteItem(index=MetadataIndex(target, chunk.offsets), type=kind, tensor_data=data)
            )
        state[target] = TensorStorageMetadata(properties, md.size, chunks)
    return items, state


def row_slabs(
    shape: tuple[int, ...], itemsize: int, limit: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of row slabs of at most ``limit`` bytes covering ``shape`` (pure).

    A 0-dim or empty tensor is one chunk, as ``dcp.save`` stores it; a row is never split.
    """
    if not shape or math.prod(shape) == 0:
        return [((0,) * len(shape), shape)]
    row_bytes = math.prod(shape[1:]) * itemsize
    step = max(1, limit // row_bytes)
    rest = (0,) * (len(shape) - 1)
    return [
        ((r0, *rest), (min(step, shape[0] - r0), *shape[1:])) for r0 in range(0, shape[0], step)
    ]
