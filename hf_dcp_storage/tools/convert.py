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
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem

from ..format.index import INDEX_NAME, SINGLE_FILE_NAME
from ..io import fsio
from ..reader import HFStorageReader
from ..writer import HFStorageWriter
from .conversion import ConvertReport, as_key_mapping, parse_dtype, refuse_existing, save_with
from .dcp_format import DCP_METADATA, check_bucket, dcp_writer, distcp_order, open_dcp, uncommit_dcp
from .dcp_items import (
    DcpChunks,
    check_data_files,
    chunk_items,
    item_bytes,
    pack_files,
    read_into,
    slab_items,
    tensor_bytes,
)
from .folders import check_thread_count
from .keymap import KeyMapping, KeyMappingError, Renaming, load_key_mapping
from .progress import NO_PROGRESS, Progress

# The key-mapping names and the report are importable from here, where they are documented.
__all__ = [
    "HF_TO_DCP_CHUNK_BYTES",
    "ConvertReport",
    "KeyMapping",
    "KeyMappingError",
    "Renaming",
    "convert_dcp_to_hf",
    "convert_hf_to_dcp",
    "load_key_mapping",
    "parse_dtype",
]

# hf -> dcp: tensors are stored as row slabs of at most this many bytes (one DCP chunk each),
# packed into .distcp files of at most this many bytes. DCP's writer keeps every tensor of a
# file in memory until the file is closed, so this bounds memory per writer thread.
HF_TO_DCP_CHUNK_BYTES = 64 << 20


# -- dcp -> hf --------------------------------------------------------------------------------


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
    mapping = as_key_mapping(key_mapping)
    cast_dtype = parse_dtype(dtype)
    writer = HFStorageWriter(
        dst,
        storage_options=storage_options,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        thread_count=thread_count,
    )
    if not overwrite:
        refuse_existing(
            writer.fs, writer.root, (INDEX_NAME, SINGLE_FILE_NAME), "a complete HF checkpoint"
        )
    # Step 1: the source's metadata, validated.
    source = open_dcp(src, storage_options)
    entries = source.metadata.state_dict_metadata
    tensors = {fqn: md for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)}
    renaming = mapping.apply(tensors)
    # Step 2: the plan: one write item per stored chunk, under its target key and dtype; and
    # every data file it reads must be there.
    items, chunks = chunk_items(
        tensors, renaming, cast_dtype, source.metadata.storage_data, source.url
    )
    check_data_files(source, chunks.values())
    total = sum(item_bytes(item) for item in items)
    # Step 3: drive the HF writer; it pulls each chunk from the source when it writes it.
    progress.start(total, "dcp -> hf")
    # One plan, as one rank: the HF writer runs thread_count writes itself. It ignores the metadata.
    save_with(
        writer,
        [items],
        DcpChunks(source.reader, chunks, progress),
        Metadata(state_dict_metadata={}),
    )
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


def _committed_hf_files(writer: HFStorageWriter) -> tuple[str, ...]:
    """The data files the committed index names, then the index."""
    index = json.loads(fsio.read_all(writer.fs, fsio.join(writer.root, INDEX_NAME)))
    return (*sorted(set(index["weight_map"].values())), INDEX_NAME)


# -- hf -> dcp --------------------------------------------------------------------------------


class _HfSlabs:
    """The planner DCP's ``FileSystemWriter.write_data`` reads from: ``resolve_data`` reads one
    row slab of an HF tensor through ``HFStorageReader``, already in the planned dtype."""

    def __init__(
        self, reader: HFStorageReader, sources: Mapping[str, str], progress: Progress
    ) -> None:
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
            storage_index=MetadataIndex(
                self._sources[item.index.fqn], torch.Size([0] * len(sizes))
            ),
            storage_offsets=offsets,
            lengths=sizes,
        )
        # The reader converts into the buffer's dtype slab by slab when it differs from the
        # stored one.
        tensor = read_into(self._reader, read, torch.empty(sizes, dtype=td.properties.dtype))
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
    mapping = as_key_mapping(key_mapping)
    cast_dtype = parse_dtype(dtype)
    check_thread_count(thread_count)
    fs, root = fsio.resolve(dst, storage_options)
    check_bucket(fs, root)
    if not overwrite:
        refuse_existing(fs, root, (DCP_METADATA,), "a DCP checkpoint")
    # Step 1: the source's index and headers, validated by the reader.
    source = _open_hf(src, storage_options, thread_count)
    renaming = mapping.apply(source.storage_metadata)
    if not renaming.targets:
        raise ValueError(
            f"{fsio.url_of(source.fs, source.root)}: nothing to convert: key_mapping drops every "
            "tensor"
        )
    # Step 2: the plan: row slabs of every kept tensor packed into files, and the DCP metadata
    # that lists the slabs as chunks.
    items, state = slab_items(source.storage_metadata, renaming, cast_dtype, HF_TO_DCP_CHUNK_BYTES)
    total = sum(tensor_bytes(md.size, md.properties.dtype) for md in state.values())
    # Step 3: write with DCP's own writer; finish writes .metadata last.
    if overwrite:
        uncommit_dcp(fs, root)
    writer = dcp_writer(dst, fs, root, storage_options)
    progress.start(total, "hf -> dcp")
    metadata = Metadata(
        state_dict_metadata=dict(state), planner_data={key: (key,) for key in state}
    )
    hf_key_of = {target: key for key, target in renaming.targets.items()}
    planner = _HfSlabs(source.reader, hf_key_of, progress)
    results = save_with(
        writer, pack_files(items, HF_TO_DCP_CHUNK_BYTES), planner, metadata, thread_count
    )
    # Step 4: report.
    files = sorted({r.storage_data.relative_path for rs in results for r in rs}, key=distcp_order)
    return ConvertReport(
        tensors=len(state),
        bytes=total,
        files=(*files, DCP_METADATA),
        skipped=renaming.dropped,
        seconds=time.perf_counter() - started,
        unused_rules=renaming.unused_rules,
    )


@dataclass(frozen=True)
class _OpenHf:
    """An HF source, read and validated: its reader, set up, and each key's metadata."""

    reader: HFStorageReader
    storage_metadata: Mapping[str, TensorStorageMetadata]
    fs: AbstractFileSystem
    root: str


def _open_hf(
    src: str | os.PathLike[str], storage_options: dict[str, Any] | None, thread_count: int
) -> _OpenHf:
    """``HFStorageReader`` for ``src``, set up with its metadata; a DCP folder gets a pointed
    message."""
    reader = HFStorageReader(src, storage_options=storage_options, thread_count=thread_count)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        if fsio.exists(reader.fs, fsio.join(reader.root, DCP_METADATA)):
            raise FileNotFoundError(
                f"{fsio.url_of(reader.fs, reader.root)} is a DCP checkpoint (it has "
                f"{DCP_METADATA}), not a Hugging Face one; convert it the other way with "
                "convert_dcp_to_hf"
            ) from None
        raise
    reader.set_up_storage_reader(metadata, True)
    state = cast(Mapping[str, TensorStorageMetadata], metadata.state_dict_metadata)
    return _OpenHf(reader, state, reader.fs, reader.root)
