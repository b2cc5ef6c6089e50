"""What a load sends through DCP's global step: no read items
(``HFStorageReader.prepare_local_plan`` keeps them on the rank), so the coordinator never holds
every rank's plan; the load is unchanged."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from tests.support.dist import run_ranks


class _Recording(DefaultLoadPlanner):
    """A load planner that notes, on the coordinator, the size of what its global step received."""

    seen: ClassVar[list[tuple[int, int]]] = []

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        type(self).seen = [(len(p.items), len(pickle.dumps(p))) for p in global_plan]
        return super().create_global_plan(global_plan)


def _full(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(key) * 7919 + shape[0])
    return torch.randn(shape, generator=gen)


SHAPES = {"a": (37, 16), "b": (8, 64), "c": (5,)}


def _load_on_ranks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    dest = {
        k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)], src_data_rank=None)
        for k, s in SHAPES.items()
    }
    planner = _Recording()
    dcp.load(dest, storage_reader=HFStorageReader(root), planner=planner)
    for k, s in SHAPES.items():
        assert torch.equal(dest[k].full_tensor(), _full(k, s)), k
    if rank == 0:
        assert len(_Recording.seen) == world
        assert all(items == 0 and size < 1024 for items, size in _Recording.seen), _Recording.seen


@pytest.mark.distributed
def test_the_global_load_step_gets_no_read_items_and_every_rank_loads(tmp_path: Path) -> None:
    dcp.save(
        {k: _full(k, s) for k, s in SHAPES.items()},
        storage_writer=HFStorageWriter(tmp_path / "ckpt"),
    )
    run_ranks(_load_on_ranks, 3, str(tmp_path / "ckpt"))


class _OnlyA(DefaultLoadPlanner):
    """A planner whose global step decides what each rank reads: here, only key ``a``."""

    def __init__(self, wanted: list) -> None:
        super().__init__()
        self.wanted = wanted

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return [dataclasses.replace(p, items=self.wanted) for p in global_plan]


def test_a_planner_that_sets_items_in_its_global_step_is_obeyed(tmp_path: Path) -> None:
    sd = {k: _full(k, s) for k, s in SHAPES.items()}
    dcp.save(sd, storage_writer=HFStorageWriter(tmp_path / "ckpt"))
    dest = {k: torch.zeros(s) for k, s in SHAPES.items()}
    probe = DefaultLoadPlanner()
    reader = HFStorageReader(tmp_path / "ckpt")
    probe.set_up_planner(dest, reader.read_metadata(), True)
    wanted = [item for item in probe.create_local_plan().items if item.dest_index.fqn == "a"]
    dcp.load(dest, storage_reader=HFStorageReader(tmp_path / "ckpt"), planner=_OnlyA(wanted))
    assert torch.equal(dest["a"], sd["a"])
    assert not dest["b"].any() and not dest["c"].any()
