"""Pure layout planning, fed hand-built rank plans: no processes, no files."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from hf_dcp_storage.format.geometry import chunk_runs
from hf_dcp_storage.format.header import decode_header
from hf_dcp_storage.format.index import shard_name
from hf_dcp_storage.plan.layout import (
    TensorSpec,
    collect_tensor_specs,
    parse_size,
    place_items,
    plan_layout,
)


@pytest.mark.parametrize(
    "size, expected",
    [
        (123, 123),
        ("5GB", 5 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5gb", 1_500_000_000),
        ("2 KiB", 2048),
        ("10", 10),
    ],
)
def test_parse_size(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["abc", "5XB", "", 0, -1, "0GB", 1.5, True, None])
def test_parse_size_rejects_with_the_accepted_forms(size: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"max_shard_size=.* is not a positive size; pass bytes as an int or a string such as "
        r"'5GB'",
    ):
        parse_size(size)  # type: ignore[arg-type]


def test_shard_name() -> None:
    assert shard_name(1, 4) == "model-00001-of-00004.safetensors"
    assert shard_name(12, 123456) == "model-00012-of-123456.safetensors"


def _brute_force_positions(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> list[int]:
    """Element index in the global tensor of each chunk element, in chunk row-major order."""
    full = torch.arange(max(1, int(torch.tensor(shape).prod())) if shape else 1).reshape(shape)
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))
    return full[index].reshape(-1).tolist()


def _runs_to_positions(runs: list[tuple[int, int, int]], itemsize: int) -> list[int]:
    out: dict[int, int] = {}
    for tensor_off, chunk_off, n in runs:
        for k in range(0, n, itemsize):
            out[(chunk_off + k) // itemsize] = (tensor_off + k) // itemsize
    return [out[i] for i in range(len(out))]


def _random_chunks(rng: random.Random, count: int):
    for _ in range(count):
        ndim = rng.randint(0, 4)
        shape = tuple(rng.randint(1, 6) for _ in range(ndim))
        offsets = tuple(rng.randint(0, d - 1) for d in shape)
        sizes = tuple(rng.randint(1, d - o) for d, o in zip(shape, offsets, strict=False))
        yield shape, offsets, sizes


@pytest.mark.parametrize("itemsize", [1, 2, 8])
def test_chunk_runs_match_brute_force_for_random_chunks(itemsize: int) -> None:
    for shape, offsets, sizes in _random_chunks(random.Random(itemsize), 300):
        runs = list(chunk_runs(shape, offsets, sizes, itemsize))
        assert _runs_to_positions(runs, itemsize) == _brute_force_positions(
            shape, offsets, sizes
        ), (shape, offsets, sizes)
        # ascending in both offsets, and non-adjacent (a run is as long as it can be)
        for (t0, c0, n0), (t1, c1, _) in itertools.pairwise(runs):
            assert t1 > t0 + n0 - 1 and c1 == c0 + n0 and t1 != t0 + n0


def test_row_shard_is_one_run_and_column_shard_one_run_per_row() -> None:
    assert list(chunk_runs((8, 4), (4, 0), (4, 4), 2)) == [(32, 0, 32)]
    assert list(chunk_runs((3, 4), (0, 2), (3, 2), 4)) == [(8, 0, 8), (24, 8, 8), (40, 16, 8)]
    assert list(chunk_runs((), (), (), 4)) == [(0, 0, 4)]
    assert list(chunk_runs((0, 4), (0, 0), (0, 4), 4)) == []


def _spec(key: str, *shape: int, dtype: torch.dtype = torch.float32) -> TensorSpec:
    return TensorSpec(key, dtype, shape)


def test_greedy_split_respects_max_bytes_and_order() -> None:
    specs = [_spec("a", 10), _spec("b", 10), _spec("big", 100), _spec("c", 5), _spec("d", 6)]
    layout = plan_layout(specs, max_shard_bytes=80)
    assert [[e.name for e in f.entries] for f in layout.files] == [["a", "b"], ["big"], ["c", "d"]]
    assert [f.name for f in layout.files] == [shard_name(i, 3) for i in (1, 2, 3)]
    assert layout.total_size == 4 * (10 + 10 + 100 + 5 + 6)
    assert layout.weight_map == {
        "a": shard_name(1, 3),
        "b": shard_name(1, 3),
        "big": shard_name(2, 3),
        "c": shard_name(3, 3),
        "d": shard_name(3, 3),
    }


def test_headers_decode_to_the_planned_entries_and_offsets() -> None:
    specs = [
        _spec("w", 3, 5),
        _spec("n", 7, dtype=torch.bfloat16),
        _spec("s", dtype=torch.int64),
        _spec("e", 0, 3),
    ]
    layout = plan_layout(specs, max_shard_bytes=10**9)
    (f,) = layout.files
    entries, metadata, data_start = decode_header(
        f.header + bytes(f.size - f.data_start), file_size=f.size
    )
    assert metadata == {"format": "pt"}
    assert data_start == f.data_start
    assert {e.name: (e.dtype, e.shape, e.begin) for e in entries} == {
        "w": (torch.float32, (3, 5), 0), "n": (torch.bfloat16, (7,), 60),
        "s": (torch.int64, (), 74), "e": (torch.float32, (0, 3), 82),
    }  # fmt: skip
    assert {k: layout.tensor_start[k] - f.data_start for k in "wnse"} == {
        "w": 0,
        "n": 60,
        "s": 74,
        "e": 82,
    }


def test_fqn_to_index_mapping_assigns_files() -> None:
    specs = [_spec("a", 1), _spec("b", 1), _spec("c", 1)]
    layout = plan_layout(specs, max_shard_bytes=1, fqn_to_index_mapping={"a": 2, "b": 1, "c": 2})
    assert [[e.name for e in f.entries] for f in layout.files] == [["b"], ["a", "c"]]


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"a": 1}, r"fqn_to_index_mapping has no file index for \['b'\]; map every saved key"),
        ({"a": 1, "b": 1, "zz": 1}, r"names keys that are not saved: \['zz'\]"),
        ({"a": 0, "b": 1}, r"values must be 1-based ints, got \['a': 0\]"),
        (
            {"a": 1, "b": 3},
            r"uses file indices up to 3 but assigns no key to \[2\]; number the files 1..N",
        ),
    ],
)
def test_fqn_to_index_mapping_errors(mapping: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_layout(
            [_spec("a", 1), _spec("b", 1)], max_shard_bytes=10, fqn_to_index_mapping=mapping
        )


def test_unsupported_dtype_is_rejected_by_the_planner() -> None:
    with pytest.raises(ValueError, match=r"dtype torch.complex128 of 'z' cannot be stored"):
        plan_layout([_spec("z", 2, dtype=torch.complex128)], max_shard_bytes=10)


def _item(
    key: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    dtype=torch.float32,
) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(
        MetadataIndex(key, offsets),
        WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk, TensorProperties(dtype), torch.Size(shape)),
    )


def _fsdp_tp_plans() -> list[SavePlan]:
    """4 fake ranks: 2x2 mesh of a [6, 4] weight (Shard(0) x Shard(1)), an uneven [7] bias over
    2 ranks, a replicated norm kept on rank 3 after dedup, and a key held by rank 2 only."""
    plans = [[] for _ in range(4)]
    for r in range(4):
        row, col = divmod(r, 2)
        plans[r].append(_item("w", (6, 4), (3 * row, 2 * col), (3, 2)))
    plans[0].append(_item("b", (7,), (0,), (4,)))
    plans[1].append(_item("b", (7,), (4,), (3,)))
    plans[3].append(_item("norm", (5,), (0,), (5,), torch.bfloat16))
    plans[2].append(_item("only_on_2", (2, 2), (0, 0), (2, 2), torch.int8))
    return [SavePlan(items) for items in plans]


def test_rank_placements_tile_every_file_exactly() -> None:
    plans = _fsdp_tp_plans()
    specs = collect_tensor_specs(
        plans,
        key_order=[
            ["w", "b", "norm"],
            ["w", "b", "norm"],
            ["w", "norm", "only_on_2"],
            ["w", "norm"],
        ],
    )
    assert [s.key for s in specs] == ["w", "b", "norm", "only_on_2"]
    layout = plan_layout(specs, max_shard_bytes=100)
    covered: dict[int, list[tuple[int, int]]] = {}
    for plan, placed in zip(plans, place_items(layout, plans), strict=False):
        for item in plan.items:
            td, place = item.tensor_data, placed[item.index]
            itemsize = torch.empty((), dtype=td.properties.dtype).element_size()
            for t, _, n in chunk_runs(td.size, td.chunk.offsets, td.chunk.sizes, itemsize):
                covered.setdefault(place.file, []).append(
                    (place.tensor_start + t, place.tensor_start + t + n)
                )
    for i, f in enumerate(layout.files):
        spans = sorted(covered[i])
        assert spans[0][0] == f.data_start and spans[-1][1] == f.size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), "holes or overlaps"


def test_conflicting_global_shapes_across_ranks_are_rejected() -> None:
    plans = [SavePlan([_item("w", (4,), (0,), (2,))]), SavePlan([_item("w", (6,), (2,), (2,))])]
    with pytest.raises(
        ValueError,
        match=r"key 'w' is torch.float32\[4\] on one rank and torch.float32\[6\] on another",
    ):
        collect_tensor_specs(plans)
