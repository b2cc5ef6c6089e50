"""Where a save's bytes travel on the part stores at scale, simulated from shapes: bytes sent
twice, bytes that cross between nodes, requests per rank, on S3, GCS and Azure.

    python -m benchmarks.bench_traffic --cases 405B:8192 --tp 1 --ranks-per-node 8 \\
        --md-out benchmarks/results/traffic-cpu-2core.md

Each case builds every rank's save plan from its DTensor shards (``_synthetic_plans``, equal to
DCP's own: ``tests/test_scale.py``), places the chunks in the HF files as the coordinator does
(``plan/compact``, ``plan/placed``) and plans each store's parts and gathering tasks
(``plan/partplan.plan_parts`` with the store's ``PartRules`` and nodes of ``--ranks-per-node``
ranks: S3's 5 MiB part minimum; GCS and Azure, with none, take a node's runs of 64 KiB or more as
parts of their own), then the same with the nodes ignored (as before) and, on GCS and Azure, with
every rank's run of 64 KiB or more its own part. Nothing is uploaded: what is counted is what
the plan makes every rank send.

- **sent twice**: bytes of gathered parts (each goes to its gathering rank, then up again), per
  checkpoint byte; a rank's own part goes up once.
- **cross-node**: bytes that leave a node (every upload, and each gathered byte whose rank is on
  another node than its gathering rank), per checkpoint byte; nodes are ``--ranks-per-node``
  consecutive ranks (as ``torchrun`` numbers them). **best possible** is the same with each
  gathered part given to the node that holds most of its bytes (a lower bound for any choice
  of gathering rank, intra-node gathering first included).
- **requests per rank**: part uploads (own and gathered), max over ranks; the coordinator's
  assembly requests apart (S3: one completion per file; GCS: the compose tree's composes;
  Azure: one block list per file).
- bytes each rank sends and receives over the network (max over ranks), the exchange of the
  gathered runs included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks._synthetic_plans import (
    DEEPSEEK,
    LLAMA,
    ExpertParallel,
    Mesh,
    deepseek_shapes,
    llama_shapes,
    rank_save_plan,
)
from benchmarks.bench_scale import _case_name, _fmt_bytes, _parse_cases, report
from hf_dcp_storage import HFStorageWriter
from hf_dcp_storage.plan.azureplan import AZURE_RULES
from hf_dcp_storage.plan.compact import check_and_dedup, gather
from hf_dcp_storage.plan.gcsplan import GCS_RULES, MAX_COMPOSE_SOURCES
from hf_dcp_storage.plan.layout import Layout, plan_layout
from hf_dcp_storage.plan.partplan import plan_parts
from hf_dcp_storage.plan.parts import S3_RULES, PartRules
from hf_dcp_storage.plan.placed import PlacedChunks, place_chunks
from hf_dcp_storage.plan.spread import GatherTasks

__all__ = ["STORES", "placed_save", "traffic"]

# Each store as it plans now (its rules; gathered stretches cut at the nodes' runs and gathered
# on the node holding them); with the nodes ignored (cut evenly, gathered where the load is
# least), which is also how GCS and Azure planned before, when they took a rank's runs of 1 MiB
# or more only; and GCS and Azure taking every rank's run of 64 KiB or more as its own part.
STORES: dict[str, tuple[PartRules, bool]] = {
    "S3": (S3_RULES, True),
    "GCS": (GCS_RULES, True),
    "Azure": (AZURE_RULES, True),
    "S3, nodes ignored (before)": (S3_RULES, False),
    "GCS, nodes ignored (before)": (GCS_RULES, False),
    "Azure, nodes ignored (before)": (AZURE_RULES, False),
    "GCS, every rank's run >= 64 KiB its own": (
        dataclasses.replace(GCS_RULES, own_part=64 << 10, node_part=0),
        False,
    ),
    "Azure, every rank's run >= 64 KiB its own": (
        dataclasses.replace(AZURE_RULES, own_part=64 << 10, node_part=0),
        False,
    ),
}


def placed_save(
    shapes: Sequence[tuple[str, Any]],
    mesh: Mesh,
    *,
    ep: ExpertParallel | None = None,
    max_shard_size: str = "5GB",
) -> tuple[PlacedChunks, Layout]:
    """Every rank's chunks placed in the HF files, as a part store's coordinator places them."""
    writer = HFStorageWriter("/tmp", max_shard_size=max_shard_size)
    chunks = [
        writer.prepare_local_plan(rank_save_plan(shapes, mesh, r, ep=ep)).storage_data
        for r in range(mesh.size)
    ]
    g = gather(chunks)
    dedup = check_and_dedup(g)
    layout = plan_layout(g.specs, max_shard_bytes=writer.max_shard_bytes)
    return place_chunks(g, dedup, layout), layout


def _composes(parts: int) -> int:
    """Composes of a GCS compose tree of ``parts`` sources (``plan/gcsplan.compose_tree``)."""
    n, total = parts, 0
    while n > MAX_COMPOSE_SOURCES:
        n = -(-n // MAX_COMPOSE_SOURCES)
        total += n
    return total + 1


def traffic(
    placed: PlacedChunks,
    layout: Layout,
    world: int,
    rules: PartRules,
    per_node: int,
    store: str,
    node_aware: bool = True,
) -> dict[str, Any]:
    """What a save with ``rules`` makes every rank send (see the module docstring); planned
    with the nodes (``per_node`` ranks each) or, ``node_aware`` false, as if every rank were a
    node of its own."""
    t = time.perf_counter()
    plan = plan_parts(placed, layout, world, rules, per_node if node_aware else 1)
    plan_s = time.perf_counter() - t
    node = np.arange(world) // per_node
    uploads = np.zeros(world, dtype=np.int64)  # part uploads per rank
    sent = np.zeros(world, dtype=np.int64)  # bytes each rank sends (uploads and exchange)
    received = np.zeros(world, dtype=np.int64)
    own = gathered = parts = 0
    for file_parts in plan.parts:
        parts += len(file_parts)
        mine = file_parts.rank >= 0
        np.add.at(uploads, file_parts.rank[mine], 1)
        np.add.at(sent, file_parts.rank[mine], file_parts.nbytes[mine])
        own += int(file_parts.nbytes[mine].sum())
    crossing = best_crossing = 0
    for rank, tasks in enumerate(plan.tasks):
        part, src, n = _task_ranges(tasks)
        uploads[rank] += len(tasks)
        sent[rank] += int((tasks.parts[:, 3] - tasks.parts[:, 2]).sum())
        gathered += int(n.sum())
        away = src != rank
        np.add.at(sent, src[away], n[away])
        received[rank] += int(n[away].sum())
        crossing += int(n[node[src] != node[rank]].sum())
        # Per part, the bytes of the node holding most of it stay; the rest cross at best.
        key = part * (int(node[-1]) + 1) + node[src]
        keys, at = np.unique(key, return_inverse=True)
        held = np.bincount(at, weights=n)
        first = np.flatnonzero(np.diff(keys // (int(node[-1]) + 1), prepend=-1))
        best_crossing += int(n.sum() - np.maximum.reduceat(held, first).sum()) if len(keys) else 0
    total = int(placed.nbytes.sum())
    assembly = (
        sum(_composes(len(ps)) for ps in plan.parts if ps)
        if store.startswith("GCS")
        else sum(1 for ps in plan.parts if ps)
    )
    return {
        "store": store,
        "plan_s": plan_s,
        "parts": parts,
        "own_bytes": own,
        "gathered_bytes": gathered,
        "sent_twice": gathered / total,
        "cross_node": (total + crossing) / total,
        "cross_node_best": (total + best_crossing) / total,
        "requests_max": int(uploads.max()),
        "requests_mean": float(uploads.mean()),
        "requests_total": int(uploads.sum()),
        "assembly_requests": assembly,
        "sent_max": int(sent.max()),
        "received_max": int(received.max()),
        "rank_bytes_mean": total / world,
    }


def _task_ranges(tasks: GatherTasks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A rank's gathered parts' staged ranges, ``(part, source rank, nbytes)`` per range: the
    row-sharded pieces straight from the arrays, a column-sharded chunk's runs from its task's
    ``ranges()`` (tasks that have any; their pieces come with them)."""
    per = np.diff(tasks.piece_at)
    strided = np.flatnonzero(np.diff(tasks.strided_at))
    rows = tasks.pieces.astype(np.int64)
    part = np.repeat(np.arange(len(tasks)), per)
    if len(strided):
        keep = ~np.isin(part, strided)
        rows, part = rows[keep], part[keep]
        extra = [tasks.task(int(i)).ranges() for i in strided]
        counts = [len(r) for r in extra]
        part = np.concatenate((part, np.repeat(strided, counts)))
        more = np.concatenate(extra)  # (file_offset, rank, staged_offset, nbytes)
        return (
            part,
            np.concatenate((rows[:, 0], more[:, 1])),
            np.concatenate((rows[:, 3], more[:, 3])),
        )
    return part, rows[:, 0], rows[:, 3]


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    model = spec["model"]
    shapes = llama_shapes(LLAMA[model]) if model in LLAMA else deepseek_shapes(DEEPSEEK[model])
    mesh = Mesh.of(spec["world"], spec["tp"])
    ep = (
        ExpertParallel(mesh.size, spec["ep"], DEEPSEEK[model].experts)
        if spec.get("ep", 1) > 1
        else None
    )
    t = time.perf_counter()
    placed, layout = placed_save(shapes, mesh, ep=ep)
    out: dict[str, Any] = {
        "spec": spec,
        "build_s": time.perf_counter() - t,
        "bytes": int(placed.nbytes.sum()),
        "files": len(layout.files),
        "stores": [],
    }
    for store, (rules, node_aware) in STORES.items():
        out["stores"].append(
            traffic(placed, layout, mesh.size, rules, spec["ranks_per_node"], store, node_aware)
        )
    return out


def table(runs: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        (
            "| case | store | parts | sent twice / ckpt | cross-node / ckpt (best possible) | "
            "uploads per rank, max (mean) | coordinator's assembly requests | sent / received "
            "per rank, max | parts planning s |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for run in runs:
        case = f"{_case_name(run['spec'])}, {run['spec']['ranks_per_node']} a node"
        lines.extend(
            f"| {case} | {s['store']} | {s['parts']:,} | {s['sent_twice']:.3f} | "
            f"{s['cross_node']:.3f} ({s['cross_node_best']:.3f}) | "
            f"{s['requests_max']:,} ({s['requests_mean']:,.0f}) | "
            f"{s['assembly_requests']:,} | {_fmt_bytes(s['sent_max'])} / "
            f"{_fmt_bytes(s['received_max'])} | {s['plan_s']:.1f} |"
            for s in run["stores"]
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default="405B:8192")
    p.add_argument("--tp", default="1", help="tensor-parallel degrees, comma-separated")
    p.add_argument(
        "--ep", default="1", help="expert-parallel degrees (MoE models), comma-separated"
    )
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--md-out", default=None)
    p.add_argument("--case-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case_json:
        print(json.dumps(run_case(json.loads(args.case_json))))
        return
    runs = []
    for model, world in _parse_cases(args.cases):
        for tp in map(int, args.tp.split(",")):
            eps = [int(e) for e in args.ep.split(",")] if model in DEEPSEEK else [1]
            for ep in eps:
                spec = {
                    "model": model,
                    "world": world,
                    "tp": tp,
                    "ep": ep,
                    "ranks_per_node": args.ranks_per_node,
                }
                # A fresh process a case: its memory is the case's alone.
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.bench_traffic",
                        "--case-json",
                        json.dumps(spec),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print("\n".join(table(runs[-1:])), flush=True)
    lines = [
        "# bench_traffic: where a save's bytes travel on S3, GCS and Azure (simulated plans)",
        "",
        f"- command: `python -m benchmarks.bench_traffic {' '.join(sys.argv[1:])}`",
        "",
        *table(runs),
    ]
    report(lines, runs, None, args.md_out)


if __name__ == "__main__":
    main()
