"""A load's requests planned across tensors (``plan/reads.plan_requests``, pure) and read in
batches bounded in host memory (``reading.py``, on ``memory://``: the ranged-request path with no
server)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.plan.reads import Request, plan_requests
from hf_dcp_storage.reading import request_budget
from tests.support.data import assert_same, random_tensor


def _deliver(requests: list[Request], file: bytes, sinks: list[bytearray]) -> None:
    """What a store's reads do with the requests: each one's bytes copied into its pieces."""
    for r in requests:
        got = file[r.start : r.end]
        for at, n, sink, offset in r.pieces:
            sinks[sink][offset : offset + n] = got[at : at + n]


def test_runs_of_neighbouring_tensors_are_one_request_and_go_to_their_own_sinks() -> None:
    # Three tensors side by side, a rank's runs of each: one request, three pieces.
    wants = [(200, 300, 2, 0), (0, 100, 0, 0), (100, 200, 1, 50)]
    assert plan_requests(wants) == [
        Request(0, 300, ((0, 100, 0, 0), (100, 100, 1, 50), (200, 100, 2, 0)))
    ]


def test_a_gap_is_read_only_when_small() -> None:
    # 50-byte gap: more than 10 % of the 100-byte run after it and more than gap_bytes.
    far = plan_requests([(0, 100, 0, 0), (150, 250, 1, 0)], gap_bytes=10)
    assert [(r.start, r.end) for r in far] == [(0, 100), (150, 250)]
    near = plan_requests([(0, 100, 0, 0), (150, 250, 1, 0)], gap_bytes=50)
    assert [(r.start, r.end) for r in near] == [(0, 250)]
    assert near[0].pieces == ((0, 100, 0, 0), (150, 100, 1, 0))


def test_a_long_span_is_cut_into_equal_requests_and_a_run_across_a_cut_is_split() -> None:
    requests = plan_requests([(0, 100, 0, 0)], request_bytes=30)
    assert [(r.start, r.end) for r in requests] == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert [r.pieces for r in requests] == [
        ((0, 25, 0, 0),),
        ((0, 25, 0, 25),),
        ((0, 25, 0, 50),),
        ((0, 25, 0, 75),),
    ]


def test_overlapping_wants_are_read_once_for_both() -> None:
    requests = plan_requests([(0, 100, 0, 0), (50, 120, 1, 0)])
    assert requests == [Request(0, 120, ((0, 100, 0, 0), (50, 70, 1, 0)))]


@pytest.mark.parametrize("seed", range(20))
def test_random_wants_are_filled_exactly_in_few_requests(seed: int) -> None:
    rng = random.Random(seed)
    file = rng.randbytes(1 << 20)
    wants, sinks, cursor = [], [], 0
    for sink in range(rng.randint(1, 60)):
        cursor += rng.choice([0, 0, rng.randint(1, 5000), rng.randint(1, 200_000)])
        n = rng.randint(1, 40_000)
        if cursor + n > len(file):
            break
        wants.append((cursor, cursor + n, sink, 7))
        sinks.append(bytearray(n + 7))
        cursor = max(0, cursor + (n if rng.random() < 0.8 else -n // 2))  # some overlap
    rng.shuffle(wants)
    request_bytes = rng.choice([4096, 65_536, 1 << 20])
    requests = plan_requests(wants, request_bytes=request_bytes, gap_bytes=8192)
    _deliver(requests, file, sinks)
    for start, end, sink, at in wants:
        assert sinks[sink][at:] == file[start:end]
    assert all(r.end - r.start <= request_bytes for r in requests)
    read = sum(r.end - r.start for r in requests)
    spans = len({(r.start, r.end) for r in requests})
    assert spans == len(requests)  # no byte asked twice
    # At most one request per joined span plus the bytes read over the request size.
    joined = 1 + sum(1 for a, b in itertools.pairwise(requests) if a.end < b.start)
    assert len(requests) <= joined + read // request_bytes + 1


def test_bad_request_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"request_bytes=0 must be >= 1"):
        plan_requests([(0, 1, 0, 0)], request_bytes=0)


def test_the_buffer_is_shared_by_slabs_and_requests() -> None:
    assert request_budget(512 << 20) == (256 << 20, 16, 16 << 20)
    assert request_budget(64 << 20) == (32 << 20, 2, 16 << 20)


@pytest.mark.parametrize("cast", [False, True], ids=["in-place", "through-host-memory"])
def test_a_load_through_host_memory_holds_no_more_than_its_buffer(cast: bool) -> None:
    """48 MiB of tensors loaded into another dtype with the smallest buffer (64 MiB: 32 MiB for
    slabs): the slabs go in several batches, none taking more host memory than its half, and
    every value arrives; into the stored dtype nothing goes through host memory."""
    sd = {f"layer.{i}": random_tensor((1024, 1024), torch.float32, i) for i in range(12)}
    url = "memory://read_plan/buffer"
    dcp.save(sd, storage_writer=HFStorageWriter(url, overwrite=True), no_dist=True)
    dtype = torch.bfloat16 if cast else torch.float32
    dest = {k: torch.zeros_like(v, dtype=dtype) for k, v in sd.items()}
    reader = HFStorageReader(url, buffer_size="64MiB")
    dcp.load(dest, storage_reader=reader, no_dist=True)
    for k, v in sd.items():
        assert_same(dest[k], v.to(dtype), k)
    stats = reader.load_stats
    assert stats.bytes_wanted == sum(v.numel() * 4 for v in sd.values())
    if cast:
        assert stats.batches >= 2 and 0 < stats.host_bytes_peak <= 32 << 20
    else:
        assert stats.batches == 1 and stats.host_bytes_peak == 0
    assert stats.in_flight_bytes == 32 << 20


def test_a_buffer_too_small_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"buffer_size='1MB' is 1000000 bytes; .* at least 64MiB"):
        HFStorageReader("memory://x", buffer_size="1MB")


def test_a_failed_load_gives_every_host_buffer_back() -> None:
    """The reader keeps its host buffers across loads: a load that fails (here a file cut short
    after the save) must hand back what it took, or the next load would wait for them forever."""
    import fsspec

    sd = {f"layer.{i}": random_tensor((256, 1024), torch.float32, i) for i in range(8)}
    url = "memory://read_plan/cut"
    dcp.save(sd, storage_writer=HFStorageWriter(url, overwrite=True), no_dist=True)
    fs = fsspec.filesystem("memory")
    name = next(p for p in fs.find("/read_plan/cut") if p.endswith(".safetensors"))
    fs.pipe_file(name, fs.cat_file(name)[:-100_000])
    reader = HFStorageReader(url)
    dest = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in sd.items()}
    with pytest.raises(BaseException, match=r"the file is truncated"):
        dcp.load(dest, storage_reader=reader, no_dist=True)
    pool = reader._host.pool
    assert pool is not None and pool.made > 0 and len(pool._free) == pool.made
