"""Merging per-rank staged objects into one file: order, coalescing, bounded reads, bad input."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from hf_dcp_storage.plan.merge import StagedPiece, merge_segments
from hf_dcp_storage.stores.staged import merge_file


def _column_pieces(
    root: str, rows: int = 3, cols: int = 4
) -> tuple[list[StagedPiece], bytes, dict[str, bytes]]:
    """A [rows, cols] uint8 tensor split into two column halves staged by two ranks."""
    full = torch.arange(rows * cols, dtype=torch.uint8).reshape(rows, cols)
    half = cols // 2
    staged = {
        f"{root}/r0": full[:, :half].contiguous().numpy().tobytes(),
        f"{root}/r1": full[:, half:].contiguous().numpy().tobytes(),
    }
    pieces = [
        StagedPiece(f"{root}/r0", 8, 0, (rows, cols), (0, 0), (rows, half), 1),
        StagedPiece(f"{root}/r1", 8, 0, (rows, cols), (0, half), (rows, cols - half), 1),
    ]
    return pieces, full.numpy().tobytes(), staged


def test_segments_interleave_column_shards_in_output_order() -> None:
    pieces, _, _ = _column_pieces("/x")
    assert list(merge_segments(pieces)) == [
        (8, "/x/r0", 0, 2), (10, "/x/r1", 0, 2), (12, "/x/r0", 2, 2),
        (14, "/x/r1", 2, 2), (16, "/x/r0", 4, 2), (18, "/x/r1", 4, 2),
    ]  # fmt: skip


def test_adjacent_runs_from_one_staged_object_are_coalesced() -> None:
    pieces = [
        StagedPiece("/s", 100, 0, (4, 3), (0, 0), (2, 3), 2),
        StagedPiece("/s", 100, 12, (4, 3), (2, 0), (2, 3), 2),
    ]
    assert list(merge_segments(pieces)) == [(100, "/s", 0, 24)]


@pytest.fixture
def staged_columns() -> Iterator[tuple[fsspec.AbstractFileSystem, str, list[StagedPiece], bytes]]:
    """Two ranks' column halves staged in a fresh ``memory://`` folder."""
    fs = fsspec.filesystem("memory")
    root = f"/{uuid.uuid4().hex}"
    pieces, data, staged = _column_pieces(root)
    for path, blob in staged.items():
        fs.pipe_file(path, blob)
    yield fs, root, pieces, data
    fs.rm(root, recursive=True)


def test_merge_file_writes_header_then_data_in_place(staged_columns) -> None:
    fs, root, pieces, data = staged_columns
    merge_file(fs, f"{root}/out", b"HEADER!!", 8 + len(data), pieces)
    assert fs.cat_file(f"{root}/out") == b"HEADER!!" + data


def test_merge_file_refuses_holes(staged_columns) -> None:
    fs, root, pieces, data = staged_columns
    with pytest.raises(
        RuntimeError, match=r"staged data jumps from byte 10 to 12; the save is inconsistent"
    ):
        merge_file(fs, f"{root}/out", b"HEADER!!", 8 + len(data), pieces[:1])
    assert not fs.exists(f"{root}/out"), "a failed merge must not leave a truncated shard"


class _RecordingMemoryFS(MemoryFileSystem):
    """``memory://`` that records the block size of every file opened for reading."""

    protocol = "recmemory"
    block_sizes: ClassVar[list[int | None]] = []

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if mode == "rb":
            self.block_sizes.append(block_size)
        return super()._open(path, mode, block_size=block_size, **kwargs)


@pytest.mark.parametrize("ranks, block", [(2, 8 << 20), (64, 4 << 20), (3000, 256 << 10)])
def test_read_blocks_of_all_open_staged_objects_stay_near_256_mib(ranks: int, block: int) -> None:
    """A file merged from many ranks' staged objects keeps them all open: each one's read
    block shrinks so that together they stay near 256 MiB (8 MiB each at most, 256 KiB at least)."""
    fs = _RecordingMemoryFS()
    root = f"/{uuid.uuid4().hex}"
    full = torch.arange(ranks * 4, dtype=torch.int32).reshape(ranks, 4)
    pieces = []
    for r in range(ranks):  # one row each, row-sharded
        fs.pipe_file(f"{root}/r{r}", full[r].numpy().tobytes())
        pieces.append(StagedPiece(f"{root}/r{r}", 8, 0, (ranks, 4), (r, 0), (1, 4), 4))
    _RecordingMemoryFS.block_sizes = []
    merge_file(fs, f"{root}/out", b"HEADER!!", 8 + full.numel() * 4, pieces)
    assert fs.cat_file(f"{root}/out") == b"HEADER!!" + full.numpy().tobytes()
    assert _RecordingMemoryFS.block_sizes == [block] * ranks
    fs.rm(root, recursive=True)
