"""Merge per-rank staged objects into one consolidated safetensors file, with bounded memory.

Used where the store has no positioned writes (object stores, ``memory://``): each rank
streamed its chunks of an output file, in chunk byte order, into one staged object; the rank
given the file (``plan/spread.py``; the coordinator when finishing an interrupted save) walks the
output file front to back and copies each byte run from the staged object that holds it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

from fsspec import AbstractFileSystem

from .io import fsio
from .plan.merge import StagedPiece, merge_segments

__all__ = ["merge_file", "COPY_BYTES"]

# Bytes moved per read/write while copying: bounds the merge's memory per thread.
COPY_BYTES = 8 << 20
# Every staged object of a file stays open while it is merged (FSDP visits them round-robin, one
# piece each per tensor), and a remote fsspec file keeps one read block: with a thousand ranks,
# 8 MiB blocks would hold 8 GiB. Blocks shrink to keep their sum near this, but not below
# _MIN_BLOCK (consecutive pieces of one rank sit back to back in its staged object: a block
# still serves several).
_READ_BLOCKS_BUDGET = 256 << 20
_MIN_BLOCK = 256 << 10


def merge_file(
    fs: AbstractFileSystem,
    out_path: str,
    header: bytes,
    size: int,
    pieces: Iterable[StagedPiece],
    *,
    source_fs: AbstractFileSystem | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Write ``header`` then every staged run in order to ``out_path``; exactly ``size`` bytes.

    The staged objects are read from ``source_fs`` (default ``fs``), all open at once, with read
    blocks whose sum stays near 256 MiB whatever the number of ranks; ``on_bytes(n)`` is told
    of each block copied.

    Raises:
        RuntimeError: the staged runs leave a hole or overlap (an inconsistent save).
    """
    source_fs = source_fs or fs
    pieces = list(pieces)
    block = max(_MIN_BLOCK, min(COPY_BYTES, _READ_BLOCKS_BUDGET // max(1, len({p.path for p in pieces}))))
    readers: dict[str, Any] = {}
    # write_stream publishes nothing if the merge fails: no truncated shard is left behind.
    with contextlib.ExitStack() as stack, fsio.write_stream(fs, out_path, size) as out:
        out.write(header)
        pos = len(header)
        for off, path, soff, n in merge_segments(pieces):
            if off != pos:
                raise RuntimeError(f"{out_path}: staged data jumps from byte {pos} to {off}; the save is inconsistent")
            src = readers.get(path)
            if src is None:
                src = readers[path] = stack.enter_context(fsio.open_read(source_fs, path, block))
            src.seek(soff)
            left = n
            while left:
                data = src.read(min(left, COPY_BYTES))
                if not data:
                    raise RuntimeError(f"{path}: staged object ends early at byte {soff + n - left}")
                out.write(data)
                left -= len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
            pos += n
        if pos != size:
            raise RuntimeError(f"{out_path}: merged {pos} bytes but the layout has {size}")
        if fsio.is_local(fs):
            out.flush()
            os.fsync(out.fileno())
