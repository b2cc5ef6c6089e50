"""PyTorch DCP's own checkpoint format, for ``hf-dcp convert``: open and check a ``.distcp``
checkpoint, read its chunks, and write one with DCP's own writers.

DCP's default format is what ``dcp.save`` writes through ``FileSystemWriter`` / ``FsspecWriter``:
``__<rank>_<n>.distcp`` files of ``torch.save``d chunks plus a pickled ``.metadata``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from ..format.header import DTYPE_TO_NAME
from ..format.index import INDEX_NAME, SINGLE_FILE_NAME
from ..io import fsio
from ..plan.layout import element_size
from .keymap import Renaming
from .progress import Progress

try:  # torch >= 2.15: the public module (the private one warns that it is deprecated)
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # torch 2.13, 2.14
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

__all__ = [
    "FsspecReader",
    "FsspecWriter",
    "DCP_METADATA_NAME",
    "DISTCP_RE",
    "StoredChunk",
    "DcpSource",
    "open_dcp",
    "read_into",
    "check_data_files",
    "describe_non_dcp",
    "check_chunks",
    "distcp_order",
    "check_bucket",
    "uncommit_dcp",
    "dcp_writer",
    "cast_to",
    "DcpChunks",
    "chunk_items",
    "pack_files",
    "slab_items",
    "row_slabs",
    "tensor_bytes",
    "item_bytes",
]

# DCP's commit marker: the pickled ``Metadata`` that ``FileSystemWriter.finish`` writes last.
DCP_METADATA_NAME = ".metadata"
# Data files FileSystemWriter names ``__<rank>_<n>.distcp``; an overwrite removes stale ones.
DISTCP_RE = re.compile(r"^__\d+_\d+\.distcp$")


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
        raise RuntimeError(f"{read_item.storage_index.fqn!r}: only tensors are converted, yet a non-tensor was read")


def read_into(reader: StorageReader, read_item: ReadItem, buffer: torch.Tensor) -> torch.Tensor:
    reader.read_data(LoadPlan([read_item]), cast(LoadPlanner, _Into(buffer))).wait()
    return buffer


@dataclass(frozen=True)
class StoredChunk:
    """Where one write item's data is in the DCP source: its key, chunk and stored dtype."""

    fqn: str
    chunk: ChunkStorageMetadata
    dtype: torch.dtype


@dataclass(frozen=True)
class DcpSource:
    """A DCP source, opened: DCP's own reader set up with the validated metadata."""

    reader: StorageReader
    metadata: Metadata
    fs: AbstractFileSystem
    root: str
    url: str


def open_dcp(src: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> DcpSource:
    """DCP's own reader for ``src`` (``FileSystemReader`` on local disk, ``FsspecReader`` else).

    Raises:
        FileNotFoundError: no ``.metadata`` (the message says what the folder holds instead).
        ValueError: a ``.metadata`` that cannot be unpickled, or not one of DCP's file format.
    """
    fs, root = fsio.resolve(src, storage_options)
    where = fsio.url_of(fs, root)
    if not fsio.exists(fs, fsio.join(root, DCP_METADATA_NAME)):
        raise FileNotFoundError(f"{where} is not a DCP checkpoint: {describe_non_dcp(fs, root)}")
    # FileSystemReader takes a plain path (it would mangle file://); anything else goes through fsspec.
    reader: StorageReader
    if fsio.is_local(fs):
        reader = FileSystemReader(root)
    else:
        reader = FsspecReader(os.fspath(src), **(storage_options or {}))
    try:
        metadata = reader.read_metadata()
    except OSError:
        raise
    except Exception as exc:  # unpickling untrusted bytes can raise almost anything
        raise ValueError(
            f"{where}/{DCP_METADATA_NAME} cannot be unpickled ({type(exc).__name__}: {exc}); it is corrupt, "
            f"or was written by an incompatible torch version: re-save it, or convert with the torch that wrote it"
        ) from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, Mapping):
        raise ValueError(f"{where}/{DCP_METADATA_NAME} holds a {type(metadata).__name__}, not DCP checkpoint Metadata")
    if not isinstance(metadata.storage_data, Mapping):
        raise ValueError(
            f"{where}/{DCP_METADATA_NAME} has no per-chunk storage table; only checkpoints written by DCP's "
            f"FileSystemWriter or FsspecWriter (dcp.save's default) can be converted"
        )
    reader.set_up_storage_reader(metadata, True)
    return DcpSource(reader, metadata, fs, root, where)


def check_data_files(source: DcpSource, chunks: Iterable[StoredChunk]) -> None:
    """Every ``.distcp`` file holding a chunk to convert exists (one listing of the folder)."""
    storage = source.metadata.storage_data
    needed = {getattr(storage[MetadataIndex(c.fqn, c.chunk.offsets)], "relative_path", None) for c in chunks}
    missing = sorted(n for n in needed - set(fsio.list_names(source.fs, source.root)) if n is not None)
    if missing:
        raise FileNotFoundError(
            f"{source.url}: the .metadata places chunks in {missing[:5]}{' and more' if len(missing) > 5 else ''}, "
            f"which the folder lacks; the checkpoint is incomplete: copy the missing files, or re-save it"
        )


def describe_non_dcp(fs: AbstractFileSystem, root: str) -> str:
    """What ``root`` holds instead of a DCP checkpoint, and what to pass instead."""
    names = sorted(fsio.list_names(fs, root))
    if not names:
        return "the folder does not exist or is empty; pass the folder dcp.save wrote (the one holding .metadata)"
    if INDEX_NAME in names or SINGLE_FILE_NAME in names:
        return "it is a Hugging Face safetensors checkpoint; convert it the other way with convert_hf_to_dcp"
    if any(n.endswith(".distcp") for n in names):
        rank_local = [n for n in names if n.endswith(DCP_METADATA_NAME)]
        return (
            f"it has .distcp files but no {DCP_METADATA_NAME}: the save did not finish"
            + (f" (or was saved without collectives, as {rank_local[:3]}, which cannot be converted)" if rank_local else "")
        )
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return f"it has no {DCP_METADATA_NAME} (found: {shown}); pass the folder dcp.save wrote"


def check_chunks(fqn: str, md: TensorStorageMetadata, storage_data: Mapping[Any, Any], where: str) -> None:
    """The stored chunks of ``fqn`` lie inside it, tile it exactly and each have stored bytes."""
    shape = tuple(md.size)
    held = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)
        ):
            raise ValueError(
                f"{where}: {fqn!r} has a chunk at {list(offsets)} of size {list(sizes)} outside its shape "
                f"{list(shape)}; the .metadata is corrupt"
            )
        if MetadataIndex(fqn, offsets) not in storage_data:
            raise ValueError(
                f"{where}: {fqn!r} lists a chunk at {list(offsets)} whose bytes the .metadata does not locate; it is corrupt"
            )
        held += math.prod(sizes)
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    if held != math.prod(shape) or overlapping(boxes):
        raise ValueError(
            f"{where}: the stored chunks of {fqn!r} do not cover its shape {list(shape)} exactly once "
            f"({held} of {math.prod(shape)} elements); the checkpoint is incomplete or corrupt and cannot be converted"
        )


def overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether any two non-empty boxes intersect (sorted by their first dim, so row shards cost O(n))."""
    if boxes and not boxes[0][0]:  # 0-dim: every chunk is the whole tensor
        return len(boxes) > 1
    boxes = sorted(boxes)
    for i, (off_a, size_a) in enumerate(boxes):
        for off_b, size_b in boxes[i + 1 :]:
            if off_b[0] >= off_a[0] + size_a[0]:
                break
            if all(ob < oa + na and oa < ob + nb for oa, na, ob, nb in zip(off_a, size_a, off_b, size_b)):
                return True
    return False


def distcp_order(name: str) -> tuple[int, ...]:
    """``__12_0.distcp`` after ``__2_0.distcp``."""
    return tuple(int(n) for n in re.findall(r"\d+", name))


def check_bucket(fs: AbstractFileSystem, root: str) -> None:
    """On S3, refuse a missing bucket: DCP's writer would create it (``makedirs``)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "s3" not in protocols:
        return
    bucket = root.split("/", 1)[0]
    if not fsio.exists(fs, bucket):
        raise FileNotFoundError(f"s3://{bucket} does not exist; create the bucket first (it is never created for you)")


def uncommit_dcp(fs: AbstractFileSystem, root: str) -> None:
    """Remove a DCP checkpoint's ``.metadata`` (its commit marker) first, then its data files."""
    fsio.remove(fs, fsio.join(root, DCP_METADATA_NAME))
    stale = [n for n in fsio.list_names(fs, root) if DISTCP_RE.match(n) or n == DCP_METADATA_NAME + ".tmp"]
    fsio.remove_many(fs, [fsio.join(root, n) for n in stale])


def dcp_writer(
    dst: str | os.PathLike[str], fs: AbstractFileSystem, root: str, storage_options: dict[str, Any] | None
) -> StorageWriter:
    """DCP's writer for ``dst``: ``FileSystemWriter`` on local disk, ``FsspecWriter`` elsewhere.

    One file per plan, written by the calling thread (``thread_count=1``; we run plans side by
    side). ``per_thread_copy_ahead=0``: no read-ahead of slabs, which is for GPU tensors and
    would only hold more in memory. ``overwrite=True``: our own check and un-commit already ran.
    """
    if fsio.is_local(fs):
        return FileSystemWriter(
            root, single_file_per_rank=True, sync_files=True, thread_count=1, per_thread_copy_ahead=0, overwrite=True
        )
    # sync_files=False: an fsspec stream has no fileno, and DCP then falls back to os.sync() of
    # the whole machine; closing the stream is what commits an object.
    return FsspecWriter(
        os.fspath(dst), single_file_per_rank=True, sync_files=False, thread_count=1, per_thread_copy_ahead=0,
        overwrite=True, **(storage_options or {}),
    )  # fmt: skip


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

    def __init__(self, reader: StorageReader, chunks: Mapping[MetadataIndex, StoredChunk], progress: Progress) -> None:
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
            f"{where}: nothing to convert: the checkpoint has no tensors, or key_mapping drops them all "
            f"(non-tensor entries cannot be stored in safetensors)"
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
            data = TensorWriteData(chunk=ChunkStorageMetadata(chunk.offsets, chunk.sizes), properties=properties, size=md.size)
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
    stored: Mapping[str, TensorStorageMetadata], renaming: Renaming, cast_dtype: torch.dtype | None, limit: int
) -> tuple[list[WriteItem], dict[str, TensorStorageMetadata]]:
    """Write items (row slabs) of every kept tensor, and each target key's DCP metadata."""
    items: list[WriteItem] = []
    state: dict[str, TensorStorageMetadata] = {}
    for src_key, target in renaming.targets.items():
        md = stored[src_key]
        dtype = cast_to(md.properties.dtype, cast_dtype)
        itemsize = max(element_size(dtype), element_size(md.properties.dtype))
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in row_slabs(tuple(md.size), itemsize, limit)]
        properties = TensorProperties(dtype=dtype)
        kind = WriteItemType.TENSOR if len(chunks) == 1 else WriteItemType.SHARD
        for chunk in chunks:
            data = TensorWriteData(chunk=chunk, properties=properties, size=md.size)
            items.append(WriteItem(index=MetadataIndex(target, chunk.offsets), type=kind, tensor_data=data))
        state[target] = TensorStorageMetadata(properties, md.size, chunks)
    return items, state


def row_slabs(shape: tuple[int, ...], itemsize: int, limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of row slabs of at most ``limit`` bytes covering ``shape`` (pure).

    A 0-dim or empty tensor is one chunk, as ``dcp.save`` stores it; a row is never split.
    """
    if not shape or math.prod(shape) == 0:
        return [((0,) * len(shape), shape)]
    row_bytes = math.prod(shape[1:]) * itemsize
    step = max(1, limit // row_bytes)
    rest = (0,) * (len(shape) - 1)
    return [((r0, *rest), (min(step, shape[0] - r0), *shape[1:])) for r0 in range(0, shape[0], step)]
