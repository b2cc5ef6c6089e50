"""Reusable host buffers (``io/hostbuf.py``): the copy pipeline that CUDA tensors go through, run
here on CPU tensors (casts and non-contiguous sources take the same path)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import HFSavePlanner, HFStorageReader, HFStorageWriter
from hf_dcp_storage.io.hostbuf import HostBuffers, to_host
from tests.support.data import read_checkpoint


def test_pool_makes_at_most_count_buffers_and_blocks_until_one_is_released() -> None:
    pool = HostBuffers(2, 1024)
    a, b = pool.acquire(100), pool.acquire(1024)
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(10)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and pool.made == 2  # blocked: both buffers are out
    pool.release(a)
    waiter.join(
        60
    )  # a bound on a hang, not a speed: it returns as soon as the thread has the buffer
    assert got and got[0].data_ptr() == a.data_ptr()  # the same buffer, reused
    big = pool.acquire(4096)  # larger than a pooled buffer: a one-off, not counted
    assert big.numel() == 4096 and pool.made == 2
    pool.release(big)
    pool.release(b)
    pool.release(got[0])
    assert pool.acquire(1).numel() == 1024


@pytest.mark.parametrize("depth", [1, 2])
def test_to_host_casts_in_order_and_holds_at_most_depth_buffers(depth: int) -> None:
    parts = [torch.randn(16, 8, dtype=torch.float32) for _ in range(7)]
    pool = HostBuffers(depth, 16 * 8 * 4)
    seen = []
    for host, part in zip(to_host(iter(parts), torch.bfloat16, pool, depth), parts, strict=True):
        assert host.dtype == torch.bfloat16 and host.shape == part.shape
        assert torch.equal(host, part.to(torch.bfloat16))
        seen.append(host.data_ptr())
    assert pool.made == depth  # a pool of exactly `depth` buffers never ran dry (it would block)
    assert len(set(seen)) == depth  # buffers were reused
    assert len(pool._free) == depth  # all given back


def test_to_host_gives_every_buffer_back_when_closed_early() -> None:
    pool = HostBuffers(2, 4096)
    gen = to_host((torch.full((4, 4), float(i)) for i in range(10)), torch.float32, pool, 2)
    assert float(next(gen)[0, 0]) == 0.0
    assert float(next(gen)[0, 0]) == 1.0
    gen.close()
    assert len(pool._free) == pool.made == 2


def test_to_host_copies_non_contiguous_sources() -> None:
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # a transposed view
    (host,) = list(to_host([src], torch.float32, HostBuffers(1, 1024), 1))
    assert torch.equal(host, src) and host.is_contiguous()


def test_a_cast_save_and_load_reuse_a_bounded_pool(tmp_path: Path) -> None:
    """fp32 weights saved as bf16 and loaded back into fp32: every slab goes through the pool,
    which stays at two buffers per I/O thread."""
    sd = {f"w{i}": torch.randn(64, 1024) for i in range(6)}
    sd["t"] = torch.randn(32, 48).t()  # non-contiguous
    writer = HFStorageWriter(tmp_path / "ckpt", thread_count=2)
    dcp.save(sd, storage_writer=writer, planner=HFSavePlanner(save_dtype=torch.bfloat16))
    assert writer._host.pool is not None and 1 <= writer._host.pool.made <= 4
    tensors, _ = read_checkpoint(tmp_path / "ckpt")
    for key, value in sd.items():
        assert torch.equal(tensors[key], value.to(torch.bfloat16)), key
    back = {key: torch.zeros_like(value) for key, value in sd.items()}
    reader = HFStorageReader(tmp_path / "ckpt", thread_count=2)
    dcp.load(back, storage_reader=reader)
    assert reader._host.pool is not None and 1 <= reader._host.pool.made <= 4
    for key, value in sd.items():
        assert torch.equal(back[key], value.to(torch.bfloat16).float()), key
