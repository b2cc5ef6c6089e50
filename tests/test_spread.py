"""The finishing work of a save on an object store is spread over its ranks by bytes.

On S3, parts that mix several ranks' small runs are gathered by the ranks the coordinator gives
them to, not by the coordinator; on other stores each rank merges the files it was given. The
ranks meet on the job's key-value store before (``session/meeting.py``), so a rank that failed its
own writes stops the others instead of leaving them waiting. Pure planning on synthetic plans of
64 ranks; real saves on 3 gloo ranks to S3 (moto, radosgw) and to a staged ``file://`` folder.
"""

from __future__ import annotations

import itertools
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from benchmarks._synthetic_plans import LlamaConfig, Mesh, llama_shapes, rank_save_plan
from benchmarks.bench_scale import bytes_per_rank, dcp_global_plan, object_local_plan, plan_ours
from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.format.geometry import chunk_runs, chunk_runs_array
from hf_dcp_storage.io.items import in_write_order as _in_write_order
from hf_dcp_storage.plan.balance import fill_near, level
from hf_dcp_storage.plan.layout import collect_tensor_specs, parse_size, place_items, plan_layout
from hf_dcp_storage.plan.parts import GatherPart, RankPart, route_run
from hf_dcp_storage.plan.placed import place_items as place_written
from hf_dcp_storage.plan.spread import GatherTask, MergeTask, assign
from hf_dcp_storage.stores import store_for_mode
from hf_dcp_storage.stores.retry import RetryPolicy
from tests.support.data import assert_same, folder_bytes, random_tensor, seed_of
from tests.support.dist import run_ranks


def _plan_tasks(layout, mode, placed, world):
    """``(the S3 store, or None, its ranks' tasks)``: the finishing work a store of ``mode`` plans,
    as the writer's coordinator has it planned (pure: the store makes no request to plan)."""
    store = store_for_mode(mode, None, "", retry=RetryPolicy(), threads=1)
    return (store if mode == "s3" else None), store.plan(layout, placed, world)


INDEX = "model.safetensors.index.json"
# One layer of a 1B-class model over 64 ranks: every rank's run of a weight is under 5 MiB, so
# on S3 nearly every byte is gathered (the 1,000-rank situation, small enough for a unit test).
SMALL_RUNS = LlamaConfig(layers=1, hidden=2048, intermediate=5632, kv_dim=256, vocab=32000)


# -- pure: who does what ------------------------------------------------------------------------


def test_assign_gives_the_largest_task_first_to_the_least_loaded_rank() -> None:
    # 60 B goes to idle rank 1 (it now counts 120); then 30 B to rank 0 (100 < 120).
    assert assign([30, 60], [100, 0]) == [0, 1]
    assert assign([10, 10, 10], [0, 0]) == [0, 1, 0]  # ties go to the lower rank
    assert assign([], [7]) == []


def test_assign_keeps_every_rank_within_one_task_of_the_others() -> None:
    rng = random.Random(0)
    sizes = [rng.randint(1, 5 << 20) for _ in range(3000)]
    load = [rng.randint(0, 50 << 20) for _ in range(64)]
    total = list(load)
    for size, rank in zip(sizes, assign(sizes, load), strict=True):
        total[rank] += 2 * size
    assert max(total) - min(total) <= 2 * max(sizes)


def test_assign_keeps_a_task_on_the_node_holding_it_where_its_ranks_have_room() -> None:
    # Ranks 0-1 are node 0, 2-3 node 1: each task goes to its own node's ranks.
    assert assign([10, 10, 10, 10], [0, 0, 0, 0], [1, 1, 0, 0], per_node=2) == [2, 3, 0, 1]
    # Node 1 is already above the level the ranks fill to: the task goes to node 0.
    assert assign([10], [0, 0, 100, 100], [1], per_node=2) == [0]
    rng = random.Random(1)
    sizes = [rng.randint(1, 5 << 20) for _ in range(3000)]
    prefer = [rng.choice([0, 0, 0, 1, -1]) for _ in sizes]  # most tasks held by node 0
    ranks = assign(sizes, [0] * 16, prefer, per_node=8)
    total = [0] * 16
    for size, rank in zip(sizes, ranks, strict=True):
        total[rank] += 2 * size
    assert max(total) - min(total) <= 4 * max(sizes)  # balanced all the same
    # Node 0 has room for half of all the bytes: its largest tasks stay, the rest go to node 1.
    held = sum(s for s, p in zip(sizes, prefer, strict=True) if p >= 0)
    kept = sum(s for s, p, r in zip(sizes, prefer, ranks, strict=True) if p >= 0 and r // 8 == p)
    assert kept > 0.85 * held


def test_assign_with_nodes_balances_random_loads_and_keeps_bytes_home_where_there_is_room() -> None:
    for seed in range(20):
        rng = np.random.default_rng(seed)
        world, per_node = int(rng.integers(2, 65)), int(rng.integers(1, 9))
        sizes = rng.integers(1, 5 << 20, int(rng.integers(1, 4000)))
        load = rng.integers(0, 200 << 20, world)
        prefer = rng.integers(-1, -(-world // per_node), len(sizes))  # each node alike
        ranks = np.array(assign(sizes.tolist(), load.tolist(), prefer.tolist(), per_node))
        assert ranks.min() >= 0 and ranks.max() < world
        assert assign(sizes.tolist(), load.tolist(), prefer.tolist(), per_node) == ranks.tolist()
        total = load + np.bincount(ranks, weights=2 * sizes, minlength=world)
        took = np.bincount(ranks, minlength=world) > 0
        # Every rank that takes tasks ends within two tasks of the others; one that takes none
        # is above them all (its own bytes already more than the level).
        assert np.ptp(total[took]) <= 4 * sizes.max(), seed
        assert (total[~took] >= total[took].min() - 4 * sizes.max()).all(), seed
        # Each node keeps its tasks' bytes as far as its ranks have room below the level all
        # ranks fill to (less the one task that straddles it).
        room = np.maximum(0, level(load, 2 * sizes.sum()) - load)
        node = np.arange(world) // per_node
        for n in range(node[-1] + 1):
            mine = prefer == n
            kept = 2 * sizes[mine & (ranks // per_node == n)].sum()
            assert kept >= min(2 * sizes[mine].sum(), room[node == n].sum()) - 2 * sizes.max()


def test_assign_with_nodes_spreads_tasks_whose_cost_is_not_their_bytes() -> None:
    """Tasks of few bytes but much fixed work (``cost``: a gathered part of thousands of
    pieces) count that work: no rank takes more of it than the level every rank fills to and
    one task, where by bytes alone they land together on the last ranks filled."""
    sizes = np.array([1 << 20] * 1000 + [1 << 10] * 50)
    prefer = np.array([r % 8 for r in range(1000)] + [0] * 50)
    cost = np.array([0] * 1000 + [8 << 20] * 50)
    weight = 2 * sizes + cost
    bound = level(np.zeros(64), weight.sum()) + weight.max()
    for c in (cost, None):
        ranks = fill_near(sizes, np.zeros(64, dtype=np.int64), prefer, 8, c)
        costs = np.bincount(ranks, weights=cost, minlength=64)
        assert (costs.max() <= bound) == (c is not None), (costs.max(), bound)


def _object_plans(world: int):
    writer = HFStorageWriter("/nonexistent/unused", max_shard_size="256MB")
    plans = [
        object_local_plan(rank_save_plan(llama_shapes(SMALL_RUNS), Mesh(world), r))
        for r in range(world)
    ]
    global_plan, _ = dcp_global_plan(plans, {})
    return writer, global_plan


def test_every_gathered_s3_part_is_given_to_one_rank_and_the_bytes_are_balanced() -> None:
    writer, global_plan = _object_plans(64)
    ours = plan_ours(writer, global_plan, "s3")
    gathers = {
        (f, p.number): p
        for f, parts in enumerate(ours.s3_parts)
        for p in parts
        if isinstance(p, GatherPart)
    }
    total = sum(f.size for f in ours.layout.files)
    assert sum(p.nbytes for p in gathers.values()) > 0.9 * total  # the situation this is for
    tasks = [p.storage_data.tasks for p in ours.rank_plans]
    given = [(t.file, t.number) for ts in tasks for t in ts]
    assert sorted(given) == sorted(gathers)  # each gathered part exactly once
    for t in (t for ts in tasks for t in ts):
        assert isinstance(t, GatherTask)
        assert t.nbytes == gathers[(t.file, t.number)].nbytes  # its sources cover the part
    # Bytes each rank moves: its own (uploaded once), and its gathered parts (read and written).
    # Tasks are ~16 MiB parts, so the balance is one task: the busiest rank moves at most one
    # gathered part (read and written) more than the idlest.
    moved = [
        own + 2 * sum(t.nbytes for t in ts)
        for own, ts in zip(bytes_per_rank(global_plan), tasks, strict=True)
    ]
    largest = max(t.nbytes for ts in tasks for t in ts)
    assert max(moved) - min(moved) <= 2 * largest, (
        f"moved per rank: {min(moved)}..{max(moved)} B, largest task {largest} B"
    )
    assert sum(1 for ts in tasks if ts) == min(
        64, len(gathers)
    )  # the coordinator is one of them, not the one
    assert max(len(ts) for ts in tasks) <= -(-len(gathers) // 64) + 1
    assert all(p.storage_data.meet and p.storage_data.world == 64 for p in ours.rank_plans)


def test_each_file_of_a_staged_save_is_merged_by_one_rank_from_every_piece() -> None:
    writer, global_plan = _object_plans(16)
    ours = plan_ours(writer, global_plan, "local")  # layout and placements; tasks planned below
    _, tasks = _plan_tasks(
        ours.layout, "staged", place_written(ours.layout, global_plan), len(global_plan)
    )
    assert tasks is not None
    merges = sorted((t for ts in tasks for t in ts), key=lambda t: t.file)
    assert [t.file for t in merges] == list(range(len(ours.layout.files)))
    for t in merges:
        assert isinstance(t, MergeTask)
        plan = ours.layout.files[t.file]
        assert (t.header, t.nbytes) == (plan.header, plan.size)
        assert sum(
            p.itemsize * torch.Size(p.sizes).numel() for p in t.pieces(str)
        ) == plan.size - len(plan.header)
    assert len([ts for ts in tasks if ts]) == min(
        16, len(ours.layout.files)
    )  # one file each while ranks last
    assert _plan_tasks(ours.layout, "direct", None, len(global_plan)) == (None, None)


def _item(
    key: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(key, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk, TensorProperties(dtype=torch.uint8), torch.Size(shape)),
    )


def _two_chunk_plans(world: int) -> list[SavePlan]:
    """Column blocks of two 2-D keys, rank r holding blocks r and r + world of 2 x world (so its
    two chunks of a key interleave row by row in the file), and a row-sharded key."""
    plans = []
    for r in range(world):
        items = []
        for key, rows, cols in (("a", 2048, 2 * world * 600), ("b", 1500, 2 * world * 1000)):
            w = cols // (2 * world)
            items += [_item(key, (rows, cols), (0, b * w), (rows, w)) for b in (r, r + world)]
        rows = (3 << 20) // 1000
        items.append(
            _item(
                "c",
                (rows, 1000),
                (r * rows // world, 0),
                ((r + 1) * rows // world - r * rows // world, 1000),
            )
        )
        plans.append(SavePlan(items))
    return plans


def _uneven_column_plans(world: int) -> list[SavePlan]:
    """Column shards that are no grid: per key, one rank holds a tall column block and the
    others the rest of the columns in row bands, so a later chunk by first byte can end before
    an earlier one (the tall block ends last)."""
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for key, rows, cols in (("a", 4096, 3000), ("b", 2048, 5000)):
        tall = cols // 4
        plans[0].append(_item(key, (rows, cols), (0, 0), (rows, tall)))
        for r in range(1, world):
            lo, hi = (r - 1) * rows // (world - 1), r * rows // (world - 1)
            plans[r].append(_item(key, (rows, cols), (lo, tall), (hi - lo, cols - tall)))
    return [SavePlan(items) for items in plans]


def _own_parts_then_columns_plans(world: int) -> list[SavePlan]:
    """Row shards of 6 MiB (each rank's own parts), then column shards and small row shards in
    the same file: what a rank stages of the file starts after the bytes it sent itself."""
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for key, rows, cols in (
        ("a_big", world * 6144, 1024),
        ("b_cols", 4096, world * 600),
        ("c_small", world * 64, 1000),
        ("d_big", world * 6144, 1024),
    ):
        for r in range(world):
            if key == "b_cols":
                plans[r].append(_item(key, (rows, cols), (0, r * 600), (rows, 600)))
            else:
                plans[r].append(
                    _item(key, (rows, cols), (r * rows // world, 0), (rows // world, cols))
                )
    return [SavePlan(items) for items in plans]


def _dtensor_plans(world: int) -> list[SavePlan]:
    """DCP's plans for FSDP x TP DTensors (uint8 here, so the bytes are easy to make)."""
    shapes = [
        ("wq", (4096, 4096)),
        ("w1", (6000, 2048)),
        ("w2", (2048, 6000)),
        ("norm", (1024,)),
        ("emb", (8192, 1024)),
    ]
    plans = [
        rank_save_plan(shapes, Mesh(world // 2, 2), r, dtype=torch.uint8) for r in range(world)
    ]
    return dcp_global_plan(plans, {})[0]


def _fsdp_plans(world: int) -> list[SavePlan]:
    """DCP's plans for FSDP DTensors with runs on both sides of S3's 5 MiB part minimum."""
    # In one file: small runs, then 8 MiB runs (the gap before them takes the first one's
    # front), small runs, 6 MiB runs (too short to give: the first is gathered whole), small.
    shapes = [
        ("w", (1000, 3000)),
        ("norm", (1024,)),
        ("emb", (8192, 8192)),
        ("w2", (3000, 1000)),
        ("emb2", (6144, 8192)),
        ("w3", (1000, 3000)),
    ]
    plans = [rank_save_plan(shapes, Mesh(world), r, dtype=torch.uint8) for r in range(world)]
    return dcp_global_plan(plans, {})[0]


@pytest.mark.parametrize(
    "make",
    [
        _dtensor_plans,
        _two_chunk_plans,
        _fsdp_plans,
        _uneven_column_plans,
        _own_parts_then_columns_plans,
    ],
    ids=[
        "dtensor-2d",
        "two-chunks-per-rank",
        "fsdp-big-and-small",
        "columns-no-grid",
        "own-parts-then-columns",
    ],
)
def test_gathered_parts_read_back_the_file_bytes_from_the_ranks_staging(make) -> None:
    """Stage every rank's bytes as ``_write_s3`` routes them, then assemble each gathered part
    from its task's sources: byte for byte the consolidated file's part; the ranks' own parts
    and the gathered ones tile every file."""
    world = 8
    plans = make(world)
    specs = collect_tensor_specs(plans, key_order=[() for _ in plans])
    layout = plan_layout(specs, max_shard_bytes=parse_size("128MiB"), fqn_to_index_mapping=None)
    placements = place_items(layout, plans)
    s3, rank_tasks = _plan_tasks(layout, "s3", place_written(layout, plans), world)
    assert s3 is not None and rank_tasks is not None
    s3_parts = s3.parts
    full = {
        k: torch.randint(
            0, 256, spec.shape, generator=torch.Generator().manual_seed(i), dtype=torch.uint8
        )
        for i, (k, spec) in enumerate(layout.specs.items())
    }
    files = [bytearray(f.header) + bytearray(f.size - len(f.header)) for f in layout.files]
    for k, t in full.items():
        f = layout.weight_map[k]
        file = layout.names.index(f)
        files[file][layout.tensor_start[k] : layout.tensor_start[k] + t.numel()] = (
            t.numpy().tobytes()
        )
    staged: dict[tuple[int, int], bytearray] = {}
    for rank, (plan, placed) in enumerate(zip(plans, placements, strict=True)):
        for item in _in_write_order(plan.items, lambda it: layout.tensor_start[it.index.fqn]):
            td, place = item.tensor_data, placed[item.index]
            own = [p for p in s3_parts[place.file] if isinstance(p, RankPart) and p.rank == rank]
            chunk = (
                full[item.index.fqn][
                    tuple(
                        slice(o, o + n)
                        for o, n in zip(td.chunk.offsets, td.chunk.sizes, strict=True)
                    )
                ]
                .contiguous()
                .numpy()
                .tobytes()
            )
            for t, c, n in chunk_runs(td.size, td.chunk.offsets, td.chunk.sizes, 1):
                for at, take, part in route_run(
                    place.tensor_start + t, n, [p.start for p in own], own
                ):
                    if part is None:
                        staged.setdefault((place.file, rank), bytearray()).extend(
                            chunk[
                                c + at - place.tensor_start - t : c
                                + at
                                - place.tensor_start
                                - t
                                + take
                            ]
                        )
    tasks = [
        t for ts in rank_tasks for t in pickle.loads(pickle.dumps(ts))
    ]  # as the ranks receive them
    gathers = {
        (f, p.number): p
        for f, parts in enumerate(s3_parts)
        for p in parts
        if isinstance(p, GatherPart)
    }
    assert sorted((t.file, t.number) for t in tasks) == sorted(gathers) and len(tasks) >= 2
    used = 0
    for task in tasks:
        data = b"".join(
            s if isinstance(s, bytes) else bytes(staged[(task.file, s[0])][s[1] : s[1] + s[2]])
            for s in task.sources()
        )
        part = gathers[(task.file, task.number)]
        assert data == bytes(files[task.file][part.start : part.end]), (
            f"file {task.file} part {task.number}"
        )
        used += len(data) - len(task.head)
        for rank, t, _, *dims in (
            np.frombuffer(task.strided, dtype=np.int64).reshape(-1, 3 + 2 * task.width).tolist()
        ):
            tensor_start, shape, itemsize = task.tensors[t]
            at, _, run = chunk_runs_array(
                shape, dims[: len(shape)], dims[task.width : task.width + len(shape)], itemsize
            )
            assert (
                (tensor_start + at < part.end) & (tensor_start + at + run > part.start)
            ).any(), f"part {task.number} names a chunk of rank {rank} with no byte in it"
    assert used == sum(len(b) for b in staged.values())  # every staged byte is gathered once
    for f, parts in enumerate(s3_parts):  # numbered in file order, tiling the file
        assert [p.number for p in parts] == list(range(1, len(parts) + 1))
        edges = [(0 if isinstance(p, RankPart) and p.header else p.start, p.end) for p in parts]
        assert (
            edges[0][0] == 0
            and edges[-1][1] == layout.files[f].size
            and all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        )
        assert all(p.nbytes >= 5 << 20 for p in parts[:-1])
    if make in (_fsdp_plans, _own_parts_then_columns_plans):
        assert any(
            isinstance(p, RankPart) for ps in s3_parts for p in ps
        )  # big runs: the ranks' own
    if make is not _fsdp_plans:
        assert any(t.strided for t in tasks)  # column shards named whole, not row by row


# -- real saves on 3 ranks ----------------------------------------------------------------------

# 8 row-sharded 4 MiB tensors on 3 ranks: every rank's run (about 1.3 MiB) is under S3's 5 MiB
# part minimum, so on S3 every byte is staged and gathered; plus odd small ones.
KEYS = [(f"layers.{i}.w", (1024, 1024), torch.float32) for i in range(8)] + [
    ("norm", (1000,), torch.bfloat16),
    ("uneven", (7, 5), torch.int64),
]


def _full(name: str) -> torch.Tensor:
    shape, dtype = next((s, d) for n, s, d in KEYS if n == name)
    return random_tensor(shape, dtype, seed_of(name))


def _sharded(mesh) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        n: distribute_tensor(
            _full(n), mesh, [Replicate() if n == "norm" else Shard(0)], src_data_rank=None
        )
        for n, _, _ in KEYS
    }


def _save_spread(
    rank: int, world: int, url: str, options: dict | None, local_dir: str, out: str
) -> None:
    """Every rank: the same state dict saved to ``url`` (staged) and to local disk (direct); the
    coordinator reports who gathered what; then every rank loads its shards back from ``url``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    sd = _sharded(mesh)
    writer = HFStorageWriter(
        url, storage_options=options, max_shard_size="12MB", direct_write=False
    )
    dcp.save(sd, storage_writer=writer)
    dcp.save(sd, storage_writer=HFStorageWriter(local_dir, max_shard_size="12MB"))
    if rank == 0:
        stats = writer.merge_stats
        store = dist.distributed_c10d._get_default_store()
        left = store.check([f"hf_dcp_storage/arrival/{writer._save_id}/arrived"])
        Path(out).write_text(
            json.dumps(
                {
                    "by_rank": stats.by_rank,
                    "client": stats.client_bytes,
                    "gathered": stats.client_bytes + stats.network_bytes,
                    "coordinator": stats.coordinator_bytes,
                    "total": stats.total_bytes,
                    "keys_left": left,
                }
            )
        )
    dest = _sharded(mesh)
    for v in dest.values():
        v.to_local().zero_()
    dcp.load(dest, storage_reader=HFStorageReader(url, storage_options=options))
    for name, v in dest.items():
        assert_same(v.to_local(), _sharded(mesh)[name].to_local(), f"rank {rank}: {name}")


def _check_spread(stats: dict, gathered_everything: bool) -> None:
    assert stats["coordinator"] == 0, stats  # the coordinator only completed and committed
    assert stats["keys_left"] is False, "the ranks' meeting keys were left in the store"
    busy = {int(r): b for r, b in stats["by_rank"].items() if b > 0}
    assert len(busy) >= 2, f"the finishing work went to {sorted(busy)} only: {stats}"
    assert sum(busy.values()) == stats["gathered"] > 0
    if gathered_everything:
        assert stats["gathered"] > 0.9 * stats["total"]


@pytest.mark.distributed
def test_s3_parts_are_gathered_by_several_ranks_not_the_coordinator(
    s3, s3_endpoint, tmp_path
) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    out = tmp_path / "stats.json"
    run_ranks(_save_spread, 3, url, options, str(tmp_path / "local"), str(out))
    stats = json.loads(out.read_text())
    _check_spread(stats, gathered_everything=True)
    assert stats["client"] == 0, stats  # gathered over the ranks' network: nothing staged
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    on_s3 = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(url.removeprefix("s3://"))}
    on_disk = folder_bytes(tmp_path / "local")
    assert (
        sorted(on_s3) == sorted(on_disk) and len(on_disk) >= 3
    )  # index + several files, no staging left
    assert [n for n in on_disk if on_s3[n] != on_disk[n]] == []


@pytest.mark.distributed
def test_files_of_a_staged_save_are_merged_by_several_ranks(tmp_path) -> None:
    out = tmp_path / "stats.json"
    run_ranks(
        _save_spread, 3, (tmp_path / "staged").as_uri(), None, str(tmp_path / "local"), str(out)
    )
    _check_spread(json.loads(out.read_text()), gathered_everything=False)
    staged, direct = folder_bytes(tmp_path / "staged"), folder_bytes(tmp_path / "local")
    assert sorted(staged) == sorted(direct) and len(direct) >= 3
    assert [n for n in direct if staged[n] != direct[n]] == []


class _FailOnRank1(DefaultSavePlanner):
    """Rank 1 fails while writing its own bytes (before the ranks meet)."""

    def resolve_data(self, write_item):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise OSError("disk on fire (injected)")
        return super().resolve_data(write_item)


def _save_failing(rank: int, world: int, url: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    sd = _sharded(init_device_mesh("cpu", (world,)))
    try:
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(url, max_shard_size="12MB", direct_write=False),
            planner=_FailOnRank1(),
        )
    except CheckpointException as exc:
        if rank == 0:
            Path(out).write_text(json.dumps({str(r): str(e) for r, (e, _) in exc.failures.items()}))
        return
    raise AssertionError(f"rank {rank}: the save succeeded though rank 1 failed")


@pytest.mark.distributed
def test_a_rank_that_fails_its_writes_stops_the_others_before_they_gather(tmp_path) -> None:
    out = tmp_path / "failures.json"
    folder = tmp_path / "ckpt"
    run_ranks(_save_failing, 2, folder.as_uri(), str(out))  # returns: nobody waits forever
    failures = json.loads(out.read_text())
    assert "disk on fire" in failures["1"]
    assert "ranks [1] of 2 failed to write their bytes" in failures["0"], failures
    assert not (folder / INDEX).exists()
    assert not list(folder.glob("model-*.safetensors")), "a file was merged from a failed save"
