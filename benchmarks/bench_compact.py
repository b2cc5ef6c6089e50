"""Save planning at scale with compact plans (direct writes: local disk, NFS, Lustre), simulated:
Llama 8B-405B over up to 8,192 ranks, in one process from shapes alone.

    python -m benchmarks.bench_compact --cases 8B:1024,70B:1024,405B:1024,405B:8192 --tp 1,8 \\
        --md-out benchmarks/results/compact-cpu-2core.md

Each case runs in a fresh process, phase by phase, as ``dcp.save`` runs them with
``HFStorageWriter`` on a local path (``plan/compact.py``):

1. ranks (one after another; not coordinator time): the ``SavePlan`` ``DefaultSavePlanner`` makes
   from the rank's DTensor shards (``_synthetic_plans``, equal to DCP's own:
   ``tests/test_scale.py``), the writer's ``prepare_local_plan`` (which keeps the items and sends
   ``LocalChunks``), pickled as ``gather_object`` sends it.
2. coordinator: unpickle the N plans (the gather); DCP's ``DefaultSavePlanner.create_global_plan``
   on them (dedup, metadata, validation: nothing left to do); then ours, phase by phase as
   ``plan/compact.plan_save`` runs them: ``gather`` (arrays), ``check_and_dedup`` (tiling
   check, one writer per replicated chunk), ``plan_layout``, ``table_plans``; each rank's final
   plan pickled as ``scatter_object_list`` does.
3. finish: each rank's one packed ``WriteResult`` pickled and unpickled (DCP's gather of the
   results), the CRC32s joined per key and DCP's metadata filled in, the index encoded.
4. load planning of the same checkpoint on N/2 ranks (``bench_scale._simulate_load``):
   ``read_metadata`` on the index (which records the headers; sparse files), a few ranks' local load
   plans, and what each sends through DCP's global step (``HFStorageReader.prepare_local_plan``
   keeps the read items on the rank);
5. one rank's write-side unpacking of its plan (``plan/rankplan.py``'s ``unpack_table``).

The part stores (``--mode s3,gcs,azure``) plan with nodes of ``--ranks-per-node`` ranks (default
8: ``LOCAL_WORLD_SIZE``, as ``torchrun`` sets it), as a real job's coordinator does.

Reported: seconds per phase, the coordinator's peak RSS over the imports (its process holds
nothing else: the simulated ranks' pickles are the gather's buffer), what each rank sends and
receives, and bytes written per rank (max / mean). Compare with the object plans DCP gathers
otherwise: ``bench_scale.py`` and ``results/scale-cpu-2core.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks._synthetic_plans import (
    DEEPSEEK,
    LLAMA,
    ExpertParallel,
    Mesh,
    deepseek_shapes,
    llama_shapes,
    rank_save_plan,
)
from benchmarks.bench_scale import (
    _case_name,
    _fake_upload_id,
    _fmt_bytes,
    _parse_cases,
    _Reporter,
    _reset_peak,
    _simulate_load,
    _status_kib,
    report,
    task_ranks,
)
from hf_dcp_storage import HFStorageWriter
from hf_dcp_storage.io.fsio import STREAM_PART_BYTES
from hf_dcp_storage.plan.compact import check_and_dedup, gather, table_plans
from hf_dcp_storage.plan.layout import index_bytes as _index_bytes
from hf_dcp_storage.plan.layout import plan_layout
from hf_dcp_storage.plan.layout import whole_tensor_metadata as _whole_tensors
from hf_dcp_storage.plan.parts import MAX_PARTS, MIN_PART_BYTES, GatherPart, RankPart
from hf_dcp_storage.plan.placed import place_chunks
from hf_dcp_storage.plan.rankplan import PACKED as _PACKED
from hf_dcp_storage.plan.rankplan import RankPlan as _RankPlan
from hf_dcp_storage.plan.rankplan import WrittenRows as _WrittenRows
from hf_dcp_storage.plan.rankplan import combine_checksums, unpack_table
from hf_dcp_storage.plan.rankplan import rank_plans as writer_rank_plans
from hf_dcp_storage.stores import store_for_mode

PHASES = (
    "gather",
    "dcp_global_plan",
    "arrays",
    "check_dedup",
    "layout",
    "table_plans",
    "place",
    "tasks",
    "scatter",
    "results_gather",
    "checksums",
    "metadata",
    "index",
)
PLANNING = (
    "gather",
    "dcp_global_plan",
    "arrays",
    "check_dedup",
    "layout",
    "table_plans",
    "place",
    "tasks",
    "scatter",
)


def _plans_cache(spec: dict[str, Any]) -> Path | None:
    """Where ``--plans-cache`` keeps a case's simulated ranks' plans (what they send, and the
    last rank's kept items), or ``None``. The ranks' side depends on the model, the mesh and the
    shard size only (not the store); a cached case reports the ranks' time of the run that made
    it. For reruns while the coordinator's code changes: delete the folder when the ranks'
    ``prepare_local_plan`` does."""
    folder = spec.get("plans_cache")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    key = [spec["model"], spec["world"], spec["tp"], spec.get("ep", 1), spec["max_shard_size"]]
    return Path(folder, "-".join(map(str, key)) + ".pkl")


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """One case in this process; returns its figures."""
    model = spec["model"]
    shapes = llama_shapes(LLAMA[model]) if model in LLAMA else deepseek_shapes(DEEPSEEK[model])
    mesh = Mesh.of(spec["world"], spec["tp"])
    ep_degree = spec.get("ep", 1)
    if ep_degree > 1 and (model not in DEEPSEEK or spec["tp"] != 1):
        raise SystemExit(f"--ep {ep_degree}: expert parallelism is modelled for MoE models, tp 1")
    experts = DEEPSEEK[model].experts if model in DEEPSEEK else 0

    def ep_over(world: int) -> ExpertParallel | None:
        return ExpertParallel(world, ep_degree, experts) if ep_degree > 1 else None

    ep = ep_over(mesh.size)
    # The part stores plan with the nodes the job runs on (``LOCAL_WORLD_SIZE``, as torchrun
    # sets it: stores/parts.ranks_per_node).
    os.environ["LOCAL_WORLD_SIZE"] = str(spec.get("ranks_per_node", 1))
    out: dict[str, Any] = {"tensors": len(shapes), "items": 0}
    mode = spec.get("mode", "direct")
    writer = HFStorageWriter(tempfile.gettempdir(), max_shard_size=spec["max_shard_size"])
    t0 = time.perf_counter()
    blobs, local_s, ranks_s = [], 0.0, 0.0
    cached = _plans_cache(spec)
    if cached is not None and cached.exists():  # an earlier run's simulated ranks, as they were
        blobs, out["items"], local_s, ranks_s, writer._local = pickle.loads(cached.read_bytes())
    else:
        for rank in range(mesh.size):
            plan = rank_save_plan(shapes, mesh, rank, ep=ep)
            out["items"] += len(plan.items)
            t = time.perf_counter()
            sent = writer.prepare_local_plan(plan)
            local_s += time.perf_counter() - t
            blobs.append(pickle.dumps(sent))
        ranks_s = time.perf_counter() - t0
        if cached is not None:
            kept = (blobs, out["items"], local_s, ranks_s, writer._local)
            cached.write_bytes(pickle.dumps(kept))
    keep_items, keep_local = writer._local  # the last rank's, for step 4
    out.update(
        ranks_s=ranks_s,
        prepare_local_plan_ms=local_s / mesh.size * 1e3,
        sent_bytes_max=max(map(len, blobs)),
        table_bytes=len(pickle.loads(blobs[-1]).storage_data.table),
    )
    gc.collect()
    base = _status_kib("VmRSS")
    _reset_peak()
    t: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        s = time.perf_counter()
        value = fn()
        t[name] = time.perf_counter() - s
        return value

    plans: list[SavePlan] = timed("gather", lambda: [pickle.loads(b) for b in blobs])
    out["gather_buffer_bytes"] = max(map(len, blobs)) * len(
        blobs
    )  # gather_object pads to the largest
    global_plans, _metadata = timed(
        "dcp_global_plan", lambda: DefaultSavePlanner().create_global_plan(plans)
    )
    chunks = [p.storage_data for p in global_plans]
    g = timed("arrays", lambda: gather(chunks))
    dedup = timed("check_dedup", lambda: check_and_dedup(g))
    layout = timed("layout", lambda: plan_layout(g.specs, max_shard_bytes=writer.max_shard_bytes))
    tables = timed("table_plans", lambda: table_plans(g, layout, dedup))
    # Stores without positioned writes: the chunks placed (staged offsets), then S3's parts and
    # gathering tasks or each file's merge task, spread over the ranks.
    placed = timed("place", lambda: place_chunks(g, dedup, layout) if mode != "direct" else None)
    # As plan/compact.plan_save does: the per-chunk arrays go; the finish needs these.
    rank_start, table_keys, table_of_rank, dropped = (
        g.rank_start,
        g.table_keys,
        g.table_of_rank,
        len(dedup.dropped),
    )
    written = placed.bytes_per_rank(mesh.size) if placed is not None else dedup.bytes_per_rank
    g = dedup = None  # type: ignore[assignment]
    store = store_for_mode(
        mode, writer.fs, writer.root, retry=writer.retry, threads=writer.thread_count
    )
    tasks = timed("tasks", lambda: _plan_tasks(store, layout, placed, mesh.size, mode))
    s3_parts = store.parts if mode in ("s3", "gcs", "azure") else None
    uploads = (
        {f: _fake_upload_id(f) for f, parts in enumerate(s3_parts) if len(parts) > 1}
        if s3_parts is not None
        else {}
    )
    if mode == "s3":
        store.uploads = uploads

    def scatter() -> list[bytes]:
        plans = writer_rank_plans(
            [SavePlan([]) for _ in range(mesh.size)],
            layout,
            "0" * 32,
            mode == "direct",
            [{}] * mesh.size,
            tables,
            tasks,
            store.rank_data(mesh.size),
        )
        return [pickle.dumps(p) for p in plans]

    final = timed("scatter", scatter)
    final_sizes = [len(b) for b in final]
    storage_sizes = [
        len(pickle.dumps(pickle.loads(final[r]).storage_data))
        for r in range(0, mesh.size, max(1, mesh.size // 64))
    ]
    del final
    if mode != "direct":
        out["finishing"] = finishing_work(layout, placed, s3_parts, tasks, mesh.size)
    plans = global_plans = chunks = []  # freed before the finish phases, as DCP drops them
    # Finish: every rank's packed result (its kept items' table rows and CRC shares).
    rng = np.random.default_rng(0)
    packed = []
    for r in range(mesh.size):
        n = int(rank_start[r + 1] - rank_start[r]) - len(tables[r].skip)
        rows = np.arange(n, dtype=np.int64) % len(table_keys[int(table_of_rank[r])])
        packed.append(
            pickle.dumps(
                [
                    WriteResult(
                        _PACKED, 0, _WrittenRows(rows, rng.integers(0, 2**32, n, dtype=np.uint32))
                    )
                ]
            )
        )
    results = timed("results_gather", lambda: [pickle.loads(b) for b in packed])
    checksums = timed(
        "checksums", lambda: combine_checksums(layout, results, (table_keys, table_of_rank))
    )
    timed("metadata", lambda: _whole_tensors(layout))
    index = timed("index", lambda: _index_bytes(layout, checksums))
    out["coordinator_peak_mib"] = (_status_kib("VmHWM") - base) / 1024
    # The gather buffer: the simulation held the pickles before the baseline, a real coordinator
    # receives them.
    out["coordinator_peak_with_buffer_mib"] = (
        out["coordinator_peak_mib"] + out["gather_buffer_bytes"] / 2**20
    )
    out.update(
        phases=t,
        planning_s=sum(t[p] for p in PLANNING),
        finish_s=sum(t[p] for p in ("results_gather", "checksums", "metadata", "index")),
        files=len(layout.files),
        index_bytes=len(index),
        final_plan_bytes_max=max(final_sizes),
        storage_data_bytes_max=max(storage_sizes),
        result_bytes_max=max(map(len, packed)),
        written_max_over_mean=float(written.max() / written.mean()),
        dropped=dropped,
    )
    # Load planning of the same checkpoint on N/2 ranks: read_metadata, local plans, what DCP
    # gathers.
    rep = _Reporter()
    load_mesh = Mesh.of(max(spec["tp"], mesh.size // 2), spec["tp"])
    load = _simulate_load(shapes, layout, load_mesh, rep, ep_over(load_mesh.size))
    out.update(
        {
            k: load[k]
            for k in (
                "load_world",
                "load_plan_s",
                "load_plan_bytes_max",
                "load_plan_sent_bytes_max",
                "load_read_items",
                "metadata_reads_per_rank",
            )
        }
    )
    out["read_metadata_s"] = rep.timings["read_metadata"]
    # One rank unpacks its plan on the write side.
    s = time.perf_counter()
    unpack_table(
        keep_items,
        keep_local,
        _RankPlan(mesh.size - 1, "0" * 32, True, layout.names, {}, None, tables[-1]),
    )
    out["unpack_ms"] = (time.perf_counter() - s) * 1e3
    assert zlib.decompress(keep_local.table)  # the table the last rank sent decodes
    return out


def _plan_tasks(store: Any, layout: Any, placed: Any, world: int, mode: str) -> Any:
    """The store's plan; on GCS also every file's compose tree (what its coordinator plans at the
    commit)."""
    tasks = store.plan(layout, placed, world)
    if mode == "gcs":
        from hf_dcp_storage.plan.gcsplan import compose_tree, part_name

        for plan, parts in zip(layout.files, store.parts, strict=True):
            compose_tree(
                plan.name,
                plan.name,
                [part_name("s", "0" * 32, plan.name, p.number) for p in parts],
                "s",
                "0" * 32,
            )
    return tasks


def finishing_work(
    layout: Any, placed: Any, s3_parts: Any, tasks: Any, world: int
) -> dict[str, Any]:
    """Who assembles what once every rank has staged: bytes per rank (its own, plus twice what
    it gathers or merges: read, then written), and on S3 the parts and requests per rank (own
    parts, its staged objects, and per gathering task one GET per rank it reads plus the upload)."""
    written = placed.bytes_per_rank(world)
    assembled = np.array(
        [sum(t.nbytes - len(getattr(t, "head", b"")) for t in ts) for ts in tasks], dtype=np.int64
    )
    moved = written + 2 * assembled
    out: dict[str, Any] = {
        "tasks": sum(len(ts) for ts in tasks),
        "assembled_bytes": int(assembled.sum()),
        "assembled_share": float(assembled.sum() / max(1, written.sum())),
        "assembled_max": int(assembled.max()),
        "assembled_by_coordinator": int(assembled[0]),
        "assemblers": int((assembled > 0).sum()),
        "moved_max_over_mean": float(moved.max() / moved.mean()),
        "task_bytes_max": max(len(pickle.dumps(ts)) for ts in tasks),
    }
    if s3_parts is None:
        return out
    requests = np.ones(world, dtype=np.int64)  # the rank record
    own = np.zeros((world, len(layout.files)), dtype=np.int64)
    for f, parts in enumerate(s3_parts):
        for p in parts:
            if isinstance(p, RankPart):
                requests[p.rank] += 1
                own[p.rank, f] += p.nbytes
    in_file = np.zeros((world, len(layout.files)), dtype=np.int64)
    np.add.at(in_file, (placed.rank, placed.file), placed.nbytes)
    staged = in_file - own
    part = np.maximum(max(STREAM_PART_BYTES, MIN_PART_BYTES), -(-staged // MAX_PARTS))
    requests += np.where(staged == 0, 0, np.where(staged < part, 1, 2 + -(-staged // part))).sum(
        axis=1
    )
    for rank, ts in enumerate(tasks):
        requests[rank] += sum(1 + len(task_ranks(t)) for t in ts)
    out.update(
        rank_parts=sum(isinstance(p, RankPart) for ps in s3_parts for p in ps),
        gather_parts=sum(isinstance(p, GatherPart) for ps in s3_parts for p in ps),
        requests_max=int(requests.max()),
        requests_mean=float(requests.mean()),
    )
    return out


def finishing_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        (
            "| case | mode | parts: ranks' own / gathered | tasks | assembled (share of bytes) | "
            "busiest assembler | coordinator assembles | ranks assembling | bytes moved per rank "
            "max/mean | requests per rank max/mean | tasks per rank (pickled, max) |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        r = run.get("result")
        if r is None or "finishing" not in r:
            continue
        w = r["finishing"]
        parts = (
            f"{w['rank_parts']:,} / {w['gather_parts']:,}"
            if "rank_parts" in w
            else "(one merge per file)"
        )
        requests = (
            f"{w['requests_max']:,} / {w['requests_mean']:,.0f}" if "requests_max" in w else ""
        )
        lines.append(
            f"| {_case_name(run['spec'])} | {run['spec'].get('mode', 'direct')} | {parts} | "
            f"{w['tasks']:,} | {_fmt_bytes(w['assembled_bytes'])} ({w['assembled_share']:.0%}) | "
            f"{_fmt_bytes(w['assembled_max'])} | {_fmt_bytes(w['assembled_by_coordinator'])} | "
            f"{w['assemblers']:,} | {w['moved_max_over_mean']:.3f} | {requests} | "
            f"{_fmt_bytes(w['task_bytes_max'])} |"
        )
    return lines


def table(runs: list[dict[str, Any]]) -> list[str]:
    head = (
        "| case | mode | write items | "
        + " | ".join(PHASES)
        + " | **planning** | finish | coordinator peak RSS (+ gather buffer) | sent per rank | "
        "storage_data per rank | result per rank | max/mean bytes | load (N/2 ranks): "
        "read_metadata, plan per rank | objects read per loading rank (index size) | load plan: "
        "built / sent to DCP per rank |"
    )
    lines = [head, "|" + "---|" * 3 + "---:|" * (len(PHASES) + 10)]
    for run in runs:
        spec, r = run["spec"], run.get("result")
        if r is None:
            lines.append(f"| {_case_name(spec)} | {spec.get('mode', 'direct')} | {run['error']} |")
            continue
        cells = [f"{r['phases'].get(p, 0.0):.2f}" for p in PHASES]
        lines.append(
            f"| {_case_name(spec)} | {spec.get('mode', 'direct')} | {r['items']:,} | "
            + " | ".join(cells)
            + f" | **{r['planning_s']:.2f} s** | {r['finish_s']:.2f} s | "
            f"{_fmt_bytes(r['coordinator_peak_mib'] * 2**20)} "
            f"(+{_fmt_bytes(r['gather_buffer_bytes'])}) | {_fmt_bytes(r['sent_bytes_max'])} | "
            f"{_fmt_bytes(r['storage_data_bytes_max'])} | {_fmt_bytes(r['result_bytes_max'])} | "
            f"{r['written_max_over_mean']:.3f} | {r['read_metadata_s'] * 1e3:.0f} ms, "
            f"{r['load_plan_s'] * 1e3:.0f} ms | "
            f"{r.get('metadata_reads_per_rank', 1 + r['files'])} ({_fmt_bytes(r['index_bytes'])}) "
            f"| {_fmt_bytes(r['load_plan_bytes_max'])} / "
            f"{_fmt_bytes(r['load_plan_sent_bytes_max'])} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cases", default="8B:1024,70B:1024,405B:1024,405B:8192", help="MODEL:RANKS,..."
    )
    ap.add_argument("--tp", default="1,8")
    ap.add_argument(
        "--ep", type=int, default=1, help="expert-parallel groups (MoE models, with --tp 1)"
    )
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument(
        "--ranks-per-node", type=int, default=8, help="LOCAL_WORLD_SIZE of the simulated job"
    )
    ap.add_argument(
        "--mode",
        default="direct",
        help="direct (local disk), staged (stores without positioned writes), s3, gcs, azure; "
        "comma-separated",
    )
    ap.add_argument(
        "--plans-cache",
        help="folder: reuse the simulated ranks' plans of an earlier run of the same case "
        "(while prepare_local_plan is unchanged)",
    )
    ap.add_argument("--md-out")
    ap.add_argument("--json-out")
    ap.add_argument(
        "--from-json", nargs="+", help="only print the tables of earlier --json-out files"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(json.loads(args.child))))
        return
    if args.from_json:
        runs = [
            json.loads(line)
            for path in args.from_json
            for line in Path(path).read_text().splitlines()
            if line
        ]
        report([*table(runs), "", *finishing_table(runs)], runs, None, args.md_out)
        return
    runs = []
    for model, world in _parse_cases(args.cases):
        for tp, mode in (
            (tp, mode) for tp in map(int, args.tp.split(",")) for mode in args.mode.split(",")
        ):
            spec = {
                "model": model,
                "world": world,
                "tp": tp,
                "max_shard_size": args.max_shard_size,
                "mode": mode,
                "ranks_per_node": args.ranks_per_node,
                **({"plans_cache": args.plans_cache} if args.plans_cache else {}),
                **({"ep": args.ep} if args.ep > 1 else {}),
            }
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_compact", "--child", json.dumps(spec)],
                capture_output=True,
                text=True,
                check=False,
            )
            run: dict[str, Any] = {"spec": spec}
            if proc.returncode == 0:
                run["result"] = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                run["error"] = (
                    f"failed (exit {proc.returncode}): "
                    f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"
                )
            print(json.dumps(run), flush=True)
            runs.append(run)
    report([*table(runs), "", *finishing_table(runs)], runs, args.json_out, args.md_out)


if __name__ == "__main__":
    main()
