"""Headers read together with the first tensors: where the index records no headers (HF folders
other tools wrote), a load reads each file's header with one ranged GET of its first
``HEADER_PREFIX`` bytes, and the bytes past the header serve the tensors it holds
(``io/files.read_head``, ``plan/reads.split_kept``, ``stores/reads.KeptReads``).

Counted through the proxy of ``tests/support/faultproxy.py`` on moto, on a folder written by
``safetensors.torch``; and without a server on ``memory://``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as st_save

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.format.header import decode_header
from hf_dcp_storage.io.files import HEADER_PREFIX, read_head
from hf_dcp_storage.plan.reads import plan_requests, split_kept
from tests.support.checks import raises_in_checkpoint
from tests.support.data import assert_same, random_tensor
from tests.support.dist import run_ranks
from tests.support.faultproxy import FaultProxy
from tests.support.storage_options import s3_storage_options

INDEX = "model.safetensors.index.json"


# -- pure: which runs the kept bytes serve ------------------------------------------------------


def test_runs_inside_the_kept_bytes_are_served_and_the_rest_requested() -> None:
    # A slab of a tensor starting at byte 1000; kept: bytes [500, 1100) of the file.
    runs = [(0, 0, 50), (50, 50, 100), (200, 150, 10)]
    served, rest = split_kept(1000, runs, 500, 1100)
    # [1000, 1050) whole, [1050, 1100) of [1050, 1150), nothing of [1200, 1210).
    assert served == [(500, 0, 50), (550, 50, 50)]
    assert rest == [(100, 100, 50), (200, 150, 10)]


def test_a_run_around_the_kept_bytes_is_cut_in_three() -> None:
    served, rest = split_kept(0, [(0, 0, 100)], 40, 60)
    assert served == [(0, 40, 20)]
    assert rest == [(0, 0, 40), (60, 60, 40)]


def test_nothing_kept_serves_nothing() -> None:
    assert split_kept(0, [(0, 0, 10)], 0, 0) == ([], [(0, 0, 10)])


# -- read_head: one request, a second only for a long header -------------------------------------


def _file(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return st_save(tensors, metadata=metadata)


def _reader(data: bytes, calls: list[tuple[int, int]]):
    def read_range(path: str, start: int, end: int) -> bytes:
        calls.append((start, end))
        return data[start:end]

    return read_range


def test_a_small_file_is_read_whole_in_one_request_and_checked_against_its_size() -> None:
    data = _file({"a": torch.arange(10.0)})
    calls: list[tuple[int, int]] = []
    head = read_head(fsspec.filesystem("memory"), "/ck", "f", _reader(data, calls))
    assert calls == [(0, HEADER_PREFIX)]
    assert head.size == len(data) and head.kept == data[head.data_start :]
    # A short answer is the whole file: a header placing data past it is refused here.
    with pytest.raises(ValueError, match=r"tensor data ends at byte \d+ but the file has"):
        read_head(fsspec.filesystem("memory"), "/ck", "f", _reader(data[:-4], []))


def test_a_large_file_keeps_the_prefix_past_its_header_and_asks_no_size() -> None:
    data = _file({"a": torch.zeros(8), "w": torch.ones(512, 1024)})  # 2 MiB
    calls: list[tuple[int, int]] = []
    head = read_head(fsspec.filesystem("memory"), "/ck", "f", _reader(data, calls))
    assert calls == [(0, HEADER_PREFIX)]
    assert head.size is None
    assert head.kept == data[head.data_start : HEADER_PREFIX]


def test_a_header_longer_than_the_prefix_costs_exactly_one_more_request() -> None:
    data = _file({"a": torch.zeros(8)}, metadata={"note": "x" * (HEADER_PREFIX + 100)})
    calls: list[tuple[int, int]] = []
    head = read_head(fsspec.filesystem("memory"), "/ck", "f", _reader(data, calls))
    assert calls == [(0, HEADER_PREFIX), (HEADER_PREFIX, head.data_start)]
    assert head.kept == b"" and [e.name for e in head.entries] == ["a"]


# -- memory://: the ranged path with no server --------------------------------------------------


def _write_folder(fs, root: str, files: list[dict[str, torch.Tensor]], **meta) -> None:
    """An HF folder as ``save_pretrained`` writes it: files by ``safetensors``, an index with a
    weight map and no copies of the headers."""
    n = len(files)
    weight_map = {}
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        fs.pipe_file(f"{root}/{name}", _file(tensors, **meta))
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(t.numel() * t.element_size() for f in files for t in f.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    fs.pipe_file(f"{root}/{INDEX}", json.dumps(index).encode())


def _layer(i: int) -> dict[str, torch.Tensor]:
    # Small tensors first in the file (names sort first, one dtype), then a 4 MiB weight.
    return {
        f"layers.{i}.a_norm": random_tensor((1024,), torch.float32, 10 * i + 1),
        f"layers.{i}.b_bias": random_tensor((4096,), torch.float32, 10 * i + 2),
        f"layers.{i}.w": random_tensor((1024, 1024), torch.float32, 10 * i + 3),
    }


def _tail() -> dict[str, torch.Tensor]:
    return {
        "norm": random_tensor((2048,), torch.float32, 91),
        "lm_bias": random_tensor((512,), torch.float32, 92),
    }


def _folder() -> list[dict[str, torch.Tensor]]:
    """Three files: two layers (small tensors, then a weight past the prefix), and a last file of
    small tensors only (all of it inside the prefix)."""
    return [_layer(0), _layer(1), _tail()]


def test_an_hf_folder_on_memory_loads_its_first_tensors_from_the_header_reads() -> None:
    fs = fsspec.filesystem("memory")
    root = f"/{uuid.uuid4().hex}/ck"
    files = _folder()
    _write_folder(fs, root, files)
    try:
        full = {k: v for f in files for k, v in f.items()}
        out = {k: torch.zeros_like(v) for k, v in full.items()}
        reader = HFStorageReader(f"memory://{root}")
        dcp.load(out, storage_reader=reader)
        for k, v in full.items():
            assert_same(out[k], v, k)
        stats = reader.load_stats
        # Every file's bytes from its data up to the prefix's end (or its own) came with its
        # header: the small tensors and each weight's first part; only the weights' rest is read.
        blobs = [_file(f) for f in files]
        kept = sum(min(len(b), HEADER_PREFIX) - decode_header(b)[2] for b in blobs)
        assert (stats.bytes_kept, stats.requests) == (kept, 2)
        assert (
            stats.bytes_kept + stats.bytes_read
            == stats.bytes_wanted
            == sum(v.numel() * 4 for v in full.values())
        )
        assert reader._heads == {}  # released after the load

        # A checkpoint whose index records the headers reads none: nothing is kept.
        ours = f"memory://{root}/ours"
        dcp.save(full, storage_writer=HFStorageWriter(ours, max_shard_size="5MB"))
        reader = HFStorageReader(ours)
        dcp.load(out, storage_reader=reader)
        assert reader.load_stats.bytes_kept == 0
    finally:
        fs.rm(root.rsplit("/", 1)[0], recursive=True)


@pytest.mark.parametrize("kind", ["gcs", "azure"])
def test_gcs_and_azure_serve_the_first_tensors_from_the_header_reads(request, kind: str) -> None:
    """The same path on the other part stores (fake-gcs-server, Azurite): exact tensors, the
    small ones served from the header reads, a long header read in two requests."""
    url, options = request.getfixturevalue(kind)
    fs, root = fsspec.core.url_to_fs(url, **options)
    files = [_layer(0), _tail()]
    _write_folder(fs, f"{root}/short", files)
    _write_folder(fs, f"{root}/long", files, metadata={"note": "x" * (HEADER_PREFIX + 4096)})
    full = {k: v for f in files for k, v in f.items()}
    kept = []
    for name in ("short", "long"):
        out = {k: torch.zeros_like(v) for k, v in full.items()}
        reader = HFStorageReader(f"{url}/{name}", storage_options=options)
        dcp.load(out, storage_reader=reader)
        for k, v in full.items():
            assert_same(out[k], v, f"{name}: {k}")
        kept.append(reader.load_stats.bytes_kept)
    small = sum(v.numel() * 4 for k, v in full.items() if not k.endswith(".w"))
    assert kept[0] > small and kept[1] == 0


# -- S3: requests counted by the proxy ----------------------------------------------------------


@pytest.fixture
def proxied(
    s3_proxy: FaultProxy, s3_endpoint: str
) -> Iterator[tuple[FaultProxy, str, dict, object]]:
    """``(proxy, s3://bucket/ck, options through the proxy, s3fs straight to the server)``."""
    s3fs = pytest.importorskip("s3fs")
    direct = s3fs.S3FileSystem(**s3_storage_options(s3_endpoint))
    bucket = f"hf-dcp-head-{uuid.uuid4().hex[:16]}"
    direct.mkdir(bucket)
    s3_proxy.clear()
    yield s3_proxy, f"s3://{bucket}/ck", s3_storage_options(s3_proxy.endpoint), direct
    s3_proxy.clear()
    direct.rm(bucket, recursive=True)


def _load_rows(rank: int, world: int, url: str, options: dict, out: str) -> None:
    """Load ``_folder`` row-sharded (1-D tensors along 0), check this rank's part, and write what
    ``load_stats`` counted to ``out.<rank>``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {k: v for f in _folder() for k, v in f.items()}
    dest = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)], src_data_rank=None)
        for k, v in full.items()
    }
    reader = HFStorageReader(url, storage_options=options)
    dcp.load(dest, storage_reader=reader)
    for k, v in full.items():
        assert_same(dest[k].to_local(), v.chunk(world)[rank], k)
    Path(f"{out}.{rank}").write_text(json.dumps(dataclasses.asdict(reader.load_stats)))


def _expected(files: list[bytes], rank: int, world: int) -> tuple[int, int, int]:
    """``(requests beyond the prefixes, bytes they read, bytes kept)`` of one rank's row-sharded
    load: its runs of each file less the file's first ``HEADER_PREFIX`` bytes, planned as a load
    plans them (``plan_requests``)."""
    requests = read = kept = 0
    for data in files:
        entries, _, start = decode_header(data[:HEADER_PREFIX])
        wants = []
        for e in entries:
            rows = e.shape[0]
            row = e.nbytes // rows
            r0, r1 = rank * rows // world, (rank + 1) * rows // world
            wants.append((start + e.begin + r0 * row, start + e.begin + r1 * row))
        cut = min(len(data), HEADER_PREFIX)
        kept += sum(max(0, min(b, cut) - a) for a, b in wants)
        rest = [(max(a, cut), b, 0, 0) for a, b in wants if b > cut]
        planned = plan_requests(rest)
        requests += len(planned)
        read += sum(r.end - r.start for r in planned)
    return requests, read, kept


@pytest.mark.distributed
def test_an_hf_folder_costs_one_request_per_file_beyond_what_its_tensors_need(
    proxied, tmp_path
) -> None:
    """Two ranks load a folder ``safetensors.torch`` wrote (three files, small tensors first, no
    headers in the index). Per rank: one GET of the index, one GET per file for its header and
    first megabyte, and only the requests its runs past those megabytes need: 1 + 3 + 2, where
    it sent 1 + 3 HEADs + 3 header GETs + 3 or 5 data GETs before (at HEAD e1b66ad). Bytes: each
    file's first megabyte once per rank, and exactly what the plan reads beyond."""
    proxy, url, options, direct = proxied
    root = url.removeprefix("s3://")
    files = _folder()
    _write_folder(direct, root, files)
    blobs = [direct.cat_file(p) for p in sorted(direct.find(root)) if p.endswith(".safetensors")]
    proxy.clear()
    run_ranks(_load_rows, 2, url, options, str(tmp_path / "stats"))

    stats = [json.loads((tmp_path / f"stats.{r}").read_text()) for r in range(2)]
    expected = [_expected(blobs, r, 2) for r in range(2)]
    assert [e[0] for e in expected] == [2, 2]  # each weight's rest; the last file none
    assert [(s["requests"], s["bytes_read"], s["bytes_kept"]) for s in stats] == expected

    kinds: dict[str, int] = {}
    for r in proxy.requests:
        kind = "index" if r.path.endswith(INDEX) else "file"
        if r.method == "GET" and kind == "file":
            first = r.headers.get("range", "").startswith("bytes=0-")
            kind = "head" if first else "data"
        kinds[f"{r.method} {kind}"] = kinds.get(f"{r.method} {kind}", 0) + 1
    # No HEAD of any file (s3fs's read of the index sends one HEAD of it, as before).
    assert kinds == {
        "HEAD index": 2,
        "GET index": 2,
        "GET head": 2 * len(files),
        "GET data": 2 * 2,
    }
    heads = [r for r in proxy.requests if r.headers.get("range", "").startswith("bytes=0-")]
    assert {r.headers["range"] for r in heads} == {f"bytes=0-{HEADER_PREFIX - 1}"}
    assert sum(r.response_bytes for r in heads) == 2 * sum(
        min(len(b), HEADER_PREFIX) for b in blobs
    )
    data = [r for r in proxy.requests if r.method == "GET" and r not in heads]
    data = [r for r in data if not r.path.endswith(INDEX)]
    assert sum(r.response_bytes for r in data) == sum(e[1] for e in expected)


def test_a_header_longer_than_the_prefix_loads_with_one_more_request(proxied) -> None:
    """A header of more than ``HEADER_PREFIX`` bytes (a large ``__metadata__``): the first GET
    brings its length and first megabyte, exactly one more its rest, then the data as usual."""
    proxy, url, options, direct = proxied
    root = url.removeprefix("s3://")
    files = [_layer(0), _tail()]
    _write_folder(direct, root, files, metadata={"note": "x" * (HEADER_PREFIX + 4096)})
    full = {k: v for f in files for k, v in f.items()}
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    proxy.clear()
    reader = HFStorageReader(url, storage_options=options)
    dcp.load(out, storage_reader=reader)
    for k, v in full.items():
        assert_same(out[k], v, k)
    gets = [r for r in proxy.requests if r.method == "GET" and r.path.endswith(".safetensors")]
    assert len(gets) == 2 * len(files) + 2  # two header GETs a file, then one data GET a file
    assert reader.load_stats.requests == 2 and reader.load_stats.bytes_kept == 0
    # No request for a file's size: the one HEAD is s3fs reading the index.
    assert [(r.method, r.path.endswith(INDEX)) for r in proxy.requests if r.method != "GET"] == [
        ("HEAD", True)
    ]


def test_a_large_file_cut_short_fails_when_its_missing_bytes_are_read(proxied) -> None:
    """No size is asked for a file longer than the prefix: one truncated after the save fails at
    the read of its missing bytes, naming the file and the range."""
    _, url, options, direct = proxied
    root = url.removeprefix("s3://")
    _write_folder(direct, root, [_layer(0)])
    victim = f"{root}/model-00001-of-00001.safetensors"
    direct.pipe_file(victim, direct.cat_file(victim)[:-10_000])
    out = {k: torch.zeros_like(v) for k, v in _layer(0).items()}
    with raises_in_checkpoint(
        ValueError, r"model-00001-of-00001\.safetensors: got \d+ of \d+ bytes at \d+; the file"
    ):
        dcp.load(out, storage_reader=HFStorageReader(url, storage_options=options))


def test_a_single_model_safetensors_is_read_with_its_first_tensors_too(proxied) -> None:
    """A folder of one ``model.safetensors`` and no index (as ``save_pretrained`` writes small
    models): its existence checked (one HEAD, for the message when it is not there), its header
    and first megabyte in one GET, then only the weight's rest; the size is not asked."""
    proxy, url, options, direct = proxied
    root = url.removeprefix("s3://")
    tensors = _layer(0)
    data = _file(tensors)
    direct.pipe_file(f"{root}/model.safetensors", data)
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    proxy.clear()
    reader = HFStorageReader(url, storage_options=options)
    dcp.load(out, storage_reader=reader)
    for k, v in tensors.items():
        assert_same(out[k], v, k)
    seen = [
        (r.method, r.headers.get("range"))
        for r in proxy.requests
        if r.path.endswith("/model.safetensors")
    ]
    assert seen == [
        ("HEAD", None),
        ("GET", f"bytes=0-{HEADER_PREFIX - 1}"),
        ("GET", f"bytes={HEADER_PREFIX}-{len(data) - 1}"),
    ]
    assert reader.load_stats.requests == 1
    assert reader.load_stats.bytes_kept == HEADER_PREFIX - decode_header(data)[2]
