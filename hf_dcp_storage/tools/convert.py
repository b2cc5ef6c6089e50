"""Convert between PyTorch DCP's default checkpoint format and consolidated HF safetensors.

DCP's default format is what ``dcp.save`` writes through ``FileSystemWriter`` / ``FsspecWriter``:
``__<rank>_<n>.distcp`` files of ``torch.save``d chunks plus a pickled ``.metadata``. The HF
format is ours: ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``.

Neither direction re-implements a format. Each drives the destination's DCP storage writer
through its own call sequence, in this one process and without a process group, as DCP does on
a lone coordinator rank::

    set_up_storage_writer(True) -> prepare_local_plan -> prepare_global_plan -> write_data -> finish

The plan's write items are chunks of the source, and the "planner" handed to ``write_data``
loads each chunk through the source's DCP storage reader only when the writer asks for it, so a
few chunks are in memory at a time, whatever the checkpoint's size. Each writer's guarantees
come with it: for HF the per-tensor CRC32s, the index written last and the refusal to replace
a complete checkpoint; for DCP exactly the files ``dcp.load`` reads.

Keys can be renamed or dropped on the way (:class:`KeyMapping`), and floating-point tensors cast.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ..format.header import DTYPE_TO_NAME
from ..format.index import INDEX_NAME, SINGLE_FILE_NAME
from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.layout import element_size
from ..reader import HFStorageReader
from ..writer import HFStorageWriter
from .keymap import KeyMapping, KeyMappingError, Renaming, load_key_mapping
from .progress import NO_PROGRESS, Progress

__all__ = [
    "ConvertReport",
    "KeyMapping",
    "KeyMappingError",
    "Renaming",
    "load_key_mapping",
    "parse_dtype",
    "convert_dcp_to_hf",
    "convert_hf_to_dcp",
    "DCP_METADATA_NAME",
    "HF_TO_DCP_CHUNK_BYTES",
]

# DCP's commit marker: the pickled ``Metadata`` that ``FileSystemWriter.finish`` writes last.
DCP_METADATA_NAME = ".metadata"
# hf -> dcp: tensors are stored as row slabs of at most this many bytes (one DCP chunk each),
# packed into .distcp files of at most this many bytes. DCP's writer keeps every tensor of a
# file in memory until the file is closed, so this bounds memory per writer thread.
HF_TO_DCP_CHUNK_BYTES = 64 << 20
# Data files FileSystemWriter names ``__<rank>_<n>.distcp``; an overwrite removes stale ones.
_DISTCP_RE = re.compile(r"^__\d+_\d+\.distcp$")


def _as_key_mapping(key_mapping: str | os.PathLike[str] | Mapping[str, str | None] | KeyMapping | None) -> KeyMapping:
    return KeyMapping({}) if key_mapping is None else load_key_mapping(key_mapping)


# -- dtype ------------------------------------------------------------------------------------

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating-point dtype to cast to: ``None``, a ``torch.dtype``, or a name like ``"bf16"``.

    Raises:
        ValueError: an unknown name (the message lists the accepted ones), or a dtype that is not
            floating point or that safetensors cannot hold.
    """
    if dtype is None:
        return None
    if isinstance(dtype, str):
        found = _DTYPE_NAMES.get(dtype.strip().lower().removeprefix("torch."))
        if found is None:
            raise ValueError(f"dtype={dtype!r} is not a known dtype; pass one of {', '.join(_DTYPE_NAMES)} (or a torch.dtype)")
        return found
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in DTYPE_TO_NAME:
        raise ValueError(
            f"dtype={dtype!r} must be a floating-point dtype that safetensors holds, such as torch.bfloat16; "
            f"only floating-point tensors are cast, integer and bool tensors keep their dtype"
        )
    return dtype


def _cast_to(stored: torch.dtype, cast_dtype: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors take ``cast_dtype``; integer and bool tensors keep theirs."""
    return cast_dtype if cast_dtype is not None and stored.is_floating_point else stored


# -- report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion did.

    ``tensors``: tensors written. ``bytes``: their bytes in the saved dtypes (the index's
    ``total_size`` for HF; DCP adds ``torch.save`` framing on top). ``files``: the output files'
    names inside ``dst``, data files then the commit marker. ``skipped``: source keys not
    converted (non-tensor DCP entries, keys mapped to null), in source order.
    ``unused_rules``: key-mapping rules that matched no tensor. ``seconds``: wall time.
    """

    tensors: int
    bytes: int
    files: tuple[str, ...]
    skipped: tuple[str, ...]
    seconds: float
    unused_rules: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


# -- the shared driving code ------------------------------------------------------------------


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


def _read_into(reader: StorageReader, read_item: ReadItem, buffer: torch.Tensor) -> torch.Tensor:
    reader.read_data(LoadPlan([read_item]), cast(LoadPlanner, _Into(buffer))).wait()
    return buffer


def _save_with(
    writer: StorageWriter, plans: list[list[WriteItem]], planner: object, metadata: Metadata, threads: int = 1
) -> list[list[WriteResult]]:
    """Run ``writer``'s save sequence in this process, as DCP does for ``len(plans)`` ranks.

    Each list of items is one rank's plan; this process plays every rank (``write_data`` of up
    to ``threads`` plans at once) and the coordinator. ``planner`` needs only
    ``resolve_data(item) -> tensor``, all that ``write_data`` calls.
    """
    writer.set_up_storage_writer(True)
    local = [writer.prepare_local_plan(SavePlan(items)) for items in plans]
    global_plans = writer.prepare_global_plan(local)
    save_planner = cast(SavePlanner, planner)
    results = parallel_map(lambda plan: writer.write_data(plan, save_planner).wait(), global_plans, threads)
    writer.finish(metadata, results)
    return results


def _refuse_existing(fs: AbstractFileSystem, root: str, markers: Sequence[str], what: str) -> None:
    """Raise if ``root`` holds a complete checkpoint (one of its commit ``markers``)."""
    found = [m for m in markers if fsio.exists(fs, fsio.join(root, m))]
    if found:
        raise FileExistsError(
            f"{fsio.url_of(fs, root)} already holds {what} ({', '.join(found)}); pass overwrite=True to "
            f"replace it, or convert to a new path"
        )


def _tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * element_size(dtype)


def _item_bytes(item: WriteItem) -> int:
    """Bytes of a write item's chunk in its planned dtype."""
    td = item.tensor_data
    assert td is not None  # every item we plan is a tensor chunk
    return _tensor_bytes(td.chunk.sizes, td.properties.dtype)


# -- dcp -> hf --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StoredChunk:
    """Where one write item's data is in the DCP source: its key, chunk and stored dtype."""

    fqn: str
    chunk: ChunkStorageMetadata
    dtype: torch.dtype


class _DcpChunks:
    """The planner ``HFStorageWriter.write_data`` reads from: ``resolve_data`` loads one stored
    chunk through DCP's own reader (the writer casts it to the planned dtype, slab by slab)."""

    def __init__(self, reader: StorageReader, chunks: Mapping[MetadataIndex, _StoredChunk], progress: Progress) -> None:
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
        tensor = _read_into(self._reader, read, torch.empty(sizes, dtype=stored.dtype))
        self._progress.advance(_item_bytes(item))
        return tensor


def convert_dcp_to_hf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    key_mapping: str | os.PathLike[str] | Mapping[str, str | None] | KeyMapping | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    thread_count: int = 4,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """Convert a DCP checkpoint (``.distcp`` + ``.metadata``) into a consolidated HF checkpoint.

    Every stored chunk of the source becomes one write item of an :class:`HFStorageWriter`
    save, so the output is exactly what a distributed save of the same tensors writes:
    consolidated files split at ``max_shard_size``, a CRC32 per tensor in the index, and the
    index written last (a failure leaves no index; converting again replaces the leftovers).
    Non-tensor entries (``BytesStorageMetadata``, such as a step counter saved as a Python int)
    cannot go into safetensors: they are skipped and listed in ``ConvertReport.skipped``.

    Memory: DCP's reader loads a whole stored chunk per read (``torch.load`` of its slice) and
    copies it into a buffer, and up to ``thread_count`` chunks are in flight, so the extra memory
    is about ``thread_count x 2 x`` the largest stored chunk (a rank's shard of a tensor, or a
    whole replicated tensor), plus the writer's 16 MiB slabs; never the checkpoint's size.

    The source's ``.metadata`` is a pickle, which can run code when loaded: convert only
    checkpoints you trust (as with ``dcp.load``).

    Args:
        src: the DCP checkpoint folder: a local path or an fsspec URL.
        dst: the HF checkpoint folder to write: a local path or an fsspec URL.
        storage_options: fsspec options (credentials, endpoint) for both ``src`` and ``dst``;
            local paths ignore them.
        key_mapping: source key -> HF key, or null to drop (see :class:`KeyMapping`): a dict, a
            ``KeyMapping`` or the path of a JSON file. Unmatched keys keep their names.
        dtype: cast floating-point tensors to this dtype (``torch.bfloat16``, ``"bf16"``,
            ``"fp16"``, ``"fp32"``...); integer and bool tensors keep theirs.
        max_shard_size: most tensor bytes per output file (``"5GB"``, ``"512MiB"`` or an int).
        thread_count: chunks read and written at once.
        overwrite: replace a complete HF checkpoint at ``dst``.
        progress: told the total bytes to write, then advanced as chunks are read.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        FileNotFoundError: ``src`` is not a DCP checkpoint (the message says what it found).
        FileExistsError: ``dst`` holds a complete HF checkpoint and ``overwrite`` is false.
        ValueError: a ``.metadata`` that cannot be unpickled or is inconsistent, a dtype
            safetensors cannot hold, no tensor to convert, or a bad option;
            ``KeyMappingError`` (a ``ValueError``) for a bad key mapping.
        Every refusal comes before anything is written to ``dst``.
    """
    started = time.perf_counter()
    progress = progress or NO_PROGRESS
    mapping = _as_key_mapping(key_mapping)
    cast_dtype = parse_dtype(dtype)
    writer = HFStorageWriter(
        dst, storage_options=storage_options, max_shard_size=max_shard_size, overwrite=overwrite, thread_count=thread_count
    )
    if not overwrite:
        _refuse_existing(writer.fs, writer.root, (INDEX_NAME, SINGLE_FILE_NAME), "a complete HF checkpoint")
    # Step 1: the source's metadata, validated.
    source = _open_dcp(src, storage_options)
    entries = source.metadata.state_dict_metadata
    tensors = {fqn: md for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)}
    renaming = mapping.apply(tensors)
    # Step 2: the plan: one write item per stored chunk, under its target key and dtype; and
    # every data file it reads must be there.
    items, chunks = _chunk_items(tensors, renaming, cast_dtype, source.metadata.storage_data, source.url)
    _check_data_files(source, chunks.values())
    total = sum(_item_bytes(item) for item in items)
    # Step 3: drive the HF writer; it pulls each chunk from the source when it writes it.
    progress.start(total, "dcp -> hf")
    # One plan, as one rank: the HF writer runs thread_count writes itself. It ignores the metadata.
    _save_with(writer, [items], _DcpChunks(source.reader, chunks, progress), Metadata(state_dict_metadata={}))
    # Step 4: report what was committed.
    skipped = tuple(k for k in entries if k not in renaming.targets)
    return ConvertReport(
        tensors=len(renaming.targets),
        bytes=total,
        files=_committed_hf_files(writer),
        skipped=skipped,
        seconds=time.perf_counter() - started,
        unused_rules=renaming.unused_rules,
    )


@dataclass(frozen=True)
class _DcpSource:
    """A DCP source, opened: DCP's own reader set up with the validated metadata."""

    reader: StorageReader
    metadata: Metadata
    fs: AbstractFileSystem
    root: str
    url: str


def _open_dcp(src: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> _DcpSource:
    """DCP's own reader for ``src`` (``FileSystemReader`` on local disk, ``FsspecReader`` else).

    Raises:
        FileNotFoundError: no ``.metadata`` (the message says what the folder holds instead).
        ValueError: a ``.metadata`` that cannot be unpickled, or not one of DCP's file format.
    """
    fs, root = fsio.resolve(src, storage_options)
    where = fsio.url_of(fs, root)
    if not fsio.exists(fs, fsio.join(root, DCP_METADATA_NAME)):
        raise FileNotFoundError(f"{where} is not a DCP checkpoint: {_describe_non_dcp(fs, root)}")
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
    return _DcpSource(reader, metadata, fs, root, where)


def _check_data_files(source: _DcpSource, chunks: Iterable[_StoredChunk]) -> None:
    """Every ``.distcp`` file holding a chunk to convert exists (one listing of the folder)."""
    storage = source.metadata.storage_data
    needed = {getattr(storage[MetadataIndex(c.fqn, c.chunk.offsets)], "relative_path", None) for c in chunks}
    missing = sorted(n for n in needed - set(fsio.list_names(source.fs, source.root)) if n is not None)
    if missing:
        raise FileNotFoundError(
            f"{source.url}: the .metadata places chunks in {missing[:5]}{' and more' if len(missing) > 5 else ''}, "
            f"which the folder lacks; the checkpoint is incomplete: copy the missing files, or re-save it"
        )


def _describe_non_dcp(fs: AbstractFileSystem, root: str) -> str:
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


def _chunk_items(
    tensors: Mapping[str, TensorStorageMetadata],
    renaming: Renaming,
    cast_dtype: torch.dtype | None,
    storage_data: Mapping[Any, Any],
    where: str,
) -> tuple[list[WriteItem], dict[MetadataIndex, _StoredChunk]]:
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
        k: str(_cast_to(tensors[k].properties.dtype, cast_dtype)).removeprefix("torch.")
        for k in renaming.targets
        if _cast_to(tensors[k].properties.dtype, cast_dtype) not in DTYPE_TO_NAME
    }
    if unsupported:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_TO_NAME)
        raise ValueError(
            f"{where}: safetensors cannot hold the dtype of {unsupported} (it holds {supported}); "
            f"drop these keys with key_mapping {{key: null}}, or convert them some other way"
        )
    items: list[WriteItem] = []
    chunks: dict[MetadataIndex, _StoredChunk] = {}
    for src_key, target in renaming.targets.items():
        md = tensors[src_key]
        _check_chunks(src_key, md, storage_data, where)
        properties = TensorProperties(dtype=_cast_to(md.properties.dtype, cast_dtype))
        for chunk in md.chunks:
            index = MetadataIndex(target, chunk.offsets)
            data = TensorWriteData(chunk=ChunkStorageMetadata(chunk.offsets, chunk.sizes), properties=properties, size=md.size)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
            chunks[index] = _StoredChunk(src_key, chunk, md.properties.dtype)
    return items, chunks


def _check_chunks(fqn: str, md: TensorStorageMetadata, storage_data: Mapping[Any, Any], where: str) -> None:
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
    if held != math.prod(shape) or _overlapping(boxes):
        raise ValueError(
            f"{where}: the stored chunks of {fqn!r} do not cover its shape {list(shape)} exactly once "
            f"({held} of {math.prod(shape)} elements); the checkpoint is incomplete or corrupt and cannot be converted"
        )


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
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


def _committed_hf_files(writer: HFStorageWriter) -> tuple[str, ...]:
    """The data files the committed index names, then the index."""
    index = json.loads(fsio.read_all(writer.fs, fsio.join(writer.root, INDEX_NAME)))
    return (*sorted(set(index["weight_map"].values())), INDEX_NAME)


# -- hf -> dcp --------------------------------------------------------------------------------


class _HfSlabs:
    """The planner DCP's ``FileSystemWriter.write_data`` reads from: ``resolve_data`` reads one
    row slab of an HF tensor through ``HFStorageReader``, already in the planned dtype."""

    def __init__(self, reader: HFStorageReader, sources: Mapping[str, str], progress: Progress) -> None:
        self._reader = reader
        self._sources = sources  # target key -> HF key
        self._progress = progress

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        td = item.tensor_data
        assert td is not None  # every item we plan is a tensor slab
        offsets, sizes = td.chunk.offsets, td.chunk.sizes
        read = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=item.index,
            dest_offsets=torch.Size([0] * len(sizes)),
            storage_index=MetadataIndex(self._sources[item.index.fqn], torch.Size([0] * len(sizes))),
            storage_offsets=offsets,
            lengths=sizes,
        )
        # The reader converts into the buffer's dtype slab by slab when it differs from the stored one.
        tensor = _read_into(self._reader, read, torch.empty(sizes, dtype=td.properties.dtype))
        self._progress.advance(tensor.numel() * tensor.element_size())
        return tensor


def convert_hf_to_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    key_mapping: str | os.PathLike[str] | Mapping[str, str | None] | KeyMapping | None = None,
    dtype: torch.dtype | str | None = None,
    thread_count: int = 4,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """Convert an HF safetensors checkpoint into DCP's default format, where ``dcp.load`` reads it.

    Reads any HF checkpoint :class:`HFStorageReader` reads (ours, or a ``save_pretrained``
    folder) and writes with DCP's own ``FileSystemWriter`` (local) or ``FsspecWriter`` (other
    URLs), ``.metadata`` last. Each tensor is stored as row slabs of at most
    ``HF_TO_DCP_CHUNK_BYTES`` (64 MiB; one row if a row is larger), each a chunk of the DCP
    checkpoint, and the slabs are packed in order into ``.distcp`` files of at most that size
    (``__<n>_0.distcp``, one per plan as if each were a rank's). DCP's writer keeps a file's
    tensors in memory until the file is closed, so the extra memory is about
    ``thread_count x HF_TO_DCP_CHUNK_BYTES`` (plus a 16 MiB slab per thread when casting). The
    result loads with plain ``dcp.load(state_dict, storage_reader=FileSystemReader(dst))`` into
    any sharding; its keys are flat (``"model.layers.0.mlp.up_proj.weight"``), as ``dcp.save``
    stores a state dict.

    With ``overwrite=True`` an existing DCP checkpoint at ``dst`` is un-committed first (its
    ``.metadata`` removed, then its ``.distcp`` files), so no reader ever sees its metadata
    pointing at half-rewritten files. A failure leaves no ``.metadata``.

    Args:
        src: the HF checkpoint folder: a local path or an fsspec URL.
        dst: the DCP checkpoint folder to write: a local path or an fsspec URL (a missing S3
            bucket is an error, never created).
        storage_options: fsspec options for both ``src`` and ``dst``; local paths ignore them.
        key_mapping: HF key -> DCP key, or null to drop (see :class:`KeyMapping`).
        dtype: cast floating-point tensors to this dtype; integer and bool tensors keep theirs.
        thread_count: ``.distcp`` files written at once.
        overwrite: replace a DCP checkpoint (a ``.metadata``) at ``dst``.
        progress: told the total bytes to write, then advanced as slabs are read.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        FileNotFoundError: ``src`` is not an HF checkpoint, or ``dst``'s S3 bucket is missing.
        FileExistsError: ``dst`` holds a DCP checkpoint and ``overwrite`` is false.
        ValueError: corrupt ``src`` files, no tensor to convert, or a bad option;
            ``KeyMappingError`` for a bad key mapping.
        Every refusal comes before anything is written to ``dst``.
    """
    started = time.perf_counter()
    progress = progress or NO_PROGRESS
    mapping = _as_key_mapping(key_mapping)
    cast_dtype = parse_dtype(dtype)
    if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
        raise ValueError(f"thread_count={thread_count!r} must be an int >= 1")
    fs, root = fsio.resolve(dst, storage_options)
    _check_bucket(fs, root)
    if not overwrite:
        _refuse_existing(fs, root, (DCP_METADATA_NAME,), "a DCP checkpoint")
    # Step 1: the source's index and headers, validated by the reader.
    source = _open_hf(src, storage_options, thread_count)
    renaming = mapping.apply(source.storage_metadata)
    if not renaming.targets:
        raise ValueError(f"{fsio.url_of(source.fs, source.root)}: nothing to convert: key_mapping drops every tensor")
    # Step 2: the plan: row slabs of every kept tensor packed into files, and the DCP metadata
    # that lists the slabs as chunks.
    items, state = _slab_items(source.storage_metadata, renaming, cast_dtype)
    total = sum(_tensor_bytes(md.size, md.properties.dtype) for md in state.values())
    # Step 3: write with DCP's own writer; finish writes .metadata last.
    if overwrite:
        _uncommit_dcp(fs, root)
    writer = _dcp_writer(dst, fs, root, storage_options)
    progress.start(total, "hf -> dcp")
    metadata = Metadata(state_dict_metadata=dict(state), planner_data={key: (key,) for key in state})
    hf_key_of = {target: key for key, target in renaming.targets.items()}
    planner = _HfSlabs(source.reader, hf_key_of, progress)
    results = _save_with(writer, _pack(items, HF_TO_DCP_CHUNK_BYTES), planner, metadata, thread_count)
    # Step 4: report.
    files = sorted({r.storage_data.relative_path for rs in results for r in rs}, key=_distcp_order)
    return ConvertReport(
        tensors=len(state),
        bytes=total,
        files=(*files, DCP_METADATA_NAME),
        skipped=renaming.dropped,
        seconds=time.perf_counter() - started,
        unused_rules=renaming.unused_rules,
    )


def _pack(items: list[WriteItem], limit: int) -> list[list[WriteItem]]:
    """Consecutive items in groups of at most ``limit`` bytes (an item larger alone) (pure)."""
    groups: list[list[WriteItem]] = []
    size = 0
    for item in items:
        nbytes = _item_bytes(item)
        if not groups or size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def _distcp_order(name: str) -> tuple[int, ...]:
    """``__12_0.distcp`` after ``__2_0.distcp``."""
    return tuple(int(n) for n in re.findall(r"\d+", name))


@dataclass(frozen=True)
class _OpenHf:
    """An HF source, read and validated: its reader, set up, and each key's metadata."""

    reader: HFStorageReader
    storage_metadata: Mapping[str, TensorStorageMetadata]
    fs: AbstractFileSystem
    root: str


def _open_hf(src: str | os.PathLike[str], storage_options: dict[str, Any] | None, thread_count: int) -> _OpenHf:
    """``HFStorageReader`` for ``src``, set up with its metadata; a DCP folder gets a pointed message."""
    reader = HFStorageReader(src, storage_options=storage_options, thread_count=thread_count)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        if fsio.exists(reader.fs, fsio.join(reader.root, DCP_METADATA_NAME)):
            raise FileNotFoundError(
                f"{fsio.url_of(reader.fs, reader.root)} is a DCP checkpoint (it has {DCP_METADATA_NAME}), not a "
                f"Hugging Face one; convert it the other way with convert_dcp_to_hf"
            ) from None
        raise
    reader.set_up_storage_reader(metadata, True)
    state = cast(Mapping[str, TensorStorageMetadata], metadata.state_dict_metadata)
    return _OpenHf(reader, state, reader.fs, reader.root)


def _slab_items(
    stored: Mapping[str, TensorStorageMetadata], renaming: Renaming, cast_dtype: torch.dtype | None
) -> tuple[list[WriteItem], dict[str, TensorStorageMetadata]]:
    """Write items (row slabs) of every kept tensor, and each target key's DCP metadata."""
    items: list[WriteItem] = []
    state: dict[str, TensorStorageMetadata] = {}
    for src_key, target in renaming.targets.items():
        md = stored[src_key]
        dtype = _cast_to(md.properties.dtype, cast_dtype)
        itemsize = max(element_size(dtype), element_size(md.properties.dtype))
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in _row_slabs(tuple(md.size), itemsize)]
        properties = TensorProperties(dtype=dtype)
        kind = WriteItemType.TENSOR if len(chunks) == 1 else WriteItemType.SHARD
        for chunk in chunks:
            data = TensorWriteData(chunk=chunk, properties=properties, size=md.size)
            items.append(WriteItem(index=MetadataIndex(target, chunk.offsets), type=kind, tensor_data=data))
        state[target] = TensorStorageMetadata(properties, md.size, chunks)
    return items, state


def _row_slabs(shape: tuple[int, ...], itemsize: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of row slabs of at most ``HF_TO_DCP_CHUNK_BYTES`` covering ``shape`` (pure).

    A 0-dim or empty tensor is one chunk, as ``dcp.save`` stores it; a row is never split.
    """
    if not shape or math.prod(shape) == 0:
        return [((0,) * len(shape), shape)]
    row_bytes = math.prod(shape[1:]) * itemsize
    step = max(1, HF_TO_DCP_CHUNK_BYTES // row_bytes)
    rest = (0,) * (len(shape) - 1)
    return [((r0, *rest), (min(step, shape[0] - r0), *shape[1:])) for r0 in range(0, shape[0], step)]


def _check_bucket(fs: AbstractFileSystem, root: str) -> None:
    """On S3, refuse a missing bucket: DCP's writer would create it (``makedirs``)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "s3" not in protocols:
        return
    bucket = root.split("/", 1)[0]
    if not fsio.exists(fs, bucket):
        raise FileNotFoundError(f"s3://{bucket} does not exist; create the bucket first (it is never created for you)")


def _uncommit_dcp(fs: AbstractFileSystem, root: str) -> None:
    """Remove a DCP checkpoint's ``.metadata`` (its commit marker) first, then its data files."""
    fsio.remove(fs, fsio.join(root, DCP_METADATA_NAME))
    stale = [n for n in fsio.list_names(fs, root) if _DISTCP_RE.match(n) or n == DCP_METADATA_NAME + ".tmp"]
    fsio.remove_many(fs, [fsio.join(root, n) for n in stale])


def _dcp_writer(
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
