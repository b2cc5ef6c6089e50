"""GCS and Azure benchmark: hf_dcp_storage against PyTorch's FsspecWriter/FsspecReader and raw puts,
on fake-gcs-server and Azurite (loopback, started here by ``tests/support/objectservers.py``).

    python -m benchmarks.bench_gcs_azure --stores gcs,azure --size-mb 128 --repeats 5 \\
        --md-out benchmarks/results/gcs_azure-cpu-2core.md

One job of ``--ranks`` gloo CPU ranks (spawned) per store runs every repeat; within a repeat the
contenders run one after another, listed order on even repeats and reversed on odd ones
(``repeat_order``: neither the first contender's cold start nor a drift of the shared machine
favours one), each timed on every rank from a barrier to its return, the slowest rank
counting:

  save  ours        ``HFStorageWriter`` -> consolidated ``model-*.safetensors`` + index (the ranks
                    upload their own parts; small runs staged and gathered; the server composes
                    the files (GCS) or commits their blocks (Azure)); ``merge_stats`` recorded
        pt_fsspec   torch ``FsspecWriter`` (``.distcp``, one file per rank: not consolidated)
        raw         every rank ``pipe_file``s each local shard's bytes, one object per tensor (the
        floor)
  load  ours        ``HFStorageReader`` of ours' checkpoint, resharded (saved ``Shard(0)``, loaded
  ``Shard(1)``)
        pt_fsspec   torch ``FsspecReader`` of pt_fsspec's checkpoint, resharded alike

State dict: llama-like bf16 tensors (embedding, attention and MLP matrices, norms) of about
``--size-mb`` MiB, every one ``Shard(0)`` over the ranks. Every load is checked bit for bit on
every rank; ours' files are read back with ``safetensors`` once per store, outside the timing.
Each checkpoint is deleted after its repeat (Azurite keeps data on disk, fake-gcs-server in memory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

MiB = 2**20
SAVES = ("ours", "pt_fsspec", "raw")
LOADS = ("ours", "pt_fsspec")


def shapes(size_mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like layers (hidden 2048, intermediate 5504, vocab 4096) up to about ``size_mb`` MiB
    bf16."""
    h, inter, vocab = 2048, 5504, 4096
    out = [
        ("model.embed_tokens.weight", (vocab, h)),
        ("model.norm.weight", (h,)),
        ("lm_head.weight", (vocab, h)),
    ]
    layer = 0
    while sum(2 * _numel(s) for _, s in out) < size_mb * MiB * 0.95:
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += [(p + f"self_attn.{n}_proj.weight", (h, h)) for n in "qkvo"]
        out += [
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
        layer += 1
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def full_tensor(key: str, shape: tuple[int, ...]) -> Any:
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _rank(
    rank: int, world: int, url: str, options: dict, size_mb: float, repeats: int, out: str
) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmarks._harness import repeat_order
    from hf_dcp_storage import HFStorageReader, HFStorageWriter
    from hf_dcp_storage.io import fsio
    from hf_dcp_storage.tools.dcp_format import FsspecReader, FsspecWriter

    mesh = init_device_mesh("cpu", (world,))
    full = {k: full_tensor(k, s) for k, s in shapes(size_mb)}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
    fs, _root = fsio.resolve(url, options)
    rows: list[dict[str, Any]] = []

    def timed(fn: Any) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    def dest() -> dict[str, Any]:
        return {
            k: distribute_tensor(
                torch.zeros_like(v), mesh, [Shard(1 if v.dim() > 1 else 0)], src_data_rank=None
            )
            for k, v in full.items()
        }

    def check(loaded: dict[str, Any]) -> None:
        for k, v in loaded.items():
            assert torch.equal(v.full_tensor(), full[k]), k

    def raw(path: str) -> None:
        for k, v in sd.items():
            fs.pipe_file(
                f"{path}/{k}.rank{rank}",
                v.to_local().contiguous().view(torch.uint8).numpy().tobytes(),
            )

    for rep in range(repeats):
        base = f"{url}/r{rep}-{uuid.uuid4().hex[:6]}" if rank == 0 else None
        holder = [base]
        dist.broadcast_object_list(holder, src=0)
        base = holder[0]
        writer = HFStorageWriter(f"{base}/ours", storage_options=options)
        row: dict[str, Any] = {"repeat": rep, "save": {}, "load": {}}
        saves = {
            "ours": lambda: dcp.save(sd, storage_writer=writer),  # noqa: B023 - called within the iteration
            "pt_fsspec": lambda: dcp.save(sd, storage_writer=FsspecWriter(f"{base}/pt", **options)),  # noqa: B023 - called within the iteration
            "raw": lambda: raw(fsio.resolve(f"{base}/raw", options)[1]),  # noqa: B023 - called within the iteration
        }
        for name in repeat_order(SAVES, rep):
            row["save"][name] = timed(saves[name])
        row["merge_stats"] = writer.merge_stats.as_dict() if rank == 0 else None
        readers = {
            "ours": lambda: HFStorageReader(f"{base}/ours", storage_options=options),  # noqa: B023 - called within the iteration
            "pt_fsspec": lambda: FsspecReader(f"{base}/pt", **options),  # noqa: B023 - called within the iteration
        }
        for name in repeat_order(LOADS, rep):
            got = dest()
            reader = readers[name]()
            row["load"][name] = timed(lambda: dcp.load(got, storage_reader=reader))  # noqa: B023 - called within the iteration
            check(got)
        dist.barrier()
        if rank == 0:
            if rep == 0:
                from safetensors.torch import load

                _, ours_root = fsio.resolve(f"{base}/ours", options)
                names = [n for n in fsio.list_names(fs, ours_root) if n.endswith(".safetensors")]
                back = {
                    k: t
                    for n in names
                    for k, t in load(fsio.read_all(fs, fsio.join(ours_root, n))).items()
                }
                assert set(back) == set(full) and all(
                    torch.equal(back[k], full[k]) for k in full
                ), "ours' files do not read back"
            fsio.remove_tree(fs, fsio.resolve(base, options)[1])
            rows.append(row)
            print(json.dumps(row), flush=True)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def run_store(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from hf_dcp_storage.io import fsio
    from tests.support import objectservers
    from tests.support.dist import run_ranks
    from tests.support.storage_options import azure_options, gcs_options

    endpoint, stop = (
        objectservers.start_fake_gcs() if kind == "gcs" else objectservers.start_azurite()
    )
    try:
        options = gcs_options(endpoint) if kind == "gcs" else azure_options(endpoint)
        place = f"bench-{uuid.uuid4().hex[:10]}"
        url = ("gs://" if kind == "gcs" else "az://") + place
        fs, _ = fsio.resolve(url, {**options, "skip_instance_cache": True})
        fs.mkdir(place)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            run_ranks(_rank, args.ranks, url, options, args.size_mb, args.repeats, out)
            return json.loads(Path(out).read_text())
    finally:
        stop()


def _median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def markdown(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    total = sum(2 * _numel(s) for _, s in shapes(args.size_mb))
    lines = [
        (
            f"# GCS and Azure, {time.strftime('%Y-%m-%d')}: {platform.machine()} "
            f"{os.cpu_count()}-core CPU VM, loopback emulators"
        ),
        "",
        (
            f"`python -m benchmarks.bench_gcs_azure --size-mb {args.size_mb:g} --repeats "
            f"{args.repeats} --ranks {args.ranks}`: a llama-like"
        ),
        (
            f"bf16 state dict of {total / MiB:.0f} MiB, `Shard(0)` over {args.ranks} gloo CPU "
            "ranks; each figure the median over"
        ),
        (
            f"{args.repeats} repeats (min-max in brackets), the slowest rank counting; contenders "
            "interleaved repeat by repeat."
        ),
        (
            "The servers (fake-gcs-server, in memory; Azurite, on disk) share the 2 cores with "
            "the ranks."
        ),
        "",
        (
            "| store | save: ours (consolidated HF) | PyTorch `FsspecWriter` (.distcp) | raw puts "
            "| ours / FsspecWriter | bytes through clients | load resharded: ours | "
            "`FsspecReader` | ours / FsspecReader |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, rows in results.items():
        s = {c: [r["save"][c] for r in rows] for c in SAVES}
        ld = {c: [r["load"][c] for r in rows] for c in LOADS}
        frac = [r["merge_stats"]["client_fraction"] for r in rows]
        lines.append(
            f"| {kind} | {_median_spread(s['ours'])} | {_median_spread(s['pt_fsspec'])} | "
            f"{_median_spread(s['raw'])} | "
            f"{statistics.median(s['ours']) / statistics.median(s['pt_fsspec']):.2f}x | "
            f"{100 * statistics.median(frac):.1f} % | {_median_spread(ld['ours'])} | "
            f"{_median_spread(ld['pt_fsspec'])} | "
            f"{statistics.median(ld['ours']) / statistics.median(ld['pt_fsspec']):.2f}x |"
        )
    lines += ["", "Raw rows (JSON, one per repeat):", "", "```"]
    lines += [json.dumps({"store": k, **r}) for k, rows in results.items() for r in rows]
    return "\n".join([*lines, "```", ""])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", default="gcs,azure")
    p.add_argument("--size-mb", type=float, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--md-out")
    args = p.parse_args()
    results = {kind: run_store(kind, args) for kind in args.stores.split(",")}
    text = markdown(results, args)
    print(text)
    if args.md_out:
        Path(args.md_out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
