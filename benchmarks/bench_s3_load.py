"""S3 load benchmark: requests and seconds of a resharded ``dcp.load`` on 2 ranks, ours against
torch's ``FsspecReader`` (s3fs defaults, and tuned: ``default_cache_type="blockcache"``, 8 MiB
blocks), on moto or Ceph radosgw (``--server``), contenders interleaved repeat by repeat.

Two state dicts, both bf16, saved once by one process (ours: ``HFStorageWriter``, consolidated;
the peers: ``FsspecWriter``) and loaded into ``Shard(0)`` DTensors on ``--ranks`` ranks:

  dense  ``--dense-mb`` of 2048 x 1024 matrices (4 MiB each; ~64 tensors at 256 MiB)
  moe    ``--moe-mb`` of 128 x 128 expert matrices (32 KiB each; ~2,000 tensors at 64 MiB)

For ours, ``--request-mb`` lists request sizes to measure (``plan/reads.REQUEST_BYTES`` set in the
rank processes): the choice of the default is this measurement. Each load is checked bit for bit.
The store's request counters (moto's, or radosgw's perf counters) give the GETs and bytes of each
load. Usage: ``python -m benchmarks.bench_s3_load --server moto --repeats 5 --md-out F``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness import (
    git_rev,
    init_dist,
    interleave,
    make_work_dir,
    remove_work_dir,
    run_ranks,
    seal_aws_env,
    server_stats,
    start_server,
    stats_delta,
    storage_options,
    timed_call,
)

__all__ = ["main"]

MiB = 1 << 20
_SHAPES = {"dense": (2048, 1024), "moe": (128, 128)}


def _state_dict(case: str, size_mb: int) -> dict[str, torch.Tensor]:
    rows, cols = _SHAPES[case]
    count = max(1, size_mb * MiB // (rows * cols * 2))
    g = torch.Generator().manual_seed(7)
    return {
        f"{case}.{i}.weight": torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        for i in range(count)
    }


def _reader(name: str, url: str, opts: dict) -> Any:
    if name.startswith("ours"):
        from hf_dcp_storage import HFStorageReader

        return HFStorageReader(url, storage_options=opts)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if name == "pt_fsspec_tuned":
        return FsspecReader(
            url, **opts, default_cache_type="blockcache", default_block_size=8 * MiB
        )
    return FsspecReader(url, **opts)


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one load (spawned fresh): time it, count the store's requests, check it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    if job.get("request_bytes"):
        import hf_dcp_storage.reading as reading

        reading.REQUEST_BYTES = job["request_bytes"]
    dist, mesh = init_dist(rank, world, job["rdzv"], timeout_s=1800)
    full = _state_dict(job["case"], job["size_mb"])
    sd = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)], src_data_rank=None)
        for k, v in full.items()
    }
    reader = _reader(job["name"], job["url"], job["opts"])
    snap: dict = {}
    timed = timed_call(
        dist,
        lambda: dcp.load(sd, storage_reader=reader),
        before=lambda: snap.update(s0=server_stats(job["server"]) if rank == 0 else None),
    )
    rec: dict[str, Any] = {"rank": rank, "wall_s": timed.wall_s}
    if rank == 0:
        rec["server"] = stats_delta(snap["s0"], server_stats(job["server"]))
    stats = getattr(reader, "load_stats", None)
    if stats is not None:
        rec["load_stats"] = dict(vars(stats))
    rec["exact"] = all(torch.equal(sd[k].to_local(), v.chunk(world)[rank]) for k, v in full.items())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        Path(job["result"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def _save(case: str, size_mb: int, url: str, opts: dict, peer: bool) -> None:
    import torch.distributed.checkpoint as dcp

    sd = _state_dict(case, size_mb)
    if peer:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer: Any = FsspecWriter(url, **opts)
    else:
        from hf_dcp_storage import HFStorageWriter

        writer = HFStorageWriter(url, storage_options=opts, max_shard_size="128MB")
    dcp.save(sd, storage_writer=writer, no_dist=True)


def _gets(server: dict | None) -> tuple[int, int]:
    ops = (server or {}).get("ops", {})
    get = [v for k, v in ops.items() if k.startswith("GetObject")]
    return sum(v["requests"] for v in get), sum(v["bytes_out"] for v in get)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["moto", "radosgw"], default="moto")
    p.add_argument("--cases", default="dense,moe")
    p.add_argument("--dense-mb", type=int, default=256)
    p.add_argument("--moe-mb", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--request-mb", default="", help="ours' request sizes to measure, comma list (MiB)"
    )
    p.add_argument("--peers", default="pt_fsspec,pt_fsspec_tuned", help="'' for none")
    p.add_argument("--md-out", type=Path)
    args = p.parse_args()
    seal_aws_env()
    work = make_work_dir("bench_s3_load")
    sizes = {"dense": args.dense_mb, "moe": args.moe_mb}
    cases = [c for c in args.cases.split(",") if c]
    server = start_server(args.server, size=sum(sizes[c] for c in cases) * MiB * 2, work=work)
    rows: list[dict] = []
    try:
        import s3fs

        opts = storage_options(server.endpoint)
        fs = s3fs.S3FileSystem(**opts)
        bucket = f"bench-load-{int(time.time())}"
        fs.mkdir(bucket)
        # "ours": the default request size, nothing patched (also runs on older trees).
        ours = [f"ours_{mb}mib" for mb in args.request_mb.split(",") if mb] or ["ours"]
        peers = [n for n in args.peers.split(",") if n]
        for case in cases:
            _save(case, sizes[case], f"s3://{bucket}/{case}_ours", opts, peer=False)
            if peers:
                _save(case, sizes[case], f"s3://{bucket}/{case}_peer", opts, peer=True)
            for rep, name in interleave(ours + peers, args.repeats):
                tag = f"{case}_{name}_{rep}"
                job = {
                    "name": name,
                    "case": case,
                    "size_mb": sizes[case],
                    "url": f"s3://{bucket}/{case}_{'ours' if name.startswith('ours') else 'peer'}",
                    "opts": opts,
                    "server": server.handle,
                    "rdzv": str(work / f"rdzv_{tag}"),
                    "result": str(work / f"result_{tag}.json"),
                    "t0_file": str(work / f"t0_{tag}"),
                    "request_bytes": (
                        int(name.split("_")[1].removesuffix("mib")) * MiB
                        if name.startswith("ours_")
                        else None
                    ),
                }
                per_rank = run_ranks(rank_main, job, args.ranks, sample_ms=0)
                gets, nbytes = _gets(per_rank[0].get("server"))
                row = {
                    "case": case,
                    "contender": name,
                    "repeat": rep,
                    "wall_s": max(r["wall_s"] for r in per_rank),
                    "gets": gets,
                    "bytes_out": nbytes,
                    "exact": all(r["exact"] for r in per_rank),
                    "stats": [r.get("load_stats") for r in per_rank],
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        server.stop()
        remove_work_dir(work)
    table = _table(rows, cases, args)
    print(table)
    if args.md_out:
        args.md_out.write_text(
            table + "\n\n```\n" + "\n".join(json.dumps(r) for r in rows) + "\n```\n"
        )


def _table(rows: list[dict], cases: list[str], args: argparse.Namespace) -> str:
    out = [
        (
            f"# bench_s3_load ({args.server}, {args.ranks} ranks, {args.repeats} repeats, "
            f"git {git_rev()})"
        ),
        "",
        "| case | contender | median s | runs s | GETs (all ranks) | MiB read | exact |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for case in cases:
        names = list(dict.fromkeys(r["contender"] for r in rows if r["case"] == case))
        for name in names:
            rs = [r for r in rows if r["case"] == case and r["contender"] == name]
            walls = [r["wall_s"] for r in rs]
            out.append(
                f"| {case} | {name} | {statistics.median(walls):.2f} | "
                f"{', '.join(f'{w:.2f}' for w in walls)} | {rs[-1]['gets']} | "
                f"{rs[-1]['bytes_out'] / MiB:.1f} | {all(r['exact'] for r in rs)} |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    main()
