"""Merging per-rank staged objects into one file: order, coalescing, bounded reads, bad input."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec
import pytest
import torch

from hf_dcp_storage._merge import StagedPiece, merge_file, merge_segments


def _column_pieces(root: str, rows: int = 3, cols: int = 4) -> tuple[list[StagedPiece], bytes, dict[str, bytes]]:
    """A [rows, cols] uint8 tensor split into two column halves staged by two ranks."""
    full = torch.arange(rows * cols, dtype=torch.uint8).reshape(rows, cols)
    half = cols // 2
    staged = {f"{root}/r0": full[:, :half].contiguous().numpy().tobytes(), f"{root}/r1": full[:, half:].contiguous().numpy().tobytes()}
    pieces = [
        StagedPiece(f"{root}/r0", 8, 0, (rows, cols), (0, 0), (rows, half), 1),
        StagedPiece(f"{root}/r1", 8, 0, (rows, cols), (0, half), (rows, cols - half), 1),
    ]
    return pieces, full.numpy().tobytes(), staged


def test_segments_interleave_column_shards_in_output_order() -> None:
    pieces, _, _ = _column_pieces("/x")
    assert list(merge_segments(pieces)) == [
        (8, "/x/r0", 0, 2), (10, "/x/r1", 0, 2), (12, "/x/r0", 2, 2), (14, "/x/r1", 2, 2), (16, "/x/r0", 4, 2), (18, "/x/r1", 4, 2),
    ]  # fmt: skip


def test_adjacent_runs_from_one_staged_object_are_coalesced() -> None:
    pieces = [StagedPiece("/s", 100, 0, (4, 3), (0, 0), (2, 3), 2), StagedPiece("/s", 100, 12, (4, 3), (2, 0), (2, 3), 2)]
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
    with pytest.raises(RuntimeError, match=r"staged data jumps from byte 10 to 12; the save is inconsistent"):
        merge_file(fs, f"{root}/out", b"HEADER!!", 8 + len(data), pieces[:1])
    assert not fs.exists(f"{root}/out"), "a failed merge must not leave a truncated shard"
