#!/usr/bin/env python
"""Save/load benchmark: hf_dcp_storage against PyTorch's own DCP storages and plain file I/O.

One synthetic llama-like bf16 state dict (~1.7 GiB by default), sharded ``Shard(0)`` over a 1-D
mesh of ``--ranks`` CPU ranks (gloo, ``file://`` rendezvous). Every measurement runs in fresh
processes, so peak memory of one contender never carries over into the next.

Save contenders (all write the same bytes):
  a  ours      HFStorageWriter -> consolidated model-*.safetensors + index (fsync'd)
  b  pt_hf     torch HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)
               (per-rank sharded files, then consolidation on rank 0, all inside dcp.save)
  c  pt_fs     torch FileSystemWriter (.distcp + .metadata)
  d  plain     each rank f.write()s its shards' bytes to its own file, then os.fsync (the floor)
  i  ours_buffered  HFStorageWriter(direct_io=False): through the page cache (a's default is
               O_DIRECT where the filesystem takes it)
  j  odirect   each rank writes its shards' bytes to its own file with O_DIRECT from one 16 MiB
               page-aligned buffer, then fsync (the device's floor)
  m  ours_baseline  a, with the library imported from --baseline DIR (a checkout of another
               revision, e.g. ``git worktree add DIR REV``): before/after in one interleaved run
``--cast``: the savers' state dict is float32 (the same values) and a, i, m save it as bfloat16
(``HFSavePlanner(save_dtype=torch.bfloat16)``), j casts into its buffer: every slab is copied on
its way out, as from a GPU; the files hold the same bytes as without it, but for the NaNs of
the random bits, which the cast makes canonical (the check of the saved files expects that).
Load contenders (into a freshly allocated Shard(0) DTensor state dict; all read the files of a):
  e  ours_load    HFStorageReader
  f  pt_hf_load   torch HuggingFaceStorageReader
  g  st_load_file safetensors.torch.load_file of every file, one process, whole model (reference).
                  Its default backend maps the file lazily (returns in ~1 ms without reading a
                  byte), so the timed region also touches one byte per 4 KiB page of every tensor:
                  the data is then really in memory (as shared page-cache pages, no copy).
  h  st_load_file_pread  the same with load_file(..., backend="pread"): copies into process memory,
                  which is what the DCP readers do (into their destination tensors).
  k  ours_load_direct  HFStorageReader(direct_io=True): O_DIRECT reads into aligned buffers
  l  odirect_read each rank reads the bytes of its own j file with O_DIRECT (16 MiB aligned buffer)

Warm-up (untimed, in the same processes, before the measured call): a save contender first saves
4 x 16 MiB a rank, so the buffers a process keeps between saves (ours: four aligned 16 MiB
buffers; the raw O_DIRECT writer: its one) exist and are touched, as at a trainer's second save;
they count in the RSS baseline, not in the extra. A load contender loads a tiny checkpoint: a load
is a process's first (a resume), so its buffers are made inside the timed call.

Timing: time.perf_counter around the save/load call only, a barrier before the start and after
the end, max over ranks. Memory: the parent samples VmRSS/RssAnon/RssFile of every rank from
/proc/<pid>/status every 5 ms and keeps the peak inside the rank's call window, above the rank's
own reading just before the call; the fresh process's ru_maxrss growth is recorded as a check.

Every measurement prints one JSON line; a markdown summary follows at the end.
Run ``python -m benchmarks.bench_save_load --help`` for the flags.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks._harness import (
    DATA_ROOT,
    CallWindow,
    GiB,
    MiB,
    Runner,
    dtensor_state_dict,
    env_record,
    gather_results,
    init_dist,
    interleave,
    make_shard,
    make_work_dir,
    max_over,
    median,
    model_dims,
    model_spec,
    paired_ratios,
    remove_work_dir,
    run_ranks,
    run_single,
    same_bits,
    select,
    timed_call,
    total_bytes,
    write_report,
)

SAVE = {
    "a": "ours",
    "b": "pt_hf",
    "c": "pt_fs",
    "d": "plain",
    "i": "ours_buffered",
    "j": "odirect",
    "m": "ours_baseline",
}
CAST_OK = ("ours", "ours_buffered", "odirect", "ours_baseline")  # the savers --cast applies to
LOAD = {
    "e": "ours_load",
    "f": "pt_hf_load",
    "g": "st_load_file",
    "h": "st_load_file_pread",
    "k": "ours_load_direct",
    "l": "odirect_read",
}
RAW_BLOCK = 16 << 20  # the raw O_DIRECT contenders' one aligned buffer
SINGLE = ("st_load_file", "st_load_file_pread")
ALL = {**SAVE, **LOAD}
SAVE_FLOOR = "plain"
LOAD_REF = "st_load_file"  # the reference the load target is stated against


# ------------------------------------------------------------------------------------------------
# Rank-side work (fresh processes)
# ------------------------------------------------------------------------------------------------


def _plain_write(sd, path: str) -> None:
    with open(path, "wb") as f:
        for v in sd.values():
            local = v.to_local()
            f.write(memoryview(local.view(torch.uint8).numpy()).cast("B") if local.numel() else b"")
        f.flush()
        os.fsync(f.fileno())


_RAW_BUFFER: list = []  # the raw writer's aligned buffer, made once per process (as ours are)


def _raw_buffer():
    import mmap

    if not _RAW_BUFFER:
        _RAW_BUFFER.append(mmap.mmap(-1, RAW_BLOCK))
    return _RAW_BUFFER[0]


def _odirect_write(sd, path: str) -> None:
    """Each local shard's bytes, back to back, with O_DIRECT from one aligned buffer (the
    process's, kept from the warm-up), in bfloat16 (a float32 shard is cast as it is copied in);
    the tail (a partial page) is padded to the page and the file truncated to its true size."""
    buf = _raw_buffer()
    dest = torch.frombuffer(buf, dtype=torch.bfloat16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        pos = fill = 0
        for v in sd.values():
            data = v.to_local().reshape(-1)
            while data.numel():
                take = min(data.numel(), (RAW_BLOCK - fill) // 2)
                dest[fill // 2 : fill // 2 + take].copy_(data[:take])
                fill, data = fill + 2 * take, data[take:]
                if fill == RAW_BLOCK:
                    pos += os.pwrite(fd, buf, pos)
                    fill = 0
        if fill:
            padded = -(-fill // 4096) * 4096
            os.pwrite(fd, memoryview(buf)[:padded], pos)
            os.ftruncate(fd, pos + fill)
        os.fsync(fd)
    finally:
        os.close(fd)


def _odirect_read(path: str) -> int:
    """Every byte of ``path`` with O_DIRECT into one aligned buffer; returns the bytes read."""
    import mmap

    buf = mmap.mmap(-1, RAW_BLOCK)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        total = 0
        while n := os.preadv(fd, [buf], total):
            total += n
        return total
    finally:
        os.close(fd)


def _save_call(name: str, sd, out: str, rank: int, cfg: dict):
    import torch.distributed.checkpoint as dcp

    if name in ("ours", "ours_buffered", "ours_baseline"):
        from hf_dcp_storage import HFSavePlanner, HFStorageWriter

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        kw["direct_io"] = False if name == "ours_buffered" else None
        planner = HFSavePlanner(save_dtype=torch.bfloat16) if cfg["cast"] else None
        return lambda: dcp.save(
            sd,
            storage_writer=HFStorageWriter(out, max_shard_size=cfg["max_shard_size"], **kw),
            planner=planner,
        )
    if name == "odirect":
        os.makedirs(out, exist_ok=True)
        return lambda: _odirect_write(sd, os.path.join(out, f"rank{rank:05d}.bin"))
    if name == "pt_hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        kw = (
            {}
            if cfg["threads"] is None
            else {"thread_count": cfg["threads"], "thread_count_consolidation": cfg["threads"]}
        )
        return lambda: dcp.save(
            sd,
            storage_writer=HuggingFaceStorageWriter(
                out, save_distributed=True, enable_consolidation=True, **kw
            ),
        )
    if name == "pt_fs":
        from torch.distributed.checkpoint import FileSystemWriter

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        return lambda: dcp.save(sd, storage_writer=FileSystemWriter(out, **kw))
    if name == "plain":
        os.makedirs(out, exist_ok=True)
        return lambda: _plain_write(sd, os.path.join(out, f"rank{rank:05d}.bin"))
    raise ValueError(name)


def _load_call(name: str, sd, src: str, cfg: dict):
    import torch.distributed.checkpoint as dcp

    if name in ("ours_load", "ours_load_direct"):
        from hf_dcp_storage import HFStorageReader

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        if name == "ours_load_direct":
            kw["direct_io"] = True
        return lambda: dcp.load(sd, storage_reader=HFStorageReader(src, **kw))
    if name == "odirect_read":
        import torch.distributed as dist

        return lambda: _odirect_read(os.path.join(cfg["raw_src"], f"rank{dist.get_rank():05d}.bin"))
    if name == "pt_hf_load":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        return lambda: dcp.load(sd, storage_reader=HuggingFaceStorageReader(src, **kw))
    raise ValueError(name)


# A save's warm-up writes 4 x 16 MiB a rank: enough for each saver's buffers to be made and
# touched (ours: the four aligned buffers its process keeps; the raw writer: its one), so the
# timed save is a trainer's next save, not its process's first.
WARM_SAVE = [(f"warm{k}", (1024, 8192)) for k in range(4)]


def _warmup(name: str, mesh, rank: int, world: int, scratch: str, cfg: dict) -> None:
    """A small save, or a tiny load, through the same code path, so one-time imports, lazy init
    and (saves) the buffers a process keeps between saves are not timed."""
    spec = [("w", (4 * world, 8))]
    if name == "odirect_read":
        return  # reads a file of its own; nothing to warm (O_DIRECT bypasses the cache)
    if name in SAVE.values():
        sd = _savers_state_dict(
            dtensor_state_dict(
                [(k, (world * r, c)) for k, (r, c) in WARM_SAVE], mesh, rank, world, fill="data"
            ),
            cfg,
        )
        _save_call(name, sd, scratch, rank, cfg)()
    else:
        # Load the tiny checkpoint written by our writer (both readers read it).
        import torch.distributed.checkpoint as dcp

        from hf_dcp_storage import HFStorageWriter

        dcp.save(
            dtensor_state_dict(spec, mesh, rank, world, fill="data"),
            storage_writer=HFStorageWriter(scratch),
        )
        _load_call(name, dtensor_state_dict(spec, mesh, rank, world, fill="zeros"), scratch, cfg)()


def _savers_state_dict(sd: dict, cfg: dict) -> dict:
    """``sd`` as the savers get it: as it is, or (``--cast``) the same values in float32."""
    if not cfg["cast"]:
        return sd
    from torch.distributed.tensor import DTensor

    return {
        k: DTensor.from_local(
            v.to_local().float(),
            v.device_mesh,
            v.placements,
            run_check=False,
            shape=v.shape,
            stride=v.stride(),
        )
        for k, v in sd.items()
    }


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one measurement (spawned fresh)."""
    torch.set_num_threads(job["cfg"]["torch_threads"])
    if job["name"] == "ours_baseline":
        # Deliberate, and the one path insert left: the library of another checkout (--baseline
        # DIR), ahead of this one, before anything here imports hf_dcp_storage.
        sys.path.insert(0, job["cfg"]["baseline"])
    dist, mesh = init_dist(rank, world, job["rdzv"])
    name, cfg = job["name"], job["cfg"]
    spec = [(k, tuple(s)) for k, s in job["spec"]]
    is_save = name in SAVE.values()

    if cfg["warmup"]:
        _warmup(name, mesh, rank, world, job["scratch"], cfg)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(job["scratch"], ignore_errors=True)

    sd = dtensor_state_dict(spec, mesh, rank, world, fill="data" if is_save else "zeros")
    if is_save:
        sd = _savers_state_dict(sd, cfg)
    call = (
        _save_call(name, sd, job["out"], rank, cfg)
        if is_save
        else _load_call(name, sd, job["src"], cfg)
    )
    timed = timed_call(dist, call)

    extra = {}
    if is_save:
        # Anything the contender left dirty in the page cache shows up here (not part of the time).
        dist.barrier()
        if rank == 0:
            t1 = time.perf_counter()
            os.sync()
            extra["sync_after_s"] = time.perf_counter() - t1
    elif job["verify"]:
        t1 = time.perf_counter()
        bad = [k for k, s in spec if not same_bits(sd[k].to_local(), make_shard(k, s, rank, world))]
        extra["verify_bad"] = bad[:5]
        extra["verify_n_bad"] = len(bad)
        extra["verify_s"] = time.perf_counter() - t1

    import hf_dcp_storage

    extra["library"] = os.path.dirname(os.path.dirname(hf_dcp_storage.__file__))
    per_rank = {"rank": rank, "call_s": timed.call_s, "wall_s": timed.wall_s, **timed.mem, **extra}
    gather_results(dist, rank, world, per_rank, job["result"])
    dist.destroy_process_group()


def _touch_pages(t: torch.Tensor) -> int:
    """Fault in every 4 KiB page of a (possibly lazily mmapped) tensor by reading one byte per
    page."""
    u = t.reshape(-1).view(torch.uint8)
    if u.numel() == 0:
        return 0
    return int(u[::4096].sum()) + int(u[-1])


def single_main(job: dict) -> None:
    """Contenders g/h: safetensors.torch.load_file of the whole consolidated model in one
    process."""
    from safetensors.torch import load_file

    torch.set_num_threads(job["cfg"]["torch_threads_single"])
    src = job["src"]
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    paths = [os.path.join(src, n) for n in files]
    backend = "pread" if job["name"] == "st_load_file_pread" else "mmap"
    if job["cfg"]["warmup"]:
        # Load a tiny safetensors file once (imports, first mmap), not the measured files.
        from safetensors.torch import save_file

        os.makedirs(job["scratch"], exist_ok=True)
        tiny = os.path.join(job["scratch"], "tiny.safetensors")
        save_file({"w": torch.zeros(8)}, tiny)
        _touch_pages(load_file(tiny, backend=backend)["w"])
        shutil.rmtree(job["scratch"], ignore_errors=True)
    gc.collect()
    gc.disable()
    win = CallWindow()
    win.start()
    t0 = time.perf_counter()
    out = {}
    for p in paths:
        out.update(load_file(p, backend=backend))
    if backend == "mmap":
        for v in out.values():
            _touch_pages(v)
    t = time.perf_counter() - t0
    mem = win.stop()
    gc.enable()
    output_mib = sum(v.numel() * v.element_size() for v in out.values()) / MiB
    rec = {"rank": 0, "call_s": t, "wall_s": t, **mem, "output_mib": output_mib, "backend": backend}
    if job["verify"]:
        t1 = time.perf_counter()
        world = job["world"]
        bad = []
        for k, shape in job["spec"]:
            s = tuple(shape)
            full = (
                torch.cat([make_shard(k, s, r, world) for r in range(world)])
                if len(s)
                else make_shard(k, s, 0, 1)
            )
            if k not in out or not same_bits(out[k], full):
                bad.append(k)
            out.pop(k, None)
        extra_keys = sorted(out)
        rec.update(
            verify_bad=(bad + extra_keys)[:5],
            verify_n_bad=len(bad) + len(extra_keys),
            verify_s=time.perf_counter() - t1,
        )
    with open(job["result"], "w") as f:
        json.dump([rec], f)


def verify_consolidated_main(job: dict) -> None:
    """After the saves: the consolidated output opens with plain safetensors and holds the
    originals."""
    from safetensors import safe_open

    src, world = job["src"], job["world"]
    spec = [(k, tuple(s)) for k, s in job["spec"]]
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    wm = index["weight_map"]
    res = {"dir": os.path.basename(src), "keys_in_index": len(wm), "keys_expected": len(spec)}
    res["index_total_size"] = index.get("metadata", {}).get("total_size")
    res["expected_total_size"] = total_bytes(spec)
    keys = [k for k, _ in spec]
    if not job["full"]:  # a few tensors: first, a norm, middle, last layer, final norm, lm_head
        keys = sorted(
            {keys[0], keys[1], keys[2], keys[len(keys) // 2], keys[-3], keys[-2], keys[-1]},
            key=keys.index,
        )
    shapes = dict(spec)
    bad, handles = [], {}
    try:
        for k in keys:
            fn = wm.get(k)
            if fn is None:
                bad.append(k)
                continue
            if fn not in handles:
                handles[fn] = safe_open(os.path.join(src, fn), framework="pt")
            got = handles[fn].get_tensor(k)
            full = torch.cat([make_shard(k, shapes[k], r, world) for r in range(world)])
            if job["cfg"]["cast"]:
                full = full.float().to(torch.bfloat16)  # the cast makes every NaN the canonical one
            if not same_bits(got, full):
                bad.append(k)
    finally:
        handles.clear()
    res.update(checked=len(keys), bad=bad, ok=not bad and len(wm) == len(spec))
    with open(job["result"], "w") as f:
        json.dump([res], f)


# ------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _meminfo_cached_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _warm(path: str) -> None:
    """Read every file under ``path`` once so that it sits in the page cache."""
    for root, _, files in os.walk(path):
        for n in files:
            with open(os.path.join(root, n), "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(path) for n in fs)


class SaveLoadRunner(Runner):
    """The harness's ``Runner`` with this benchmark's measurements: one record per contender run."""

    def __init__(self, args, work: Path, spec, cfg) -> None:
        super().__init__(work)
        self.args, self.spec, self.cfg = args, spec, cfg

    def _job(self, name: str, **kw) -> dict:
        job = self.job(
            name,
            cfg=self.cfg,
            spec=self.spec,
            world=self.args.ranks,
            verify=kw.pop("verify", False),
            **kw,
        )
        job["scratch"] = str(self.work / f"warmup_{job['tag']}")
        return job

    def measure(self, name: str, *, repeat: int, phase: str, cache: str | None, **kw) -> dict:
        job = self._job(name, **kw)
        rec = {
            "phase": phase,
            "contender": name,
            "repeat": repeat,
            "cache": cache,
            "ranks": self.args.ranks,
            "size_bytes": self.cfg["size_bytes"],
        }
        t0 = time.time()
        try:
            if name in SINGLE:
                per_rank = run_single(single_main, job, sample_ms=self.cfg["sample_ms"])
            else:
                per_rank = run_ranks(
                    rank_main, job, self.args.ranks, sample_ms=self.cfg["sample_ms"]
                )
        except Exception as exc:  # noqa: BLE001 - a failing contender is reported, the rest still run
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            self.emit(rec)
            return rec
        finally:
            self.discard(job)
            shutil.rmtree(job["scratch"], ignore_errors=True)
        rec.update(
            ok=True,
            time_s=max_over(per_rank, "wall_s"),
            call_s=max_over(per_rank, "call_s"),
            gbps=self.cfg["size_bytes"] / max_over(per_rank, "wall_s") / 1e9,
            **{
                k: max_over(per_rank, k)
                for k in ("rss_extra_mib", "anon_extra_mib", "file_extra_mib", "maxrss_delta_mib")
            },
            per_rank=per_rank,
            process_s=round(time.time() - t0, 2),
        )
        if "sync_after_s" in per_rank[0]:
            rec["sync_after_s"] = per_rank[0]["sync_after_s"]
        if job["verify"]:
            n_bad = sum(r.get("verify_n_bad", 0) for r in per_rank)
            rec["verified"] = n_bad == 0
            if n_bad:
                rec["verify_bad"] = [k for r in per_rank for k in r.get("verify_bad", [])][:5]
        if "out" in job and os.path.isdir(job["out"]):
            rec["out_bytes"] = _du(job["out"])
        self.emit(rec)
        return rec

    def verify_output(self, src: str, full: bool) -> dict:
        job = self._job("verify", src=src, full=full)
        try:
            res = run_single(verify_consolidated_main, job, sample_ms=0)[0]
        except Exception as exc:  # noqa: BLE001 - a failing run is reported, the rest still run
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.discard(job)
        rec = {"phase": "verify_save", **res}
        self.emit(rec)
        return rec


def summarize(records: list[dict], cfg: dict) -> str:
    lines = []
    saves = [r for r in records if r.get("phase") == "save" and r.get("ok")]
    loads = [r for r in records if r.get("phase") == "load" and r.get("ok")]
    failed = [r for r in records if r.get("ok") is False]

    def block(rows, refs, label):
        out = []
        caches = sorted({r["cache"] for r in rows}, key=lambda c: (c is None, c))
        for cache in caches:
            sub = [r for r in rows if r["cache"] == cache]
            names = list(dict.fromkeys(r["contender"] for r in sub))
            med = {n: median([r["time_s"] for r in sub if r["contender"] == n]) for n in names}
            refs_here = [x for x in refs if x in med]
            title = f"**{label}**" + (f" (page cache: {cache})" if cache else "")
            out.append(title)
            out.append("")

            def paired(n, x):
                return median(paired_ratios(sub, n, x))  # noqa: B023 - called within the iteration

            out.append(
                "| contender | median s | runs s (repeat 0,1,..) | GB/s | "
                + "".join(f"× {x} (of medians / paired) | " for x in refs_here)
                + "extra peak RSS/rank MiB (max) | of which anon MiB | ru_maxrss Δ MiB | "
                + ("sync after s |" if label == "save" else "verified |")
            )
            out.append("|---|---:|---|---:|" + "---:|" * len(refs_here) + "---:|---:|---:|---|")
            for n in names:
                rs = [r for r in sub if r["contender"] == n]
                m = med[n]
                ratios = "".join(f"{m / med[x]:.2f} / {paired(n, x):.2f} | " for x in refs_here)
                runs = ", ".join(
                    f"{r['time_s']:.2f}" for r in sorted(rs, key=lambda r: r["repeat"])
                )
                last = (
                    f"{max(r.get('sync_after_s', 0) for r in rs):.2f}"
                    if label == "save"
                    else (
                        "yes"
                        if all(r.get("verified") for r in rs)
                        else ("NO" if any(r.get("verified") is False for r in rs) else "-")
                    )
                )
                out.append(
                    f"| {n} | {m:.2f} | {runs} | {cfg['size_bytes'] / m / 1e9:.2f} | "
                    f"{ratios}{max(r['rss_extra_mib'] for r in rs):.0f} | "
                    f"{max(r['anon_extra_mib'] for r in rs):.0f} | "
                    f"{max(r['maxrss_delta_mib'] for r in rs):.0f} | {last} |"
                )
            out.append("")
        return out

    if saves:
        lines += block(saves, [SAVE_FLOOR], "save")
    if loads:
        lines += block(loads, list(SINGLE), "load")
    ver = [r for r in records if r.get("phase") == "verify_save"]
    for v in ver:
        lines.append(
            f"- saved output `{v.get('dir')}` read back with `safetensors.safe_open`: "
            f"{'OK' if v.get('ok') else 'FAILED'} ({v.get('checked')} tensors compared bit-exact, "
            f"{v.get('keys_in_index')}/{v.get('keys_expected')} keys in index, total_size "
            f"{v.get('index_total_size')} vs "
            f"{v.get('expected_total_size')}){' bad: ' + str(v.get('bad')) if v.get('bad') else ''}"
            + (f" error: {v.get('error')}" if v.get("error") else "")
        )
    for r in failed:
        lines.append(
            f"- FAILED: {r.get('phase')} {r.get('contender')} repeat {r.get('repeat')}: "
            f"{r.get('error')}"
        )
    targets = []

    def paired_all(rows, n, x):
        return median(paired_ratios(rows, n, x))

    smed = {n: median([r["time_s"] for r in saves if r["contender"] == n]) for n in SAVE.values()}
    if smed.get("ours") and smed.get(SAVE_FLOOR):
        q = smed["ours"] / smed[SAVE_FLOOR]
        qp = paired_all(saves, "ours", SAVE_FLOOR)
        targets.append(
            f"- save: ours / plain write+fsync = {q:.2f} as a ratio of medians, {qp:.2f} as the "
            f"median of per-repeat ratios (target ≤ 1.15): {'met' if q <= 1.15 else 'MISSED'}"
        )
    if smed.get("ours") and smed.get("odirect"):
        q = smed["ours"] / smed["odirect"]
        slow = max(r["time_s"] for r in saves if r["contender"] == "ours") / max(
            r["time_s"] for r in saves if r["contender"] == "odirect"
        )
        targets.append(
            f"- save: ours / raw O_DIRECT write = {q:.2f} as a ratio of medians (target ≤ 1.05): "
            f"{'met' if q <= 1.05 else 'MISSED'}; slowest repeats {slow:.2f} (target ≤ 1.2): "
            f"{'met' if slow <= 1.2 else 'MISSED'}"
        )
    for cache in sorted({r["cache"] for r in loads}):
        sub = [r for r in loads if r["cache"] == cache]
        raw = median([r["time_s"] for r in sub if r["contender"] == "odirect_read"])
        for name in ("ours_load", "ours_load_direct"):
            a = median([r["time_s"] for r in sub if r["contender"] == name])
            if a and raw:
                targets.append(
                    f"- load ({cache} cache): {name} / raw O_DIRECT read = {a / raw:.2f} as a "
                    "ratio of medians (target ≤ 1.1 cold): "
                    f"{'met' if a / raw <= 1.1 else 'MISSED'}"
                )
    ours_rss = [
        r["rss_extra_mib"]
        for r in saves + loads
        if r["contender"] in ("ours", "ours_buffered", "ours_load", "ours_load_direct")
    ]
    if ours_rss:
        m = max(ours_rss)
        targets.append(
            f"- extra peak RSS per rank, ours (save and load, max) = {m:.0f} MiB (target ≤ 128): "
            f"{'met' if m <= 128 else 'MISSED'}"
        )
    for cache in sorted({r["cache"] for r in loads}):
        sub = [r for r in loads if r["cache"] == cache]
        a = median([r["time_s"] for r in sub if r["contender"] == "ours_load"])
        for ref in SINGLE:
            b = median([r["time_s"] for r in sub if r["contender"] == ref])
            if a and b:
                q = a / b
                qp = paired_all(sub, "ours_load", ref)
                targets.append(
                    f"- load ({cache} cache): ours / {ref} = {q:.2f} as a ratio of medians, "
                    f"{qp:.2f} paired (target ≤ 1.2): {'met' if q <= 1.2 else 'MISSED'}"
                )
    if targets:
        lines += ["", "Targets:", "", *targets]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-gb", type=float, default=1.75, help="state dict size in GiB (default 1.75)"
    )
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per contender (default 3)")
    p.add_argument(
        "--dir", default=None, help=f"work folder (default: a new temp dir under {DATA_ROOT})"
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma list of contenders to run, by letter or name: "
        + ", ".join(f"{k}={v}" for k, v in ALL.items()),
    )
    p.add_argument(
        "--cache",
        choices=["cold", "warm", "both"],
        default="both",
        help="page cache state for loads (cold needs a writable /proc/sys/vm/drop_caches; default "
        "both)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="thread_count passed to every storage that has one (default: each library's own "
        "default)",
    )
    p.add_argument(
        "--cast",
        action="store_true",
        help="save a float32 state dict as bfloat16 (a, i, j, m only; see above)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="contender m's library: the root of a checkout of another revision",
    )
    p.add_argument(
        "--max-shard-size", default="5GB", help="HFStorageWriter max_shard_size (default 5GB)"
    )
    p.add_argument(
        "--sample-ms",
        type=float,
        default=5.0,
        help="RSS sampling period in ms; 0 turns the sampling thread off (ru_maxrss only)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed warm-up save/load before each measurement",
    )
    p.add_argument(
        "--no-prime",
        action="store_true",
        help="skip the throwaway plain write that precedes the timed saves",
    )
    p.add_argument(
        "--full-verify", action="store_true", help="compare every saved tensor, not a few"
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the checkpoints (default: delete the work folder)"
    )
    p.add_argument(
        "--md-out", default=None, help="also write the markdown table and JSON lines to this file"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    selected = select(args.only, ALL)
    save_names = [n for n in SAVE.values() if n in selected]
    load_names = [n for n in LOAD.values() if n in selected]
    if args.cast and set(save_names) - set(CAST_OK):
        raise SystemExit(
            f"--cast applies to {', '.join(CAST_OK)}; not to "
            f"{', '.join(sorted(set(save_names) - set(CAST_OK)))}"
        )
    if ("ours_baseline" in save_names) != (args.baseline is not None):
        raise SystemExit("contender m (ours_baseline) and --baseline DIR go together")
    if args.baseline is not None and not os.path.isfile(
        os.path.join(args.baseline, "hf_dcp_storage", "__init__.py")
    ):
        raise SystemExit(
            f"--baseline {args.baseline}: no hf_dcp_storage package there (give the root of a "
            "checkout)"
        )

    d = model_dims(args.size_gb)
    spec = model_spec(d)
    size = total_bytes(spec)
    bad_dims = [k for k, s in spec if s[0] % args.ranks]
    if bad_dims:
        print(
            f"note: {len(bad_dims)} tensors have dim 0 not divisible by {args.ranks} ranks "
            "(uneven Shard(0))",
            file=sys.stderr,
        )
    work = make_work_dir("bench_", args.dir)
    free = shutil.disk_usage(work).free
    need = size * 4  # ours + pt_hf (sharded + consolidated) + the one being measured
    if free < need + 2 * GiB:
        raise SystemExit(f"{work}: {free / GiB:.1f} GiB free, need about {need / GiB:.1f} GiB")

    can_drop = _drop_caches()
    caches: list[str] = []
    if load_names:
        if args.cache in ("cold", "both"):
            if can_drop:
                caches.append("cold")
            else:
                print(
                    "note: cannot write /proc/sys/vm/drop_caches; cold-cache loads skipped",
                    file=sys.stderr,
                )
        if args.cache in ("warm", "both") or not caches:
            caches.append("warm")

    cpu = os.cpu_count() or 1
    cfg = {
        "threads": args.threads,
        "max_shard_size": args.max_shard_size,
        "warmup": not args.no_warmup,
        "sample_ms": args.sample_ms,
        "torch_threads": max(1, cpu // args.ranks),
        "torch_threads_single": cpu,
        "size_bytes": size,
        "cast": args.cast,
        "baseline": os.path.abspath(args.baseline) if args.baseline else None,
    }
    env = {
        **env_record(("safetensors", "hf_dcp_storage"), work=work),
        "drop_caches": can_drop,
        "dims": d.__dict__,
        "tensors": len(spec),
        "size_bytes": size,
        "size_gib": round(size / GiB, 3),
        "args": vars(args),
        "cfg": cfg,
    }
    runner = SaveLoadRunner(args, work, spec, cfg)
    runner.emit(env)
    try:
        # ---- saves: repeat r runs the contenders forward when r is even, backwards when odd ----
        keep = {}  # contender -> output folder kept for the load phase / verification
        if save_names and not args.no_prime:
            # Untimed-in-the-table first write: on the VM disk this was measured on, the first write
            # after the disk sat idle for a while runs at about half speed (see
            # benchmarks/README.md, "Prime").
            out = str(work / "prime")
            os.sync()
            runner.measure(SAVE_FLOOR, repeat=-1, phase="prime", cache=None, out=out)
            shutil.rmtree(out, ignore_errors=True)
        for rep, name in interleave(save_names, args.repeats):
            out = str(work / f"{name}_r{rep}")
            os.sync()
            rec = runner.measure(name, repeat=rep, phase="save", cache=None, out=out)
            if name in ("ours", "pt_hf", "odirect") and rec.get("ok"):
                if name in keep:
                    shutil.rmtree(keep[name], ignore_errors=True)
                keep[name] = out
            else:
                shutil.rmtree(out, ignore_errors=True)
        for name in ("ours", "pt_hf"):
            if name in keep:
                runner.verify_output(keep[name], full=args.full_verify)
        if (
            "pt_hf" in keep
        ):  # the consolidated copy is what a reader uses; the sharded one is a by-product
            shutil.rmtree(os.path.join(keep["pt_hf"], "sharded"), ignore_errors=True)

        # ---- loads: all readers read the same consolidated files (ours, else pt_hf's, else a fresh
        # save) ----
        if "odirect_read" in load_names:
            if "odirect" not in keep:
                keep["odirect"] = str(work / "raw_src")
                runner.measure(
                    "odirect", repeat=-1, phase="prepare", cache=None, out=keep["odirect"]
                )
            cfg["raw_src"] = keep["odirect"]
        if load_names:
            src = keep.get("ours") or keep.get("pt_hf")
            if src is None:
                src = str(work / "load_src")
                rec = runner.measure("ours", repeat=-1, phase="prepare", cache=None, out=src)
                if not rec.get("ok"):
                    raise SystemExit("could not write the checkpoint to load")
            runner.emit({"phase": "load_source", "dir": os.path.basename(src), "bytes": _du(src)})
            for cache in caches:
                for rep, name in interleave(load_names, args.repeats):
                    if cache == "cold":
                        _drop_caches()
                    else:
                        _warm(src)
                    runner.measure(
                        name,
                        repeat=rep,
                        phase="load",
                        cache=cache,
                        src=src,
                        verify=name != "odirect_read",
                    )
    finally:
        runner.close()
        elapsed = time.time() - t_start
        table = summarize(runner.records, cfg)
        print()
        print(table)
        where = (
            f"{work / 'results.jsonl'}"
            if args.keep
            else ("in " + args.md_out if args.md_out else "printed above")
        )
        print(f"\nfull run: {elapsed / 60:.1f} min; raw JSON lines: {where}")
        if args.md_out:
            _write_md(args.md_out, env, table, work / "results.jsonl", elapsed)
        if not args.keep:
            remove_work_dir(work)
    return 0 if all(r.get("ok", True) for r in runner.records) else 1


def _write_md(path: str, env: dict, table: str, jsonl: Path, elapsed: float) -> None:
    d = env["dims"]
    head = [
        (
            f"# bench_save_load: {env['size_gib']} GiB bf16, {env['args']['ranks']} ranks, "
            f"{env['cpus']} CPUs"
        ),
        "",
        (
            f"- date {env['date']}; python {env['python']}, torch {env['torch']}, safetensors "
            f"{env['safetensors']}, hf_dcp_storage {env['hf_dcp_storage']} (git {env['git']})"
        ),
        (
            f"- model: llama-like, vocab {d['vocab']}, hidden {d['hidden']}, intermediate "
            f"{d['inter']}, kv {d['kv']}, {d['layers']} layers -> {env['tensors']} tensors, "
            f"{env['size_bytes']} bytes; every tensor a Shard(0) DTensor"
        ),
        f"- work dir {env['work_dir']} ({env['fs']}); drop_caches writable: {env['drop_caches']}",
        (
            f"- repeats {env['args']['repeats']}, thread_count "
            f"{env['cfg']['threads'] or 'library defaults'}, torch threads per rank "
            f"{env['cfg']['torch_threads']}, warmup {env['cfg']['warmup']}"
        ),
        (
            f"- command: `python -m benchmarks.bench_save_load {' '.join(sys.argv[1:])}`; full "
            f"run {elapsed / 60:.1f} min"
        ),
        "",
    ]
    write_report(path, "\n".join(head) + "\n" + table, jsonl.read_text() if jsonl.exists() else "")


if __name__ == "__main__":
    sys.exit(main())
