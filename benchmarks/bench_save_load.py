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
Load contenders (into a freshly allocated Shard(0) DTensor state dict; all read the files of a):
  e  ours_load    HFStorageReader
  f  pt_hf_load   torch HuggingFaceStorageReader
  g  st_load_file safetensors.torch.load_file of every file, one process, whole model (reference).
                  Its default backend maps the file lazily (returns in ~1 ms without reading a byte),
                  so the timed region also touches one byte per 4 KiB page of every tensor: the data
                  is then really in memory (as shared page-cache pages, no copy).
  h  st_load_file_pread  the same with load_file(..., backend="pread"): copies into process memory,
                  which is what the DCP readers do (into their destination tensors).

Timing: time.perf_counter around the save/load call only, a barrier before the start and after
the end, max over ranks. Memory: the parent samples VmRSS/RssAnon/RssFile of every rank from
/proc/<pid>/status every 5 ms and keeps the peak inside the rank's call window, above the rank's
own reading just before the call; the fresh process's ru_maxrss growth is recorded as a check.

Every measurement prints one JSON line; a markdown summary follows at the end.
Run ``python benchmarks/bench_save_load.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DEFAULT_DATA_ROOT = HERE / "_data"  # git-ignored, same disk as the checkout

SAVE = {"a": "ours", "b": "pt_hf", "c": "pt_fs", "d": "plain"}
LOAD = {"e": "ours_load", "f": "pt_hf_load", "g": "st_load_file", "h": "st_load_file_pread"}
SINGLE = ("st_load_file", "st_load_file_pread")
ALL = {**SAVE, **LOAD}
SAVE_FLOOR = "plain"
LOAD_REF = "st_load_file"  # the reference the load target is stated against
MiB = 1 << 20
GiB = 1 << 30


# ------------------------------------------------------------------------------------------------
# Synthetic model
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    inter: int
    kv: int  # GQA: k/v projection output features
    layers: int


# (vocab, hidden, intermediate, kv) presets, largest first; TinyLlama-like at the top.
_PRESETS = [(32000, 2048, 5632, 256), (16000, 1024, 2816, 256), (8000, 512, 1408, 128), (2048, 256, 704, 64)]


def model_dims(size_gb: float) -> Dims:
    """Pick a preset whose embeddings are small next to the target, then the layer count."""
    target = size_gb * GiB
    for v, h, i, kv in _PRESETS:
        fixed = (2 * v * h + h) * 2
        per_layer = (2 * h * h + 2 * kv * h + 3 * h * i + 2 * h) * 2
        if fixed <= target / 4 or (v, h, i, kv) == _PRESETS[-1]:
            layers = max(1, round((target - fixed) / per_layer))
            return Dims(v, h, i, kv, layers)
    raise AssertionError


def model_spec(d: Dims) -> list[tuple[str, tuple[int, ...]]]:
    """(key, global shape) in state-dict order, with Hugging Face llama key names."""
    spec: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (d.vocab, d.hidden))]
    for i in range(d.layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "input_layernorm.weight", (d.hidden,)),
            (p + "self_attn.q_proj.weight", (d.hidden, d.hidden)),
            (p + "self_attn.k_proj.weight", (d.kv, d.hidden)),
            (p + "self_attn.v_proj.weight", (d.kv, d.hidden)),
            (p + "self_attn.o_proj.weight", (d.hidden, d.hidden)),
            (p + "post_attention_layernorm.weight", (d.hidden,)),
            (p + "mlp.gate_proj.weight", (d.inter, d.hidden)),
            (p + "mlp.up_proj.weight", (d.inter, d.hidden)),
            (p + "mlp.down_proj.weight", (d.hidden, d.inter)),
        ]
    spec += [("model.norm.weight", (d.hidden,)), ("lm_head.weight", (d.vocab, d.hidden))]
    return spec


def total_bytes(spec) -> int:
    return sum(math.prod(s) * 2 for _, s in spec)


def local_shape(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """(row offset, rows) of ``rank``'s Shard(0) chunk, as DTensor (torch.chunk) splits dim 0."""
    step = -(-shape[0] // world)
    start = min(rank * step, shape[0])
    return start, min(shape[0], start + step) - start


def make_shard(key: str, shape: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """Deterministic random bf16 bits for ``rank``'s Shard(0) chunk of ``key`` (any bit pattern)."""
    _, rows = local_shape(shape, rank, world)
    lshape = (rows, *shape[1:])
    n = math.prod(lshape)
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}|{rank}|{world}".encode()))
    if n % 4 == 0:  # int64 generation is ~2x faster than int16
        bits = torch.empty(n // 4, dtype=torch.int64)
        bits.random_(generator=g)
        return bits.view(torch.bfloat16).view(lshape)
    bits16 = torch.empty(n, dtype=torch.int16)
    bits16.random_(-(1 << 15), 1 << 15, generator=g)
    return bits16.view(torch.bfloat16).view(lshape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (the data holds NaN patterns, so no float ==)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


# ------------------------------------------------------------------------------------------------
# Memory sampling
# ------------------------------------------------------------------------------------------------


def _status_kib(pid: int | str = "self") -> dict[str, int] | None:
    """VmRSS, RssAnon, RssFile (KiB) of a process; None once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"VmRSS:", b"RssAnon:", b"RssFile:")):
                    k, v = line.split(b":", 1)
                    out[k.decode()] = int(v.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return out if len(out) == 3 else None


class CallWindow:
    """In the measured process: baseline memory and wall-clock bounds of the timed call.

    The 5 ms sampling itself runs in the parent (``ProcSampler``), so no extra thread competes
    for this process's GIL or CPU; the parent keeps the samples that fall inside [ts0, ts1].
    """

    def start(self) -> None:
        self.base = _status_kib()
        self.ru0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.ts0 = time.time()

    def stop(self) -> dict:
        self.ts1 = time.time()
        end = _status_kib()
        ru1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {
            "pid": os.getpid(),
            "ts0": self.ts0,
            "ts1": self.ts1,
            "base_kib": self.base,
            "end_kib": end,
            "rss_base_mib": self.base["VmRSS"] / 1024,
            # ru_maxrss is the process's lifetime peak: its growth during the call is a lower bound
            # of the call's extra peak (exact when nothing before the call went higher).
            "maxrss_delta_mib": (ru1 - self.ru0) / 1024,
        }


class ProcSampler:
    """Parent-side thread sampling /proc/<pid>/status of child processes every ``period`` s."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.pids: list[int] = []
        self.samples: dict[int, list[tuple[float, dict[str, int]]]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self, pids: list[int]) -> "ProcSampler":
        self.pids = list(pids)
        self.samples = {p: [] for p in self.pids}
        if self.period > 0:
            self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for p in self.pids:
                st = _status_kib(p)
                if st is not None:
                    self.samples[p].append((time.time(), st))

    def stop(self) -> None:
        self._stop.set()
        if self._t.is_alive():
            self._t.join()

    def peak_extra(self, rec: dict) -> dict:
        """Extra peak (MiB) above the baseline inside the rank's call window."""
        base, end = rec["base_kib"], rec["end_kib"]
        window = [st for t, st in self.samples.get(rec["pid"], []) if rec["ts0"] <= t <= rec["ts1"]]
        window.append(end)
        out = {}
        for key, name in (("VmRSS", "rss"), ("RssAnon", "anon"), ("RssFile", "file")):
            out[f"{name}_extra_mib"] = max(0, max(st[key] for st in window) - base[key]) / 1024
        out["rss_samples"] = len(window) - 1
        return out


# ------------------------------------------------------------------------------------------------
# Rank-side work (fresh processes)
# ------------------------------------------------------------------------------------------------


def _init_dist(rank: int, world: int, rdzv: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    return dist, init_device_mesh("cpu", (world,))


def _dtensor_sd(spec, mesh, rank, world, *, fill: str):
    from torch.distributed.tensor import DTensor, Shard

    sd = {}
    for key, shape in spec:
        if fill == "data":
            local = make_shard(key, shape, rank, world)
        else:  # destination for a load: allocated and touched, so it is in the RSS baseline
            _, rows = local_shape(shape, rank, world)
            local = torch.zeros((rows, *shape[1:]), dtype=torch.bfloat16)
        sd[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=_stride(shape))
    return sd


def _stride(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


def _plain_write(sd, path: str) -> None:
    with open(path, "wb") as f:
        for v in sd.values():
            local = v.to_local()
            f.write(memoryview(local.view(torch.uint8).numpy()).cast("B") if local.numel() else b"")
        f.flush()
        os.fsync(f.fileno())


def _save_call(name: str, sd, out: str, rank: int, cfg: dict):
    import torch.distributed.checkpoint as dcp

    if name == "ours":
        from hf_dcp_storage import HFStorageWriter

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        return lambda: dcp.save(sd, storage_writer=HFStorageWriter(out, max_shard_size=cfg["max_shard_size"], **kw))
    if name == "pt_hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"], "thread_count_consolidation": cfg["threads"]}
        return lambda: dcp.save(
            sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True, **kw)
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

    if name == "ours_load":
        from hf_dcp_storage import HFStorageReader

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        return lambda: dcp.load(sd, storage_reader=HFStorageReader(src, **kw))
    if name == "pt_hf_load":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        return lambda: dcp.load(sd, storage_reader=HuggingFaceStorageReader(src, **kw))
    raise ValueError(name)


def _warmup(name: str, mesh, rank: int, world: int, scratch: str, cfg: dict) -> None:
    """A tiny save/load through the same code path, so one-time imports/lazy init are not timed."""
    spec = [("w", (4 * world, 8))]
    if name in SAVE.values():
        sd = _dtensor_sd(spec, mesh, rank, world, fill="data")
        _save_call(name, sd, scratch, rank, cfg)()
    else:
        # Load the tiny checkpoint written by our writer (both readers read it).
        from hf_dcp_storage import HFStorageWriter
        import torch.distributed.checkpoint as dcp

        dcp.save(_dtensor_sd(spec, mesh, rank, world, fill="data"), storage_writer=HFStorageWriter(scratch))
        _load_call(name, _dtensor_sd(spec, mesh, rank, world, fill="zeros"), scratch, cfg)()


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one measurement (spawned fresh)."""
    torch.set_num_threads(job["cfg"]["torch_threads"])
    dist, mesh = _init_dist(rank, world, job["rdzv"])
    name, cfg = job["name"], job["cfg"]
    spec = [(k, tuple(s)) for k, s in job["spec"]]
    is_save = name in SAVE.values()

    if cfg["warmup"]:
        _warmup(name, mesh, rank, world, job["scratch"], cfg)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(job["scratch"], ignore_errors=True)

    sd = _dtensor_sd(spec, mesh, rank, world, fill="data" if is_save else "zeros")
    call = _save_call(name, sd, job["out"], rank, cfg) if is_save else _load_call(name, sd, job["src"], cfg)
    gc.collect()
    gc.disable()  # no collector pauses inside the timed region
    dist.barrier()
    win = CallWindow()
    win.start()
    dist.barrier()
    t0 = time.perf_counter()
    call()
    t_call = time.perf_counter() - t0
    dist.barrier()
    t_wall = time.perf_counter() - t0
    mem = win.stop()
    gc.enable()

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

    per_rank = {"rank": rank, "call_s": t_call, "wall_s": t_wall, **mem, **extra}
    gathered = [None] * world
    dist.all_gather_object(gathered, per_rank)
    if rank == 0:
        with open(job["result"], "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def _touch_pages(t: torch.Tensor) -> int:
    """Fault in every 4 KiB page of a (possibly lazily mmapped) tensor by reading one byte per page."""
    u = t.reshape(-1).view(torch.uint8)
    if u.numel() == 0:
        return 0
    return int(u[::4096].sum()) + int(u[-1])


def single_main(job: dict) -> None:
    """Contenders g/h: safetensors.torch.load_file of the whole consolidated model in one process."""
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
        for k, s in job["spec"]:
            s = tuple(s)
            full = torch.cat([make_shard(k, s, r, world) for r in range(world)]) if len(s) else make_shard(k, s, 0, 1)
            if k not in out or not same_bits(out[k], full):
                bad.append(k)
            out.pop(k, None)
        extra_keys = sorted(out)
        rec.update(verify_bad=(bad + extra_keys)[:5], verify_n_bad=len(bad) + len(extra_keys), verify_s=time.perf_counter() - t1)
    with open(job["result"], "w") as f:
        json.dump([rec], f)


def verify_consolidated_main(job: dict) -> None:
    """After the saves: the consolidated output opens with plain safetensors and holds the originals."""
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
        keys = sorted({keys[0], keys[1], keys[2], keys[len(keys) // 2], keys[-3], keys[-2], keys[-1]}, key=keys.index)
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


def _finish(per_rank: list[dict], sampler: ProcSampler) -> list[dict]:
    for rec in per_rank:
        if "pid" in rec:
            rec.update(sampler.peak_extra(rec))
            for k in ("base_kib", "end_kib", "ts0", "ts1", "pid"):
                rec.pop(k, None)
    return per_rank


def _run_ranks(job: dict, world: int, main: Callable[[int, int, dict], None] | None = None) -> list[dict]:
    """Run ``main(rank, world, job)`` (default ``rank_main``) on ``world`` fresh processes,
    sampling their RSS; the per-rank records it wrote to ``job["result"]``."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(main or rank_main, args=(world, job), nprocs=world, join=False, start_method="spawn")
    sampler = ProcSampler(job["cfg"]["sample_ms"] / 1000).start([p.pid for p in ctx.processes])
    try:
        while not ctx.join():
            pass
    finally:
        sampler.stop()
    with open(job["result"]) as f:
        return _finish(json.load(f), sampler)


def _run_single(fn, job: dict, sample: bool = True) -> list[dict]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=fn, args=(job,))
    p.start()
    sampler = ProcSampler(job["cfg"]["sample_ms"] / 1000 if sample else 0).start([p.pid])
    try:
        p.join()
    finally:
        sampler.stop()
    if p.exitcode != 0:
        raise RuntimeError(f"{fn.__name__} exited with {p.exitcode}")
    with open(job["result"]) as f:
        return _finish(json.load(f), sampler)


class Runner:
    def __init__(self, args, work: Path, spec, cfg) -> None:
        self.args, self.work, self.spec, self.cfg = args, work, spec, cfg
        self.records: list[dict] = []
        self.seq = 0
        self.jsonl = open(work / "results.jsonl", "a")

    def emit(self, rec: dict) -> None:
        line = json.dumps(rec, sort_keys=False)
        print(line, flush=True)
        self.jsonl.write(line + "\n")
        self.jsonl.flush()
        self.records.append(rec)

    def _job(self, name: str, **kw) -> dict:
        self.seq += 1
        tag = f"{self.seq:03d}_{name}"
        return {
            "name": name,
            "cfg": self.cfg,
            "spec": self.spec,
            "world": self.args.ranks,
            "rdzv": str(self.work / f"rdzv_{tag}"),
            "result": str(self.work / f"result_{tag}.json"),
            "scratch": str(self.work / f"warmup_{tag}"),
            "verify": kw.pop("verify", False),
            **kw,
        }

    def measure(self, name: str, *, repeat: int, phase: str, cache: str | None, **kw) -> dict:
        job = self._job(name, **kw)
        rec = {"phase": phase, "contender": name, "repeat": repeat, "cache": cache, "ranks": self.args.ranks,
               "size_bytes": self.cfg["size_bytes"]}
        t0 = time.time()
        try:
            if name in SINGLE:
                per_rank = _run_single(single_main, job)
            else:
                per_rank = _run_ranks(job, self.args.ranks)
        except Exception as exc:  # a failing contender is reported, the rest still run
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            self.emit(rec)
            return rec
        finally:
            for p in (job["rdzv"], job["result"]):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
            shutil.rmtree(job["scratch"], ignore_errors=True)
        def mx(k):
            vals = [r[k] for r in per_rank if r.get(k) is not None]
            return max(vals) if vals else None
        rec.update(
            ok=True,
            time_s=mx("wall_s"),
            call_s=mx("call_s"),
            gbps=self.cfg["size_bytes"] / mx("wall_s") / 1e9,
            rss_extra_mib=mx("rss_extra_mib"),
            anon_extra_mib=mx("anon_extra_mib"),
            file_extra_mib=mx("file_extra_mib"),
            maxrss_delta_mib=mx("maxrss_delta_mib"),
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
            res = _run_single(verify_consolidated_main, job, sample=False)[0]
        except Exception as exc:
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(job["result"])
        rec = {"phase": "verify_save", **res}
        self.emit(rec)
        return rec


def _median(xs):
    return statistics.median(xs) if xs else None


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
            med = {n: _median([r["time_s"] for r in sub if r["contender"] == n]) for n in names}
            refs_here = [x for x in refs if x in med]
            title = f"**{label}**" + (f" (page cache: {cache})" if cache else "")
            out.append(title)
            out.append("")
            by_rep = {(r["contender"], r["repeat"]): r["time_s"] for r in sub}

            def paired(n, x):
                qs = [by_rep[(n, rep)] / by_rep[(x, rep)] for (m, rep) in by_rep if m == n and (x, rep) in by_rep]
                return _median(qs)

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
                runs = ", ".join(f"{r['time_s']:.2f}" for r in sorted(rs, key=lambda r: r["repeat"]))
                last = (
                    f"{max(r.get('sync_after_s', 0) for r in rs):.2f}"
                    if label == "save"
                    else ("yes" if all(r.get("verified") for r in rs) else ("NO" if any(r.get("verified") is False for r in rs) else "-"))
                )
                out.append(
                    f"| {n} | {m:.2f} | {runs} | {cfg['size_bytes'] / m / 1e9:.2f} | {ratios}"
                    f"{max(r['rss_extra_mib'] for r in rs):.0f} | {max(r['anon_extra_mib'] for r in rs):.0f} | "
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
            f"{v.get('index_total_size')} vs {v.get('expected_total_size')}){' bad: ' + str(v.get('bad')) if v.get('bad') else ''}"
            + (f" error: {v.get('error')}" if v.get("error") else "")
        )
    for r in failed:
        lines.append(f"- FAILED: {r.get('phase')} {r.get('contender')} repeat {r.get('repeat')}: {r.get('error')}")
    targets = []
    def paired_all(rows, n, x):
        t = {(r["contender"], r["repeat"]): r["time_s"] for r in rows}
        return _median([t[(n, rep)] / t[(x, rep)] for (m, rep) in t if m == n and (x, rep) in t])

    smed = {n: _median([r["time_s"] for r in saves if r["contender"] == n]) for n in SAVE.values()}
    if smed.get("ours") and smed.get(SAVE_FLOOR):
        q = smed["ours"] / smed[SAVE_FLOOR]
        qp = paired_all(saves, "ours", SAVE_FLOOR)
        targets.append(
            f"- save: ours / plain write+fsync = {q:.2f} as a ratio of medians, {qp:.2f} as the median of "
            f"per-repeat ratios (target ≤ 1.15): {'met' if q <= 1.15 else 'MISSED'}"
        )
    ours_rss = [r["rss_extra_mib"] for r in saves + loads if r["contender"] in ("ours", "ours_load")]
    if ours_rss:
        m = max(ours_rss)
        targets.append(f"- extra peak RSS per rank, ours (save and load, max) = {m:.0f} MiB (target ≤ 128): {'met' if m <= 128 else 'MISSED'}")
    for cache in sorted({r["cache"] for r in loads}):
        sub = [r for r in loads if r["cache"] == cache]
        a = _median([r["time_s"] for r in sub if r["contender"] == "ours_load"])
        for ref in SINGLE:
            b = _median([r["time_s"] for r in sub if r["contender"] == ref])
            if a and b:
                q = a / b
                qp = paired_all(sub, "ours_load", ref)
                targets.append(
                    f"- load ({cache} cache): ours / {ref} = {q:.2f} as a ratio of medians, {qp:.2f} paired "
                    f"(target ≤ 1.2): {'met' if q <= 1.2 else 'MISSED'}"
                )
    if targets:
        lines += ["", "Targets:", ""] + targets
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.75, help="state dict size in GiB (default 1.75)")
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per contender (default 3)")
    p.add_argument("--dir", default=None, help=f"work folder (default: a new temp dir under {DEFAULT_DATA_ROOT})")
    p.add_argument(
        "--only", default=None,
        help="comma list of contenders to run, by letter or name: " + ", ".join(f"{k}={v}" for k, v in ALL.items()),
    )
    p.add_argument("--cache", choices=["cold", "warm", "both"], default="both",
                   help="page cache state for loads (cold needs a writable /proc/sys/vm/drop_caches; default both)")
    p.add_argument("--threads", type=int, default=None,
                   help="thread_count passed to every storage that has one (default: each library's own default)")
    p.add_argument("--max-shard-size", default="5GB", help="HFStorageWriter max_shard_size (default 5GB)")
    p.add_argument("--sample-ms", type=float, default=5.0,
                   help="RSS sampling period in ms; 0 turns the sampling thread off (ru_maxrss only)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed tiny save/load before each measurement")
    p.add_argument("--no-prime", action="store_true",
                   help="skip the throwaway plain write that precedes the timed saves")
    p.add_argument("--full-verify", action="store_true", help="compare every saved tensor, not a few")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: delete the work folder)")
    p.add_argument("--md-out", default=None, help="also write the markdown table and JSON lines to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    selected = list(ALL.values())
    if args.only:
        selected = []
        for tok in args.only.split(","):
            tok = tok.strip()
            name = ALL.get(tok, tok)
            if name not in ALL.values():
                raise SystemExit(f"--only: unknown contender {tok!r}; choose from {ALL}")
            selected.append(name)
    save_names = [n for n in SAVE.values() if n in selected]
    load_names = [n for n in LOAD.values() if n in selected]

    d = model_dims(args.size_gb)
    spec = model_spec(d)
    size = total_bytes(spec)
    bad_dims = [k for k, s in spec if s[0] % args.ranks]
    if bad_dims:
        print(f"note: {len(bad_dims)} tensors have dim 0 not divisible by {args.ranks} ranks (uneven Shard(0))", file=sys.stderr)
    if args.dir:
        work = Path(args.dir).resolve()
        work.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="bench_", dir=work))
    else:
        DEFAULT_DATA_ROOT.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="bench_", dir=DEFAULT_DATA_ROOT))
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
                print("note: cannot write /proc/sys/vm/drop_caches; cold-cache loads skipped", file=sys.stderr)
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
    }
    env = {
        "phase": "env",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": _version("safetensors"),
        "hf_dcp_storage": _version("hf_dcp_storage"),
        "git": _git_rev(),
        "cpus": cpu,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
        "work_dir": str(work),
        "fs": _fs_type(work),
        "drop_caches": can_drop,
        "dims": d.__dict__,
        "tensors": len(spec),
        "size_bytes": size,
        "size_gib": round(size / GiB, 3),
        "args": vars(args),
        "cfg": cfg,
    }
    runner = Runner(args, work, spec, cfg)
    runner.emit(env)
    try:
        # ---- saves: repeat r runs the contenders forward when r is even, backwards when odd ----
        keep = {}  # contender -> output folder kept for the load phase / verification
        if save_names and not args.no_prime:
            # Untimed-in-the-table first write: on the VM disk this was measured on, the first write
            # after the disk sat idle for a while runs at about half speed (see README).
            out = str(work / "prime")
            os.sync()
            runner.measure(SAVE_FLOOR, repeat=-1, phase="prime", cache=None, out=out)
            shutil.rmtree(out, ignore_errors=True)
        for rep in range(args.repeats):
            order = save_names if rep % 2 == 0 else save_names[::-1]
            for name in order:
                out = str(work / f"{name}_r{rep}")
                os.sync()
                rec = runner.measure(name, repeat=rep, phase="save", cache=None, out=out)
                if name in ("ours", "pt_hf") and rec.get("ok"):
                    if name in keep:
                        shutil.rmtree(keep[name], ignore_errors=True)
                    keep[name] = out
                else:
                    shutil.rmtree(out, ignore_errors=True)
        for name in ("ours", "pt_hf"):
            if name in keep:
                runner.verify_output(keep[name], full=args.full_verify)
        if "pt_hf" in keep:  # the consolidated copy is what a reader uses; the sharded one is a by-product
            shutil.rmtree(os.path.join(keep["pt_hf"], "sharded"), ignore_errors=True)

        # ---- loads: all readers read the same consolidated files (ours, else pt_hf's, else a fresh save) ----
        if load_names:
            src = keep.get("ours") or keep.get("pt_hf")
            if src is None:
                src = str(work / "load_src")
                rec = runner.measure("ours", repeat=-1, phase="prepare", cache=None, out=src)
                if not rec.get("ok"):
                    raise SystemExit("could not write the checkpoint to load")
            runner.emit({"phase": "load_source", "dir": os.path.basename(src), "bytes": _du(src)})
            for cache in caches:
                for rep in range(args.repeats):
                    order = load_names if rep % 2 == 0 else load_names[::-1]
                    for name in order:
                        if cache == "cold":
                            _drop_caches()
                        else:
                            _warm(src)
                        runner.measure(name, repeat=rep, phase="load", cache=cache, src=src, verify=True)
    finally:
        runner.jsonl.close()
        elapsed = time.time() - t_start
        table = summarize(runner.records, cfg)
        print()
        print(table)
        where = f"{work / 'results.jsonl'}" if args.keep else ("in " + args.md_out if args.md_out else "printed above")
        print(f"\nfull run: {elapsed / 60:.1f} min; raw JSON lines: {where}")
        if args.md_out:
            _write_md(args.md_out, env, table, work / "results.jsonl", elapsed)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            with contextlib.suppress(OSError):
                DEFAULT_DATA_ROOT.rmdir()  # only if empty
    return 0 if all(r.get("ok", True) for r in runner.records) else 1


def _write_md(path: str, env: dict, table: str, jsonl: Path, elapsed: float) -> None:
    d = env["dims"]
    head = [
        f"# bench_save_load: {env['size_gib']} GiB bf16, {env['args']['ranks']} ranks, {env['cpus']} CPUs",
        "",
        f"- date {env['date']}; python {env['python']}, torch {env['torch']}, safetensors {env['safetensors']}, "
        f"hf_dcp_storage {env['hf_dcp_storage']} (git {env['git']})",
        f"- model: llama-like, vocab {d['vocab']}, hidden {d['hidden']}, intermediate {d['inter']}, kv {d['kv']}, "
        f"{d['layers']} layers -> {env['tensors']} tensors, {env['size_bytes']} bytes; every tensor a Shard(0) DTensor",
        f"- work dir {env['work_dir']} ({env['fs']}); drop_caches writable: {env['drop_caches']}",
        f"- repeats {env['args']['repeats']}, thread_count {env['cfg']['threads'] or 'library defaults'}, "
        f"torch threads per rank {env['cfg']['torch_threads']}, warmup {env['cfg']['warmup']}",
        f"- command: `python benchmarks/bench_save_load.py {' '.join(sys.argv[1:])}`; full run {elapsed / 60:.1f} min",
        "",
    ]
    raw = jsonl.read_text() if jsonl.exists() else ""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(head) + "\n" + table + "\n\n## Raw JSON lines\n\n```json\n" + raw + "```\n")


def _git_rev() -> str:
    """The checkout's commit, with "+dirty" when the library folder has uncommitted changes."""
    import subprocess

    try:
        root = HERE.parent
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "hf_dcp_storage"], capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) or "?"
    except Exception:
        return "?"


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "?"


def _fs_type(path: Path) -> str:
    best, fstype = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], f"{parts[2]} on {parts[0]}"
    return fstype


if __name__ == "__main__":
    sys.exit(main())
