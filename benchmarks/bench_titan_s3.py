"""torchtitan on S3: a save and a resume through our integration (``HFCheckpointManager``)
against torchtitan's stock ``CheckpointManager`` (``dcp.save``/``dcp.load`` with an ``s3://``
checkpoint id: torch's ``FsspecWriter``/``FsspecReader`` on s3fs), on radosgw or moto,
contenders interleaved repeat by repeat, medians.

Each measurement is one job on ``--ranks`` fresh gloo ranks, built from torchtitan's own parts as
``tests/integrations/_titan.py`` builds them (the llama3 ``debugmodel`` under ``fully_shard``,
AdamW, the LR scheduler, a stateful data loader, the train state): two training steps, then the
timed ``save(2)`` (synchronous); then a fresh job's parts (another init seed) and the timed
``load(step=2)`` of a new manager, checked bit for bit against the saved model and optimizer
state. Requests and bytes come from the server's counters, read by rank 0 around each call.

Runs in ``.venv-integrations`` (torchtitan 0.3): ``.venv-integrations/bin/python -m
benchmarks.bench_titan_s3 --repeats 5 --md-out benchmarks/results/titan_s3-cpu-2core.md``.
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
    env_record,
    init_dist,
    interleave,
    make_work_dir,
    median,
    run_ranks,
    seal_aws_env,
    server_stats,
    start_server,
    stats_delta,
    storage_options,
    timed_call,
)

__all__ = ["main"]

CONTENDERS = ["ours", "stock"]
STEP = 2  # the step saved and resumed (torchtitan skips a save at step 1 by default)


def _manager(job: dict, parts: Any, load_step: int) -> Any:
    common = {"enable": True, "folder": job["folder"], "interval": 1, "keep_latest_k": 0}
    common.update(async_mode="disabled", load_step=load_step)
    if job["name"] == "ours":
        from hf_dcp_storage.integrations.torchtitan import HFCheckpointManager

        # No storage options, as the stock manager has none to take: both reach the server
        # through the environment (AWS_ENDPOINT_URL, the sealed credentials) and share s3fs's
        # cached filesystem the same way.
        config = HFCheckpointManager.Config(**common, storage_options=None)
    else:
        from torchtitan.components.checkpoint import CheckpointManager

        config = CheckpointManager.Config(**common)
    return config.build(**parts.manager_parts())


def _locals(parts: Any) -> dict[str, torch.Tensor]:
    from tests.integrations import _titan

    out = {f"model.{k}": _titan._local(v) for k, v in parts.model.state_dict().items()}
    for k, v in parts.optimizers.state_dict().items():
        if isinstance(v, torch.Tensor):
            out[f"optim.{k}"] = _titan._local(v)
    return out


def _timed(dist: Any, rank: int, job: dict, call: Any) -> tuple[float, dict | None]:
    """``call()`` timed on every rank; the server's counters around it (rank 0)."""
    snap: dict = {}

    def before() -> None:
        snap["s0"] = server_stats(job["server"]) if rank == 0 else None

    wall = timed_call(dist, call, before=before).wall_s
    return wall, stats_delta(snap["s0"], server_stats(job["server"])) if rank == 0 else None


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one job: train, timed save, fresh parts, timed resume, check."""
    from tests.integrations import _titan

    torch.set_num_threads(1)
    os.environ["AWS_ENDPOINT_URL"] = job["endpoint"]  # the stock path's s3fs takes it from here
    dist, _ = init_dist(rank, world, job["rdzv"], timeout_s=1800)
    parts = _titan.build(rank, world, init_seed=0)
    batches = iter(parts.dataloader)
    for _ in range(STEP):
        _titan.step(parts, batches)
    saved = _locals(parts)
    rec: dict[str, Any] = {"rank": rank}
    for op in ("save", "load"):
        if op == "load":
            parts = _titan.build(rank, world, init_seed=1)
        manager = _manager(job, parts, load_step=-1 if op == "save" else STEP)
        call = manager.save if op == "save" else manager.load
        rec[f"{op}_s"], rec[f"{op}_server"] = _timed(dist, rank, job, lambda c=call: c(STEP))
        manager.close()
    loaded = _locals(parts)
    rec["exact"] = (
        parts.state.step == STEP
        and sorted(loaded) == sorted(saved)
        and all(torch.equal(loaded[k], saved[k]) for k in saved)
    )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        Path(job["result"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def _table(rows: list[dict]) -> str:
    head = (
        "| op | contender | median s | runs s | ours / stock | requests per rank (GET / PUT) "
        "| MiB moved per rank | exact |"
    )
    out = [head, "|---|---|---:|---|---:|---:|---:|---|"]
    for op in ("save", "load"):
        med = {n: median([r[f"{op}_s"] for r in rows if r["contender"] == n]) for n in CONTENDERS}
        for n in CONTENDERS:
            mine = [r for r in rows if r["contender"] == n]
            if not mine:
                continue
            srv = mine[-1][f"{op}_server"] or {}
            ops = srv.get("ops") or {}
            per = mine[-1]["ranks"]
            gets = sum(v["requests"] for k, v in ops.items() if k.startswith("Get")) / per
            puts = sum(v["requests"] for k, v in ops.items() if k.startswith("Put")) / per
            moved = (srv.get("bytes_in" if op == "save" else "bytes_out") or 0) / per / 2**20
            ratio = f"{med[n] / med['stock']:.2f}" if n == "ours" and med.get("stock") else ""
            runs = ", ".join(format(r[f"{op}_s"], ".2f") for r in mine)
            out.append(
                f"| {op} | {n} | {med[n]:.2f} | {runs} | {ratio} | "
                f"{(srv.get('requests') or 0) / per:.0f} ({gets:.0f} / {puts:.0f}) | "
                f"{moved:.1f} | {all(r['exact'] for r in mine)} |"
            )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["moto", "radosgw"], default="radosgw")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--md-out", type=Path)
    args = p.parse_args()
    seal_aws_env()
    work = make_work_dir("bench_titan_s3")
    runner = Runner(work)
    env = env_record(["torchtitan", "s3fs", "moto"], with_cpu_model=True)
    env.update(server=args.server, ranks=args.ranks, repeats=args.repeats)
    runner.emit(env)
    server = start_server(args.server, size=1 << 30, work=work)
    try:
        import s3fs

        opts = storage_options(server.endpoint)
        fs = s3fs.S3FileSystem(**opts)
        bucket = f"bench-titan-{int(time.time())}"
        fs.mkdir(bucket)
        for rep, name in interleave(CONTENDERS, args.repeats):
            folder = f"s3://{bucket}/{name}_r{rep}"
            job = runner.job(name, folder=folder, endpoint=server.endpoint)
            job["server"] = server.handle
            per_rank = run_ranks(rank_main, job, args.ranks, sample_ms=0)
            row = {"phase": "titan", "contender": name, "repeat": rep, "ranks": args.ranks}
            for op in ("save", "load"):
                row[f"{op}_s"] = round(max(r[f"{op}_s"] for r in per_rank), 4)
                row[f"{op}_server"] = per_rank[0][f"{op}_server"]
            row["exact"] = all(r["exact"] for r in per_rank)
            runner.emit(row)
            runner.discard(job)
            fs.rm(folder.removeprefix("s3://"), recursive=True)
            collect_garbage(server.handle)
    finally:
        server.stop()
        runner.close()
    rows = [r for r in runner.records if r.get("phase") == "titan"]
    table = (
        f"# bench_titan_s3 ({args.server}, {args.ranks} ranks, {args.repeats} repeats, "
        f"torchtitan {env['torchtitan']}, git {env['git']}, {env['date']})\n\n" + _table(rows)
    )
    runner.report(table, args.md_out)


if __name__ == "__main__":
    main()
