"""A rank holding several chunks of one tensor as separate write items (DCP's checkpointable-tensor
protocol: ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, which
DTensor implements and tensor subclasses may too) saves and loads exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from tests.support.jobs import run_job

SHAPE = (32, 4)


class Chunks(torch.Tensor):
    """One global tensor of which this rank holds ``chunks`` (``[(offsets, tensor), ...]``)."""

    @staticmethod
    def __new__(
        cls, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], torch.Tensor]]
    ) -> Chunks:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=chunks[0][1].dtype)
        t.chunks = chunks
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError(
            f"{func} on a Chunks wrapper: only DCP's protocol methods are supported"
        )

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(off), t.shape),
                    properties=TensorProperties(dtype=t.dtype),
                    size=self.shape,
                ),
            )
            for off, t in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), t.shape) for off, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return next(t for off, t in self.chunks if tuple(off) == tuple(index.offset))


def _full() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)


def _mine(rank: int, fill: torch.Tensor | None = None) -> Chunks:
    """Rows 8r..8r+7 and 16+8r..16+8r+7: two chunks a rank apart, as separate write items."""
    source = _full() if fill is None else fill
    rows = [8 * rank, 16 + 8 * rank]
    return Chunks(SHAPE, [((r, 0), source[r : r + 8].clone()) for r in rows])


def _save_and_load(rank: int, world: int, url: str) -> None:
    dcp.save(
        {"w": _mine(rank), "b": torch.ones(3)},
        storage_writer=HFStorageWriter(url, max_shard_size="256B"),
    )
    dest = {"w": _mine(rank, torch.zeros(SHAPE)), "b": torch.zeros(3)}
    dcp.load(dest, storage_reader=HFStorageReader(url))
    for (row, _), got in dest["w"].chunks:
        assert torch.equal(got, _full()[row : row + 8]), f"rank {rank}: rows {row}.."


@pytest.mark.distributed
def test_several_chunks_of_one_tensor_per_rank_save_and_load_exactly(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    run_job(_save_and_load, 2, url, timeout=120).check_returned()
    # The consolidated tensor, read back whole in one process, is the original.
    whole = {"w": torch.zeros(SHAPE), "b": torch.zeros(3)}
    dcp.load(whole, storage_reader=HFStorageReader(url, verify=True), no_dist=True)
    assert torch.equal(whole["w"], _full()) and torch.equal(whole["b"], torch.ones(3))
