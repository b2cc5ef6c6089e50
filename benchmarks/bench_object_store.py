"""Object-store benchmark: saves and loads of DCP state dicts on S3, ours against the S3 paths a
user would pick instead, contenders interleaved repeat by repeat, medians.

Server: Ceph radosgw on loopback (``--server radosgw``, default; ``scripts/setup/radosgw.sh``,
an 8 GiB memstore OSD) or moto (``--server moto``). Every measurement runs in fresh spawned rank
processes (gloo, ``file://`` rendezvous), each with one torch thread.

State dicts (bf16, HF key names, every tensor a ``Shard(0)`` DTensor on ``--ranks`` ranks):

  dense  a Qwen-like stack, hidden 1536, MLP 2560, q/k/v biases: ~1 GiB in 267 tensors
  moe    hidden 512, 80 experts of 3 x (128 x 512) per layer, 8 layers: ~256 MiB in 1,976
         tensors

Save contenders (``dcp.save`` on every rank; wall = max over ranks, barriers around):
  ours             HFStorageWriter, defaults: consolidated ``model-*.safetensors`` + index
  pt_fsspec        torch ``FsspecWriter`` (s3fs), defaults: ``.distcp`` per rank
  pt_fsspec_proxy  the same through the ETag proxy (``_etag_proxy``): the proxy's own cost
  s3tc             s3torchconnector ``S3StorageWriter`` (CRT client) through the ETag proxy,
                   which radosgw needs (its CompleteMultipartUpload answers an empty ETag)
Load contenders (``dcp.load`` into zeroed ``Shard(0)`` DTensors, checked bit for bit):
  ours             HFStorageReader of ours' checkpoint
  pt_fsspec        ``FsspecReader`` (s3fs defaults) of pt_fsspec's checkpoint
  pt_fsspec_tuned  the same with ``default_cache_type="blockcache"``, 8 MiB blocks
  s3tc             ``S3StorageReader`` (its default, ``dcp_optimized``) of s3tc's checkpoint
One process reading the consolidated folder (ours' checkpoint), every tensor, checked:
  ours_1p          ``dcp.load(no_dist=True)`` with HFStorageReader into plain tensors
  runai_1p         runai-model-streamer ``SafetensorsStreamer.stream_files`` (owned tensors)

Requests and bytes come from the server: radosgw's perf counters (requests, GETs, PUTs and
their bytes) or moto's per-operation accounting, read by rank 0 (or the one process) around the
timed call. "per rank" columns are totals divided by the ranks. Each save's checkpoint is
deleted after it (radosgw's garbage collector run outside the timing) except the last repeat's,
which the loads read.

Usage: ``python -m benchmarks.bench_object_store --repeats 5 --md-out
benchmarks/results/object_store-cpu-2core.md``; ``--cases moe --moe-mb 16 --dense-mb 64
--repeats 1`` is a smoke run (~2 min). The peers come from ``scripts/setup/bench_peers.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness import (
    Runner,
    collect_garbage,
    dtensor_state_dict,
    env_record,
    init_dist,
    interleave,
    make_shard,
    make_work_dir,
    median,
    original_full,
    run_ranks,
    run_single,
    same_bits,
    seal_aws_env,
    server_stats,
    start_server,
    stats_delta,
    storage_options,
    timed_call,
)

__all__ = ["main", "spec"]

MiB = 1 << 20
REGION = "us-east-1"
SAVES = ["ours", "pt_fsspec", "pt_fsspec_proxy", "s3tc"]
LOADS = ["ours", "pt_fsspec", "pt_fsspec_tuned", "s3tc"]
SINGLE = ["ours_1p", "runai_1p"]
# Which save's checkpoint each load reads.
SOURCE = {
    "ours": "ours",
    "pt_fsspec": "pt_fsspec",
    "pt_fsspec_tuned": "pt_fsspec",
    "s3tc": "s3tc",
    "ours_1p": "ours",
    "runai_1p": "ours",
}
PROXIED = {"pt_fsspec_proxy", "s3tc"}


def spec(case: str, size_mb: int) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) list of ``case`` ("dense" or "moe") for about ``size_mb`` MiB of bf16."""
    out: list[tuple[str, tuple[int, ...]]] = []
    if case == "dense":
        h, m, vocab = 1536, 2560, 16384
        per_layer = 2 * (4 * h * h + 3 * h * m + 3 * h + 2 * h)
        layers = max(1, (size_mb * MiB - 4 * vocab * h) // per_layer)
        out.append(("model.embed_tokens.weight", (vocab, h)))
        for i in range(layers):
            p = f"model.layers.{i}."
            out.append((p + "input_layernorm.weight", (h,)))
            for x in "qkv":
                out += [(p + f"self_attn.{x}_proj.weight", (h, h))]
                out += [(p + f"self_attn.{x}_proj.bias", (h,))]
            out.append((p + "self_attn.o_proj.weight", (h, h)))
            out.append((p + "post_attention_layernorm.weight", (h,)))
            out += [(p + f"mlp.{x}_proj.weight", (m, h)) for x in ("gate", "up")]
            out.append((p + "mlp.down_proj.weight", (h, m)))
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
        return out
    if case == "moe":
        h, m, experts = 512, 128, 80
        per_layer = 2 * (4 * h * h + experts * 3 * h * m + experts * h + 2 * h)
        layers = max(1, round(size_mb * MiB / per_layer))
        for i in range(layers):
            p = f"model.layers.{i}."
            out.append((p + "input_layernorm.weight", (h,)))
            out += [(p + f"self_attn.{x}_proj.weight", (h, h)) for x in "qkvo"]
            out.append((p + "post_attention_layernorm.weight", (h,)))
            out.append((p + "mlp.gate.weight", (experts, h)))
            for e in range(experts):
                q = p + f"mlp.experts.{e}."
                out += [(q + f"{x}_proj.weight", (m, h)) for x in ("gate", "up")]
                out.append((q + "down_proj.weight", (h, m)))
        return out
    raise ValueError(f"case {case!r}: choose 'dense' or 'moe'")


def _nbytes(sp: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(2 * torch.Size(s).numel() for _, s in sp)


# ------------------------------------------------------------------------------------------------
# The contenders, in the rank processes
# ------------------------------------------------------------------------------------------------


def _s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def _writer(job: dict) -> Any:
    name, url, opts = job["name"], job["url"], job["opts"]
    if name.startswith("ours"):
        from hf_dcp_storage import HFStorageWriter

        if name != "ours":  # ours_<N>mib: the gathered parts' size cap under measurement
            import hf_dcp_storage.plan.parts as parts

            parts.GATHER_PART_BYTES = int(name.split("_")[1].removesuffix("mib")) * MiB

        return HFStorageWriter(url, storage_options=opts)
    if name.startswith("pt_fsspec"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url, **opts)
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(REGION, url, s3client_config=_s3tc_config())


def _reader(job: dict) -> Any:
    name, url, opts = job["name"], job["url"], job["opts"]
    if name.startswith("ours"):
        from hf_dcp_storage import HFStorageReader

        return HFStorageReader(url, storage_options=opts)
    if name.startswith("pt_fsspec"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        tuned = {"default_cache_type": "blockcache", "default_block_size": 8 * MiB}
        return FsspecReader(url, **opts, **(tuned if name.endswith("tuned") else {}))
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(REGION, url, s3client_config=_s3tc_config())


def _endpoint_env(job: dict) -> None:
    # The CRT clients (s3tc, Run:ai) take the endpoint from the environment.
    os.environ["AWS_ENDPOINT_URL"] = job["endpoint"]
    os.environ["AWS_REGION"] = REGION
    os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one save or load (spawned fresh): time it, read the store's counters, check a
    load bit for bit; rank 0 writes every rank's record to ``job["result"]``."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    _endpoint_env(job)
    dist, mesh = init_dist(rank, world, job["rdzv"], timeout_s=1800)
    sp = spec(job["case"], job["size_mb"])
    sd = dtensor_state_dict(sp, mesh, rank, world, fill="data" if job["op"] == "save" else "zeros")
    snap: dict = {}

    def before() -> None:
        snap["s0"] = server_stats(job["server"]) if rank == 0 else None

    if job["op"] == "save":
        writer = _writer(job)
        timed = timed_call(dist, lambda: dcp.save(sd, storage_writer=writer), before=before)
    else:
        reader = _reader(job)
        timed = timed_call(dist, lambda: dcp.load(sd, storage_reader=reader), before=before)
    rec: dict[str, Any] = {"rank": rank, "wall_s": timed.wall_s}
    if rank == 0:
        rec["server"] = stats_delta(snap["s0"], server_stats(job["server"]))
    if job["op"] == "load":
        rec["exact"] = all(
            same_bits(sd[k].to_local(), make_shard(k, s, rank, world)) for k, s in sp
        )
    if job["name"].startswith("ours"):
        stats = writer.merge_stats if job["op"] == "save" else reader.load_stats
        plain = (int, float, str, bool, type(None))
        rec["stats"] = {k: v for k, v in vars(stats).items() if isinstance(v, plain)}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        Path(job["result"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def single_main(job: dict) -> None:
    """One process reading the whole consolidated folder (no process group), checked."""
    torch.set_num_threads(1)
    _endpoint_env(job)
    sp = spec(job["case"], job["size_mb"])
    world = job["saved_world"]
    s0 = server_stats(job["server"])
    if job["name"] == "ours_1p":
        import torch.distributed.checkpoint as dcp

        from hf_dcp_storage import HFStorageReader

        sd = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in sp}
        reader = HFStorageReader(job["url"], storage_options=job["opts"])
        t0 = time.perf_counter()
        dcp.load(sd, storage_reader=reader, no_dist=True)
        wall = time.perf_counter() - t0
    else:
        import s3fs
        from runai_model_streamer import SafetensorsStreamer

        fs = s3fs.S3FileSystem(**job["opts"])
        files = sorted(
            "s3://" + f for f in fs.ls(job["url"], detail=False) if f.endswith(".safetensors")
        )
        sd = {}
        t0 = time.perf_counter()
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for name, tensor in streamer.get_tensors():
                sd[name] = tensor
        wall = time.perf_counter() - t0
    exact = sorted(sd) == sorted(k for k, _ in sp) and all(
        same_bits(sd[k], original_full(k, s, world)) for k, s in sp
    )
    rec = {"rank": 0, "wall_s": wall, "exact": exact}
    rec["server"] = stats_delta(s0, server_stats(job["server"]))
    Path(job["result"]).write_text(json.dumps([rec]))


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


def _row(case: str, op: str, name: str, rep: int, per_rank: list[dict], ranks: int) -> dict:
    srv = per_rank[0].get("server") or {}
    ops = srv.get("ops") or {}
    gets = sum(v["requests"] for k, v in ops.items() if k.startswith("Get"))
    puts = sum(v["requests"] for k, v in ops.items() if k.startswith("Put"))
    return {
        "phase": op,
        "case": case,
        "contender": name,
        "repeat": rep,
        "wall_s": round(max(r["wall_s"] for r in per_rank), 4),
        "ranks": ranks,
        "requests": srv.get("requests"),
        "gets": gets,
        "puts": puts,
        "bytes_in": srv.get("bytes_in"),
        "bytes_out": srv.get("bytes_out"),
        "server_cpu_s": srv.get("server_cpu_s"),
        "exact": all(r.get("exact", True) for r in per_rank),
        "stats": [r.get("stats") for r in per_rank if r.get("stats") is not None] or None,
    }


def _run_case(
    case: str,
    size_mb: int,
    args: argparse.Namespace,
    server: Any,
    fs: Any,
    bucket: str,
    runner: Runner,
    proxy: Any,
) -> None:
    direct = storage_options(server.endpoint)
    via_proxy = storage_options(proxy.endpoint)
    base = f"s3://{bucket}/{case}"
    kept: dict[str, str] = {}

    def job(op: str, name: str, url: str) -> dict:
        proxied = name in PROXIED
        return runner.job(
            name,
            op=op,
            case=case,
            size_mb=size_mb,
            url=url,
            opts=via_proxy if proxied else direct,
            endpoint=proxy.endpoint if proxied else server.endpoint,
            server=server.handle,
            saved_world=args.ranks,
        )

    saves = [n for n in SAVES if n in args.contenders]
    saves += [f"ours_{mb}mib" for mb in args.gather_mb.split(",") if mb]
    for rep, name in interleave(saves, args.repeats):
        url = f"{base}/{name}/r{rep}"
        j = job("save", name, url)
        per_rank = run_ranks(rank_main, j, args.ranks, sample_ms=0)
        runner.emit(_row(case, "save", name, rep, per_rank, args.ranks))
        runner.discard(j)
        if rep == args.repeats - 1 and name in SOURCE.values():
            kept[name] = url
        else:
            fs.rm(url.removeprefix("s3://"), recursive=True)
            collect_garbage(server.handle)
    loads = [n for n in LOADS + SINGLE if n in args.contenders and SOURCE[n] in kept]
    loads = loads if "load" in args.ops else []
    for rep, name in interleave(loads, args.repeats):
        j = job("load", name, kept[SOURCE[name]])
        if name in SINGLE:
            per_rank = run_single(single_main, j, sample_ms=0)
        else:
            per_rank = run_ranks(rank_main, j, args.ranks, sample_ms=0)
        runner.emit(_row(case, "load", name, rep, per_rank, 1 if name in SINGLE else args.ranks))
        runner.discard(j)
    for url in kept.values():
        fs.rm(url.removeprefix("s3://"), recursive=True)
    collect_garbage(server.handle)


def _peers(name: str, names: list[str]) -> list[str]:
    # The peers ``name`` is compared with: the other packages measuring the same thing (one
    # process against one process), not the proxy-cost control.
    single = name.endswith("_1p")
    return [
        p
        for p in names
        if not p.startswith("ours") and p.endswith("_1p") == single and p != "pt_fsspec_proxy"
    ]


def _cells(r: dict, nbytes: int) -> list[str]:
    per = r["ranks"]
    if r["requests"] is None:
        return ["-", "-", ""]
    sent = r["bytes_in"] or 0
    moved = sent if r["phase"] == "save" else r["bytes_out"] or 0
    return [
        f"{r['requests'] / per:.0f} ({r['gets'] / per:.0f} / {r['puts'] / per:.0f})",
        f"{moved / per / MiB:.1f}",
        f"{sent / nbytes:.3f}" if r["phase"] == "save" else "",
    ]


def _table(rows: list[dict], sizes: dict[str, int]) -> str:
    head = (
        "| case | op | contender | median s | runs s | ours / best peer | requests per rank "
        "(GET / PUT) | MiB sent (save) or received (load) per rank | client bytes sent / "
        "checkpoint | exact |"
    )
    out = [head, "|---|---|---|---:|---|---:|---:|---:|---:|---|"]
    for case in sizes:
        nbytes = _nbytes(spec(case, sizes[case]))
        for op in ("save", "load"):
            rs = [r for r in rows if r["case"] == case and r["phase"] == op]
            names = list(dict.fromkeys(r["contender"] for r in rs))
            med = {n: median([r["wall_s"] for r in rs if r["contender"] == n]) for n in names}
            for n in names:
                mine = [r for r in rs if r["contender"] == n]
                best = min((med[p] for p in _peers(n, names)), default=None)
                ratio = f"{med[n] / best:.2f}" if best and n.startswith("ours") else ""
                runs = ", ".join(format(r["wall_s"], ".2f") for r in mine)
                cells = [case, op, n, f"{med[n]:.2f}", runs, ratio, *_cells(mine[-1], nbytes)]
                cells.append(str(all(r["exact"] for r in mine)))
                out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["moto", "radosgw"], default="radosgw")
    p.add_argument("--cases", default="dense,moe")
    p.add_argument("--dense-mb", type=int, default=1024)
    p.add_argument("--moe-mb", type=int, default=256)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", default="save,load", help="save, load or both")
    p.add_argument("--contenders", default=",".join(dict.fromkeys(SAVES + LOADS + SINGLE)))
    p.add_argument(
        "--gather-mb",
        default="",
        help="also save as ours_<N>mib: gathered parts capped at N MiB, comma list (the default's "
        "measurement)",
    )
    p.add_argument("--md-out", type=Path)
    args = p.parse_args()
    args.contenders = set(args.contenders.split(","))
    seal_aws_env()
    os.environ.setdefault("RADOSGW_MEMSTORE_GIB", "8")
    sizes = {c: {"dense": args.dense_mb, "moe": args.moe_mb}[c] for c in args.cases.split(",") if c}
    work = make_work_dir("bench_object_store")
    runner = Runner(work)
    env = env_record(
        ["s3fs", "s3torchconnector", "runai-model-streamer", "moto"], with_cpu_model=True
    )
    env.update(server=args.server, ranks=args.ranks, repeats=args.repeats, sizes=sizes)
    env["tensors"] = {c: len(spec(c, mb)) for c, mb in sizes.items()}
    env["mib"] = {c: round(_nbytes(spec(c, mb)) / MiB, 1) for c, mb in sizes.items()}
    runner.emit(env)
    server = start_server(args.server, size=2 * max(sizes.values()) * MiB, work=work)
    from benchmarks._etag_proxy import EtagProxy

    try:
        import s3fs

        fs = s3fs.S3FileSystem(**storage_options(server.endpoint))
        bucket = f"bench-os-{int(time.time())}"
        fs.mkdir(bucket)
        with EtagProxy(server.endpoint) as proxy:
            for case, mb in sizes.items():
                _run_case(case, mb, args, server, fs, bucket, runner, proxy)
            runner.emit({"phase": "proxy", "served": proxy.served, "etags_filled": proxy.filled})
    finally:
        server.stop()
        runner.close()
    rows = [r for r in runner.records if r.get("phase") in ("save", "load")]
    head = (
        f"# bench_object_store ({args.server}, {args.ranks} ranks, {args.repeats} repeats, "
        f"git {env['git']}, {env['date']})\n\n"
        + ", ".join(f"{c}: {env['mib'][c]} MiB in {env['tensors'][c]} tensors" for c in sizes)
        + "\n\n"
    )
    table = head + _table(rows, sizes)
    runner.report(table, args.md_out)


if __name__ == "__main__":
    main()
