"""Store bytes a load reads per checkpoint byte, with and without shared reads, simulated from
shapes alone for Llama models over up to 16,384 ranks (no tensors, no process group, no I/O).

    python -m benchmarks.bench_shared_reads --md-out benchmarks/results/shared_reads-cpu-2core.md

Each case is a mesh ``(replicas, shards, tp)``: HSDP (``Replicate`` over the replicas, ``Shard(0)``
over the shards) with ``tp``-way tensor parallelism (matrices ``Shard(1)`` over TP, vectors
``Replicate``, so norms are shared by replicas x tp ranks). Every rank's region of every tensor
is its DTensor local chunk (``_synthetic_plans.local_chunk``); its group is what
``sharedreads.py`` computes on a real load (``plan/sharing.replica_group``), and each distinct
group's pieces are planned by ``plan/sharing.plan_group``, the code a load runs. Reported: the
store bytes read per checkpoint byte with sharing (each piece once) and without (every rank its
whole region: the replica count, more for the TP-replicated norms), the most bytes a rank reads,
sends and receives, and the planning time of the slowest group (each member plans its groups
alone, no coordinator). The 4-rank measurement on real servers is in
``tests/test_shared_reads.py`` (moto, through the recording proxy, and local disk).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks._harness import git_rev
from benchmarks._synthetic_plans import LLAMA, Mesh, llama_shapes, local_chunk
from hf_dcp_storage.plan.sharing import SharedItem, plan_group, replica_group

_BF16 = 2


def run_case(model: str, replicas: int, shards: int, tp: int) -> dict[str, float | int | str]:
    shapes = llama_shapes(LLAMA[model])
    world = replicas * shards * tp
    sub = Mesh(shards, tp)  # what each replica holds: FSDP x TP, as _synthetic_plans models it
    ranks = np.arange(world).reshape(replicas, shards, tp)
    total = sum(math.prod(s) for _, s in shapes) * _BF16
    groups: dict[tuple[int, ...], list[SharedItem]] = defaultdict(list)
    alone = 0
    for local in range(shards * tp):  # a rank of replica 0; the other replicas mirror it
        coord = (0, *sub.coordinate(local)) if tp > 1 else (0, local, 0)
        for index, (key, shape) in enumerate(shapes):
            vector = len(shape) == 1
            placements = (0, None) if vector and tp > 1 else ((0, 1) if tp > 1 else (0,))
            offsets, sizes = local_chunk(shape, sub, placements, local)
            rows = sizes[0]
            row_bytes = math.prod(sizes[1:]) * _BF16
            if not rows * row_bytes:
                continue
            replicated = [True, False, vector]  # (replicas, shards, tp)
            group = replica_group(ranks, coord, replicated)
            # A TP-replicated vector's region is the same on every rank of its tp group: count
            # it once per group here (the tp ranks of replica 0 all reach this line).
            if vector and tp > 1 and coord[2] != 0:
                continue
            groups[group].append(SharedItem(index, (key, offsets), rows, row_bytes))
            alone += len(group) * rows * row_bytes
    read = 0
    reads: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    slowest = 0.0
    gc.disable()  # as on a load: read_data runs with the collector paused (io/gcpause.py)
    for group, items in groups.items():
        t0 = time.perf_counter()
        plan = plan_group(group, items)
        slowest = max(slowest, time.perf_counter() - t0)
        nbytes = sum(i.rows * i.row_bytes for i in items)
        read += nbytes
        for pieces in plan.rounds:
            for piece in pieces:
                reads[piece.reader] += piece.nbytes
                sent[piece.reader] += piece.nbytes * (len(group) - 1)
        for r in group:
            received[r] += nbytes - reads_in(plan, r)
    gc.enable()
    return {
        "model": model,
        "mesh": f"{replicas} x {shards} x tp {tp}",
        "ranks": world,
        "groups": len(groups),
        "shared": read / total,
        "alone": alone / total,
        "read_max_gib": max(reads.values()) / 2**30,
        "sent_max_gib": max(sent.values()) / 2**30,
        "received_max_gib": max(received.values()) / 2**30,
        "plan_s": slowest,
    }


def reads_in(plan: object, rank: int) -> int:
    return sum(p.nbytes for r in plan.rounds for p in r if p.reader == rank)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        default="8B:2:2:1,70B:8:128:1,405B:8:1024:1,405B:2:512:8,405B:16:1024:1",
        help="MODEL:REPLICAS:SHARDS:TP, comma separated",
    )
    parser.add_argument("--md-out", type=Path)
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        model, replicas, shards, tp = case.split(":")
        rows.append(run_case(model, int(replicas), int(shards), int(tp)))
        print(rows[-1], flush=True)
    command = "python -m benchmarks.bench_shared_reads " + " ".join(sys.argv[1:])
    lines = [
        (
            "# bench_shared_reads: store bytes a load reads per checkpoint byte, simulated, bf16 "
            f"({datetime.date.today()}, {git_rev()})"
        ),
        "",
        f"`{command.strip()}`",
        "",
        "How it is simulated: the module's docstring. `alone`: every rank reads",
        "its whole region (`share_reads=False`, and before shared reads existed); `shared`: each",
        "piece read by one rank of its group. Per-rank maxima with sharing. `plan`: the slowest",
        "group's `plan_group` (each rank plans only its own groups).",
        "",
        (
            "| model | replicas x shards x tp | ranks | groups | store bytes / ckpt, alone | "
            "shared | read max | sent max | received max | plan |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['mesh']} | {r['ranks']:,} | {r['groups']:,} | "
        f"{r['alone']:.2f} | {r['shared']:.3f} | {r['read_max_gib']:.2f} GiB | "
        f"{r['sent_max_gib']:.2f} GiB | {r['received_max_gib']:.2f} GiB | "
        f"{r['plan_s'] * 1000:.0f} ms |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md_out:
        args.md_out.write_text(text)


if __name__ == "__main__":
    main()
