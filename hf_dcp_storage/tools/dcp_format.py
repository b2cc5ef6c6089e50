"""PyTorch DCP's own checkpoint format: open and check a ``.distcp`` checkpoint (for
``inspect``, ``verify`` and ``convert``), and write one with DCP's own writers. The write items
of a conversion, and reading their data, are ``tools/dcp_items.py``.

DCP's default format is what ``dcp.save`` writes through ``FileSystemWriter`` / ``FsspecWriter``:
``__<rank>_<n>.distcp`` files of ``torch.save``d chunks plus a pickled ``.metadata``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from ..format.index import INDEX_NAME, SINGLE_FILE_NAME
from ..io import fsio
from ..stores.registry import makedirs_creates_buckets

try:  # torch >= 2.15: the public module (the private one warns that it is deprecated)
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # torch 2.13, 2.14
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

__all__ = [
    "DCP_METADATA",
    "DCP_SUFFIX",
    "DISTCP_RE",
    "DcpSource",
    "FsspecReader",
    "FsspecWriter",
    "check_bucket",
    "check_chunks",
    "dcp_metadata",
    "dcp_reader",
    "dcp_writer",
    "describe_non_dcp",
    "distcp_order",
    "open_dcp",
    "overlapping",
    "uncommit_dcp",
]

# DCP's commit marker: the pickled ``Metadata`` that ``FileSystemWriter.finish`` writes last.
DCP_METADATA = ".metadata"
# Its data files, which FileSystemWriter names ``__<rank>_<n>.distcp``; an overwrite removes
# stale ones.
DCP_SUFFIX = ".distcp"
DISTCP_RE = re.compile(r"^__\d+_\d+\.distcp$")


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
    if not fsio.exists(fs, fsio.join(root, DCP_METADATA)):
        raise FileNotFoundError(f"{where} is not a DCP checkpoint: {describe_non_dcp(fs, root)}")
    reader = dcp_reader(fs, root, os.fspath(src), storage_options)
    try:
        metadata = reader.read_metadata()
    except OSError:
        raise
    except Exception as exc:  # unpickling untrusted bytes can raise almost anything
        raise ValueError(
            f"{where}/{DCP_METADATA} cannot be unpickled ({type(exc).__name__}: {exc}); it is "
            "corrupt, or was written by an incompatible torch version: re-save it, or convert "
            "with the torch that wrote it"
        ) from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, Mapping):
        raise ValueError(
            f"{where}/{DCP_METADATA} holds a {type(metadata).__name__}, not DCP checkpoint Metadata"
        )
    if not isinstance(metadata.storage_data, Mapping):
        raise ValueError(
            f"{where}/{DCP_METADATA} has no per-chunk storage table; only checkpoints written by "
            "DCP's FileSystemWriter or FsspecWriter (dcp.save's default) can be converted"
        )
    reader.set_up_storage_reader(metadata, True)
    return DcpSource(reader, metadata, fs, root, where)


def dcp_reader(
    fs: AbstractFileSystem, root: str, url: str, storage_options: dict[str, Any] | None
) -> StorageReader:
    """DCP's own reader of the checkpoint at ``root`` of ``fs``: ``FileSystemReader`` on local
    disk (it takes a plain path: it would mangle ``file://``), else ``FsspecReader`` of ``url``."""
    if fsio.is_local(fs):
        return FileSystemReader(root)
    return FsspecReader(url, **(storage_options or {}))


def dcp_metadata(fs: AbstractFileSystem, root: str, storage_options: dict[str, Any] | None) -> Any:
    """The unpickled ``.metadata`` of a DCP checkpoint, read by PyTorch's own reader, unchecked
    (``inspect_checkpoint`` and ``verify_checkpoint``; a conversion uses :func:`open_dcp`).

    Raises:
        whatever PyTorch's reader raises for an unreadable file (``pickle`` errors,
        ``EOFError``, ...).
    """
    return dcp_reader(fs, root, fsio.url_of(fs, root), storage_options).read_metadata()


def describe_non_dcp(fs: AbstractFileSystem, root: str) -> str:
    """What ``root`` holds instead of a DCP checkpoint, and what to pass instead."""
    names = sorted(fsio.list_names(fs, root))
    if not names:
        return (
            "the folder does not exist or is empty; pass the folder dcp.save wrote (the one "
            "holding .metadata)"
        )
    if INDEX_NAME in names or SINGLE_FILE_NAME in names:
        return (
            "it is a Hugging Face safetensors checkpoint; convert it the other way with "
            "convert_hf_to_dcp"
        )
    if any(n.endswith(DCP_SUFFIX) for n in names):
        rank_local = [n for n in names if n.endswith(DCP_METADATA)]
        return f"it has .distcp files but no {DCP_METADATA}: the save did not finish" + (
            f" (or was saved without collectives, as {rank_local[:3]}, which cannot be converted)"
            if rank_local
            else ""
        )
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return f"it has no {DCP_METADATA} (found: {shown}); pass the folder dcp.save wrote"


def check_chunks(
    fqn: str, md: TensorStorageMetadata, storage_data: Mapping[Any, Any], where: str
) -> None:
    """The stored chunks of ``fqn`` lie inside it, tile it exactly and each have stored bytes."""
    shape = tuple(md.size)
    held = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True)
            )
        ):
            raise ValueError(
                f"{where}: {fqn!r} has a chunk at {list(offsets)} of size {list(sizes)} outside "
                f"its shape {list(shape)}; the .metadata is corrupt"
            )
        if MetadataIndex(fqn, offsets) not in storage_data:
            raise ValueError(
                f"{where}: {fqn!r} lists a chunk at {list(offsets)} whose bytes the .metadata "
                "does not locate; it is corrupt"
            )
        held += math.prod(sizes)
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    if held != math.prod(shape) or overlapping(boxes):
        raise ValueError(
            f"{where}: the stored chunks of {fqn!r} do not cover its shape {list(shape)} exactly "
            f"once ({held} of {math.prod(shape)} elements); the checkpoint is incomplete or "
            "corrupt and cannot be converted"
        )


def overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether any two non-empty boxes intersect (sorted by their first dim, so row shards cost
    O(n))."""
    if boxes and not boxes[0][0]:  # 0-dim: every chunk is the whole tensor
        return len(boxes) > 1
    boxes = sorted(boxes)
    for i, (off_a, size_a) in enumerate(boxes):
        for off_b, size_b in boxes[i + 1 :]:
            if off_b[0] >= off_a[0] + size_a[0]:
                break
            if all(
                ob < oa + na and oa < ob + nb
                for oa, na, ob, nb in zip(off_a, size_a, off_b, size_b, strict=True)
            ):
                return True
    return False


def distcp_order(name: str) -> tuple[int, ...]:
    """``__12_0.distcp`` after ``__2_0.distcp``."""
    return tuple(int(n) for n in re.findall(r"\d+", name))


def check_bucket(fs: AbstractFileSystem, root: str) -> None:
    """Refuse a missing bucket where DCP's writer would create it (its ``makedirs``, on S3)."""
    if not makedirs_creates_buckets(fs):
        return
    bucket = root.split("/", 1)[0]
    if not fsio.exists(fs, bucket):
        raise FileNotFoundError(
            f"{fsio.url_of(fs, bucket)} does not exist; create the bucket first (it is never "
            "created for you)"
        )


def uncommit_dcp(fs: AbstractFileSystem, root: str) -> None:
    """Remove a DCP checkpoint's ``.metadata`` (its commit marker) first, then its data files."""
    fsio.remove(fs, fsio.join(root, DCP_METADATA))
    stale = [
        n for n in fsio.list_names(fs, root) if DISTCP_RE.match(n) or n == DCP_METADATA + ".tmp"
    ]
    fsio.remove_many(fs, [fsio.join(root, n) for n in stale])


def dcp_writer(
    dst: str | os.PathLike[str],
    fs: AbstractFileSystem,
    root: str,
    storage_options: dict[str, Any] | None,
) -> StorageWriter:
    """DCP's writer for ``dst``: ``FileSystemWriter`` on local disk, ``FsspecWriter`` elsewhere.

    One file per plan, written by the calling thread (``thread_count=1``; we run plans side by
    side). ``per_thread_copy_ahead=0``: no read-ahead of slabs, which is for GPU tensors and
    would only hold more in memory. ``overwrite=True``: our own check and un-commit already ran.
    """
    if fsio.is_local(fs):
        return FileSystemWriter(
            root,
            single_file_per_rank=True,
            sync_files=True,
            thread_count=1,
            per_thread_copy_ahead=0,
            overwrite=True,
        )
    # sync_files=False: an fsspec stream has no fileno, and DCP then falls back to os.sync() of
    # the whole machine; closing the stream is what commits an object.
    return FsspecWriter(
        os.fspath(dst),
        single_file_per_rank=True,
        sync_files=False,
        thread_count=1,
        per_thread_copy_ahead=0,
        overwrite=True,
        **(storage_options or {}),
    )
