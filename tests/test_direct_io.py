"""Direct I/O on local disk: the same bytes as the buffered path, the pages a rank writes directly
its own, and a clear fallback (or error) where the filesystem refuses ``O_DIRECT``.

The refusing filesystem is a real one: ramfs, mounted for the test (it needs root; skipped with
the reason where the mount is not allowed). tmpfs and ext4 here take ``O_DIRECT``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dcp_storage import CheckpointManager, HFStorageReader, HFStorageWriter
from hf_dcp_storage.io import aligned
from hf_dcp_storage.io.aligned import AlignedPool
from hf_dcp_storage.io.direct import (
    ALIGN,
    MIN_DIRECT,
    WRITE_BUFFERS,
    AlignedBuffers,
    DirectWriter,
    interior,
    open_direct,
    pread_run,
)
from hf_dcp_storage.plan.layout import DATA_ALIGN
from tests.support.jobs import run_job

# Row counts and widths that put every rank boundary off a page (and some tensors under
# MIN_DIRECT, written buffered whole).
SHAPES = {
    "embed": ((1001, 515), torch.float32),
    "proj": ((700, 1100), torch.bfloat16),
    "norm": ((515,), torch.float32),
    "bias": ((3,), torch.int64),
}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: (torch.randn(s, generator=g) * 100).to(d) for k, (s, d) in SHAPES.items()}


def _folder(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(0, 1 << 24), st.integers(0, 1 << 23))
def test_the_direct_part_of_a_run_is_whole_pages_inside_it(offset: int, n: int) -> None:
    start, end = interior(offset, n)
    if start == end:
        # Nothing direct: only when the run holds fewer than MIN_DIRECT bytes of whole pages.
        assert (offset + n) // ALIGN * ALIGN - -(-offset // ALIGN) * ALIGN < MIN_DIRECT
        return
    assert start % ALIGN == 0 and end % ALIGN == 0 and offset <= start < end <= offset + n
    assert start - offset < ALIGN and offset + n - end < ALIGN  # every whole page of the run


def _whole_pages(start: int, end: int) -> int:
    return max(0, end // ALIGN * ALIGN - -(-start // ALIGN) * ALIGN)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(0, 3 * ALIGN),  # where the first stream starts
    st.lists(
        st.lists(st.integers(1, 3 * ALIGN + 7), min_size=1, max_size=6), min_size=1, max_size=4
    ),  # each stream's run lengths
    st.booleans(),
    st.integers(0, (1 << 28) - 1),
)
def test_streams_write_their_bytes_and_only_their_own_whole_pages_direct(
    tmp_path_factory, first: int, runs: list[list[int]], threaded: bool, placed: int
) -> None:
    """Neighbouring streams (ranks' byte ranges meeting inside a page) split into runs at
    arbitrary offsets: the file holds every byte, and each stream wrote directly exactly the
    whole pages of its own range (a page it shares goes through the page cache). Runs whose bit
    in ``placed`` is set are put where ``reserve`` says (no copy), where it gives a place."""
    path = tmp_path_factory.mktemp("streams") / "f.bin"
    lead = MIN_DIRECT + ALIGN + 5  # every stream's first run has an interior to write directly
    streams, pos = [], first
    for lengths in runs:
        sizes = [lead, *lengths]
        streams.append((pos, sizes))
        pos += sum(sizes)
    data = (
        torch.randint(
            0, 256, (pos,), dtype=torch.uint8, generator=torch.Generator().manual_seed(pos)
        )
        .numpy()
        .tobytes()
    )
    with open(path, "wb") as f:
        f.truncate(pos)
    fd, direct_fd = os.open(path, os.O_WRONLY), open_direct(str(path), write=True)
    assert direct_fd is not None, "the test folder's filesystem takes O_DIRECT"
    # Buffers smaller than most runs: several pieces per run, and runs too long to be placed.
    writer = DirectWriter(buffers=2, pool=AlignedPool((MIN_DIRECT >> 12 << 12) + 4 * ALIGN))
    done: dict[int, int] = {}

    def write(k: int) -> None:
        start, sizes = streams[k]
        stream, at = writer.stream(direct_fd, fd), start
        for j, n in enumerate(sizes):
            run = memoryview(data)[at : at + n]
            view = stream.reserve(at, n) if placed >> (7 * k + j) & 1 else None
            if view is not None:
                view[:] = run
                run = view
            stream.write(run, at)
            at += n
        stream.flush()
        done[k] = stream.direct

    try:
        if threaded:
            threads = [threading.Thread(target=write, args=(k,)) for k in range(len(streams))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for k in range(len(streams)):
                write(k)
        writer.close()
    finally:
        os.close(fd)
        os.close(direct_fd)
    assert path.read_bytes()[first:] == data[first:]
    assert done == {
        k: _whole_pages(start, start + sum(sizes)) for k, (start, sizes) in enumerate(streams)
    }


def test_a_failed_direct_write_fails_the_writer_with_its_error(tmp_path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4 * MIN_DIRECT))
    fd = os.open(path, os.O_WRONLY)
    read_only = os.open(path, os.O_RDONLY | os.O_DIRECT)  # a write through it fails (EBADF)
    writer = DirectWriter(buffers=1)
    try:
        stream = writer.stream(read_only, fd)
        stream.write(memoryview(bytes(2 * MIN_DIRECT)), 0)
        with pytest.raises(OSError, match="Bad file descriptor"):
            writer.close()
        with pytest.raises(RuntimeError, match="a stream wrote after the writer was closed"):
            writer.stream(read_only, fd).write(memoryview(bytes(2 * MIN_DIRECT)), 0)
    finally:
        writer.close(check=False)
        os.close(fd)
        os.close(read_only)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    st.integers(0, 5 * ALIGN),
    st.integers(MIN_DIRECT, MIN_DIRECT + 9 * ALIGN),
    st.integers(-3 * ALIGN, 3 * ALIGN),
)
def test_a_direct_read_of_a_run_longer_than_its_buffer_reads_every_byte(
    tmp_path_factory, offset: int, n: int, cut: int
) -> None:
    """A run read a buffer at a time (buffers of a few pages here: many per run), whatever its
    offset and length; a file that ends inside the run (``cut`` < 0) is an error naming it."""
    path = tmp_path_factory.mktemp("reads") / "f.bin"
    size = offset + n + cut
    data = (
        torch.randint(
            0,
            256,
            (max(size, 0),),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(size),
        )
        .numpy()
        .tobytes()
    )
    path.write_bytes(data)
    fd, direct_fd = os.open(path, os.O_RDONLY), open_direct(str(path), write=False)
    assert direct_fd is not None
    buffers = AlignedBuffers(AlignedPool(3 * ALIGN))
    out = bytearray(n)
    try:
        if cut < 0:
            with pytest.raises(
                ValueError,
                match=r"the file\.bin: unexpected end of file at byte \d+; the file is truncated",
            ):
                pread_run(direct_fd, fd, memoryview(out), offset, buffers, where="the file.bin")
            assert out[: size - offset] == data[offset:]  # up to the file's end, read
        else:
            read = pread_run(direct_fd, fd, memoryview(out), offset, buffers, where="the file.bin")
            assert bytes(out) == data[offset : offset + n]
            assert read >= n  # all of it directly: the aligned superset
    finally:
        buffers.close()
        os.close(fd)
        os.close(direct_fd)


def test_a_whole_slab_at_any_page_shift_is_placed_and_written_from_its_buffer(tmp_path) -> None:
    """A slab of SLAB_BYTES a few bytes into a page (the usual case) fits a buffer of the
    process's pool, so a slab that needs a copy anyway is copied once, into it."""
    from hf_dcp_storage.io.slabs import SLAB_BYTES

    path, at = tmp_path / "f.bin", 4 * ALIGN + 2
    data = (
        torch.randint(
            0, 256, (SLAB_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
        )
        .numpy()
        .tobytes()
    )
    path.write_bytes(bytes(at + SLAB_BYTES + 7))
    fd, direct_fd = os.open(path, os.O_WRONLY), open_direct(str(path), write=True)
    assert direct_fd is not None
    writer = DirectWriter()
    try:
        stream = writer.stream(direct_fd, fd)
        view = stream.reserve(at, SLAB_BYTES)
        assert view is not None and len(view) == SLAB_BYTES
        view[:] = data
        stream.write(view, at)
        stream.flush()
        writer.close()
        assert stream.direct == (at + SLAB_BYTES) // ALIGN * ALIGN - 5 * ALIGN  # every whole page
    finally:
        writer.close(check=False)
        os.close(fd)
        os.close(direct_fd)
    assert path.read_bytes()[at : at + SLAB_BYTES] == data


def test_the_aligned_buffers_are_kept_for_the_next_save_and_load(tmp_path) -> None:
    """A direct save gives its buffers back and the next save takes the same ones (not new
    mappings), as a load does; ``release`` unmaps them, and more than ``keep`` are not kept."""
    aligned.POOL.release()
    dcp.save(
        _full(), storage_writer=HFStorageWriter(str(tmp_path / "a"), direct_io=True), no_dist=True
    )
    kept = list(aligned.POOL._free)
    assert 0 < len(kept) <= WRITE_BUFFERS
    dcp.save(
        _full(), storage_writer=HFStorageWriter(str(tmp_path / "b"), direct_io=True), no_dist=True
    )
    assert sorted(map(id, aligned.POOL._free)) == sorted(map(id, kept))
    dcp.load(
        {k: torch.zeros_like(t) for k, t in _full().items()},
        storage_reader=HFStorageReader(str(tmp_path / "b"), direct_io=True),
        no_dist=True,
    )
    assert {id(b) for b in aligned.POOL._free} == {id(b) for b in kept}
    aligned.POOL.release()
    assert aligned.POOL.free == 0 and all(b.closed for b in kept)

    pool = AlignedPool(ALIGN, keep=2)
    bufs = [pool.take() for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.free == 2 and bufs[2].closed and not bufs[0].closed
    with pytest.raises(
        ValueError,
        match=r"AlignedPool\(nbytes=100, keep=1\): needs nbytes a positive multiple of the page "
        r"size",
    ):
        AlignedPool(100, keep=1)


def test_a_forked_child_starts_with_an_empty_pool(tmp_path) -> None:
    dcp.save(
        _full(), storage_writer=HFStorageWriter(str(tmp_path / "a"), direct_io=True), no_dist=True
    )
    assert aligned.POOL.free > 0
    pid = os.fork()
    if pid == 0:  # the child: none of the parent's buffers, and a pool that works (its lock is new)
        code = 1
        try:
            if aligned.POOL.free == 0:
                aligned.POOL.give(aligned.POOL.take())
                code = 0 if aligned.POOL.free == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert aligned.POOL.free > 0  # the parent's are still there


def test_every_file_s_data_starts_on_a_page(tmp_path) -> None:
    from safetensors import safe_open

    dcp.save(
        _full(),
        storage_writer=HFStorageWriter(str(tmp_path / "ck"), max_shard_size="2MB"),
        no_dist=True,
    )
    files = sorted((tmp_path / "ck").glob("*.safetensors"))
    assert len(files) > 1
    for f in files:
        raw = f.read_bytes()
        assert (8 + int.from_bytes(raw[:8], "little")) % DATA_ALIGN == 0, f.name
        with safe_open(str(f), "pt") as opened:  # the padded header is plain safetensors
            for key in opened.keys():  # noqa: SIM118 - a safe_open handle is no dict: it has keys() only
                assert torch.equal(opened.get_tensor(key), _full()[key]), key


def _save(rank: int, world: int, base: str, layout: str) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dim = {"rows": 0, "cols": 1}[layout]
    sd = {
        k: distribute_tensor(t, mesh, [Shard(min(dim, t.dim() - 1))], src_data_rank=None)
        for k, t in _full().items()
    }
    out = {}
    for mode, flag in (("direct", True), ("buffered", False)):
        writer = HFStorageWriter(f"{base}/{mode}", direct_io=flag, max_shard_size="2MB")
        dcp.save(sd, storage_writer=writer)
        out[mode] = writer.merge_stats.direct_io_bytes
    dest = {
        k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(min(dim, t.dim() - 1))])
        for k, t in _full().items()
    }
    dcp.load(dest, storage_reader=HFStorageReader(f"{base}/direct", direct_io=True))
    for k, t in sd.items():
        assert torch.equal(dest[k].to_local(), t.to_local()), k
    return out


LONG = ("embed", "proj")  # every rank's shard a run long enough to go direct


def _save_cast(rank: int, world: int, base: str) -> dict[str, object]:
    """float32 shards saved as bfloat16 (each slab cast on its way out), direct and buffered."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_dcp_storage import HFSavePlanner

    mesh = init_device_mesh("cpu", (world,))
    full = {k: t.float() for k, t in _full().items() if k in LONG}
    sd = {k: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for k, t in full.items()}
    out: dict[str, object] = {}
    for mode, flag in (("direct", True), ("buffered", False)):
        writer = HFStorageWriter(f"{base}/{mode}", direct_io=flag, max_shard_size="2MB")
        dcp.save(sd, storage_writer=writer, planner=HFSavePlanner(save_dtype=torch.bfloat16))
        out[mode] = writer.merge_stats.direct_io_bytes if dist.get_rank() == 0 else None
        out[f"{mode}_host_buffers"] = 0 if writer._host.pool is None else writer._host.pool.made
    return out


@pytest.mark.distributed
def test_a_cast_save_copies_its_slabs_straight_into_the_direct_buffers(tmp_path) -> None:
    """A slab that needs a copy (cast here; on CUDA, the device-to-host copy) is copied into the
    aligned buffer it is written from, not into a host buffer first: the same bytes as the
    buffered save, and the direct save used no host buffer for its long runs."""
    stats = run_job(_save_cast, 2, str(tmp_path), timeout=180).check_returned()
    assert _folder(tmp_path / "direct") == _folder(tmp_path / "buffered")
    assert stats[0]["direct"] > 0.8 * sum(_full()[k].numel() * 2 for k in LONG), stats
    assert [(s["direct_host_buffers"], s["buffered_host_buffers"] > 0) for s in stats] == [
        (0, True)
    ] * 2, stats


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_direct_and_buffered_saves_write_the_same_bytes_on_two_ranks(tmp_path, layout: str) -> None:
    stats = run_job(_save, 2, str(tmp_path), layout, timeout=180).check_returned()[0]
    assert _folder(tmp_path / "direct") == _folder(tmp_path / "buffered")
    assert stats["buffered"] == 0
    if layout == "rows":
        # Row shards are long runs: most of their bytes went to disk directly.
        assert stats["direct"] > 0.8 * sum(
            t.numel() * t.element_size() for t in _full().values()
        ), stats
    else:
        assert (
            stats["direct"] < stats["buffered"] + MIN_DIRECT
        )  # column shards: short runs, through the cache


def test_a_direct_load_reads_what_a_buffered_load_reads(tmp_path) -> None:
    dcp.save(_full(), storage_writer=HFStorageWriter(str(tmp_path / "ck")), no_dist=True)
    for flag in (True, False, None):
        dest = {k: torch.zeros_like(t) for k, t in _full().items()}
        dcp.load(
            dest, storage_reader=HFStorageReader(str(tmp_path / "ck"), direct_io=flag), no_dist=True
        )
        assert all(torch.equal(dest[k], t) for k, t in _full().items()), flag


@pytest.fixture
def ramfs(tmp_path) -> Iterator[Path]:
    """A ramfs mount (no O_DIRECT) under ``tmp_path``."""
    where = tmp_path / f"ramfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a ramfs here (needs root): {done.stderr.strip() or done.returncode}"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_where_o_direct_is_refused_saves_fall_back_and_say_so(ramfs, tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hf_dcp_storage"):
        writer = HFStorageWriter(str(ramfs / "ck"))
        dcp.save(_full(), storage_writer=writer, no_dist=True)
    assert writer.merge_stats.direct_io_bytes == 0
    assert any(
        "refuses O_DIRECT: this save goes through the page cache" in r.getMessage()
        for r in caplog.records
    )
    dcp.save(_full(), storage_writer=HFStorageWriter(str(tmp_path / "ref")), no_dist=True)
    assert _folder(ramfs / "ck") == _folder(tmp_path / "ref")
    dest = {k: torch.zeros_like(t) for k, t in _full().items()}
    dcp.load(
        dest, storage_reader=HFStorageReader(str(ramfs / "ck")), no_dist=True
    )  # None: buffered
    assert all(torch.equal(dest[k], t) for k, t in _full().items())


def test_direct_io_true_where_refused_is_an_error_before_any_data_is_written(ramfs) -> None:
    with pytest.raises(
        BaseException,
        match=r"direct_io=True, but the filesystem of .*ck/model-00001-of-00001.safetensors "
        r"refuses O_DIRECT; pass direct_io=None",
    ):
        dcp.save(
            _full(), storage_writer=HFStorageWriter(str(ramfs / "ck"), direct_io=True), no_dist=True
        )
    data = (ramfs / "ck" / "model-00001-of-00001.safetensors").read_bytes()
    header = int.from_bytes(data[:8], "little") + 8
    assert data[header:] == bytes(len(data) - header)  # the files exist, their data is all zeros
    assert not (ramfs / "ck" / "model.safetensors.index.json").exists()
    dcp.save(_full(), storage_writer=HFStorageWriter(str(ramfs / "ok")), no_dist=True)
    with pytest.raises(
        BaseException, match=r"direct_io=True, but the filesystem of .* refuses O_DIRECT"
    ):
        dcp.load(
            {k: torch.zeros_like(t) for k, t in _full().items()},
            storage_reader=HFStorageReader(str(ramfs / "ok"), direct_io=True),
            no_dist=True,
        )


@pytest.mark.parametrize("bad", [1, 0, "yes"])
def test_direct_io_is_validated(bad) -> None:
    for make in (HFStorageWriter, HFStorageReader):
        with pytest.raises(
            ValueError,
            match=r"direct_io=.* must be None \(O_DIRECT where the filesystem takes it\), True",
        ):
            make("/tmp/unused", direct_io=bad)


def test_the_manager_passes_direct_io_on(ramfs) -> None:
    with CheckpointManager(str(ramfs / "run"), direct_io=False) as manager:
        manager.save(1, _full())
    assert os.path.exists(ramfs / "run" / "step_1" / "COMMITTED")
    with (
        pytest.raises(
            BaseException, match=r"direct_io=True, but the filesystem of .* refuses O_DIRECT"
        ),
        CheckpointManager(str(ramfs / "run"), direct_io=True) as manager,
    ):
        manager.save(2, _full())
    assert not os.path.exists(ramfs / "run" / "step_2" / "COMMITTED")
