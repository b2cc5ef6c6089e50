"""Shared reads: where several ranks need the same bytes, one reads them from the store and the
others get them over the load's group (``HFStorageReader(share_reads=True)``, the default).

4 gloo ranks load one checkpoint as HSDP (2 replicas x 2 shards: ``(Replicate, Shard(0))``), with
a TP-replicated norm (``(Replicate, Replicate)``), a plain scalar every rank loads, and a weight
loaded into another dtype. The loads are exact; the bytes the ranks read add up to the
checkpoint's once with sharing (each rank's ``load_stats.bytes_wanted``; on S3 also the bytes
moto served, counted by the recording proxy), and to the replica count times it without.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.plan.sharing import SharedItem, agreed, group_digest, plan_group
from tests.support.dist import run_ranks
from tests.support.storage_options import s3_storage_options

# key -> (shape, stored dtype, destination dtype, placements on the (replicate, shard) mesh:
# "plain" for a plain tensor).
_TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, torch.dtype, Any]] = {
    "embed.weight": ((2048, 1024), torch.float32, torch.float32, ("R", "S0")),
    "layers.0.attn.weight": ((1001, 700), torch.float32, torch.float32, ("R", "S0")),
    "layers.0.mlp.weight": ((700, 1300), torch.bfloat16, torch.float32, ("R", "S0")),
    "layers.0.norm.weight": ((1024,), torch.float32, torch.float32, ("R", "R")),
    "step": ((), torch.int64, torch.int64, "plain"),
}
_COLUMNS = {"lm_head.weight": ((512, 900), torch.float32, torch.float32, ("R", "S1"))}


def _full(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    if dtype == torch.int64:
        return torch.randint(0, 1 << 40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _placements(spec: tuple[str, str]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1])) for p in spec]


def _load(
    rank: int, world: int, url: str, options: dict, share: bool, out: str, tensors: dict
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    dest: dict[str, torch.Tensor] = {}
    expect: dict[str, torch.Tensor] = {}
    for key, (shape, stored, dtype, spec) in tensors.items():
        if spec == "plain" and rank == 3 and "drop_on_3" in out:
            continue  # this rank loads less: the ranks disagree, each reads alone
        full = _full(key, shape, stored).to(dtype)
        if spec == "plain":
            dest[key], expect[key] = torch.zeros_like(full), full
            continue
        p = _placements(spec)
        dest[key] = distribute_tensor(torch.zeros_like(full), mesh, p, src_data_rank=None)
        expect[key] = distribute_tensor(full, mesh, p, src_data_rank=None).to_local()
    reader = HFStorageReader(url, storage_options=options, share_reads=share)
    dcp.load(dest, storage_reader=reader)
    for key, want in expect.items():
        got = dest[key].to_local() if hasattr(dest[key], "to_local") else dest[key]
        assert torch.equal(got, want), key
    stats = reader.load_stats
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "wanted": stats.bytes_wanted,
                "sent": stats.bytes_sent,
                "received": stats.bytes_received,
                "groups": stats.shared_groups,
            }
        )
    )


def _save(url: str, options: dict, tensors: dict) -> int:
    full = {k: _full(k, shape, stored) for k, (shape, stored, _, _) in tensors.items()}
    writer = HFStorageWriter(url, storage_options=options, overwrite=True)
    dcp.save(full, storage_writer=writer, no_dist=True)
    return sum(t.numel() * t.element_size() for t in full.values())


def _run(url: str, options: dict, share: bool, out: Path, tensors: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(_load, 4, url, options, share, str(out), tensors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_an_hsdp_load_reads_each_byte_once_on_local_disk(tmp_path: Path) -> None:
    tensors = {**_TENSORS, **_COLUMNS}
    total = _save(str(tmp_path / "ckpt"), {}, tensors)
    shared = _run(str(tmp_path / "ckpt"), {}, True, tmp_path / "on", tensors)
    alone = _run(str(tmp_path / "ckpt"), {}, False, tmp_path / "off", tensors)
    assert sum(s["wanted"] for s in shared) == total
    # Without: every replica reads its slice; the norm and the scalar, every rank.
    step, norm = 8, 1024 * 4
    assert sum(s["wanted"] for s in alone) == 2 * (total - step - norm) + 4 * (step + norm)
    assert all(s["groups"] == 2 for s in shared)  # the replicas' group, and the world's
    assert all(s["sent"] == s["received"] == s["groups"] == 0 for s in alone)
    assert sum(s["sent"] for s in shared) == sum(s["received"] for s in shared) > 0


def test_ranks_that_load_different_plain_tensors_each_read_their_own(tmp_path: Path) -> None:
    total = _save(str(tmp_path / "ckpt"), {}, _TENSORS)
    stats = _run(str(tmp_path / "ckpt"), {}, True, tmp_path / "drop_on_3", _TENSORS)
    # The replicas' groups still share; the scalar (rank 3 lacks it) is read by ranks 0-2 each,
    # the norm (one group with the scalar: the world's) by all four.
    step, norm = 8, 1024 * 4
    assert sum(s["wanted"] for s in stats) == (total - step - norm) + 3 * step + 4 * norm
    assert [s["groups"] for s in stats] == [1, 1, 1, 1]


def test_an_hsdp_load_on_s3_fetches_each_byte_once(
    s3_proxy: Any, s3_endpoint: str, tmp_path: Path
) -> None:
    import s3fs

    direct = s3fs.S3FileSystem(**s3_storage_options(s3_endpoint))
    bucket = f"hf-dcp-shared-{uuid.uuid4().hex[:16]}"
    direct.mkdir(bucket)
    try:
        options = s3_storage_options(s3_proxy.endpoint)
        url = f"s3://{bucket}/ckpt"
        total = _save(url, options, _TENSORS)
        served = {}
        for share in (True, False):
            s3_proxy.clear()
            _run(url, options, share, tmp_path / str(share), _TENSORS)
            served[share] = sum(
                r.response_bytes
                for r in s3_proxy.requests
                if r.method == "GET" and r.path.endswith(".safetensors")
            )
        assert total <= served[True] <= 1.05 * total, served
        assert served[False] >= 1.9 * total, served
        assert s3_proxy.errors == []
    finally:
        direct.rm(bucket, recursive=True)


# -- the plan alone --------------------------------------------------------------------------


def _items(n: int, seed: int) -> list[SharedItem]:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        rows = rng.choice([1, 3, 100, 4096, 70_000])
        row_bytes = rng.choice([2, 4, 4096, 1 << 20])
        out.append(SharedItem(i, (f"t{i}",), rows, row_bytes))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("g", [2, 3, 8])
def test_the_pieces_cover_every_row_once_balanced_and_in_bounded_rounds(seed: int, g: int) -> None:
    items = _items(40, seed)
    ranks = tuple(range(10, 10 + g))
    plan = plan_group(ranks, items, piece_bytes=1 << 22, round_bytes=1 << 26)
    again = plan_group(ranks, list(reversed(items)), piece_bytes=1 << 22, round_bytes=1 << 26)
    assert plan.rounds == again.rounds  # every member plans alike, whatever its item order
    pieces = [p for r in plan.rounds for p in r]
    for item in items:
        mine = sorted((p.r0, p.r1) for p in pieces if p.index == item.index)
        assert mine[0][0] == 0 and mine[-1][1] == item.rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
    biggest = max(p.nbytes for p in pieces)
    assert all(sum(p.nbytes for p in r) <= (1 << 26) + biggest for r in plan.rounds)
    load = {r: sum(p.nbytes for p in pieces if p.reader == r) for r in ranks}
    assert max(load.values()) - min(load.values()) <= biggest
    assert set(load) == set(ranks)


def test_a_group_is_shared_only_where_every_member_agrees() -> None:
    items = _items(5, 0)
    mine = group_digest((0, 1), items)
    other = group_digest((0, 1), items[:4])
    world = group_digest((0, 1, 2), items)
    tables = [dict([mine, world]), dict([mine, world]), dict([world])]
    groups = {(0, 1): mine[1], (0, 1, 2): world[1]}
    assert agreed(groups, tables) == {(0, 1), (0, 1, 2)}
    tables[1] = dict([other, world])
    assert agreed(groups, tables) == {(0, 1, 2)}
    tables[2] = {}
    assert agreed(groups, tables) == set()
    assert math.isfinite(mine[0]) and mine[0] >= 0


def _load_cut(rank: int, world: int, url: str, out: str) -> None:
    try:
        _load(rank, world, url, {}, True, out, _TENSORS)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException
        Path(out, f"rank{rank}.err").write_text(str(exc))
    else:
        Path(out, f"rank{rank}.err").write_text("")


def test_a_rank_that_fails_its_share_fails_the_others_without_a_wait(tmp_path: Path) -> None:
    """A file cut short: the ranks that read past its end fail with that error, the members of
    their groups with one naming them, none with the group's timeout."""
    _save(str(tmp_path / "ckpt"), {}, _TENSORS)
    (file,) = (tmp_path / "ckpt").glob("*.safetensors")
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_load_cut, 4, str(tmp_path / "ckpt"), str(out))
    errors = [(out / f"rank{r}.err").read_text() for r in range(4)]
    assert all(errors), errors
    assert any("the file is truncated" in e for e in errors), errors
    assert not any("stopped taking part" in e for e in errors), errors


def _lazy_pair(rank: int, world: int, out: str) -> None:
    from hf_dcp_storage.session.group import EAGER_GROUP_WORLD, save_group

    # A group of EAGER_GROUP_WORLD + 1 of which only these 2 ranks exist: made lazily (the
    # default at that size) it needs no other rank to join, and the two exchange as in a load's
    # group or a save's exchange.
    group = save_group(f"lazy-{world}", rank, EAGER_GROUP_WORLD + 1, 20.0)
    buf = torch.tensor([rank + 41])
    (group.send if rank == 0 else group.recv)([buf], 1 - rank, 0).wait()
    Path(out, f"rank{rank}").write_text(str(int(buf.item())))


def test_groups_beyond_64_ranks_connect_only_the_ranks_that_exchange(tmp_path: Path) -> None:
    """The load's group and the save's exchange group are made with gloo's lazy init
    (``TORCH_GLOO_LAZY_INIT``, read when the group is made) beyond ``EAGER_GROUP_WORLD`` ranks:
    a rank opens sockets to the ranks it exchanges with, not to the whole job (a full mesh is
    16,383 sockets a rank at 16,384 ranks). Without it, making a group of 65 with 2 ranks waits
    for the other 63 and fails."""
    run_ranks(_lazy_pair, 2, str(tmp_path))
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["41", "41"]
    assert "TORCH_GLOO_LAZY_INIT" not in os.environ  # put back as it was
