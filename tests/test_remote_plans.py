"""Pure plans for remote stores (no server): S3 multipart parts the ranks fill, coalesced reads."""

from __future__ import annotations

import bisect
import itertools
import random

import numpy as np
import pytest
import torch

from hf_dcp_storage.format.geometry import chunk_runs
from hf_dcp_storage.plan.parts import (
    GATHER_PART_BYTES,
    MAX_PART_BYTES,
    MIN_PART_BYTES,
    GatherPart,
    RankPart,
    gather_part_bytes,
    plan_file_parts,
    route_run,
)
from hf_dcp_storage.plan.reads import coalesce
from hf_dcp_storage.plan.spread import assign

MiB = 2**20


def _plan(header_len: int, owners: list[tuple[int, int]], **kwargs):
    """``owners`` of ``(rank, nbytes)`` laid end to end after the header, neighbours of one rank
    joined (as ``plan/partplan.py`` passes them) -> ``(parts, runs as (start, rank, n), size)``."""
    runs: list[tuple[int, int, int]] = []
    pos = header_len
    for rank, n in owners:
        if n and runs and runs[-1][1] == rank and rank >= 0:
            runs[-1] = (runs[-1][0], rank, runs[-1][2] + n)
        elif n:
            runs.append((pos, rank, n))
        pos += n
    arr = np.array(runs, dtype=np.int64).reshape(-1, 3)
    return plan_file_parts(header_len, pos, arr[:, 0], arr[:, 2], arr[:, 1], **kwargs), runs, pos


def _check(parts, runs, header_len: int, size: int, *, min_part: int = MIN_PART_BYTES) -> None:
    """Parts are numbered 1..N in file order, all but the last hold at least ``min_part`` bytes,
    none over 5 GiB; together they tile the file, and a rank's own part holds only its bytes."""
    assert [p.number for p in parts] == list(range(1, len(parts) + 1))
    sizes = [p.nbytes + (p.start if isinstance(p, RankPart) and p.header else 0) for p in parts]
    assert all(n >= min_part for n in sizes[:-1]), sizes
    assert all(n <= MAX_PART_BYTES for n in sizes)
    run_starts = [r[0] for r in runs]
    pos = 0
    for p in parts:
        start = 0 if isinstance(p, RankPart) and p.header else p.start
        assert start == pos, (p, pos)
        if isinstance(p, RankPart):
            assert p.start == max(start, header_len)
            i = bisect.bisect_right(run_starts, p.start) - 1
            assert runs[i][1] == p.rank and runs[i][0] + runs[i][2] >= p.end, (p, runs[i])
        pos = p.end
    assert pos == size


def test_big_runs_are_the_ranks_own_parts_and_the_first_carries_the_header() -> None:
    parts, runs, size = _plan(1000, [(0, 20 * MiB), (1, 20 * MiB)])
    _check(parts, runs, 1000, size)
    assert parts == [
        RankPart(1, 0, 1000, 1000 + 10 * MiB, header=True),
        RankPart(2, 0, 1000 + 10 * MiB, 1000 + 20 * MiB),
        RankPart(3, 1, 1000 + 20 * MiB, 1000 + 30 * MiB),
        RankPart(4, 1, 1000 + 30 * MiB, 1000 + 40 * MiB),
    ]


def test_small_runs_are_gathered_and_take_the_front_of_the_next_big_run() -> None:
    parts, runs, size = _plan(100, [(0, 8 * MiB), (0, 1000), (1, 1000), (1, 12 * MiB), (0, 300)])
    _check(parts, runs, 100, size)
    # rank 0's 8 MiB + 1000 B joined: its own part, header in front; rank 1's 1000 B and 12 MiB
    # joined: its own; rank 0's last 300 B are the last part, again one rank's own.
    assert all(isinstance(p, RankPart) for p in parts)
    assert parts[0] == RankPart(1, 0, 100, 100 + 8 * MiB + 1000, header=True)
    parts, runs, size = _plan(8, [(0, 1000), (1, 2000), (0, 12 * MiB), (1, 3000)])
    _check(parts, runs, 8, size)
    # header + two ranks' small runs + the front of rank 0's run make 5 MiB, gathered; the rest
    # of the run is rank 0's; rank 1's last 3000 B are one rank's last part.
    assert parts[0] == GatherPart(1, 0, MIN_PART_BYTES)
    assert parts[1] == RankPart(2, 0, MIN_PART_BYTES, 8 + 3000 + 12 * MiB)
    assert parts[2] == RankPart(3, 1, 8 + 3000 + 12 * MiB, size)
    parts, runs, size = _plan(8, [(0, 1000), (1, 2000), (0, 6 * MiB), (1, 3000)])
    _check(parts, runs, 8, size)
    # Taking the front of the 6 MiB run would leave under 5 MiB: it is gathered whole.
    assert parts == [GatherPart(1, 0, size)]


def test_mixed_runs_are_gathered_and_gathers_split_evenly() -> None:
    # A column-sharded tensor (rank -1) of 53 MiB between two ranks' big runs: 3 parts near 16 MiB.
    parts, runs, size = _plan(0, [(0, 20 * MiB), (-1, 53 * MiB), (1, 20 * MiB)])
    _check(parts, runs, 0, size)
    gathered = [p for p in parts if isinstance(p, GatherPart)]
    assert len(gathered) == 3 and sum(p.nbytes for p in gathered) == 53 * MiB
    assert max(p.nbytes for p in gathered) - min(p.nbytes for p in gathered) <= 1


def test_gathered_parts_are_sized_so_the_busiest_rank_moves_at_most_5_percent_over_the_mean() -> (
    None
):
    assert gather_part_bytes(15 << 30, 1024) == MIN_PART_BYTES  # 15 MiB a rank: S3's minimum
    assert gather_part_bytes(1 << 40, 64) == GATHER_PART_BYTES  # 16 GiB a rank: the largest
    assert gather_part_bytes(131 << 30, 1024) == 3 * (131 << 30) // (
        40 * 1024
    )  # 131 MiB a rank: 9.8 MiB
    for total, world in ((131 << 30, 1024), (40 << 30, 512), (756 << 30, 8192)):
        share, part = total // world, gather_part_bytes(total, world)
        sizes = [part] * (total // part)  # every byte gathered
        moved = [share] * world
        for size, rank in zip(sizes, assign(sizes, [share] * world), strict=True):
            moved[rank] += 2 * size
        assert max(moved) / (sum(moved) / world) <= 1.05, (total, world, part)


def test_long_runs_are_cut_near_16_mib_and_huge_files_keep_under_the_part_limit() -> None:
    parts, runs, size = _plan(0, [(0, 12 * 2**30)])
    _check(parts, runs, 0, size)
    assert len(parts) == 768 and {p.nbytes for p in parts} == {16 * MiB}
    parts, runs, size = _plan(
        8, [(i % 2, MiB) for i in range(60_000)]
    )  # 60,000 one-MiB runs, two ranks
    _check(parts, runs, 8, size)
    assert len(parts) <= 5_000 and all(isinstance(p, GatherPart) for p in parts)


def test_without_a_part_minimum_every_run_from_the_own_part_size_is_its_ranks_own() -> None:
    """GCS and Azure (no part minimum, ``own_part`` 64 KiB): at 8,192 ranks a 405B model's runs
    are ~64 KiB; each run of at least ``own_part`` is its rank's own part, however far under S3's
    5 MiB; smaller runs and mixed ones are gathered, in parts of any size."""
    owners = [(r % 4, 64 << 10) for r in range(64)]  # a tensor's 64 KiB runs, rank after rank
    owners += [(r % 4, 4 << 10) for r in range(8)]  # a norm's 4 KiB runs
    owners += [(-1, 100_000)] + [(r % 4, 200 << 10) for r in range(16)]
    parts, runs, size = _plan(24, owners, min_part=1, own_part=64 << 10, rank_part=16 * MiB)
    _check(parts, runs, 24, size, min_part=1)
    own = [p for p in parts if isinstance(p, RankPart)]
    assert [p.nbytes for p in own] == [64 << 10] * 64 + [200 << 10] * 16
    assert own[0].header and own[0].start == 24
    gathered = [p for p in parts if isinstance(p, GatherPart)]
    assert [p.nbytes for p in gathered] == [8 * (4 << 10) + 100_000]  # the norm, the mixed run
    # The same runs under S3's rules: every run is under 5 MiB, so all are gathered.
    parts, runs, size = _plan(24, owners)
    assert not any(isinstance(p, RankPart) for p in parts)


def test_a_file_of_more_runs_than_the_part_limit_gathers_its_smallest_runs_until_it_fits() -> None:
    """Azure's 50,000 blocks a blob (GCS's compose-tree limit): where every own run would make
    too many parts, the least own run rises just enough for the file to fit: the smallest runs
    are gathered, every larger one stays its rank's."""
    rng = random.Random(7)
    sizes = [rng.choice([64, 100, 150, 300, 1000, 5000]) for _ in range(2_000)]
    owners = [(i % 7, n) for i, n in enumerate(sizes)]
    free, _, _ = _plan(0, owners, min_part=1, own_part=64, rank_part=1 << 20)
    assert len(free) == 2_000  # every run its own part
    parts, runs, size = _plan(
        0, owners, min_part=1, own_part=64, rank_part=1 << 20, gather_part=4096, max_parts=1_000
    )
    _check(parts, runs, 0, size, min_part=1)
    assert len(parts) <= 1_000
    gathered = [p for p in parts if isinstance(p, GatherPart)]
    # Per run: whether its bytes go through a gathered part.
    in_gathered = [any(p.start < a + n and a < p.end for p in gathered) for a, _, n in runs]
    largest_gathered = max(n for (_, _, n), g in zip(runs, in_gathered, strict=True) if g)
    # The gathered runs are the smallest: every larger run is its rank's own part.
    assert all(
        not g for (_, _, n), g in zip(runs, in_gathered, strict=True) if n > largest_gathered
    )
    assert largest_gathered < max(sizes)
    assert sum(not g for g in in_gathered) > 300  # not all of them gathered


def test_gathered_stretches_are_cut_at_the_nodes_runs() -> None:
    """S3 at scale: every rank's run is under 5 MiB, but a node's 4 ranks hold 8 MiB side by
    side. Cut at the nodes' runs, each gathered part is one node's bytes (then gathered on that
    node, crossing hosts once); cut evenly, parts straddle nodes."""
    owners = [(r, 2 * MiB) for r in range(16)]  # 4 nodes of 4 ranks, 8 MiB a node
    owners += [(r, 64 << 10) for r in range(16)]  # a small tensor: 256 KiB a node
    nodes_of = lambda runs: np.array([max(r, -1) // 4 for _, r, _ in runs])  # noqa: E731
    _, runs, _ = _plan(16, owners)
    parts, runs, size = _plan(16, owners, gather_part=16 * MiB, run_nodes=nodes_of(runs))
    _check(parts, runs, 16, size)
    assert all(isinstance(p, GatherPart) for p in parts)

    def nodes_in(p):
        return {r // 4 for a, r, n in runs if a < p.end and a + n > max(p.start, 16)}

    # Each node's 8 MiB its own part; the small tensor's 1 MiB, every node's, the last part.
    assert [len(nodes_in(p)) for p in parts] == [1, 1, 1, 1, 4]
    assert [p.nbytes for p in parts] == [8 * MiB + 16] + [8 * MiB] * 3 + [MiB]  # header first
    even, _, _ = _plan(16, owners, gather_part=16 * MiB)
    assert max(len(nodes_in(p)) for p in even) >= 2


def test_random_runs_cut_at_nodes_are_valid_parts() -> None:
    rng = random.Random(3)
    for _ in range(200):
        owners = [
            (rng.randrange(-1, 8), rng.choice([0, 1, 7, 40, 63, 64, 65, 100, 300, 1000]))
            for _ in range(rng.randrange(1, 60))
        ]
        header = rng.choice([0, 8, 70])
        _, runs, _ = _plan(header, owners, min_part=64, rank_part=256)
        nodes = np.array([r // 2 if r >= 0 else -1 for _, r, _ in runs], dtype=np.int64)
        parts, runs, size = _plan(
            header, owners, min_part=64, rank_part=256, gather_part=128, run_nodes=nodes
        )
        _check(parts, runs, header, size, min_part=64)


def test_node_cuts_without_a_minimum_equal_the_cuts_one_node_run_at_a_time() -> None:
    """The numpy path (no part minimum: GCS, Azure) cuts exactly as the step-by-step one does."""
    from hf_dcp_storage.plan.nodecuts import NodeRuns, even_cuts, node_cuts

    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        nbytes = rng.choice([1, 7, 64, 100, 300, 5000], size=n).astype(np.int64)
        starts = 10 + np.concatenate(([0], np.cumsum(nbytes)[:-1]))
        nodes = rng.integers(-1, 4, size=n).astype(np.int64)
        runs = NodeRuns(starts, nbytes, nodes)
        a = int(rng.integers(0, 20))
        b = int(starts[-1] + nbytes[-1]) - int(rng.integers(0, 3))
        if b <= a:
            continue
        target, node_min = int(rng.choice([50, 256, 4096])), int(rng.choice([1, 64, 300]))
        fast = np.concatenate([e[:-1] for e in node_cuts(a, b, runs, 1, node_min, target, True)])
        # The same one stretch at a time: every big node run, and each gap, cut evenly.
        s, e = np.maximum(runs.start, a), np.minimum(runs.end, b)
        edges, pos = [], a
        for i in np.flatnonzero((runs.node >= 0) & (e - s >= node_min) & (s < b) & (e > a)):
            if s[i] > pos:
                edges.append(even_cuts(pos, int(s[i]), target)[:-1])
            edges.append(even_cuts(int(s[i]), int(e[i]), target)[:-1])
            pos = int(e[i])
        if pos < b:
            edges.append(even_cuts(pos, b, target)[:-1])
        assert fast.tolist() == np.concatenate(edges).tolist()


@pytest.mark.parametrize("nodes", [False, True])
def test_a_file_without_a_part_minimum_is_cut_at_once_as_run_by_run(nodes: bool) -> None:
    """GCS and Azure (no minimum): the numpy cut of a whole file gives the parts the step per own
    run gives, header, node cuts and the one-rank rule included."""
    from hf_dcp_storage.plan.nodecuts import NodeRuns
    from hf_dcp_storage.plan.parts import _cut_file

    rng = random.Random(11)
    for _ in range(300):
        owners = [
            (rng.randrange(-1, 8), rng.choice([1, 7, 40, 64, 65, 100, 300, 1000, 5000]))
            for _ in range(rng.randrange(1, 50))
        ]
        header = rng.choice([0, 8, 70])
        _, runs, size = _plan(header, owners, min_part=64)
        arr = np.array(runs, dtype=np.int64).reshape(-1, 3)
        starts, ranks, nbytes = arr[:, 0], arr[:, 1], arr[:, 2]
        node_runs = (
            NodeRuns(starts, nbytes, np.where(ranks >= 0, ranks // 2, -1)) if nodes else None
        )
        own, node = rng.choice([1, 64, 300]), rng.choice([0, 50, 200])
        args = (header, size, starts, nbytes, ranks, 1, 256, 128, 10_000, own, node_runs, node)
        fast = _cut_file(*args)
        assert fast == _cut_file(*args, vectorized=False)
        _check(fast, runs, header, size, min_part=1)


def test_runs_that_do_not_tile_the_file_are_refused() -> None:
    one = np.array([5])
    with pytest.raises(ValueError, match="do not tile it"):
        plan_file_parts(10, 16, np.array([11]), one, np.array([0]))
    with pytest.raises(ValueError, match="do not tile it"):
        plan_file_parts(10, 16, np.array([10]), one, np.array([0]))


@pytest.mark.parametrize("seed", range(30))
def test_random_runs_and_their_routing(seed: int) -> None:
    """Random owners and sizes (min part 64 B): valid parts; each rank's routing sends every byte
    it holds either into one of its parts or to its staged object, and the staged bytes of all
    ranks are exactly the gathered parts' bytes but the header's."""
    rng = random.Random(seed)
    min_part = 64
    owners = [
        (rng.randrange(-1, 3), rng.choice([0, 1, 7, 40, 63, 64, 65, 100, 300, 1000]))
        for _ in range(rng.randrange(1, 40))
    ]
    header = rng.choice([0, 8, 70])
    parts, runs, size = _plan(header, owners, min_part=min_part, rank_part=256)
    _check(parts, runs, header, size, min_part=min_part)
    staged = bytearray(size)
    for rank in range(-1, 3):
        mine = [p for p in parts if isinstance(p, RankPart) and p.rank == rank]
        assert rank >= 0 or not mine  # mixed bytes are never a rank's own part
        for start, owner, n in runs:
            if owner != rank:
                continue
            for at, take, part in route_run(start, n, [p.start for p in mine], mine):
                if part is None:
                    staged[at : at + take] = b"\x01" * take
                else:
                    assert part.start <= at and at + take <= part.end
    gathered = bytearray(size)
    for p in parts:
        if isinstance(p, GatherPart):
            gathered[max(p.start, header) : p.end] = b"\x01" * (p.end - max(p.start, header))
    assert staged == gathered


# -- coalesced ranged reads ------------------------------------------------------------------------


def test_coalesce_joins_adjacent_and_near_spans_only() -> None:
    assert coalesce([]) == []
    assert coalesce([(0, 100), (100, 200), (205, 300)], gap_bytes=0) == [
        (0, 300)
    ]  # gap 5 <= 10% of 95
    assert coalesce([(0, 100), (150, 250)], gap_bytes=0) == [
        (0, 100),
        (150, 250),
    ]  # gap 50 > 10% of 100
    assert coalesce([(0, 100), (150, 250)], waste=0.5, gap_bytes=0) == [(0, 250)]
    assert coalesce([(0, 100), (150, 250)], gap_bytes=50) == [
        (0, 250)
    ]  # a gap cheaper than a request


def test_column_shard_of_narrow_rows_is_one_request_and_of_wide_rows_one_per_row() -> None:
    """Half of each row: 4 KiB halves (gaps far under a request's worth) -> one request of 2x the
    bytes; 2 MiB halves -> one request per row, exactly the bytes needed."""
    narrow = [(t, t + n) for t, _, n in chunk_runs((1024, 4096), (0, 2048), (1024, 2048), 2)]
    assert coalesce(narrow) == [(4096, 1024 * 8192)]
    wide = [(t, t + n) for t, _, n in chunk_runs((4, 2 * 2**20), (0, 2**20), (4, 2**20), 2)]
    assert coalesce(wide) == wide and len(wide) == 4


@pytest.mark.parametrize("seed", range(20))
def test_coalesced_requests_cover_every_run_within_10_percent_extra(seed: int) -> None:
    """Runs of a random region of a random tensor (row and column cuts), with no gap allowance:
    every run lies inside one request, requests are disjoint and ordered, and they fetch at most
    1.1x the needed bytes."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))
    offsets = tuple(rng.randrange(d) for d in shape)
    sizes = tuple(rng.randint(1, d - o) for d, o in zip(shape, offsets, strict=False))
    itemsize = rng.choice([1, 2, 4])
    spans = [(t, t + n) for t, _, n in chunk_runs(shape, offsets, sizes, itemsize)]
    requests = coalesce(spans, gap_bytes=0)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(requests))
    assert all(any(s >= r0 and e <= r1 for r0, r1 in requests) for s, e in spans)
    needed = sum(e - s for s, e in spans)
    assert sum(e - s for s, e in requests) <= 1.1 * needed
    if sizes[1:] == shape[1:]:
        assert len(requests) == 1  # a row cut is contiguous: one request
    # With the default gap allowance (1 MiB, far above these tensors) each region is one request.
    assert len(coalesce(spans)) == 1


def test_remote_column_shard_slabs_fetch_about_16_mib_whatever_the_world_size() -> None:
    """On a remote store a slab of a narrow-row column shard is read as whole rows (the gaps are
    cheaper than requests), so the reader shrinks the slab: fetched bytes per slab stay ~16 MiB."""
    from types import SimpleNamespace

    from hf_dcp_storage.io.slabs import SLAB_BYTES, slab_bounds
    from hf_dcp_storage.plan.loadmeta import Stored as _Stored
    from hf_dcp_storage.reader import HFStorageReader

    stored = _Stored("f.safetensors", 0, torch.bfloat16, (16384, 4096))
    remote, local = HFStorageReader("memory://x/ck"), HFStorageReader("/tmp/ck")
    for world in (1, 2, 8, 64):
        item = SimpleNamespace(storage_offsets=(0, 0), lengths=(16384, 4096 // world))
        r0, r1 = next(slab_bounds(item.lengths, 2, remote._slab_bytes(stored, item)))
        fetched = (r1 - r0) * 4096 * 2  # whole rows
        assert SLAB_BYTES // 2 < fetched <= SLAB_BYTES, (world, fetched)
        assert local._slab_bytes(stored, item) == SLAB_BYTES  # local reads only the runs
    wide = _Stored("f.safetensors", 0, torch.float32, (64, 2**20))  # 2 MiB half-rows: gaps skipped
    assert (
        remote._slab_bytes(wide, SimpleNamespace(storage_offsets=(0, 0), lengths=(64, 2**19)))
        == SLAB_BYTES
    )


def test_file_parts_are_arrays_that_read_as_the_part_objects() -> None:
    from hf_dcp_storage.plan.fileparts import FileParts

    objects = [
        RankPart(1, 3, 100, 300, header=True),
        GatherPart(2, 300, 900),
        RankPart(3, 0, 900, 1000),
    ]
    parts = FileParts.of(objects)
    assert parts == objects and objects == parts and list(parts) == objects
    assert len(parts) == 3 and parts[1] == objects[1] and parts[-1] == objects[2]
    assert parts[1:] == objects[1:]
    assert parts.own() == [objects[0], objects[2]]
    assert parts.nbytes.tolist() == [200, 600, 100]
    assert parts != objects[:2] and parts != FileParts.of(objects[:2])
    with pytest.raises(IndexError, match="part index 3 out of range for a file of 3 parts"):
        parts[3]
    # What the planner returns is such arrays, equal to the objects it stands for.
    cut, _, _ = _plan(1000, [(0, 20 * MiB), (1, 20 * MiB)])
    assert isinstance(cut, FileParts) and FileParts.of(list(cut)) == cut
