"""Compact save plans (``plan/compact.py``): what the coordinator plans from arrays equals what it
plans from DCP's own write items, chunks that do not tile a tensor are refused, and replicated
chunks get exactly one writer, spread over the ranks."""

from __future__ import annotations

import itertools
import pickle
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
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from benchmarks._synthetic_plans import LlamaConfig, Mesh, llama_shapes, rank_save_plan
from benchmarks.bench_scale import dcp_global_plan
from hf_dcp_storage import HFSavePlanner, HFStorageReader, HFStorageWriter
from hf_dcp_storage.plan.compact import check_and_dedup, encode_local, gather, table_plans
from hf_dcp_storage.plan.layout import collect_tensor_specs, place_items, plan_layout
from hf_dcp_storage.plan.placed import stable_order
from tests.support.dist import run_ranks

UNEVEN = LlamaConfig(layers=2, hidden=7, intermediate=10, kv_dim=3, vocab=11)


def _item(
    key: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(
        MetadataIndex(key, torch.Size(offsets)),
        WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk, TensorProperties(dtype=dtype), torch.Size(shape)),
    )


def _plan(ranks: list[list[WriteItem]]):  # type: ignore[no-untyped-def]
    g = gather([encode_local(items) for items in ranks])
    return g, check_and_dedup(g)


def _written(g, dedup) -> list[tuple[int, str, tuple[int, ...], tuple[int, ...]]]:  # type: ignore[no-untyped-def]
    """(rank, key, offsets, sizes) of every chunk that is written, after deduplication."""
    dropped = set(dedup.dropped.tolist())
    out = []
    for row in range(len(g.key)):
        if row in dropped:
            continue
        spec = g.specs[int(g.key[row])]
        nd = len(spec.shape)
        out.append(
            (
                int(g.rank[row]),
                spec.key,
                tuple(g.offsets[row, :nd].tolist()),
                tuple(g.sizes[row, :nd].tolist()),
            )
        )
    return out


@pytest.mark.parametrize("world, tp", [(4, 1), (4, 2), (6, 3), (16, 1)])
def test_compact_planning_equals_planning_from_dcp_items(world: int, tp: int) -> None:
    """Same files, headers and key placements as the object path on DCP's deduplicated plans;
    the same chunks written, each exactly once."""
    shapes = llama_shapes(UNEVEN)
    mesh = Mesh.of(world, tp)
    plans = [rank_save_plan(shapes, mesh, r) for r in range(world)]
    g, dedup = _plan([p.items for p in plans])
    compact_layout = plan_layout(g.specs, max_shard_bytes=400)
    dcp_plans, _ = dcp_global_plan(plans, {})
    key_order = [
        [item.index.fqn for item in p.items] for p in plans
    ]  # as the writer records it, before DCP's dedup
    object_layout = plan_layout(collect_tensor_specs(dcp_plans, key_order), max_shard_bytes=400)
    assert [(f.name, f.header) for f in compact_layout.files] == [
        (f.name, f.header) for f in object_layout.files
    ]
    assert len(compact_layout.files) > 1
    written = _written(g, dedup)
    by_dcp = {
        (i.index.fqn, tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes))
        for p in dcp_plans
        for i in p.items
    }
    assert sorted(w[1:] for w in written) == sorted(by_dcp)
    # Every rank's table plan places its kept items where the object path places them.
    placed = place_items(object_layout, dcp_plans)
    expected = {index: p for rank_placed in placed for index, p in rank_placed.items()}
    for r, tp_ in enumerate(table_plans(g, compact_layout, dedup)):
        local = encode_local(plans[r].items)
        skip = set(tp_.skip.tolist())
        for i, item in enumerate(plans[r].items):
            if i in skip:
                continue
            row = int(local.rows[i, 0])
            want = expected[item.index]
            assert (int(tp_.file[row]), int(tp_.start[row])) == (want.file, want.tensor_start), (
                item.index
            )


def test_replicated_chunks_get_one_writer_spread_over_ranks() -> None:
    """Twelve replicated 1 KiB tensors on 4 ranks holding uneven shards (20, 10, 10, 0 rows):
    each written once, by the least loaded holder, so the bytes even out (DCP's lowest-rank
    choice would put all 12 on rank 0)."""
    rows = [(0, 20), (20, 10), (30, 10), (40, 0)]
    ranks = []
    for start, n in rows:
        items = [_item("rows", (40, 64), (start, 0), (n, 64))]  # 256 B a row
        items += [_item(f"norm{k}", (256,), (0,), (256,)) for k in range(12)]
        ranks.append(items)
    g, dedup = _plan(ranks)
    per_key: dict[str, list[int]] = {}
    for rank, key, _, _ in _written(g, dedup):
        per_key.setdefault(key, []).append(rank)
    assert per_key.pop("rows") == [0, 1, 2, 3]
    assert all(len(v) == 1 for v in per_key.values()), per_key
    loads = dedup.bytes_per_rank.tolist()
    assert sum(loads) == 40 * 256 + 12 * 1024
    assert max(loads) - min(loads) <= 1024, loads  # within one replicated tensor of even
    writers = [per_key[f"norm{k}"][0] for k in range(12)]
    assert writers.count(3) > writers.count(0), writers  # the rank with no shard takes the most


@pytest.mark.parametrize("disjoint", [True, False], ids=["tp-groups", "overlapping"])
def test_each_replicated_chunk_goes_to_the_least_loaded_holder_in_turn(disjoint: bool) -> None:
    """The writers are the plain greedy's: chunk after chunk (keys in order, then offsets), the
    holder with the fewest bytes so far (the lower rank on ties), starting from each rank's
    unreplicated bytes; whether a key's holders are disjoint groups (TP: planned at once) or not."""
    rng = np.random.default_rng(7 if disjoint else 8)
    world = 8
    ranks: list[list[WriteItem]] = [
        [_item(f"own{r}", (1, 64 * (1 + r % 3)), (0, 0), (1, 64 * (1 + r % 3)))]
        for r in range(world)
    ]
    for k in range(6):
        rows = 4 if disjoint else 8
        for row in range(rows):
            # Disjoint: row i on TP pair i (ranks 2i, 2i + 1), as TP-replicated FSDP shards are.
            holders = (
                [2 * row, 2 * row + 1]
                if disjoint
                else sorted(rng.choice(world, size=int(rng.integers(2, 5)), replace=False).tolist())
            )
            for r in holders:
                ranks[r].append(_item(f"rep{k}", (rows, 16), (row, 0), (1, 16)))
    g, dedup = _plan(ranks)
    expected, load = _greedy_reference(g)
    assert {(r, key, o) for r, key, o, _ in _written(g, dedup) if key.startswith("rep")} == {
        w for w in expected if w[1].startswith("rep")
    }
    assert dedup.bytes_per_rank.tolist() == load


def test_ranks_listing_the_same_keys_out_of_mesh_order_keep_their_writers_and_bytes() -> None:
    """Every rank holds a chunk of every key (one table: the rows are a ranks x keys matrix,
    grouped by key without a sort); one key's row blocks, of different sizes, come in reverse
    rank order (re-sorted by offsets), and others are replicated: the writers and each rank's
    bytes are the greedy's, so every row kept its rank through the re-sort."""
    world = 4
    ranks: list[list[WriteItem]] = []
    for r in range(world):
        start = sum(q + 1 for q in range(r + 1, world))  # rank 3 holds the first rows
        ranks.append(
            [
                _item("w", (10, 16), (start, 0), (r + 1, 16)),
                _item("norm", (16,), (0,), (16,)),
                _item("pair", (4, 16), (r // 2 * 2, 0), (2, 16)),
            ]
        )
    g, dedup = _plan(ranks)
    assert len(g.table_keys) == 1
    expected, load = _greedy_reference(g)
    assert {(r, key, o) for r, key, o, _ in _written(g, dedup)} == expected
    # By hand: w gives 64, 128, 192, 256; norm goes to rank 0 (64), pair 0 to rank 0 (128, a
    # tie with rank 1), pair 2 to rank 2 (192 < 256).
    assert dedup.bytes_per_rank.tolist() == load == [64 + 64 + 128, 128, 192 + 128, 256]


def _greedy_reference(g):  # type: ignore[no-untyped-def]
    """The writers ``(rank, key, offsets)`` and each rank's bytes of the dedup greedy,
    spelled out: chunks held once count first; then chunk after chunk (keys in order, then
    offsets) the holder with the fewest bytes so far, the lower rank on ties."""
    world = len(g.rank_start) - 1
    held: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}
    for row in range(len(g.key)):
        spec = g.specs[int(g.key[row])]
        nbytes = spec.dtype.itemsize * int(np.prod(g.sizes[row, : len(spec.shape)]))
        held.setdefault(
            (int(g.key[row]), tuple(g.offsets[row, : len(spec.shape)].tolist())), []
        ).append((int(g.rank[row]), nbytes))
    load = [0] * world
    expected = set()
    for (k, offsets), holders in sorted(held.items()):
        if len(holders) == 1:
            load[holders[0][0]] += holders[0][1]
            expected.add((holders[0][0], g.specs[k].key, offsets))
    for (k, offsets), holders in sorted(held.items()):
        if len(holders) > 1:
            best, nbytes = min(sorted(holders), key=lambda h: (load[h[0]], h[0]))
            load[best] += nbytes
            expected.add((best, g.specs[k].key, offsets))
    return expected, load


def test_empty_chunks_are_kept_once_and_cover_nothing() -> None:
    ranks = [
        [_item("t", (3, 4), (0, 0), (2, 4))],
        [_item("t", (3, 4), (2, 0), (1, 4))],
        [_item("t", (3, 4), (3, 0), (0, 4))],
        [_item("t", (3, 4), (3, 0), (0, 4))],
    ]
    g, dedup = _plan(ranks)
    assert [w[0] for w in _written(g, dedup)] == [0, 1, 2]


def test_a_valid_tiling_that_is_no_grid_passes() -> None:
    """Row 0 split in two columns, rows 1-2 in three: no grid, still an exact tiling."""
    boxes = [
        ((0, 0), (1, 3)),
        ((0, 3), (1, 3)),
        ((1, 0), (2, 2)),
        ((1, 2), (2, 2)),
        ((1, 4), (2, 2)),
    ]
    g, dedup = _plan([[_item("t", (3, 6), o, s)] for o, s in boxes])
    assert len(_written(g, dedup)) == 5


@pytest.mark.parametrize(
    "shape, boxes, problem",
    [
        (
            (4, 4),
            [((0, 0), (2, 4)), ((3, 0), (1, 4))],
            "do not cover it exactly once",
        ),  # row 2 missing
        (
            (4, 4),
            [((0, 0), (3, 4)), ((2, 0), (2, 4))],
            "do not cover it exactly once",
        ),  # rows overlap
        (
            (4, 4),
            [((0, 0), (4, 2)), ((0, 2), (4, 2)), ((1, 1), (1, 2))],
            "do not cover it exactly once",
        ),
        (
            (4, 6),
            [((0, 0), (1, 3)), ((0, 3), (1, 3)), ((1, 0), (3, 3)), ((1, 2), (3, 4))],
            "do not cover it exactly once",
        ),
        (
            (4, 6),
            [((0, 0), (1, 6)), ((1, 0), (3, 2)), ((1, 3), (3, 3))],
            "do not cover it exactly once",
        ),  # no grid, gap
        ((4, 4), [((0, 0), (4, 4)), ((4, 0), (1, 4))], "lies outside the tensor"),
    ],
    ids=["gap", "overlap", "overlap-no-grid", "overlap-partial", "gap-no-grid", "outside"],
)
def test_chunks_that_do_not_tile_are_refused(
    shape: tuple[int, int], boxes: list, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem) as err:
        _plan([[_item("t", shape, o, s)] for o, s in boxes])
    assert f"'t' {list(shape)}" in str(err.value) or "'t'" in str(err.value)


def _guillotine(
    rng: np.random.Generator, offsets: tuple[int, ...], sizes: tuple[int, ...], grid: bool
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A random exact tiling of the box: a grid (every dimension cut at the same points
    throughout), or cut recursively along random dimensions (bands of different cuts)."""
    if grid:
        cuts = [
            sorted({0, n, *rng.integers(1, max(n, 2), rng.integers(0, 3)).tolist()} - {n} | {n})
            if n > 1
            else [0, n]
            for n in sizes
        ]
        cells: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
        for d, c in enumerate(cuts):
            cells = [
                ((*o, offsets[d] + a), (*s, b - a))
                for o, s in cells
                for a, b in itertools.pairwise(c)
            ]
        return cells
    splittable = [d for d, n in enumerate(sizes) if n > 1]
    if not splittable or rng.random() < 0.3:
        return [(offsets, sizes)]
    d = int(rng.choice(splittable))
    cut = int(rng.integers(1, sizes[d]))
    lo_s = (*sizes[:d], cut, *sizes[d + 1 :])
    hi_o, hi_s = (
        (*offsets[:d], offsets[d] + cut, *offsets[d + 1 :]),
        (*sizes[:d], sizes[d] - cut, *sizes[d + 1 :]),
    )
    return _guillotine(rng, offsets, lo_s, False) + _guillotine(rng, hi_o, hi_s, False)


@pytest.mark.parametrize("seed", range(6))
def test_the_tiling_check_agrees_with_counting_every_element(seed: int) -> None:
    """Random tilings (grids and bands cut differently), some broken (a box dropped, grown or
    moved), replicated on several ranks, listed in mesh order or shuffled, several keys in one
    save: refused exactly when some element is not covered once, naming the right key; accepted
    ones keep each distinct chunk once."""
    rng = np.random.default_rng(seed)
    for trial in range(30):
        world = int(rng.integers(1, 5))
        ranks: list[list[WriteItem]] = [[] for _ in range(world)]
        broken: list[str] = []
        expected: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
        for k in range(int(rng.integers(1, 4))):
            shape = tuple(int(x) for x in rng.integers(1, 6, int(rng.integers(1, 4))))
            boxes = _guillotine(rng, (0,) * len(shape), shape, grid=bool(rng.random() < 0.5))
            if rng.random() < 0.5:  # break it
                i = int(rng.integers(len(boxes)))
                o, s = boxes[i]
                d = int(rng.integers(len(shape)))
                how = rng.integers(3)
                if how == 0 and len(boxes) > 1:
                    boxes.pop(i)
                elif how == 1 and o[d] + s[d] < shape[d]:
                    boxes[i] = (o, (*s[:d], s[d] + 1, *s[d + 1 :]))
                elif o[d] > 0:
                    boxes[i] = ((*o[:d], o[d] - 1, *o[d + 1 :]), s)
            count = np.zeros(shape, dtype=np.int64)
            for o, s in set(boxes):
                count[tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))] += 1
            if not (count == 1).all():
                broken.append(f"t{k}")
            expected |= {(f"t{k}", o, s) for o, s in boxes}
            for o, s in boxes:  # each box on one to all ranks (replicated)
                for r in rng.choice(
                    world, size=int(rng.integers(1, world + 1)), replace=False
                ).tolist():
                    ranks[r].append(_item(f"t{k}", shape, o, s))
        for items in ranks:
            if rng.random() < 0.5:
                rng.shuffle(items)  # type: ignore[arg-type]
        ranks = [items for items in ranks if items] or [[]]
        if broken:
            with pytest.raises(ValueError, match="do not cover it exactly once") as err:
                _plan(ranks)
            assert any(f"of '{key}'" in str(err.value) for key in broken), (
                trial,
                broken,
                str(err.value),
            )
        else:
            g, dedup = _plan(ranks)
            written = _written(g, dedup)
            assert sorted(w[1:] for w in written) == sorted(expected), trial


def test_chunks_ending_past_2_31_are_planned_without_wrapping() -> None:
    """Rows fit int32 on every rank, but a chunk's end does not: the coordinator keeps int64
    (an int32 sum would wrap and the tiling check would refuse a valid save)."""
    n = 2**31 + 10
    ranks = [
        [_item("big", (n,), (0,), (n // 2,), torch.int8)],
        [_item("big", (n,), (n // 2,), (n - n // 2,), torch.int8)],
    ]
    assert all(encode_local(items).rows.dtype == np.int32 for items in ranks)
    g, dedup = _plan(ranks)
    assert g.offsets.dtype == np.int64
    assert [w[0] for w in _written(g, dedup)] == [0, 1]
    assert dedup.bytes_per_rank.tolist() == [n // 2, n - n // 2]
    g, _ = _plan([[_item("small", (8, 4), (0, 0), (8, 4))]])
    assert (g.offsets.dtype, g.key.dtype, g.rank.dtype) == (
        np.int32,
        np.int32,
        np.int32,
    )  # half the memory


def test_a_key_with_two_shapes_across_ranks_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"'w' is torch.float32\[4, 4\] on one rank and torch.float32\[4, 5\] on another",
    ):
        _plan([[_item("w", (4, 4), (0, 0), (2, 4))], [_item("w", (4, 5), (2, 0), (2, 5))]])


def test_ranks_with_the_same_keys_share_one_table() -> None:
    """Each distinct key table is decoded once; what a rank sends does not grow with the ranks."""
    shapes = llama_shapes(UNEVEN)
    sent = {}
    for world in (8, 32):
        mesh = Mesh.of(world, 1)
        locals_ = [encode_local(rank_save_plan(shapes, mesh, r).items) for r in range(world)]
        g = gather(locals_)
        assert len(g.table_keys) == 1
        sent[world] = max(len(pickle.dumps(x)) for x in locals_)
    assert sent[32] == sent[8]


def test_dcp_save_returns_the_metadata_the_reader_reports(tmp_path: Path) -> None:
    """Compact plans leave DCP nothing to describe; the writer fills in the checkpoint's
    metadata."""
    sd = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(5, dtype=torch.bfloat16),
        "c": torch.tensor(7),
    }
    metadata = dcp.save(sd, storage_writer=HFStorageWriter(tmp_path / "ckpt"))
    read = HFStorageReader(tmp_path / "ckpt").read_metadata()
    assert metadata.state_dict_metadata == read.state_dict_metadata
    assert sorted(metadata.state_dict_metadata) == ["a", "b", "c"]


def test_rows_round_trip_through_encode_and_gather() -> None:
    items = [
        _item("x", (8, 3, 2), (4, 0, 0), (4, 3, 2)),
        _item("y", (5,), (1,), (2,), torch.bfloat16),
        _item("z", (), (), ()),
    ]
    g = gather([encode_local(items)])
    assert [s.key for s in g.specs] == ["x", "y", "z"]
    assert g.offsets.tolist() == [[4, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert g.sizes.tolist() == [[4, 3, 2], [2, 0, 0], [0, 0, 0]]
    assert np.array_equal(g.key, [0, 1, 2])


def test_plan_caching_is_refused_before_the_second_save_writes(tmp_path: Path) -> None:
    """DCP's plan caching would hand the second save the first one's layout and placements."""
    sd = {"a": torch.arange(6, dtype=torch.float32)}
    planner = DefaultSavePlanner(enable_plan_caching=True)
    dcp.save(sd, storage_writer=HFStorageWriter(tmp_path / "one"), planner=planner)
    with pytest.raises(CheckpointException, match="enable_plan_caching") as err:
        dcp.save(sd, storage_writer=HFStorageWriter(tmp_path / "two"), planner=planner)
    assert "HFStorageWriter plans every save afresh" in str(err.value)
    assert not (tmp_path / "two").exists() or not any((tmp_path / "two").iterdir())
    tensors = HFStorageReader(tmp_path / "one").read_metadata().state_dict_metadata
    assert list(tensors) == ["a"]


def _collide_across_ranks(rank: int, world: int, root: str) -> None:
    sd = {"a" if rank == 0 else "b": torch.ones(4)}
    try:
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(root),
            planner=HFSavePlanner(key_mapping={"a": "x", "b": "x"}),
        )
    except CheckpointException as exc:
        messages = " ".join(str(e) for e, _ in exc.failures.values())
        assert "maps both 'a' and 'b' (on different ranks) to 'x'" in messages, messages
    else:
        raise AssertionError("two ranks mapping different keys onto 'x' were not refused")


@pytest.mark.distributed
def test_a_key_mapping_collision_across_ranks_is_still_caught(tmp_path: Path) -> None:
    """Compact plans keep a renaming planner's flattening map, so HFSavePlanner still sees a
    collision that only shows across ranks, before anything is written."""
    run_ranks(_collide_across_ranks, 2, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    assert not list((tmp_path / "ckpt").glob("*.safetensors"))


@pytest.mark.parametrize("top", [7, 2**16 - 1, 2**20, 2**33])
def test_stable_order_is_numpys_stable_argsort(top: int) -> None:
    values = np.random.default_rng(top).integers(0, top + 1, size=50_000)
    assert np.array_equal(stable_order(values), np.argsort(values, kind="stable"))
