"""S3 benchmark: hf_dcp_storage against PyTorch's FsspecWriter/FsspecReader and raw s3fs puts,
on moto or on Ceph radosgw (``--server``).

``--server moto`` (default): a moto S3 server (ThreadedMotoServer on 127.0.0.1, port 0) runs in
its own process, so its CPU use is outside the measured ranks' GIL. ``--server radosgw``: a
one-node Ceph cluster (monitor, memstore OSD, radosgw on 127.0.0.1) started by
``tests/support/radosgw.py`` (``scripts/setup/radosgw.sh``). Either way the ranks talk to the store
over loopback through s3fs, and the store shares the machine's cores with them. Every measurement
runs in fresh rank processes (gloo, ``file://`` rendezvous, spawn), like ``bench_save_load.py``.
Each run uses a bucket of its own.

State dict: llama-7B dimensions (hidden 4096, intermediate 11008, MHA 32 heads) with few layers
and a small vocab, ~512 MiB bf16 by default (vocab 8192, 1 decoder layer), HF key names. Every
tensor is a ``Shard(0)`` DTensor on a 1-D mesh of ``--ranks`` CPU ranks (FSDP-like).

Save contenders (``dcp.save`` of the same state dict; wall time = max over ranks, barrier before):
  a  ours        HFStorageWriter("s3://<bucket>/ours_rN") -> consolidated model-*.safetensors +
                 index (each rank uploads the multipart parts that hold only its own bytes
                 straight into the consolidated file's multipart upload; runs under 5 MiB are
                 staged, then gathered into parts by the ranks the coordinator gives them to;
                 the coordinator completes the upload); its writer.merge_stats is recorded
  b  pt_fsspec   torch FsspecWriter("s3://<bucket>/pt_fsspec_rN", **storage_options) (.distcp,
                 not consolidated)
  c  raw_s3fs    each rank fs.pipe()s the bytes of its local shards, one object per tensor (the
  floor)
Load contenders (``dcp.load``, wall time as above), resharded by default:
  d  ours_load       HFStorageReader of (a)'s checkpoint
  e  pt_fsspec_load  torch FsspecReader of (b)'s checkpoint
  Saved Shard(0) on N ranks; loaded into Shard(1) DTensors ("col": column shards; 1-D norms stay
  Shard(0)) on N ranks. If a col load runs past ``--col-timeout`` it is stopped, and Shard(0) ->
  Shard(0) loads ("row") are measured as well; ``--load-layouts col,row`` measures both anyway.

Every load rank checks every loaded local shard bit-for-bit against the regenerated original;
every save is read back outside the timing (ours: the consolidated files with
``safetensors.torch.load``; pt_fsspec: an untimed FsspecReader load; raw: the objects' bytes).
Between contenders the previous checkpoint of the same contender is deleted (radosgw: its
garbage collector is run at once, outside the timing), so the RAM-backed store never holds more
than the two checkpoints kept for the loads plus the one being written.

Store accounting around each timed call: on moto, a counting WSGI middleware in the moto process
records requests, bytes in/out and server-side copied bytes per S3 operation, and moto's own CPU
seconds; on radosgw, radosgw's perf counters (admin socket: requests, GET/HEAD count and bytes
out, PUT/UploadPart count and bytes in) and the CPU seconds of the radosgw, ceph-osd and
ceph-mon daemons (from /proc). Each measurement also records the CPU that anything else on the
machine used during its timed call (``other_cpu_s``: /proc/stat busy time minus the ranks' and
the store's CPU), so results taken next to other jobs show as such. At the end, untimed, one
4 KiB and one 16 MiB ranged GET of ours' file are probed (5 each): what a request costs here.

Run ``python -m benchmarks.bench_s3 --help`` for the flags; ``--md-out FILE`` writes a markdown
report with the raw JSON lines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

from benchmarks._harness import (
    CallTimeout,
    MiB,
    Runner,
    collect_garbage,
    dtensor_state_dict,
    env_record,
    expected_local,
    fmt,
    fmt_mib,
    gather_results,
    init_dist,
    interleave,
    local_shape,
    make_work_dir,
    max_over,
    median,
    model_spec,
    original_full,
    osd_used_bytes,
    paired_ratios,
    remove_work_dir,
    run_ranks,
    same_bits,
    seal_aws_env,
    select,
    server_stats,
    start_server,
    stats_delta,
    storage_options,
    sys_busy_s,
    timed_call,
    timed_subclass,
    total_bytes,
    wait_idle,
    wide_model_dims,
    write_report,
)

BUCKET_PREFIX = "bench-"  # + a random suffix: one bucket per run
SAVE = {"a": "ours", "b": "pt_fsspec", "c": "raw_s3fs"}
LOAD = {"d": "ours_load", "e": "pt_fsspec_load"}
ALL = {**SAVE, **LOAD}
SAVE_REF, SAVE_FLOOR, LOAD_REF = "pt_fsspec", "raw_s3fs", "pt_fsspec_load"


# ------------------------------------------------------------------------------------------------
# What the library plans for this model: GETs of a col load, client-side consolidation bytes
# ------------------------------------------------------------------------------------------------


def col_get_count(spec, world: int, rank: int = 0) -> int:
    """Ranged GETs rank ``rank``'s HFStorageReader makes for a col load (not verify mode), from
    the library's own slab cutting and request coalescing: per slab of the destination, the
    column runs of its rows joined into requests. Falls back to one GET per row if those
    helpers are not importable."""
    try:
        from hf_dcp_storage.io.slabs import slab_bounds
        from hf_dcp_storage.plan.reads import coalesce
    except ImportError:
        return sum(s[0] if len(s) >= 2 else 1 for _, s in spec)
    n_req = 0
    for _, shape in spec:
        if len(shape) < 2:
            n_req += 1
            continue
        c0, n = local_shape((shape[1],), rank, world)
        row = 2 * math.prod(shape[1:])
        for r0, r1 in slab_bounds((shape[0], n), 2):
            n_req += len(
                coalesce([(r * row + 2 * c0, r * row + 2 * (c0 + n)) for r in range(r0, r1)])
            )
    return n_req


# Shapes for the consolidation projection: (name, vocab, hidden, intermediate, kv features, layers).
_PROJECT = [
    ("this benchmark's model", None, None, None, None, None),
    ("TinyLlama-1.1B (GQA)", 32000, 2048, 5632, 256, 22),
    ("Llama-2-7B (MHA)", 32000, 4096, 11008, 4096, 32),
    ("Llama-3-8B (GQA)", 128256, 4096, 14336, 1024, 32),
]


def project_client_fraction(spec, world: int, header_len: int = 16 << 10) -> float | None:
    """merge_stats.client_fraction that HFStorageWriter's S3 part planner gives for ``spec`` saved
    as Shard(0) on ``world`` ranks into one file: computed (not measured) with the library's own
    ``plan_file_parts`` on the file's byte runs and their owners. A run of one rank shorter than
    S3's 5 MiB minimum part is staged, then gathered (by the ranks)."""
    try:
        from hf_dcp_storage.plan.parts import GatherPart, plan_file_parts
    except ImportError:
        return None
    runs, pos = [], header_len
    for _, shape in spec:
        row = 2 * math.prod(shape[1:])
        for r in range(world):
            _, n = local_shape(shape, r, world)
            runs.append((pos, r, n * row))
            pos += n * row
    try:
        parts = plan_file_parts(header_len, runs, pos)
    except Exception:  # noqa: BLE001 - best effort: any failure reads as unknown
        return None
    return sum(p.nbytes for p in parts if isinstance(p, GatherPart)) / pos


def _projection_lines(spec, world: int) -> list[str]:
    worlds = sorted({world, 2, 8, 32})
    rows = []
    for name, v, h, i, kv, layers in _PROJECT:
        if v is None:
            sp = spec
        else:
            sp = [("e", (v, h))]
            for _ in range(layers):
                sp += [
                    ("n", (h,)),
                    ("q", (h, h)),
                    ("k", (kv, h)),
                    ("v", (kv, h)),
                    ("o", (h, h)),
                    ("n", (h,)),
                    ("g", (i, h)),
                    ("u", (i, h)),
                    ("d", (h, i)),
                ]
            sp += [("n", (h,)), ("lm", (v, h))]
        fr = [project_client_fraction(sp, w) for w in worlds]
        if any(f is None for f in fr):
            return []
        rows.append(
            f"| {name} | {total_bytes(sp) / (1 << 30):.2f} | "
            + " | ".join(f"{f * 100:.1f} %" for f in fr)
            + " |"
        )
    return [
        (
            "**projected client-side consolidation bytes** (not measured: the library's part "
            "planner run on the byte runs of a Shard(0) save into one file, bf16; one rank's runs "
            "under S3's 5 MiB minimum part are staged, then gathered by the ranks)"
        ),
        "",
        "| model | GiB | " + " | ".join(f"{w} ranks" for w in worlds) + " |",
        "|---|---:|" + "---:|" * len(worlds),
        *rows,
        "",
    ]


# ------------------------------------------------------------------------------------------------
# Rank side (fresh processes)
# ------------------------------------------------------------------------------------------------


# Steps around which the store's counters are read too (they run on the coordinator only, so the
# counts are the step's own).
_SNAP = ("finish",)


@contextlib.contextmanager
def _server_step(writer, name: str):
    """Around a timed writer step: for the steps in ``_SNAP``, what the store did during it, in
    ``writer.bench_server[name]``."""
    srv = writer.__dict__.get("bench_srv") if name in _SNAP else None
    s0 = server_stats(srv)
    try:
        yield
    finally:
        if s0 is not None:
            writer.__dict__.setdefault("bench_server", {})[name] = stats_delta(
                s0, server_stats(srv)
            )


def _writer(name: str, url: str, cfg: dict):
    """The writer of a DCP save contender, timed per step."""
    opts = cfg["opts"]
    kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
    if name == "ours":
        from hf_dcp_storage import HFStorageWriter

        # _complete_s3: the coordinator's part of finish on S3 (CompleteMultipartUpload; the ranks
        # gathered the staged small runs in write_data); _merge: the non-S3 staged path.
        cls = timed_subclass(
            HFStorageWriter,
            ["prepare_global_plan", "write_data", "finish", "_complete_s3", "_merge"],
            _server_step,
        )
        w = cls(url, storage_options=opts, max_shard_size=cfg["max_shard_size"], **kw)
    elif name == "pt_fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        w = timed_subclass(
            FsspecWriter, ["prepare_global_plan", "write_data", "finish"], _server_step
        )(url, **kw, **opts)
    else:
        raise ValueError(name)
    w.bench_srv = cfg["server"]
    return w


def _reader(name: str, url: str, cfg: dict, timed: bool = True):
    opts = cfg["opts"]
    if name == "ours_load":
        from hf_dcp_storage import HFStorageReader

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        cls = (
            timed_subclass(HFStorageReader, ["read_metadata", "read_data"])
            if timed
            else HFStorageReader
        )
        return cls(url, storage_options=opts, **kw)
    if name == "pt_fsspec_load":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        cls = (
            timed_subclass(FsspecReader, ["read_metadata", "read_data"]) if timed else FsspecReader
        )
        return cls(url, **opts)
    raise ValueError(name)


def _shard_bytes(v) -> bytes:
    return v.to_local().contiguous().view(torch.uint8).numpy().tobytes()


def _raw_put(fs, sd, base: str, rank: int) -> dict:
    """The floor: this rank's shard bytes, one object per tensor, uploaded concurrently by s3fs."""
    blobs = {f"{base}/rank{rank:05d}/{key}": _shard_bytes(v) for key, v in sd.items()}
    fs.pipe(blobs)
    return blobs


def _save_call(name: str, sd, url: str, rank: int, cfg: dict):
    import torch.distributed.checkpoint as dcp

    if name in ("ours", "pt_fsspec"):
        w = _writer(name, url, cfg)
        return (lambda: dcp.save(sd, storage_writer=w)), w
    if name == "raw_s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(**cfg["opts"])
        base = url.removeprefix("s3://")
        return (lambda: _raw_put(fs, sd, base, rank)), fs
    raise ValueError(name)


def _warmup(name: str, mesh, rank: int, world: int, url: str, cfg: dict, layout: str) -> None:
    """A tiny save/load through the same code path (imports, client set-up, first collectives)."""
    import torch.distributed.checkpoint as dcp

    spec = [("w", (4 * world, 8 * world))]
    data = dtensor_state_dict(spec, mesh, rank, world, fill="data")
    if name in SAVE.values():
        _save_call(name, data, url, rank, cfg)[0]()
        return
    dcp.save(data, storage_writer=_writer("ours" if name == "ours_load" else "pt_fsspec", url, cfg))
    dcp.load(
        dtensor_state_dict(spec, mesh, rank, world, fill="zeros", layout=layout),
        storage_reader=_reader(name, url, cfg, timed=False),
    )


def _verify_save(
    name: str, spec, sd, url: str, rank: int, world: int, cfg: dict, mesh, handle
) -> dict:
    """Outside the timing: read what was saved back and compare with the originals, bit for bit."""
    t0 = time.perf_counter()
    bad: list[str] = []
    checked = 0
    if name == "ours":
        if rank == 0:
            import s3fs
            from safetensors.torch import load as st_load

            fs = s3fs.S3FileSystem(**cfg["opts"])
            root = url.removeprefix("s3://")
            index = json.loads(fs.cat_file(f"{root}/model.safetensors.index.json"))
            wm = index["weight_map"]
            if index.get("metadata", {}).get("total_size") != total_bytes(spec):
                bad.append("index total_size")
            shapes = dict(spec)
            if set(wm) != set(shapes):
                bad.append("index keys")
            for fn in sorted(set(wm.values())):
                tensors = st_load(fs.cat_file(f"{root}/{fn}"))
                for k in [k for k, f in wm.items() if f == fn]:
                    checked += 1
                    if k not in tensors or not same_bits(
                        tensors.pop(k), original_full(k, shapes[k], world)
                    ):
                        bad.append(k)
                bad += [f"extra:{k}" for k in tensors]
                del tensors
    elif name == "pt_fsspec":
        import torch.distributed.checkpoint as dcp

        dest = dtensor_state_dict(spec, mesh, rank, world, fill="zeros")
        dcp.load(dest, storage_reader=_reader("pt_fsspec_load", url, cfg, timed=False))
        for k, v in dest.items():
            checked += 1
            if not same_bits(v.to_local(), sd[k].to_local()):
                bad.append(k)
    elif name == "raw_s3fs":
        paths = {f"{url.removeprefix('s3://')}/rank{rank:05d}/{k}": k for k in sd}
        got = handle.cat(list(paths))
        for p, k in paths.items():
            checked += 1
            if got.get(p) != _shard_bytes(sd[k]):
                bad.append(k)
    return {
        "verify_checked": checked,
        "verify_n_bad": len(bad),
        "verify_bad": bad[:5],
        "verify_s": time.perf_counter() - t0,
    }


def _merge_stats(ms) -> dict:
    """HFStorageWriter.merge_stats as a JSON-able dict."""
    return {
        "files": ms.files,
        "total_bytes": ms.total_bytes,
        "rank_part_bytes": ms.rank_part_bytes,
        "client_bytes": ms.client_bytes,
        "coordinator_bytes": ms.coordinator_bytes,
        "gathered_by_rank": {str(r): b for r, b in sorted(ms.by_rank.items())},
        "client_fraction": ms.client_fraction,
    }


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one measurement (spawned fresh); rank 0 also reads the store's counters."""
    cfg, name = job["cfg"], job["name"]
    torch.set_num_threads(cfg["torch_threads"])
    dist, mesh = init_dist(rank, world, job["rdzv"], timeout_s=1800)
    spec = [(k, tuple(s)) for k, s in job["spec"]]
    is_save = name in SAVE.values()
    layout = job.get("layout", "row")

    if cfg["warmup"]:
        _warmup(name, mesh, rank, world, job["scratch_url"], cfg, layout)
        dist.barrier()

    if is_save:
        sd = dtensor_state_dict(spec, mesh, rank, world, fill="data")
        call, handle = _save_call(name, sd, job["url"], rank, cfg)
    else:
        import torch.distributed.checkpoint as dcp

        sd = dtensor_state_dict(spec, mesh, rank, world, fill="zeros", layout=layout)
        handle = _reader(name, job["url"], cfg)
        call = lambda: dcp.load(sd, storage_reader=handle)  # noqa: E731 - a one-line call to time
    snap: dict = {}

    def before() -> None:  # untimed: the store's counters and the machine's busy time (rank 0)
        snap.update(
            s0=server_stats(cfg["server"]) if rank == 0 else None,
            b0=sys_busy_s() if rank == 0 else None,
        )
        snap["ru0"] = resource.getrusage(resource.RUSAGE_SELF)

    def started() -> None:
        if rank == 0:
            with open(job["t0_file"], "w") as f:  # the parent enforces --col-timeout from here
                f.write(str(time.time()))

    timed = timed_call(dist, call, before=before, started=started)
    ru0, ru1 = snap["ru0"], resource.getrusage(resource.RUSAGE_SELF)
    b0, b1 = snap["b0"], sys_busy_s() if rank == 0 else None
    s1 = server_stats(cfg["server"]) if rank == 0 else None

    extra: dict = {"cpu_s": round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 3)}
    phases = getattr(handle, "bench_t", None)
    if phases:
        extra["phases"] = {k: round(v, 3) for k, v in phases.items()}
    if rank == 0:
        extra["server"] = stats_delta(snap["s0"], s1)
        if b0 is not None and b1 is not None:
            extra["sys_busy_cpu_s"] = round(b1 - b0, 3)
        if getattr(handle, "bench_server", None):
            extra["server_steps"] = handle.bench_server
        ms = getattr(handle, "merge_stats", None)
        if ms is not None:
            extra["merge_stats"] = _merge_stats(ms)
    if is_save:
        if cfg["verify_saves"]:
            extra.update(_verify_save(name, spec, sd, job["url"], rank, world, cfg, mesh, handle))
    else:
        t1 = time.perf_counter()
        bad = [
            k
            for k, s in spec
            if not same_bits(sd[k].to_local(), expected_local(k, s, rank, world, layout))
        ]
        extra.update(
            verify_checked=len(spec),
            verify_n_bad=len(bad),
            verify_bad=bad[:5],
            verify_s=time.perf_counter() - t1,
        )

    per_rank = {"rank": rank, "call_s": timed.call_s, "wall_s": timed.wall_s, **timed.mem, **extra}
    gather_results(dist, rank, world, per_rank, job["result"])
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------


class S3Runner(Runner):
    """The harness's ``Runner`` on one bucket: measurements in fresh ranks with the store's
    accounting around them, deletions (with radosgw's garbage collection), GET probes."""

    def __init__(self, args, work: Path, spec, cfg, fs) -> None:
        super().__init__(work)
        self.args, self.spec, self.cfg, self.fs = args, spec, cfg, fs
        self.srv = cfg["server"]
        self.bucket = cfg["bucket"]

    def remove(self, url: str) -> None:
        """Delete everything under ``url`` (outside any timing); on radosgw also run its garbage
        collector now, so deleted multipart data leaves the RAM-backed OSD before the next
        measurement rather than being collected by radosgw during one."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(url.removeprefix("s3://"), recursive=True)
        collect_garbage(self.srv)

    def measure(
        self,
        name: str,
        *,
        repeat: int,
        phase: str,
        url: str,
        layout: str = "row",
        call_timeout: float | None = None,
    ) -> dict:
        job = self.job(name, cfg=self.cfg, spec=self.spec, url=url, layout=layout)
        job["scratch_url"] = f"s3://{self.bucket}/_warmup/{job['tag']}"
        rec = {
            "phase": phase,
            "contender": name,
            "repeat": repeat,
            "layout": layout,
            "ranks": self.args.ranks,
            "url": url,
        }
        s0 = server_stats(self.srv)
        t_start = time.time()
        try:
            per_rank = run_ranks(
                rank_main,
                job,
                self.args.ranks,
                sample_ms=self.cfg["sample_ms"],
                call_timeout=call_timeout,
                hard_timeout=self.args.hard_timeout,
            )
        except CallTimeout as exc:
            s1 = server_stats(self.srv)
            wait_idle(self.srv)
            rec.update(
                ok=False,
                timed_out=True,
                error=str(exc),
                time_s=None,
                timeout_s=call_timeout,
                server_until_kill=stats_delta(s0, s1),
                process_s=round(time.time() - t_start, 1),
            )
            self.emit(rec)
            return rec
        except Exception as exc:  # noqa: BLE001 - a failing contender is reported, the rest still run
            wait_idle(self.srv)
            rec.update(
                ok=False,
                error=f"{type(exc).__name__}: {exc}"[:2000],
                process_s=round(time.time() - t_start, 1),
            )
            self.emit(rec)
            return rec
        finally:
            self.discard(job)
            with contextlib.suppress(Exception):
                self.fs.rm(job["scratch_url"].removeprefix("s3://"), recursive=True)
            collect_garbage(self.srv)

        r0 = per_rank[0]
        n_bad = sum(r.get("verify_n_bad", 0) for r in per_rank)
        checked = sum(r.get("verify_checked", 0) for r in per_rank)
        rec.update(
            ok=True,
            time_s=max_over(per_rank, "wall_s"),
            call_s=max_over(per_rank, "call_s"),
            rss_extra_mib=max_over(per_rank, "rss_extra_mib"),
            anon_extra_mib=max_over(per_rank, "anon_extra_mib"),
            cpu_s_ranks=round(sum(r.get("cpu_s", 0) for r in per_rank), 2),
            verified=(n_bad == 0) if checked else None,
            verify_bad=[k for r in per_rank for k in r.get("verify_bad", [])][:5],
            server=r0.get("server"),
            server_steps=r0.get("server_steps"),
            merge_stats=r0.get("merge_stats"),
            phases=[r.get("phases") for r in per_rank],
            per_rank=[
                {
                    k: v
                    for k, v in r.items()
                    if k not in ("server", "server_steps", "merge_stats", "phases")
                }
                for r in per_rank
            ],
            process_s=round(time.time() - t_start, 1),
        )
        busy, srv_cpu = r0.get("sys_busy_cpu_s"), (rec["server"] or {}).get("server_cpu_s")
        if busy is not None and srv_cpu is not None:
            # what else ran during the timed call (includes this orchestrator's RSS sampler)
            rec["other_cpu_s"] = round(busy - rec["cpu_s_ranks"] - srv_cpu, 2)
        if phase == "save":
            rec["stored"] = self._stored(url)
        if self.srv["kind"] == "radosgw":
            used = osd_used_bytes(self.srv)
            rec["osd_used_mib"] = None if used is None else round(used / MiB)
        self.emit(rec)
        return rec

    def _stored(self, url: str) -> dict:
        """Bytes and objects left under the prefix, and unfinished multipart uploads in the
        bucket."""
        root = url.removeprefix("s3://")
        out: dict = {}
        with contextlib.suppress(Exception):
            found = self.fs.find(root, detail=True)
            out["objects"] = len(found)
            out["bytes"] = sum(v["size"] for v in found.values())
            out["staging_left"] = sum(1 for k in found if "/.hf_dcp_staging/" in k)
        with contextlib.suppress(Exception):
            r = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket)
            out["open_uploads"] = len(r.get("Uploads", []))
        return out

    def probe_gets(self, url: str, n: int = 5) -> dict:
        """Time single 4 KiB ranged GETs (on moto each costs a full copy of the object)."""
        root = url.removeprefix("s3://")
        out = {}
        with contextlib.suppress(Exception):
            files = {k: v["size"] for k, v in self.fs.find(root, detail=True).items()}
            big = max(files, key=files.get)
            ts = []
            for i in range(n):
                off = (files[big] // (n + 1)) * (i + 1)
                t0 = time.perf_counter()
                data = self.fs.cat_file(big, start=off, end=off + 4096)
                ts.append(time.perf_counter() - t0)
                assert len(data) == 4096
            out = {
                "object": big.rsplit("/", 1)[-1],
                "object_bytes": files[big],
                "get_4k_s_median": statistics.median(ts),
                "runs": ts,
            }
            ts = []
            for i in range(n):  # the same with one slab's worth (the reader's request size)
                off = (files[big] // (n + 1)) * i
                t0 = time.perf_counter()
                data = self.fs.cat_file(big, start=off, end=off + (16 << 20))
                ts.append(time.perf_counter() - t0)
                assert len(data) == 16 << 20
            out.update(get_16m_s_median=statistics.median(ts), runs_16m=ts)
        return out


def _ops_desc(ops: dict, server: str) -> str:
    def busy(o):
        return o.get("busy_s") or 0.0

    return ", ".join(
        f"{op} {o['requests']}"
        + (f" ({fmt_mib(o['bytes_in'])} in)" if o["bytes_in"] > MiB else "")
        + (f" ({fmt_mib(o['bytes_out'])} out)" if o["bytes_out"] > MiB else "")
        + (f" ({fmt_mib(o['copied'])} copied)" if o["copied"] else "")
        + (f" [{server} busy {o['busy_s']:.1f} s]" if o.get("busy_s") is not None else "")
        for op, o in sorted(ops.items(), key=lambda kv: (-busy(kv[1]), -kv[1]["requests"]))
    )


def summarize(records: list[dict], cfg: dict, spec) -> str:
    size = cfg["size_bytes"]
    kind = cfg["server"]["kind"]
    cpu_col = "moto CPU s" if kind == "moto" else "rgw+osd+mon CPU s"
    lines: list[str] = []
    saves = [r for r in records if r.get("phase") == "save"]
    loads = [r for r in records if r.get("phase") == "load"]

    def med(rows, n):
        return median([r["time_s"] for r in rows if r["contender"] == n and r.get("ok")])

    def med_max_rank(ok, step):
        """Median over repeats of the slowest rank's time in ``step``."""
        return median(
            [
                max((p or {}).get(step, 0) for p in r["phases"]) if any(r["phases"]) else None
                for r in ok
                if r.get("phases")
            ]
        )

    def med_coord(ok, step):
        return median([(r["phases"][0] or {}).get(step) for r in ok if r.get("phases")])

    # ---- saves ----
    if saves:
        smed = {n: med(saves, n) for n in SAVE.values()}
        lines += [
            (
                "**save** (`dcp.save`, Shard(0) state dict, wall s = max over ranks; every column "
                "but 'runs' and 'extra peak RSS' (max of the repeats) is a median over the "
                "repeats)"
            ),
            "",
            (
                f"| contender | median s | runs s | MB/s | × {SAVE_REF} | × {SAVE_FLOOR} | "
                "write_data s (slowest rank) | finish s (coordinator) | of which _complete_s3 s "
                f"| rank CPU s (sum) | {cpu_col} (of which in finish) | extra peak RSS/rank MiB | "
                "verified |"
            ),
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for n in SAVE.values():
            rows = [r for r in saves if r["contender"] == n]
            if not rows:
                continue
            ok = [r for r in rows if r.get("ok")]
            m = smed[n]
            runs = ", ".join(f"{r['time_s']:.2f}" if r.get("ok") else "FAILED" for r in rows)
            wd = med_max_rank(ok, "write_data")
            fin, cpl = med_coord(ok, "finish"), med_coord(ok, "_complete_s3")
            scpu = median([(r.get("server") or {}).get("server_cpu_s") for r in ok])
            sfin = median(
                [
                    ((r.get("server_steps") or {}).get("finish") or {}).get("server_cpu_s")
                    for r in ok
                ]
            )
            scpu_s = (
                "-" if scpu is None else f"{scpu:.1f}" + ("" if sfin is None else f" ({sfin:.1f})")
            )
            lines.append(
                f"| {n} | {m:.2f} | {runs} | {size / m / 1e6:.0f} | "
                f"{(m / smed[SAVE_REF]) if (m and smed.get(SAVE_REF)) else float('nan'):.2f} | "
                f"{(m / smed[SAVE_FLOOR]) if (m and smed.get(SAVE_FLOOR)) else float('nan'):.2f} "
                f"| {fmt(wd)} | {fmt(fin)} | {fmt(cpl)} | "
                f"{median([r.get('cpu_s_ranks') for r in ok]) or 0:.1f} | {scpu_s} | "
                f"{max((r.get('rss_extra_mib') or 0) for r in ok):.0f} | "
                f"{'yes' if all(r.get('verified') for r in ok) else 'NO'} |"
                if m
                else f"| {n} | FAILED | {runs} | | | | | | | | | | |"
            )
        lines.append("")
        counted = (
            "counted in the moto process"
            if kind == "moto"
            else "radosgw perf counters (PUT/UploadPart bodies in, GET bodies out)"
        )
        lines += [
            f"**bytes moved during the timed save** ({counted}; last repeat)",
            "",
            (
                "| contender | client→server | server→client | server-side copied "
                "(UploadPartCopy) | requests | stored after | objects | open multipart uploads |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for n in SAVE.values():
            ok = [r for r in saves if r["contender"] == n and r.get("ok")]
            if not ok:
                continue
            r = ok[-1]
            mo, st = r.get("server") or {}, r.get("stored") or {}
            lines.append(
                f"| {n} | {fmt_mib(mo.get('bytes_in'))} | {fmt_mib(mo.get('bytes_out'))} | "
                f"{fmt_mib(mo.get('server_copied'))} | {mo.get('requests', '-')} | "
                f"{fmt_mib(st.get('bytes'))} | {st.get('objects', '-')} | "
                f"{st.get('open_uploads', '-')} |"
            )
        lines.append("")
        lines.append(
            "Requests by S3 operation (last repeat"
            + ("" if kind == "moto" else "; radosgw's counters: GET counts HEAD too")
            + "):"
        )
        lines.append("")
        for n in SAVE.values():
            ok = [r for r in saves if r["contender"] == n and r.get("ok")]
            if ok and (ok[-1].get("server") or {}).get("ops"):
                lines.append(f"- {n}: {_ops_desc(ok[-1]['server']['ops'], kind)}")
                fin = (ok[-1].get("server_steps") or {}).get("finish")
                if fin and fin.get("ops") is not None:
                    lines.append(
                        f"  - of which in `finish` (coordinator; {cpu_col.removesuffix(' s')} "
                        f"{fin['server_cpu_s']:.1f} s): {_ops_desc(fin['ops'], kind)}"
                    )
        lines.append("")
        ms = [
            r["merge_stats"]
            for r in saves
            if r["contender"] == "ours" and r.get("ok") and r.get("merge_stats")
        ]
        for i, m in enumerate(ms):
            lines.append(
                f"- ours merge_stats (repeat {i}): files {m['files']}, total {m['total_bytes']} "
                f"B, sent by the ranks as their own parts {m['rank_part_bytes']} B, staged and "
                f"gathered {m['client_bytes']} B (by the coordinator "
                f"{m.get('coordinator_bytes', 'n/a')} B) = client_fraction "
                f"{m['client_fraction'] * 100:.4f} %"
            )
        lines.append("")
        if any(r["contender"] == "ours" for r in saves):
            lines += _projection_lines(spec, cfg["world"])

    # ---- loads ----
    if loads:
        gets_col = "GETs" if kind == "moto" else "GET+HEAD"
        for layout in ("col", "row"):
            sub = [r for r in loads if r.get("layout") == layout]
            if not sub:
                continue
            title = (
                "**load, resharded** (saved Shard(0) on the ranks, loaded into Shard(1) column "
                "shards; 1-D norms Shard(0))"
                if layout == "col"
                else "**load, same sharding** (saved Shard(0), loaded into Shard(0))"
            )
            ref = med(sub, LOAD_REF)
            lines += [
                title,
                "",
                (
                    f"| contender | median s | runs s | MB/s | × {LOAD_REF} | read_metadata s | "
                    f"read_data s (slowest rank) | {gets_col} | server→client | {cpu_col} | rank "
                    "CPU s (sum) | extra peak RSS/rank MiB | verified |"
                ),
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            ]
            for n in LOAD.values():
                rows = [r for r in sub if r["contender"] == n]
                if not rows:
                    continue
                ok = [r for r in rows if r.get("ok")]
                runs = ", ".join(
                    f"{r['time_s']:.2f}"
                    if r.get("ok")
                    else (f"> {r['timeout_s']:.0f} (stopped)" if r.get("timed_out") else "FAILED")
                    for r in rows
                )
                m = med(sub, n)
                if not ok:
                    tr = [r for r in rows if r.get("timed_out")]
                    mo = (tr[0].get("server_until_kill") or {}) if tr else {}
                    gets = sum(
                        o["requests"]
                        for op, o in mo.get("ops", {}).items()
                        if op.startswith("GetObject")
                    )
                    lines.append(
                        f"| {n} | > {tr[0]['timeout_s']:.0f} | {runs} | < "
                        f"{size / tr[0]['timeout_s'] / 1e6:.1f} | > "
                        f"{(tr[0]['timeout_s'] / ref) if ref else float('nan'):.1f} | - | - | "
                        f"{gets} done when stopped | {fmt_mib(mo.get('bytes_out'))} | "
                        f"{mo.get('server_cpu_s', '-')} | - | - | - |"
                        if tr
                        else f"| {n} | FAILED | {runs} | | | | | | | | | | |"
                    )
                    continue
                rm, rd = med_max_rank(ok, "read_metadata"), med_max_rank(ok, "read_data")
                mo = ok[-1].get("server") or {}
                gets = (
                    sum(
                        o["requests"]
                        for op, o in mo.get("ops", {}).items()
                        if op.startswith("GetObject")
                    )
                    if mo.get("ops")
                    else "-"
                )
                scpu = median([(r.get("server") or {}).get("server_cpu_s") for r in ok])
                lines.append(
                    f"| {n} | {m:.2f} | {runs} | {size / m / 1e6:.0f} | "
                    f"{(m / ref) if ref else float('nan'):.2f} | {fmt(rm)} | {fmt(rd)} | {gets} | "
                    f"{fmt_mib(mo.get('bytes_out'))} | {fmt(scpu, '.1f')} | "
                    f"{median([r.get('cpu_s_ranks') for r in ok]) or 0:.1f} | "
                    f"{max((r.get('rss_extra_mib') or 0) for r in ok):.0f} | "
                    f"{'yes' if all(r.get('verified') for r in ok) else 'NO'} |"
                )
            lines.append(f"({gets_col} and server→client: last repeat)")
            lines.append("")
    probes = [r for r in records if r.get("phase") == "probe"]
    for p in probes:
        if p.get("get_4k_s_median") is not None:
            line = (
                "- probe (untimed, one request at a time from the orchestrator): one ranged GET "
                f"of `{p['object']}` ({fmt_mib(p['object_bytes'])}) takes "
                f"{p['get_4k_s_median'] * 1000:.0f} ms for 4 KiB"
                + (
                    f", {p['get_16m_s_median'] * 1000:.0f} ms for 16 MiB"
                    if p.get("get_16m_s_median") is not None
                    else ""
                )
                + f" on this {kind} (medians of {len(p['runs'])})"
            )
            if p.get("col_gets_per_rank"):
                line += (
                    f"; ours' col load makes about {p['col_gets_per_rank']} GETs per rank "
                    f"({p['col_gets_per_rank'] * p['world']} in all), about "
                    f"{p['col_eta_s'] / 60:.1f} min at the 4 KiB rate with requests serialised"
                )
            lines.append(line)
    timed = [
        r
        for r in records
        if r.get("phase") in ("save", "load") and r.get("other_cpu_s") is not None
    ]
    if timed:
        worst = max(timed, key=lambda r: r["other_cpu_s"])
        busy = [r for r in timed if r["other_cpu_s"] > 1.0]
        lines.append(
            "- CPU used by anything else on the machine during the timed calls (machine busy "
            "time − ranks − store; includes this script's RSS sampler): median "
            f"{median([r['other_cpu_s'] for r in timed]):.2f} s, max {worst['other_cpu_s']:.2f} s "
            f"({worst['phase']} {worst['contender']} {worst.get('layout')} repeat "
            f"{worst['repeat']}); "
            + (
                f"{len(busy)} of {len(timed)} measurements over 1 s: "
                + ", ".join(
                    f"{r['phase']} {r['contender']}/{r['layout']}/r{r['repeat']} "
                    f"{r['other_cpu_s']:.1f} s"
                    for r in busy
                )
                if busy
                else "none over 1 s"
            )
        )
    failed = [r for r in records if r.get("ok") is False and not r.get("timed_out")]
    for r in failed:
        lines.append(
            f"- FAILED: {r.get('phase')} {r.get('contender')} ({r.get('layout')}) repeat "
            f"{r.get('repeat')}: {r.get('error')}"
        )

    # ---- targets ----
    def ratio_line(
        what: str, rows: list[dict], a_name: str, b_name: str, a: float, b: float
    ) -> str:
        pr = paired_ratios(rows, a_name, b_name)
        paired = f"; per repeat {', '.join(f'{x:.2f}' for x in pr)}" if len(pr) > 1 else ""
        return (
            f"- {what} = {a / b:.2f} (ratio of medians{paired}; target ≤ 1.0): "
            f"{'met' if a / b <= 1.0 else 'MISSED'}"
        )

    t: list[str] = []
    if saves:
        a, b = med(saves, "ours"), med(saves, SAVE_REF)
        if a and b:
            t.append(ratio_line("save: ours / FsspecWriter", saves, "ours", SAVE_REF, a, b))
    for layout in ("col", "row"):
        sub = [r for r in loads if r.get("layout") == layout]
        if not sub:
            continue
        a, b = med(sub, "ours_load"), med(sub, LOAD_REF)
        lbl = (
            "resharded Shard(0)->Shard(1)"
            if layout == "col"
            else "same sharding Shard(0)->Shard(0)"
        )
        if a and b:
            t.append(
                ratio_line(f"load ({lbl}): ours / FsspecReader", sub, "ours_load", LOAD_REF, a, b)
            )
        elif b:
            tr = [r for r in sub if r["contender"] == "ours_load" and r.get("timed_out")]
            if tr:
                t.append(
                    f"- load ({lbl}): ours stopped after {tr[0]['timeout_s']:.0f} s, FsspecReader "
                    f"{b:.2f} s: ratio > {tr[0]['timeout_s'] / b:.0f} (target ≤ 1.0): MISSED"
                )
    ms = [
        r["merge_stats"]
        for r in saves
        if r["contender"] == "ours" and r.get("ok") and r.get("merge_stats")
    ]
    if ms:
        f = max(m["client_fraction"] for m in ms)
        t.append(
            "- client-side consolidation bytes (merge_stats.client_fraction, max) = "
            f"{f * 100:.4f} % (target ≤ 5 %): {'met' if f <= 0.05 else 'MISSED'}"
        )
    if t:
        lines += ["Targets:", "", *t]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-mb",
        type=float,
        default=512,
        help="state dict size in MiB (default 512: llama-7B widths, 1 layer, vocab 8192)",
    )
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="measurements per contender (default 1)")
    p.add_argument(
        "--only",
        default=None,
        help="comma list of contenders by letter or name: "
        + ", ".join(f"{k}={v}" for k, v in ALL.items()),
    )
    p.add_argument(
        "--load-layouts",
        default="auto",
        help="'auto' (col; row too if a col load hits --col-timeout), or a comma list of col,row",
    )
    p.add_argument(
        "--col-timeout",
        type=float,
        default=180.0,
        help="stop a col load after this many seconds of its timed call (default 180)",
    )
    p.add_argument(
        "--hard-timeout",
        type=float,
        default=900.0,
        help="kill any measurement whose processes run longer (default 900 s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="thread_count for every storage that has one (default: library defaults)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="HFStorageWriter max_shard_size (default 5GB: one file)",
    )
    p.add_argument(
        "--block-size-mb",
        type=float,
        default=None,
        help="s3fs default_block_size in MiB (default: not set, i.e. s3fs's own 50 MiB)",
    )
    p.add_argument(
        "--server",
        choices=("moto", "radosgw"),
        default="moto",
        help="the S3 store: moto (default; its own process) or radosgw (a one-node Ceph cluster, "
        "tests/support/radosgw.py)",
    )
    p.add_argument(
        "--moto-tmp",
        default=None,
        help="where moto spills objects (default: a folder in /dev/shm if writable)",
    )
    p.add_argument(
        "--sample-ms",
        type=float,
        default=5.0,
        help="RSS sampling period of the ranks in ms (0: off)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed tiny save/load before each measurement",
    )
    p.add_argument(
        "--no-verify-saves",
        action="store_true",
        help="skip reading every save back (loads are always verified)",
    )
    p.add_argument(
        "--md-out",
        default=None,
        help="also write the markdown report and the JSON lines to this file",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    selected = select(args.only, ALL)
    save_names = [n for n in SAVE.values() if n in selected]
    load_names = [n for n in LOAD.values() if n in selected]
    d = wide_model_dims(args.size_mb)
    spec = model_spec(d)
    size = total_bytes(spec)
    seal_aws_env()
    work = make_work_dir("bench_s3_")
    server = start_server(args.server, size=size, work=work, moto_tmp=args.moto_tmp)
    try:
        return _run(args, t_start, save_names, load_names, d, spec, size, work, server)
    finally:
        server.stop()
        remove_work_dir(work)


def _run(args, t_start, save_names, load_names, d, spec, size, work, server) -> int:
    srv, endpoint = server.handle, server.endpoint
    opts = storage_options(endpoint, int(args.block_size_mb * MiB) if args.block_size_mb else None)
    import s3fs

    bucket = BUCKET_PREFIX + uuid.uuid4().hex[:12]
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir(bucket)
    cfg = {
        "endpoint": endpoint,
        "server": srv,
        "bucket": bucket,
        "opts": opts,
        "threads": args.threads,
        "max_shard_size": args.max_shard_size,
        "warmup": not args.no_warmup,
        "verify_saves": not args.no_verify_saves,
        "sample_ms": args.sample_ms,
        "torch_threads": max(1, (os.cpu_count() or 1) // args.ranks),
        "size_bytes": size,
        "world": args.ranks,
    }
    env = {
        **env_record(
            ("s3fs", "fsspec", "botocore", "aiobotocore", "safetensors", "hf_dcp_storage"),
            with_cpu_model=True,
        ),
        "server": srv["kind"],
        "endpoint": endpoint,
        "bucket": bucket,
        **server.facts,
        "s3fs_default_block_size": getattr(fs, "default_block_size", None),
        "storage_options": {k: v for k, v in opts.items() if k not in ("key", "secret")},
        "dims": {**d.__dict__, "heads": d.hidden // 128},
        "tensors": len(spec),
        "size_bytes": size,
        "size_mib": round(size / MiB, 1),
        "args": vars(args),
        "cfg": {k: v for k, v in cfg.items() if k != "opts"},
        "argv": sys.argv[1:],
    }
    runner = S3Runner(args, work, spec, cfg, fs)
    runner.emit(env)
    try:
        _schedule(runner, args, spec, bucket, save_names, load_names)
    finally:
        runner.close()
        elapsed = time.time() - t_start
        table = summarize(runner.records, cfg, spec)
        print()
        print(table)
        print(f"\nfull run: {elapsed / 60:.1f} min")
        if args.md_out:
            _write_md(args.md_out, env, table, work / "results.jsonl", elapsed)
        with contextlib.suppress(Exception):
            fs.rm(bucket, recursive=True)
    return (
        0
        if all(r.get("ok", True) or r.get("timed_out") for r in runner.records)
        and all(r.get("verified") is not False for r in runner.records)
        else 1
    )


def _schedule(
    runner: S3Runner, args, spec, bucket: str, save_names: list[str], load_names: list[str]
) -> None:
    """The saves, interleaved; then the loads of the kept checkpoints per layout; the GET probes."""
    keep: dict[str, str] = {}
    for rep, name in interleave(save_names, args.repeats):
        url = f"s3://{bucket}/{name}_r{rep}"
        if (
            name in keep
        ):  # this contender's previous checkpoint goes first: the store holds at most 3
            runner.remove(keep.pop(name))
        rec = runner.measure(name, repeat=rep, phase="save", url=url)
        if name in ("ours", "pt_fsspec") and rec.get("ok") and rec.get("verified") is not False:
            keep[name] = url  # kept for the loads
        else:
            runner.remove(url)
    if load_names:
        src = {"ours_load": "ours", "pt_fsspec_load": "pt_fsspec"}
        for reader, writer in src.items():  # a reader without its contender's save: save untimed
            if reader in load_names and writer not in keep:
                url = f"s3://{bucket}/{writer}_prepare"
                rec = runner.measure(writer, repeat=-1, phase="prepare", url=url)
                if rec.get("ok"):
                    keep[writer] = url
        layouts = (
            ["col"]
            if args.load_layouts == "auto"
            else [x.strip() for x in args.load_layouts.split(",")]
        )
        done: list[str] = []
        while layouts:
            layout = layouts.pop(0)
            done.append(layout)
            stopped = set()
            for rep, name in interleave(load_names, args.repeats):
                if name in stopped or src[name] not in keep:
                    continue
                rec = runner.measure(
                    name,
                    repeat=rep,
                    phase="load",
                    url=keep[src[name]],
                    layout=layout,
                    call_timeout=args.col_timeout if layout == "col" else None,
                )
                if rec.get("timed_out"):
                    stopped.add(name)  # no point repeating a stopped measurement
                    if name == "ours_load":
                        probe = runner.probe_gets(keep["ours"])
                        if probe:
                            n = col_get_count(spec, args.ranks)
                            probe.update(
                                phase="probe",
                                col_gets_per_rank=n,
                                world=args.ranks,
                                col_eta_s=n * args.ranks * probe["get_4k_s_median"],
                            )
                            runner.emit(probe)
            if (
                stopped
                and args.load_layouts == "auto"
                and "row" not in done
                and "row" not in layouts
            ):
                layouts.append("row")
    if "ours" in keep and not any(r.get("phase") == "probe" for r in runner.records):
        probe = runner.probe_gets(
            keep["ours"]
        )  # what one small and one slab-sized GET cost on this store
        if probe:
            runner.emit({**probe, "phase": "probe"})


def _write_md(path: str, env: dict, table: str, jsonl: Path, elapsed: float) -> None:
    d = env["dims"]
    bs = env["s3fs_default_block_size"]
    if env["server"] == "moto":
        title = "moto S3 on loopback"
        versions = f"moto {env['moto']}"
        machine = (
            "moto server (ThreadedMotoServer, 127.0.0.1, own process, objects spilled to "
            f"`{env['moto_tmp'].rsplit('/', 1)[0]}`) shares the {env['cpus']} cores with the ranks"
        )
    else:
        title = "Ceph radosgw on loopback"
        versions = env.get("ceph", "ceph ?")
        ms = env.get("memstore_device_bytes")
        machine = (
            "one-node Ceph cluster from `scripts/setup/radosgw.sh` (ceph-mon, one memstore "
            f"OSD{f' of {ms / (1 << 30):.0f} GiB' if ms else ''} keeping objects in RAM, radosgw "
            f"with the beast frontend; 127.0.0.1, no auth, pool size 1) shares the {env['cpus']} "
            "cores with the ranks"
        )
    head = [
        (
            f"# bench_s3: {env['size_mib']} MiB bf16, {env['args']['ranks']} ranks, {title}, "
            f"{env['cpus']} CPUs"
        ),
        "",
        (
            f"- date {env['date']}; python {env['python']}, torch {env['torch']}, s3fs "
            f"{env['s3fs']} (fsspec {env['fsspec']}, aiobotocore {env['aiobotocore']}, botocore "
            f"{env['botocore']}), {versions}, safetensors {env['safetensors']}, hf_dcp_storage "
            f"{env['hf_dcp_storage']} (git {env['git']})"
        ),
        f"- machine: {env['cpus']} × {env['cpu_model']}, {env['mem_gib']} GiB RAM; {machine}",
        (
            f"- model: llama-7B widths (hidden {d['hidden']}, intermediate {d['inter']}, MHA "
            f"{d['heads']} heads), vocab {d['vocab']}, {d['layers']} layer(s) -> {env['tensors']} "
            f"tensors, {env['size_bytes']} bytes; saved as Shard(0) DTensors"
        ),
        (
            f"- s3fs storage options: {json.dumps(env['storage_options'])}; default_block_size "
            f"{'not set: s3fs default ' if not env['args']['block_size_mb'] else ''}"
            f"{bs // MiB if bs else '?'} MiB"
        ),
        (
            "- thread_count "
            f"{env['cfg']['threads'] or 'library defaults (ours 4, FsspecWriter 1)'}, torch "
            f"threads per rank {env['cfg']['torch_threads']}, warmup {env['cfg']['warmup']}, "
            f"repeats {env['args']['repeats']}"
        ),
        (
            f"- command: `python -m benchmarks.bench_s3 {' '.join(env['argv'])}`; full run "
            f"{elapsed / 60:.1f} min"
        ),
        "",
    ]
    write_report(path, "\n".join(head) + "\n" + table, jsonl.read_text() if jsonl.exists() else "")


if __name__ == "__main__":
    sys.exit(main())
