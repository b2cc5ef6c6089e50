#!/usr/bin/env python
"""Async save benchmark: ``dcp.async_save`` through ``HFStorageWriter`` against a synchronous
``dcp.save``.

The state dict is ``bench_save_load.py``'s llama-like bf16 model (~1 GiB by default), every tensor
a ``Shard(0)`` DTensor over ``--ranks`` CPU ranks (gloo, ``file://`` rendezvous). Every measurement
runs in fresh spawned rank processes, as in the other benchmarks.

Modes (each its own measurement, same state dict, same writer options):
  s  sync         ``dcp.save(sd, storage_writer=HFStorageWriter(url))``: the caller is blocked for
                  the whole save ("blocked" = "total")
  a  async        ``dcp.async_save(sd, storage_writer=..., process_group=<extra gloo group>)``,
                  then the caller waits on the future and does nothing else: what async costs
                  when nothing competes with the write
  t  async_train  the same call, then the caller runs a "training" loop (float32 matmuls of
                  ``--train-n``, one torch thread per rank) until the future is done, as a
                  training loop would; before the save the same loop runs alone for
                  ``--baseline-s`` seconds, so the report compares its rate during the write
                  with its rate alone
The extra process group is what ``CheckpointManager`` uses: the save's collectives then never
share a group with the training loop's.

Per rank: ``blocked`` = call start -> ``async_save`` returns (DCP's default stager copies every
local tensor inside the call); ``total`` = call start -> the future is done (a done-callback
stamps it in the writing thread; for rank 0 that is after the commit, and DCP makes every rank
wait for it). Both are maxima over ranks, measured after a barrier. Memory: the parent samples
``/proc/<pid>/status`` of every rank every ``--sample-ms`` and keeps the peak inside
[call start, future done] above the rank's reading just before the call ("extra peak RSS");
each rank also records its RSS growth right after ``async_save`` returns (the staged copy), what
is left once the future is done, and the bytes of its local shards (what the default stager
copies: "staged").

Backends: ``local`` (a folder under ``benchmarks/_data/``) always; ``--server moto`` adds S3 on a
moto server in its own process (``_harness.py``'s, the one ``bench_s3.py`` uses; objects in
``/dev/shm``), with ``bench_s3.py``'s model (llama-7B-like widths, ``--s3-size-mb``, 256 by
default: moto moves ~40 MB/s here, and with these widths most of each rank's rows fill multipart
parts of their own). Each measurement's
output is deleted after it, except the last sync and async outputs of each backend: their
indexes (weight map, sizes and every tensor's CRC32) must be equal, and ``verify_checkpoint``
must find the async one sound (every tensor's bytes re-read against its CRC32).

Run ``python -m benchmarks.bench_async --help`` for the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# bench_save_load's model on local disk, bench_s3's on S3 (moto), and the rank and RSS machinery.
from benchmarks._harness import (
    MiB,
    Runner,
    Server,
    dtensor_state_dict,
    env_record,
    fmt,
    gather_results,
    init_dist,
    interleave,
    make_work_dir,
    max_over,
    median,
    model_dims,
    model_spec,
    remove_work_dir,
    run_ranks,
    seal_aws_env,
    select,
    start_server,
    status_kib,
    storage_options,
    timed_call,
    total_bytes,
    wide_model_dims,
    write_report,
)

MODES = {"s": "sync", "a": "async", "t": "async_train"}


# ------------------------------------------------------------------------------------------------
# Rank side (fresh processes)
# ------------------------------------------------------------------------------------------------


class Trainer:
    """The stand-in for training: ``c = a @ b`` on float32 ``n x n`` matrices, counted."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=g)
        self.b = torch.randn(n, n, generator=g)
        self.c = torch.empty(n, n)

    def step(self) -> None:
        torch.mm(self.a, self.b, out=self.c)

    def run_for(self, seconds: float) -> float:
        """Steps per second over ``seconds`` of steps."""
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
        return n / (time.perf_counter() - t0)

    def run_until(self, done: Callable[[], bool]) -> tuple[int, float]:
        """Steps until ``done()`` (checked between steps); returns (steps, seconds)."""
        n, t0 = 0, time.perf_counter()
        while not done():
            self.step()
            n += 1
        return n, time.perf_counter() - t0


def _malloc_trim() -> None:
    """Hand free heap memory back to the OS (glibc ``malloc_trim``; nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _writer(url: str, cfg: dict):
    from hf_dcp_storage import HFStorageWriter

    kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
    return HFStorageWriter(
        url, storage_options=cfg["opts"], max_shard_size=cfg["max_shard_size"], **kw
    )


def _warmup(mode: str, mesh, rank: int, world: int, url: str, cfg: dict, group) -> None:
    """A tiny save through the same call and group: imports, thread pools and first collectives
    are not timed."""
    import torch.distributed.checkpoint as dcp

    sd = dtensor_state_dict([("w", (4 * world, 8))], mesh, rank, world, fill="data")
    if mode == "sync":
        dcp.save(sd, storage_writer=_writer(url, cfg))
    else:
        dcp.async_save(sd, storage_writer=_writer(url, cfg), process_group=group).result()


def _timed_save(mode: str, sd, url: str, cfg: dict, group, trainer: Trainer | None) -> dict:
    """The measured call; perf_counter seconds relative to its start, and the RSS at return."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    if mode == "sync":
        dcp.save(sd, storage_writer=_writer(url, cfg))
        t = time.perf_counter() - t0
        return {"blocked_s": t, "total_s": t}
    fut = dcp.async_save(sd, storage_writer=_writer(url, cfg), process_group=group)
    blocked = time.perf_counter() - t0
    at_return = status_kib()
    done_at: list[float] = []
    called = threading.Event()

    def stamp(_: Any) -> None:
        done_at.append(time.perf_counter())
        called.set()

    # Runs in the writing thread the moment the save completes (or at once if it already has),
    # after the callbacks DCP registered before it (the one that releases the staged copy).
    fut.add_done_callback(stamp)
    out: dict[str, Any] = {"blocked_s": blocked, "at_return_kib": at_return}
    if trainer is not None:
        steps, secs = trainer.run_until(fut.done)
        out.update(train_steps=steps, train_s=secs)
    fut.result()
    # result() can return before the callbacks have run.
    called.wait()
    _join_save_threads()
    out["total_s"] = done_at[0] - t0
    return out


def _join_save_threads() -> None:
    """Wait for DCP's finished background thread to exit: until it does, its work item still
    references the staged state dict, which would then count as "left after" the save."""
    for t in threading.enumerate():
        if t.name.startswith("AsyncCheckpointExecutor") and t is not threading.current_thread():
            t.join(timeout=30)


def _left_after(base_kib: dict[str, int]) -> dict[str, float]:
    """RSS above the pre-call baseline once the save is over: as it is, and after glibc has
    handed free heap back. Freed small blocks stay resident until the trim; a staged copy that
    something still held would survive it."""
    gc.collect()
    after = status_kib()
    _malloc_trim()
    trimmed = status_kib()
    return {
        "left_after_mib": (after["VmRSS"] - base_kib["VmRSS"]) / 1024,
        "left_after_trim_mib": (trimmed["VmRSS"] - base_kib["VmRSS"]) / 1024,
    }


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one measurement (spawned fresh); rank 0 writes every rank's record."""
    cfg, mode = job["cfg"], job["mode"]
    torch.set_num_threads(cfg["torch_threads"])
    dist, mesh = init_dist(rank, world, job["rdzv"])
    # Every rank creates the group (a collective call), also for sync, so all modes start alike.
    group = dist.new_group(backend="gloo")
    if cfg["warmup"]:
        _warmup(mode, mesh, rank, world, job["scratch"], cfg, group)
    sd = dtensor_state_dict([(k, tuple(s)) for k, s in job["spec"]], mesh, rank, world, fill="data")
    staged = sum(v.to_local().numel() * v.to_local().element_size() for v in sd.values())
    trainer = Trainer(cfg["train_n"]) if mode == "async_train" else None
    alone = None
    if trainer is not None:
        dist.barrier()
        alone = trainer.run_for(cfg["baseline_s"])  # both ranks at once, as during the save
    # The call measures its own times (blocked, total); the window ends when the future is done.
    timed = timed_call(
        dist, lambda: _timed_save(mode, sd, job["out"], cfg, group, trainer), trailing_barrier=False
    )
    res, mem = timed.result, timed.mem
    rec = {
        "rank": rank,
        **mem,
        "staged_mib": staged / MiB,
        "train_alone_per_s": alone,
        **res,
        **_left_after(mem["base_kib"]),
    }
    if "at_return_kib" in rec:
        rec["at_return_mib"] = (rec.pop("at_return_kib")["VmRSS"] - mem["base_kib"]["VmRSS"]) / 1024
    gather_results(dist, rank, world, rec, job["result"])
    dist.destroy_process_group(group)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------


class Backend:
    """Where the checkpoints go (``url(name)``, ``remove(url)``) and the model saved there."""

    def __init__(
        self,
        kind: str,
        root: str,
        opts: dict | None,
        spec: list[tuple[str, tuple[int, ...]]],
        dims: Any,
    ) -> None:
        self.kind, self.root, self.opts = kind, root, opts
        self.spec, self.dims, self.size = spec, dims, total_bytes(spec)
        import fsspec

        self.fs = fsspec.core.url_to_fs(root, **(opts or {}))[0]

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def remove(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(url, recursive=True)


def _summarize_rec(per_rank: list[dict]) -> dict:
    """One measurement's figures from its ranks: times are maxima, memory maxima, rates sums."""

    out = {
        k: max_over(per_rank, k)
        for k in (
            "blocked_s",
            "total_s",
            "staged_mib",
            "at_return_mib",
            "rss_extra_mib",
            "anon_extra_mib",
            "left_after_mib",
            "left_after_trim_mib",
        )
    }
    if all(r.get("train_steps") is not None for r in per_rank):
        out["train_alone_per_s"] = sum(r["train_alone_per_s"] for r in per_rank)
        out["train_during_per_s"] = sum(
            r["train_steps"] / r["train_s"] for r in per_rank if r["train_s"] > 0
        )
        out["train_steps"] = sum(r["train_steps"] for r in per_rank)
    return out


def measure(runner: Runner, backend: Backend, mode: str, rep: int, cfg: dict, world: int) -> dict:
    """One measurement in fresh processes; its record (``ok``: False with the error on failure).
    The peak RSS is taken inside [call start, call end]; the call ends after the future is done."""
    job = runner.job(
        f"{backend.kind}_{mode}",
        mode=mode,
        cfg={**cfg, "opts": backend.opts},
        spec=backend.spec,
        out=backend.url(f"{mode}_r{rep}"),
    )
    job["scratch"] = backend.url(f"warmup_{job['tag']}")
    rec: dict[str, Any] = {
        "phase": "save",
        "backend": backend.kind,
        "mode": mode,
        "repeat": rep,
        "size_bytes": backend.size,
        "out": job["out"],
    }
    t0 = time.time()
    try:
        if backend.kind == "local":
            os.sync()  # the previous measurement's dirty pages are not this one's
        per_rank = run_ranks(rank_main, job, world, sample_ms=cfg["sample_ms"])
        rec.update(ok=True, **_summarize_rec(per_rank), per_rank=per_rank)
    except Exception as exc:  # noqa: BLE001 - a failing measurement is reported; the others still run
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        runner.discard(job)
        backend.remove(job["scratch"])
    rec["process_s"] = round(time.time() - t0, 2)
    return rec


def verify_pair(backend: Backend, sync_url: str, async_url: str) -> dict:
    """The async output equals the sync one: same index (CRC32 of every tensor included), and
    every tensor's bytes re-read match their CRC32."""
    from hf_dcp_storage import verify_checkpoint

    def index(url: str) -> dict:
        return json.loads(backend.fs.cat_file(f"{url}/model.safetensors.index.json"))

    same_index = index(sync_url) == index(async_url)
    report = verify_checkpoint(async_url, storage_options=backend.opts)
    return {
        "phase": "verify",
        "backend": backend.kind,
        "same_index": same_index,
        "sound": report.ok,
        "tensors": report.tensors_checked,
        "bytes": report.bytes_checked,
        "problems": [str(p) for p in report.problems][:5],
    }


def summarize(records: list[dict]) -> str:
    """The markdown table: medians over repeats per backend and mode."""
    saves = [r for r in records if r.get("phase") == "save" and r.get("ok")]
    lines = [
        (
            "| backend | MiB | mode | blocked s | total s | runs total s | total × sync | GB/s "
            "(total) | staged MiB/rank | RSS at return MiB/rank | extra peak RSS MiB/rank (max) | "
            "left after (after malloc_trim) MiB/rank | train steps/s alone | during write | kept |"
        ),
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in dict.fromkeys(r["backend"] for r in saves):
        rows = [r for r in saves if r["backend"] == kind]
        size = rows[0]["size_bytes"]
        sync_total = median([r["total_s"] for r in rows if r["mode"] == "sync"])
        for mode in MODES.values():
            rs = [r for r in rows if r["mode"] == mode]
            if not rs:
                continue
            med = {
                k: median([r.get(k) for r in rs])
                for k in (
                    "blocked_s",
                    "total_s",
                    "staged_mib",
                    "at_return_mib",
                    "left_after_mib",
                    "left_after_trim_mib",
                    "train_alone_per_s",
                    "train_during_per_s",
                )
            }
            peak = max(r["rss_extra_mib"] for r in rs)
            kept = (
                med["train_during_per_s"] / med["train_alone_per_s"]
                if med["train_alone_per_s"]
                else None
            )
            runs = ", ".join(f"{r['total_s']:.2f}" for r in sorted(rs, key=lambda r: r["repeat"]))
            lines.append(
                f"| {kind} | {size / MiB:.0f} | {mode} | {fmt(med['blocked_s'])} | "
                f"{fmt(med['total_s'])} | {runs} | "
                f"{fmt(med['total_s'] / sync_total if sync_total else None)} | "
                f"{fmt(size / med['total_s'] / 1e9)} | {fmt(med['staged_mib'], '.0f')} | "
                f"{fmt(med['at_return_mib'], '.0f') if mode != 'sync' else '-'} | {peak:.0f} | "
                f"{fmt(med['left_after_mib'], '.0f')} ({fmt(med['left_after_trim_mib'], '.0f')}) "
                f"| {fmt(med['train_alone_per_s'], '.1f')} | "
                f"{fmt(med['train_during_per_s'], '.1f')} | "
                f"{fmt(kept * 100 if kept else None, '.0f')}{'%' if kept else ''} |"
            )
    for v in (r for r in records if r.get("phase") == "verify"):
        lines.append("")
        lines.append(
            f"- {v['backend']}: last async output vs last sync output: index (weight map, sizes, "
            f"CRC32 of every tensor) {'identical' if v['same_index'] else 'DIFFERENT'}; "
            "`verify_checkpoint` of the async output "
            f"{'sound' if v['sound'] else 'NOT sound: ' + '; '.join(v['problems'])} "
            f"({v['tensors']} tensors, {v['bytes']} bytes re-read)"
        )
    lines.extend(
        (
            f"- FAILED: {r.get('phase')} {r.get('backend')} {r.get('mode')} repeat "
            f"{r.get('repeat')}: {r.get('error')}"
        )
        for r in records
        if r.get("ok") is False
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-gb", type=float, default=1.0, help="state dict size in GiB (default 1.0)"
    )
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument(
        "--repeats", type=int, default=3, help="measurements per backend and mode (default 3)"
    )
    p.add_argument(
        "--server",
        choices=["none", "moto"],
        default="none",
        help="also measure S3 on a moto server (default none)",
    )
    p.add_argument(
        "--s3-size-mb",
        type=float,
        default=256,
        help="S3 model size in MiB, bench_s3's model (default 256)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma list of modes, by letter or name: "
        + ", ".join(f"{k}={v}" for k, v in MODES.items()),
    )
    p.add_argument(
        "--train-n",
        type=int,
        default=512,
        help="matmul size of the training stand-in (default 512)",
    )
    p.add_argument(
        "--baseline-s",
        type=float,
        default=1.0,
        help="seconds the training loop runs alone before the save (default 1.0)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="HFStorageWriter thread_count (default: the library's)",
    )
    p.add_argument(
        "--max-shard-size", default="5GB", help="HFStorageWriter max_shard_size (default 5GB)"
    )
    p.add_argument(
        "--sample-ms", type=float, default=5.0, help="RSS sampling period in ms (default 5)"
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed tiny save before each measurement",
    )
    p.add_argument(
        "--md-out",
        default=None,
        help="also write the markdown report and the JSON lines to this file",
    )
    return p.parse_args(argv)


def _start_s3(work: Path, size_mb: float) -> tuple[Backend, Server]:
    """bench_s3's moto server (own process), a fresh bucket and bench_s3's model (llama-7B-like
    widths: each rank's rows of most tensors fill parts of their own); (backend, server)."""
    import s3fs

    seal_aws_env()  # inherited by the spawned ranks
    dims = wide_model_dims(size_mb)
    spec = model_spec(dims)
    server = start_server("moto", size=total_bytes(spec), work=work)
    opts = storage_options(server.endpoint)
    bucket = "bench-async-" + uuid.uuid4().hex[:12]
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    return Backend("s3-moto", f"s3://{bucket}", opts, spec, dims), server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    modes = select(args.only, MODES, "mode")
    work = make_work_dir("bench_async_")
    d = model_dims(args.size_gb)
    backends = [Backend("local", str(work / "ckpt"), None, model_spec(d), d)]
    cpu = os.cpu_count() or 1
    cfg = {
        "threads": args.threads,
        "max_shard_size": args.max_shard_size,
        "warmup": not args.no_warmup,
        "sample_ms": args.sample_ms,
        "torch_threads": max(1, cpu // args.ranks),
        "train_n": args.train_n,
        "baseline_s": args.baseline_s,
    }
    env: dict[str, Any] = {
        **env_record(("safetensors", "hf_dcp_storage", "s3fs"), work=work),
        "args": vars(args),
        "cfg": cfg,
        "argv": sys.argv[1:],
    }
    server: Server | None = None
    runner = Runner(work, jsonl=None)  # the JSON lines go to stdout and into --md-out
    records = runner.records
    try:
        if args.server == "moto":
            s3_backend, server = _start_s3(work, args.s3_size_mb)
            env["s3"] = {"moto": server.facts.get("moto"), "endpoint": server.endpoint}
            backends.append(s3_backend)
        env["models"] = {
            b.kind: {**b.dims.__dict__, "tensors": len(b.spec), "size_bytes": b.size}
            for b in backends
        }
        runner.emit(env)
        _run(runner, backends, modes, args, cfg)
    finally:
        if server is not None:
            server.stop()
        remove_work_dir(work)
    elapsed = time.time() - t_start
    table = summarize(records)
    print()
    print(table)
    print(f"\nfull run: {elapsed / 60:.1f} min")
    if args.md_out:
        _write_md(args.md_out, env, table, records, elapsed)
    verified = all(r["same_index"] and r["sound"] for r in records if r.get("phase") == "verify")
    return 0 if verified and all(r.get("ok", True) for r in records) else 1


def _run(
    runner: Runner, backends: list[Backend], modes: list[str], args: argparse.Namespace, cfg: dict
) -> None:
    """Every backend, every repeat, every mode (forward on even repeats, backward on odd ones)."""
    for backend in backends:
        kept: dict[str, str] = {}
        for rep, mode in interleave(modes, args.repeats):
            rec = measure(runner, backend, mode, rep, cfg, args.ranks)
            runner.emit(rec)
            keep_as = "sync" if mode == "sync" else "async"
            if rec.get("ok"):
                if keep_as in kept:
                    backend.remove(kept[keep_as])
                kept[keep_as] = rec["out"]
            else:
                backend.remove(rec["out"])
        if "sync" in kept and "async" in kept:
            runner.emit(verify_pair(backend, kept["sync"], kept["async"]))
        for url in kept.values():
            backend.remove(url)


def _write_md(path: str, env: dict, table: str, records: list[dict], elapsed: float) -> None:
    a = env["args"]
    models = [
        f"- model on {kind}: llama-like, vocab {m['vocab']}, hidden {m['hidden']}, intermediate "
        f"{m['inter']}, kv {m['kv']}, {m['layers']} layers -> {m['tensors']} tensors, "
        f"{m['size_bytes']} bytes; every tensor a Shard(0) DTensor"
        for kind, m in env["models"].items()
    ]
    head = [
        f"# bench_async: dcp.async_save vs dcp.save, {a['ranks']} ranks, {env['cpus']} CPUs",
        "",
        (
            f"- date {env['date']}; python {env['python']}, torch {env['torch']}, safetensors "
            f"{env['safetensors']}, s3fs {env['s3fs']}, hf_dcp_storage {env['hf_dcp_storage']} "
            f"(git {env['git']}); {env['mem_gib']} GiB RAM"
        ),
        *models,
        f"- local: {env['work_dir']} ({env['fs']})"
        + (f"; S3: moto {env['s3']['moto']} in its own process on loopback" if "s3" in env else ""),
        (
            f"- repeats {a['repeats']}, thread_count "
            f"{env['cfg']['threads'] or 'library default'}, torch threads per rank "
            f"{env['cfg']['torch_threads']}, training stand-in: float32 matmul "
            f"{a['train_n']}x{a['train_n']}, alone for {a['baseline_s']} s before the save"
        ),
        (
            f"- command: `python -m benchmarks.bench_async {' '.join(env['argv'])}`; full run "
            f"{elapsed / 60:.1f} min"
        ),
        "",
    ]
    write_report(
        path, "\n".join(head) + "\n" + table, "".join(json.dumps(r) + "\n" for r in records)
    )


if __name__ == "__main__":
    sys.exit(main())
