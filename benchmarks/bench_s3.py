"""S3 benchmark: hf_dcp_storage against PyTorch's FsspecWriter/FsspecReader and raw s3fs puts,
on moto or on Ceph radosgw (``--server``).

``--server moto`` (default): a moto S3 server (ThreadedMotoServer on 127.0.0.1, port 0) runs in
its own process, so its CPU use is outside the measured ranks' GIL. ``--server radosgw``: a
one-node Ceph cluster (monitor, memstore OSD, radosgw on 127.0.0.1) started by
``tests/_radosgw.py`` (``scripts/radosgw.sh``). Either way the ranks talk to the store over
loopback through s3fs, and the store shares the machine's cores with them. Every measurement
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
  c  raw_s3fs    each rank fs.pipe()s the bytes of its local shards, one object per tensor (the floor)
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

Run ``python benchmarks/bench_s3.py --help`` for the flags; ``--md-out FILE`` writes a markdown
report with the raw JSON lines.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# Shared with the local-disk benchmark: data generation, bit-exact compare, RSS sampling.
from bench_save_load import (
    CallWindow,
    Dims,
    ProcSampler,
    _git_rev,
    _stride,
    _version,
    make_shard,
    model_spec,
    same_bits,
    total_bytes,
)

DEFAULT_DATA_ROOT = HERE / "_data"  # git-ignored: rendezvous files, per-measurement results
REPO = HERE.parent
BUCKET_PREFIX = "bench-"  # + a random suffix: one bucket per run
SAVE = {"a": "ours", "b": "pt_fsspec", "c": "raw_s3fs"}
LOAD = {"d": "ours_load", "e": "pt_fsspec_load"}
ALL = {**SAVE, **LOAD}
SAVE_REF, SAVE_FLOOR, LOAD_REF = "pt_fsspec", "raw_s3fs", "pt_fsspec_load"
MiB = 1 << 20
STATS_PATH = "/__bench__/stats"

# Fake credentials and a sealed AWS environment, as in tests/conftest.py.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/hf_dcp_storage_bench/aws_config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/hf_dcp_storage_bench/aws_credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
UNSET_AWS_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION")


def storage_options(endpoint: str, block_size: int | None) -> dict:
    """tests/conftest.py's ``s3_storage_options`` (the same for moto and radosgw);
    ``default_block_size`` only when given (otherwise s3fs's own default, 50 MiB, applies)."""
    opts = {
        "anon": False,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},  # no region_name: moto refuses bucket creation with it
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }
    if block_size:
        opts["default_block_size"] = block_size
    return opts


# ------------------------------------------------------------------------------------------------
# Synthetic model: llama-7B widths, few layers, small vocab
# ------------------------------------------------------------------------------------------------


# (vocab, hidden, intermediate), MHA (k/v as wide as q); llama-7B widths first, then halvings for
# smoke tests whose target is smaller than one 7B-wide layer.
_PRESETS = [(8192, 4096, 11008), (4096, 2048, 5504), (2048, 1024, 2752), (1024, 512, 1376), (512, 256, 704)]


def model_dims(size_mb: float) -> Dims:
    """bench_save_load's model with MHA (k/v as wide as q), sized to about ``size_mb``."""
    target = size_mb * MiB
    for v, h, i in _PRESETS:
        fixed = (2 * v * h + h) * 2
        per_layer = (4 * h * h + 3 * h * i + 2 * h) * 2
        if fixed + per_layer <= target * 1.1 or (v, h, i) == _PRESETS[-1]:
            return Dims(v, h, i, h, max(1, round((target - fixed) / per_layer)))
    raise AssertionError


def _range(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s torch.chunk piece of a dimension of size ``n``."""
    step = -(-n // world)
    start = min(rank * step, n)
    return start, min(n, start + step) - start


def shard_dim(shape: tuple[int, ...], layout: str) -> int:
    """The dimension a tensor is sharded on: "row" -> 0; "col" -> 1 (1-D tensors stay on 0)."""
    return 1 if layout == "col" and len(shape) >= 2 else 0


def original_full(key: str, shape: tuple[int, ...], world: int) -> torch.Tensor:
    """The whole tensor as saved: the Shard(0) chunks of the saving ranks, concatenated."""
    return torch.cat([make_shard(key, shape, r, world) for r in range(world)])


def expected_local(key: str, shape, rank: int, world: int, layout: str) -> torch.Tensor:
    dim = shard_dim(shape, layout)
    if dim == 0:
        return make_shard(key, shape, rank, world)
    start, n = _range(shape[dim], rank, world)
    return original_full(key, shape, world).narrow(dim, start, n)


def col_get_count(spec, world: int, rank: int = 0) -> int:
    """Ranged GETs rank ``rank``'s HFStorageReader makes for a col load (not verify mode), from
    the library's own slab cutting and request coalescing: per slab of the destination, the
    column runs of its rows joined into requests. Falls back to one GET per row if those
    helpers are not importable."""
    try:
        from hf_dcp_storage.io.slabs import slab_bounds
        from hf_dcp_storage.reader import coalesce
    except ImportError:
        return sum(s[0] if len(s) >= 2 else 1 for _, s in spec)
    n_req = 0
    for _, shape in spec:
        if len(shape) < 2:
            n_req += 1
            continue
        c0, n = _range(shape[1], rank, world)
        row = 2 * math.prod(shape[1:])
        for r0, r1 in slab_bounds((shape[0], n), 2):
            n_req += len(coalesce([(r * row + 2 * c0, r * row + 2 * (c0 + n)) for r in range(r0, r1)]))
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
        from hf_dcp_storage.plan.s3parts import GatherPart, plan_file_parts
    except ImportError:
        return None
    runs, pos = [], header_len
    for _, shape in spec:
        row = 2 * math.prod(shape[1:])
        for r in range(world):
            _, n = _range(shape[0], r, world)
            runs.append((pos, r, n * row))
            pos += n * row
    try:
        parts = plan_file_parts(header_len, runs, pos)
    except Exception:
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
                sp += [("n", (h,)), ("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)), ("n", (h,)), ("g", (i, h)), ("u", (i, h)), ("d", (h, i))]
            sp += [("n", (h,)), ("lm", (v, h))]
        fr = [project_client_fraction(sp, w) for w in worlds]
        if any(f is None for f in fr):
            return []
        rows.append(f"| {name} | {total_bytes(sp) / (1 << 30):.2f} | " + " | ".join(f"{f * 100:.1f} %" for f in fr) + " |")
    return [
        "**projected client-side consolidation bytes** (not measured: the library's part planner run on the byte runs "
        "of a Shard(0) save into one file, bf16; one rank's runs under S3's 5 MiB minimum part are staged, then gathered by the ranks)",
        "",
        "| model | GiB | " + " | ".join(f"{w} ranks" for w in worlds) + " |",
        "|---|---:|" + "---:|" * len(worlds),
        *rows,
        "",
    ]


# ------------------------------------------------------------------------------------------------
# moto server process, with request accounting
# ------------------------------------------------------------------------------------------------


def _classify(env: dict) -> str:
    method = env.get("REQUEST_METHOD", "")
    qs = env.get("QUERY_STRING", "")
    path = env.get("PATH_INFO", "")
    bucket_only = path.strip("/").count("/") == 0
    copy = "HTTP_X_AMZ_COPY_SOURCE" in env
    if method == "PUT":
        if "partNumber=" in qs:
            return "UploadPartCopy" if copy else "UploadPart"
        if bucket_only:
            return "CreateBucket"
        return "CopyObject" if copy else "PutObject"
    if method == "POST":
        if "uploads" in qs.split("&"):
            return "CreateMultipartUpload"
        if "uploadId=" in qs:
            return "CompleteMultipartUpload"
        if "delete" in qs:
            return "DeleteObjects"
        return "POST"
    if method == "GET":
        if bucket_only:
            return "ListMultipartUploads" if "uploads" in qs else "ListObjects"
        return "GetObject(range)" if env.get("HTTP_RANGE") else "GetObject"
    if method == "HEAD":
        return "HeadBucket" if bucket_only else "HeadObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId=" in qs else "DeleteObject"
    return method


class _Counter:
    """WSGI middleware: per-operation requests, bytes in/out, server-copied bytes, busy seconds."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.ops: dict[str, list[float]] = {}  # op -> [requests, bytes_in, bytes_out, copied, busy_s]
        self.inflight = 0

    def snapshot(self) -> dict:
        with self.lock:
            ops = {k: list(v) for k, v in self.ops.items()}
            inflight = self.inflight
        mem = {}
        with contextlib.suppress(OSError), open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    k, v = line.split(":", 1)
                    mem[k] = int(v.split()[0]) // 1024
        return {"ops": ops, "inflight": inflight, "cpu_s": time.process_time(), "rss_mib": mem.get("VmRSS"), "hwm_mib": mem.get("VmHWM")}

    def _record(self, op: str, nin: int, nout: int, copied: int, busy: float) -> None:
        with self.lock:
            row = self.ops.setdefault(op, [0, 0, 0, 0, 0.0])
            row[0] += 1
            row[1] += nin
            row[2] += nout
            row[3] += copied
            row[4] += busy
            self.inflight -= 1

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO") == STATS_PATH:
            body = json.dumps(self.snapshot()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        op = _classify(environ)
        nin = int(environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get("CONTENT_LENGTH") or 0)
        copied = 0
        rng = environ.get("HTTP_X_AMZ_COPY_SOURCE_RANGE", "")
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            with contextlib.suppress(ValueError):
                copied = int(b) - int(a) + 1
        with self.lock:
            self.inflight += 1
        t0 = time.perf_counter()
        try:
            result = self.app(environ, start_response)
        except BaseException:
            self._record(op, nin, 0, copied, time.perf_counter() - t0)
            raise
        return self._iterate(result, op, nin, copied, t0)

    def _iterate(self, result, op, nin, copied, t0):
        nout = 0
        try:
            for chunk in result:
                nout += len(chunk)
                yield chunk
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
            self._record(op, nin, nout, copied, time.perf_counter() - t0)


def moto_main(conn, tmpdir: str) -> None:
    """The moto server process: ThreadedMotoServer on 127.0.0.1:0 with the counting middleware.

    Objects over ~5 MiB spill from moto's SpooledTemporaryFile to ``tmpdir`` (tmpfs when
    available, so the store's data never becomes dirty page cache of the measured machine's
    disk, which FsspecWriter's os.sync() calls would otherwise flush).
    """
    import logging

    tempfile.tempdir = tmpdir
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # it logs every request at INFO
    from moto.server import ThreadedMotoServer

    class CountingMotoServer(ThreadedMotoServer):
        counting = False

        def _server_entry(self) -> None:  # ThreadedMotoServer's own, with the app wrapped
            from moto.moto_server.werkzeug_app import (
                DomainDispatcherApplication,
                MotoRequestHandler,
                create_backend_app,
            )
            from werkzeug.serving import make_server

            app = _Counter(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            type(self).counting = True
            self._server_ready_event.set()
            self._server.serve_forever()

    try:
        server = CountingMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    except Exception:  # moto internals changed: plain server, no request accounting
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    host, port = server.get_host_and_port()
    conn.send((host, port, CountingMotoServer.counting))
    with contextlib.suppress(EOFError):
        conn.recv()  # "stop", or the parent went away
    server.stop()


def moto_stats(endpoint: str) -> dict | None:
    try:
        with urllib.request.urlopen(endpoint + STATS_PATH, timeout=30) as r:
            return {"kind": "moto", **json.load(r)}
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# radosgw (Ceph) accounting: perf counters over the admin socket, daemons' CPU from /proc
# ------------------------------------------------------------------------------------------------

# radosgw's "rgw" perf counters kept: requests; GET/HEAD object requests ("get" counts HEAD too)
# and the bytes sent; PutObject/UploadPart requests and the bytes received; requests in progress.
RGW_COUNTERS = ("req", "get", "get_b", "put", "put_b", "qactive")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _asok(path: str, cmd: dict, timeout: float = 10.0) -> dict:
    """One command on a Ceph admin socket: the JSON command and a NUL out; a 4-byte big-endian
    length and the JSON answer back."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(cmd).encode() + b"\0")
        head = b""
        while len(head) < 4:
            c = s.recv(4 - len(head))
            if not c:
                raise OSError("admin socket closed")
            head += c
        n = struct.unpack(">I", head)[0]
        buf = bytearray()
        while len(buf) < n:
            c = s.recv(min(1 << 16, n - len(buf)))
            if not c:
                raise OSError("admin socket closed")
            buf += c
    return json.loads(buf)


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process, in seconds (its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


def _proc_rss_mib(pid: int) -> int | None:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return None


def sys_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat user+nice+system+irq+
    softirq+steal): across a timed call, minus the ranks' and the store's own CPU, it shows what
    anything else on the machine took from the measurement."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _CLK_TCK
    return None


def radosgw_stats(srv: dict) -> dict:
    out: dict = {"kind": "radosgw", "cpu_by": {}, "rss_mib": {}}
    for name, pid in srv["pids"].items():
        cpu = _proc_cpu_s(pid)
        if cpu is not None:
            out["cpu_by"][name] = cpu
            out["rss_mib"][name] = _proc_rss_mib(pid)
    out["cpu_s"] = sum(out["cpu_by"].values())
    if srv.get("rgw_asok"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            d = _asok(srv["rgw_asok"], {"prefix": "perf dump"})["rgw"]
            out["rgw"] = {k: d.get(k, 0) for k in RGW_COUNTERS}
    return out


def osd_used_bytes(srv: dict) -> int | None:
    """Bytes the memstore OSD reports in use (its statfs; refreshed by the OSD every few s)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(_asok(srv["osd_asok"], {"prefix": "perf dump"})["osd"]["stat_bytes_used"])
    return None


def server_stats(srv: dict | None) -> dict | None:
    """A snapshot of the store's counters (moto: per-operation accounting; radosgw: perf
    counters and daemon CPU), or None where there is none."""
    if not srv:
        return None
    if srv["kind"] == "moto":
        return moto_stats(srv["endpoint"]) if srv.get("counting") else None
    return radosgw_stats(srv)


def stats_delta(a: dict | None, b: dict | None) -> dict | None:
    """Requests/bytes/CPU between two snapshots of the store."""
    if not a or not b:
        return None
    if b.get("kind") == "radosgw":
        out: dict = {
            "server_cpu_s": round(b["cpu_s"] - a["cpu_s"], 3),
            "server_cpu_by": {k: round(v - a["cpu_by"].get(k, 0.0), 3) for k, v in b["cpu_by"].items()},
            "server_rss_mib": b["rss_mib"],
            "server_copied": None,  # not counted on radosgw
        }
        ra, rb = a.get("rgw"), b.get("rgw")
        if ra and rb:
            d = {k: rb[k] - ra[k] for k in ("req", "get", "get_b", "put", "put_b")}
            out.update(
                requests=d["req"], bytes_in=d["put_b"], bytes_out=d["get_b"],
                ops={
                    "GetObject/HeadObject": {"requests": d["get"], "bytes_in": 0, "bytes_out": d["get_b"], "copied": 0, "busy_s": None},
                    "PutObject/UploadPart": {"requests": d["put"], "bytes_in": d["put_b"], "bytes_out": 0, "copied": 0, "busy_s": None},
                    "other": {"requests": d["req"] - d["get"] - d["put"], "bytes_in": 0, "bytes_out": 0, "copied": 0, "busy_s": None},
                },
            )
        return out
    ops = {}
    for op, row in b["ops"].items():
        old = a["ops"].get(op, [0, 0, 0, 0, 0.0])
        d = [x - y for x, y in zip(row, old)]
        if d[0]:
            ops[op] = {"requests": int(d[0]), "bytes_in": int(d[1]), "bytes_out": int(d[2]), "copied": int(d[3]), "busy_s": round(d[4], 3)}
    return {
        "requests": sum(o["requests"] for o in ops.values()),
        "bytes_in": sum(o["bytes_in"] for o in ops.values()),
        "bytes_out": sum(o["bytes_out"] for o in ops.values()),
        "server_copied": sum(o["copied"] for o in ops.values()),
        "server_cpu_s": round(b["cpu_s"] - a["cpu_s"], 3),
        "server_rss_mib": b.get("rss_mib"),
        "ops": ops,
    }


# ------------------------------------------------------------------------------------------------
# Rank side (fresh processes)
# ------------------------------------------------------------------------------------------------


# Steps around which the store's counters are read too (they run on the coordinator only, so the
# counts are the step's own).
_SNAP = ("finish",)


def _timed(cls, names):
    """A subclass of ``cls`` whose methods ``names`` add their wall time to ``self.bench_t``
    (benchmark-only instrumentation; no behaviour change)."""

    def wrap(name):
        orig = getattr(cls, name)

        def method(self, *a, **kw):
            srv = self.__dict__.get("bench_srv") if name in _SNAP else None
            s0 = server_stats(srv)
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **kw)
            finally:
                t = self.__dict__.setdefault("bench_t", {})
                t[name] = t.get(name, 0.0) + time.perf_counter() - t0
                if s0 is not None:  # what the store did during this step (coordinator-only steps)
                    self.__dict__.setdefault("bench_server", {})[name] = stats_delta(s0, server_stats(srv))

        return method

    return type(f"Timed{cls.__name__}", (cls,), {n: wrap(n) for n in names if hasattr(cls, n)})


def _sd(spec, mesh, rank: int, world: int, layout: str, fill: str):
    from torch.distributed.tensor import DTensor, Shard

    sd = {}
    for key, shape in spec:
        dim = shard_dim(shape, layout)
        if fill == "data":
            assert dim == 0
            local = make_shard(key, shape, rank, world)
        else:  # a load destination, allocated and touched before the call
            _, n = _range(shape[dim], rank, world)
            lshape = list(shape)
            lshape[dim] = n
            local = torch.zeros(lshape, dtype=torch.bfloat16)
        sd[key] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=_stride(shape))
    return sd


def _writer(name: str, url: str, cfg: dict):
    """(writer, None) for the DCP contenders."""
    opts = cfg["opts"]
    kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
    if name == "ours":
        from hf_dcp_storage import HFStorageWriter

        # _complete_s3: the coordinator's part of finish on S3 (CompleteMultipartUpload; the ranks
        # gathered the staged small runs in write_data); _merge: the non-S3 staged path.
        cls = _timed(HFStorageWriter, ["prepare_global_plan", "write_data", "finish", "_complete_s3", "_merge"])
        w = cls(url, storage_options=opts, max_shard_size=cfg["max_shard_size"], **kw)
        w.bench_srv = cfg["server"]
        return w
    if name == "pt_fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        cls = _timed(FsspecWriter, ["prepare_global_plan", "write_data", "finish"])
        w = cls(url, **kw, **opts)
        w.bench_srv = cfg["server"]
        return w
    raise ValueError(name)


def _reader(name: str, url: str, cfg: dict, timed: bool = True):
    opts = cfg["opts"]
    if name == "ours_load":
        from hf_dcp_storage import HFStorageReader

        kw = {} if cfg["threads"] is None else {"thread_count": cfg["threads"]}
        cls = _timed(HFStorageReader, ["read_metadata", "read_data"]) if timed else HFStorageReader
        return cls(url, storage_options=opts, **kw)
    if name == "pt_fsspec_load":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        cls = _timed(FsspecReader, ["read_metadata", "read_data"]) if timed else FsspecReader
        return cls(url, **opts)
    raise ValueError(name)


def _raw_put(fs, sd, base: str, rank: int) -> dict:
    """The floor: this rank's shard bytes, one object per tensor, uploaded concurrently by s3fs."""
    blobs = {}
    for key, v in sd.items():
        local = v.to_local()
        blobs[f"{base}/rank{rank:05d}/{key}"] = local.contiguous().view(torch.uint8).numpy().tobytes()
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
    if name in SAVE.values():
        call, _ = _save_call(name, _sd(spec, mesh, rank, world, "row", "data"), url, rank, cfg)
        call()
        return
    writer = "ours" if name == "ours_load" else "pt_fsspec"
    dcp.save(_sd(spec, mesh, rank, world, "row", "data"), storage_writer=_writer(writer, url, cfg))
    dcp.load(_sd(spec, mesh, rank, world, layout, "zeros"), storage_reader=_reader(name, url, cfg, timed=False))


def _verify_save(name: str, spec, sd, url: str, rank: int, world: int, cfg: dict, dist, mesh, handle) -> dict:
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
                    if k not in tensors or not same_bits(tensors.pop(k), original_full(k, shapes[k], world)):
                        bad.append(k)
                bad += [f"extra:{k}" for k in tensors]
                del tensors
    elif name == "pt_fsspec":
        import torch.distributed.checkpoint as dcp

        dest = _sd(spec, mesh, rank, world, "row", "zeros")
        dcp.load(dest, storage_reader=_reader("pt_fsspec_load", url, cfg, timed=False))
        for k, v in dest.items():
            checked += 1
            if not same_bits(v.to_local(), sd[k].to_local()):
                bad.append(k)
    elif name == "raw_s3fs":
        fs = handle
        base = url.removeprefix("s3://")
        paths = {f"{base}/rank{rank:05d}/{k}": k for k in sd}
        got = fs.cat(list(paths))
        for p, k in paths.items():
            checked += 1
            if got.get(p) != sd[k].to_local().contiguous().view(torch.uint8).numpy().tobytes():
                bad.append(k)
    return {"verify_checked": checked, "verify_n_bad": len(bad), "verify_bad": bad[:5], "verify_s": time.perf_counter() - t0}


def rank_main(rank: int, world: int, job: dict) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cfg = job["cfg"]
    torch.set_num_threads(cfg["torch_threads"])
    dist.init_process_group(
        "gloo", init_method=f"file://{job['rdzv']}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800)
    )
    mesh = init_device_mesh("cpu", (world,))
    name = job["name"]
    spec = [(k, tuple(s)) for k, s in job["spec"]]
    is_save = name in SAVE.values()
    layout = job.get("layout", "row")

    if cfg["warmup"]:
        _warmup(name, mesh, rank, world, job["scratch_url"], cfg, layout)
        dist.barrier()

    if is_save:
        sd = _sd(spec, mesh, rank, world, "row", "data")
        call, handle = _save_call(name, sd, job["url"], rank, cfg)
    else:
        import torch.distributed.checkpoint as dcp

        sd = _sd(spec, mesh, rank, world, layout, "zeros")
        handle = _reader(name, job["url"], cfg)
        call = lambda: dcp.load(sd, storage_reader=handle)
    gc.collect()
    gc.disable()
    dist.barrier()
    s0 = server_stats(cfg["server"]) if rank == 0 else None
    b0 = sys_busy_s() if rank == 0 else None
    win = CallWindow()
    win.start()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        with open(job["t0_file"], "w") as f:  # the parent enforces --col-timeout from here
            f.write(str(time.time()))
    call()
    t_call = time.perf_counter() - t0
    dist.barrier()
    t_wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    mem = win.stop()
    b1 = sys_busy_s() if rank == 0 else None
    s1 = server_stats(cfg["server"]) if rank == 0 else None
    gc.enable()

    extra: dict = {"cpu_s": round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 3)}
    phases = getattr(handle, "bench_t", None)
    if phases:
        extra["phases"] = {k: round(v, 3) for k, v in phases.items()}
    if rank == 0:
        extra["server"] = stats_delta(s0, s1)
        if b0 is not None and b1 is not None:
            extra["sys_busy_cpu_s"] = round(b1 - b0, 3)
        if getattr(handle, "bench_server", None):
            extra["server_steps"] = handle.bench_server
        ms = getattr(handle, "merge_stats", None)
        if ms is not None:
            extra["merge_stats"] = {
                "files": ms.files,
                "total_bytes": ms.total_bytes,
                "rank_part_bytes": ms.rank_part_bytes,
                "client_bytes": ms.client_bytes,
                "coordinator_bytes": ms.coordinator_bytes,
                "gathered_by_rank": {str(r): b for r, b in sorted(ms.by_rank.items())},
                "client_fraction": ms.client_fraction,
            }
    if is_save:
        if cfg["verify_saves"]:
            extra.update(_verify_save(name, spec, sd, job["url"], rank, world, cfg, dist, mesh, handle))
    else:
        t1 = time.perf_counter()
        bad = [k for k, s in spec if not same_bits(sd[k].to_local(), expected_local(k, s, rank, world, layout))]
        extra.update(verify_checked=len(spec), verify_n_bad=len(bad), verify_bad=bad[:5], verify_s=time.perf_counter() - t1)

    per_rank = {"rank": rank, "call_s": t_call, "wall_s": t_wall, **mem, **extra}
    gathered = [None] * world
    dist.all_gather_object(gathered, per_rank)
    if rank == 0:
        with open(job["result"], "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------


class CallTimeout(Exception):
    pass


def _finish_rss(per_rank: list[dict], sampler: ProcSampler) -> list[dict]:
    for rec in per_rank:
        if "pid" in rec:
            rec.update(sampler.peak_extra(rec))
            for k in ("base_kib", "end_kib", "ts0", "ts1", "pid"):
                rec.pop(k, None)
    return per_rank


def _run_ranks(job: dict, world: int, call_timeout: float | None, hard_timeout: float) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(rank_main, args=(world, job), nprocs=world, join=False, start_method="spawn")
    sampler = ProcSampler(job["cfg"]["sample_ms"] / 1000).start([p.pid for p in ctx.processes])
    start = time.time()
    try:
        while not ctx.join(timeout=1.0):
            now = time.time()
            t0 = None
            with contextlib.suppress(OSError, ValueError):
                t0 = float(Path(job["t0_file"]).read_text())
            over_call = call_timeout is not None and t0 is not None and now - t0 > call_timeout
            if over_call or now - start > hard_timeout:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                if over_call:
                    raise CallTimeout(f"call still running after {now - t0:.0f} s; ranks killed")
                raise TimeoutError(f"measurement still running after {now - start:.0f} s; ranks killed")
    finally:
        sampler.stop()
    with open(job["result"]) as f:
        return _finish_rss(json.load(f), sampler)


class Runner:
    def __init__(self, args, work: Path, spec, cfg, fs) -> None:
        self.args, self.work, self.spec, self.cfg, self.fs = args, work, spec, cfg, fs
        self.srv = cfg["server"]
        self.bucket = cfg["bucket"]
        self.records: list[dict] = []
        self.seq = 0
        self.jsonl = open(work / "results.jsonl", "a")

    def emit(self, rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        self.jsonl.write(line + "\n")
        self.jsonl.flush()
        self.records.append(rec)

    def _settle(self) -> None:
        """Wait until the store has no request in progress (after ranks were killed mid-request)."""
        deadline = time.time() + (300 if self.srv["kind"] == "moto" else 60)
        while time.time() < deadline:
            s = server_stats(self.srv)
            if not s:
                return
            if s["kind"] == "moto" and s["inflight"] == 0:
                return
            # radosgw's qactive reads 1 on an idle gateway here: compare with its idle reading
            if s["kind"] == "radosgw" and (s.get("rgw") or {}).get("qactive", 0) <= self.srv.get("qactive_idle", 0):
                return
            time.sleep(0.5)

    def remove(self, url: str) -> None:
        """Delete everything under ``url`` (outside any timing); on radosgw also run its garbage
        collector now, so deleted multipart data leaves the RAM-backed OSD before the next
        measurement rather than being collected by radosgw during one."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(url.removeprefix("s3://"), recursive=True)
        self.collect_garbage()

    def collect_garbage(self) -> None:
        if self.srv["kind"] != "radosgw":
            return
        state = self.srv["state"]
        with contextlib.suppress(Exception):
            subprocess.run(
                ["radosgw-admin", "-c", f"{state}/ceph.conf", "-n", "client.rgw", "--log-file", f"{state}/log/radosgw-admin.log",
                 "--admin-socket", "", "gc", "process", "--include-all"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False,
            )

    def measure(self, name: str, *, repeat: int, phase: str, url: str, layout: str = "row", call_timeout: float | None = None) -> dict:
        self.seq += 1
        tag = f"{self.seq:03d}_{name}"
        job = {
            "name": name,
            "cfg": self.cfg,
            "spec": self.spec,
            "url": url,
            "layout": layout,
            "scratch_url": f"s3://{self.bucket}/_warmup/{tag}",
            "rdzv": str(self.work / f"rdzv_{tag}"),
            "result": str(self.work / f"result_{tag}.json"),
            "t0_file": str(self.work / f"t0_{tag}"),
        }
        rec = {"phase": phase, "contender": name, "repeat": repeat, "layout": layout, "ranks": self.args.ranks, "url": url}
        s0 = server_stats(self.srv)
        t_start = time.time()
        try:
            per_rank = _run_ranks(job, self.args.ranks, call_timeout, self.args.hard_timeout)
        except CallTimeout as exc:
            s1 = server_stats(self.srv)
            self._settle()
            rec.update(ok=False, timed_out=True, error=str(exc), time_s=None, timeout_s=call_timeout,
                       server_until_kill=stats_delta(s0, s1), process_s=round(time.time() - t_start, 1))
            self.emit(rec)
            return rec
        except Exception as exc:
            self._settle()
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000], process_s=round(time.time() - t_start, 1))
            self.emit(rec)
            return rec
        finally:
            for p in (job["rdzv"], job["result"], job["t0_file"]):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
            with contextlib.suppress(Exception):
                self.fs.rm(job["scratch_url"].removeprefix("s3://"), recursive=True)
            self.collect_garbage()

        def mx(k):
            vals = [r[k] for r in per_rank if r.get(k) is not None]
            return max(vals) if vals else None

        r0 = per_rank[0]
        n_bad = sum(r.get("verify_n_bad", 0) for r in per_rank)
        checked = sum(r.get("verify_checked", 0) for r in per_rank)
        rec.update(
            ok=True,
            time_s=mx("wall_s"),
            call_s=mx("call_s"),
            rss_extra_mib=mx("rss_extra_mib"),
            anon_extra_mib=mx("anon_extra_mib"),
            cpu_s_ranks=round(sum(r.get("cpu_s", 0) for r in per_rank), 2),
            verified=(n_bad == 0) if checked else None,
            verify_bad=[k for r in per_rank for k in r.get("verify_bad", [])][:5],
            server=r0.get("server"),
            server_steps=r0.get("server_steps"),
            merge_stats=r0.get("merge_stats"),
            phases=[r.get("phases") for r in per_rank],
            per_rank=[{k: v for k, v in r.items() if k not in ("server", "server_steps", "merge_stats", "phases")} for r in per_rank],
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
        """Bytes and objects left under the prefix, and unfinished multipart uploads in the bucket."""
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
            out = {"object": big.rsplit("/", 1)[-1], "object_bytes": files[big], "get_4k_s_median": statistics.median(ts), "runs": ts}
            ts = []
            for i in range(n):  # the same with one slab's worth (the reader's request size)
                off = (files[big] // (n + 1)) * i
                t0 = time.perf_counter()
                data = self.fs.cat_file(big, start=off, end=off + (16 << 20))
                ts.append(time.perf_counter() - t0)
                assert len(data) == 16 << 20
            out.update(get_16m_s_median=statistics.median(ts), runs_16m=ts)
        return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt_b(n) -> str:
    if n is None:
        return "-"
    return f"{n / MiB:.1f} MiB"


def _ops_desc(ops: dict, server: str) -> str:
    def busy(o):
        return o.get("busy_s") or 0.0

    return ", ".join(
        f"{op} {o['requests']}" + (f" ({_fmt_b(o['bytes_in'])} in)" if o["bytes_in"] > MiB else "")
        + (f" ({_fmt_b(o['bytes_out'])} out)" if o["bytes_out"] > MiB else "")
        + (f" ({_fmt_b(o['copied'])} copied)" if o["copied"] else "")
        + (f" [{server} busy {o['busy_s']:.1f} s]" if o.get("busy_s") is not None else "")
        for op, o in sorted(ops.items(), key=lambda kv: (-busy(kv[1]), -kv[1]["requests"]))
    )


def _paired(rows: list[dict], a: str, b: str) -> list[float]:
    """a/b per repeat, for the repeats where both ran (contenders of one repeat run back to back)."""
    by = {(r["contender"], r["repeat"]): r["time_s"] for r in rows if r.get("ok")}
    return [by[(a, k)] / by[(b, k)] for (n, k) in sorted(by) if n == a and (b, k) in by]


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def summarize(records: list[dict], cfg: dict, spec) -> str:
    size = cfg["size_bytes"]
    kind = cfg["server"]["kind"]
    cpu_col = "moto CPU s" if kind == "moto" else "rgw+osd+mon CPU s"
    lines: list[str] = []
    saves = [r for r in records if r.get("phase") == "save"]
    loads = [r for r in records if r.get("phase") == "load"]

    def med(rows, n):
        return _median([r["time_s"] for r in rows if r["contender"] == n and r.get("ok")])

    def med_max_rank(ok, step):
        """Median over repeats of the slowest rank's time in ``step``."""
        return _median([max((p or {}).get(step, 0) for p in r["phases"]) if any(r["phases"]) else None for r in ok if r.get("phases")])

    def med_coord(ok, step):
        return _median([(r["phases"][0] or {}).get(step) for r in ok if r.get("phases")])

    # ---- saves ----
    if saves:
        smed = {n: med(saves, n) for n in SAVE.values()}
        lines += [
            "**save** (`dcp.save`, Shard(0) state dict, wall s = max over ranks; every column but 'runs' and "
            "'extra peak RSS' (max of the repeats) is a median over the repeats)",
            "",
            f"| contender | median s | runs s | MB/s | × {SAVE_REF} | × {SAVE_FLOOR} | write_data s (slowest rank) | finish s (coordinator) "
            f"| of which _complete_s3 s | rank CPU s (sum) | {cpu_col} (of which in finish) | extra peak RSS/rank MiB | verified |",
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
            scpu = _median([(r.get("server") or {}).get("server_cpu_s") for r in ok])
            sfin = _median([((r.get("server_steps") or {}).get("finish") or {}).get("server_cpu_s") for r in ok])
            scpu_s = "-" if scpu is None else f"{scpu:.1f}" + ("" if sfin is None else f" ({sfin:.1f})")
            lines.append(
                f"| {n} | {m:.2f} | {runs} | {size / m / 1e6:.0f} | "
                f"{(m / smed[SAVE_REF]) if (m and smed.get(SAVE_REF)) else float('nan'):.2f} | "
                f"{(m / smed[SAVE_FLOOR]) if (m and smed.get(SAVE_FLOOR)) else float('nan'):.2f} | "
                f"{_f(wd)} | {_f(fin)} | {_f(cpl)} | "
                f"{_median([r.get('cpu_s_ranks') for r in ok]) or 0:.1f} | {scpu_s} | "
                f"{max((r.get('rss_extra_mib') or 0) for r in ok):.0f} | {'yes' if all(r.get('verified') for r in ok) else 'NO'} |"
                if m else f"| {n} | FAILED | {runs} | | | | | | | | | | |"
            )
        lines.append("")
        counted = "counted in the moto process" if kind == "moto" else "radosgw perf counters (PUT/UploadPart bodies in, GET bodies out)"
        lines += [
            f"**bytes moved during the timed save** ({counted}; last repeat)",
            "",
            "| contender | client→server | server→client | server-side copied (UploadPartCopy) | requests | stored after | objects | open multipart uploads |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for n in SAVE.values():
            ok = [r for r in saves if r["contender"] == n and r.get("ok")]
            if not ok:
                continue
            r = ok[-1]
            mo, st = r.get("server") or {}, r.get("stored") or {}
            lines.append(
                f"| {n} | {_fmt_b(mo.get('bytes_in'))} | {_fmt_b(mo.get('bytes_out'))} | {_fmt_b(mo.get('server_copied'))} | "
                f"{mo.get('requests', '-')} | {_fmt_b(st.get('bytes'))} | {st.get('objects', '-')} | {st.get('open_uploads', '-')} |"
            )
        lines.append("")
        lines.append("Requests by S3 operation (last repeat" + ("" if kind == "moto" else "; radosgw's counters: GET counts HEAD too") + "):")
        lines.append("")
        for n in SAVE.values():
            ok = [r for r in saves if r["contender"] == n and r.get("ok")]
            if ok and (ok[-1].get("server") or {}).get("ops"):
                lines.append(f"- {n}: {_ops_desc(ok[-1]['server']['ops'], kind)}")
                fin = (ok[-1].get("server_steps") or {}).get("finish")
                if fin and fin.get("ops") is not None:
                    lines.append(
                        f"  - of which in `finish` (coordinator; {cpu_col.removesuffix(' s')} {fin['server_cpu_s']:.1f} s): "
                        f"{_ops_desc(fin['ops'], kind)}"
                    )
        lines.append("")
        ms = [r["merge_stats"] for r in saves if r["contender"] == "ours" and r.get("ok") and r.get("merge_stats")]
        for i, m in enumerate(ms):
            lines.append(
                f"- ours merge_stats (repeat {i}): files {m['files']}, total {m['total_bytes']} B, sent by the ranks "
                f"as their own parts {m['rank_part_bytes']} B, staged and gathered {m['client_bytes']} B (by the coordinator {m.get('coordinator_bytes', 'n/a')} B) = client_fraction "
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
                "**load, resharded** (saved Shard(0) on the ranks, loaded into Shard(1) column shards; 1-D norms Shard(0))"
                if layout == "col"
                else "**load, same sharding** (saved Shard(0), loaded into Shard(0))"
            )
            ref = med(sub, LOAD_REF)
            lines += [
                title,
                "",
                f"| contender | median s | runs s | MB/s | × {LOAD_REF} | read_metadata s | read_data s (slowest rank) | {gets_col} | "
                f"server→client | {cpu_col} | rank CPU s (sum) | extra peak RSS/rank MiB | verified |",
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            ]
            for n in LOAD.values():
                rows = [r for r in sub if r["contender"] == n]
                if not rows:
                    continue
                ok = [r for r in rows if r.get("ok")]
                runs = ", ".join(
                    f"{r['time_s']:.2f}" if r.get("ok") else (f"> {r['timeout_s']:.0f} (stopped)" if r.get("timed_out") else "FAILED")
                    for r in rows
                )
                m = med(sub, n)
                if not ok:
                    tr = [r for r in rows if r.get("timed_out")]
                    mo = (tr[0].get("server_until_kill") or {}) if tr else {}
                    gets = sum(o["requests"] for op, o in mo.get("ops", {}).items() if op.startswith("GetObject"))
                    lines.append(
                        f"| {n} | > {tr[0]['timeout_s']:.0f} | {runs} | < {size / tr[0]['timeout_s'] / 1e6:.1f} | "
                        f"> {(tr[0]['timeout_s'] / ref) if ref else float('nan'):.1f} | - | - | {gets} done when stopped | "
                        f"{_fmt_b(mo.get('bytes_out'))} | {mo.get('server_cpu_s', '-')} | - | - | - |"
                        if tr else f"| {n} | FAILED | {runs} | | | | | | | | | | |"
                    )
                    continue
                rm, rd = med_max_rank(ok, "read_metadata"), med_max_rank(ok, "read_data")
                mo = ok[-1].get("server") or {}
                gets = sum(o["requests"] for op, o in mo.get("ops", {}).items() if op.startswith("GetObject")) if mo.get("ops") else "-"
                scpu = _median([(r.get("server") or {}).get("server_cpu_s") for r in ok])
                lines.append(
                    f"| {n} | {m:.2f} | {runs} | {size / m / 1e6:.0f} | {(m / ref) if ref else float('nan'):.2f} | "
                    f"{_f(rm)} | {_f(rd)} | {gets} | {_fmt_b(mo.get('bytes_out'))} | "
                    f"{_f(scpu, '.1f')} | {_median([r.get('cpu_s_ranks') for r in ok]) or 0:.1f} | "
                    f"{max((r.get('rss_extra_mib') or 0) for r in ok):.0f} | {'yes' if all(r.get('verified') for r in ok) else 'NO'} |"
                )
            lines.append(f"({gets_col} and server→client: last repeat)")
            lines.append("")
    probes = [r for r in records if r.get("phase") == "probe"]
    for p in probes:
        if p.get("get_4k_s_median") is not None:
            line = (
                f"- probe (untimed, one request at a time from the orchestrator): one ranged GET of `{p['object']}` "
                f"({_fmt_b(p['object_bytes'])}) takes {p['get_4k_s_median'] * 1000:.0f} ms for 4 KiB"
                + (f", {p['get_16m_s_median'] * 1000:.0f} ms for 16 MiB" if p.get("get_16m_s_median") is not None else "")
                + f" on this {kind} (medians of {len(p['runs'])})"
            )
            if p.get("col_gets_per_rank"):
                line += (
                    f"; ours' col load makes about {p['col_gets_per_rank']} GETs per rank ({p['col_gets_per_rank'] * p['world']} in all), "
                    f"about {p['col_eta_s'] / 60:.1f} min at the 4 KiB rate with requests serialised"
                )
            lines.append(line)
    timed = [r for r in records if r.get("phase") in ("save", "load") and r.get("other_cpu_s") is not None]
    if timed:
        worst = max(timed, key=lambda r: r["other_cpu_s"])
        busy = [r for r in timed if r["other_cpu_s"] > 1.0]
        lines.append(
            f"- CPU used by anything else on the machine during the timed calls (machine busy time − ranks − store; includes "
            f"this script's RSS sampler): median {_median([r['other_cpu_s'] for r in timed]):.2f} s, max {worst['other_cpu_s']:.2f} s "
            f"({worst['phase']} {worst['contender']} {worst.get('layout')} repeat {worst['repeat']}); "
            + (f"{len(busy)} of {len(timed)} measurements over 1 s: "
               + ", ".join(f"{r['phase']} {r['contender']}/{r['layout']}/r{r['repeat']} {r['other_cpu_s']:.1f} s" for r in busy)
               if busy else "none over 1 s")
        )
    failed = [r for r in records if r.get("ok") is False and not r.get("timed_out")]
    for r in failed:
        lines.append(f"- FAILED: {r.get('phase')} {r.get('contender')} ({r.get('layout')}) repeat {r.get('repeat')}: {r.get('error')}")

    # ---- targets ----
    def ratio_line(what: str, rows: list[dict], a_name: str, b_name: str, a: float, b: float) -> str:
        pr = _paired(rows, a_name, b_name)
        paired = f"; per repeat {', '.join(f'{x:.2f}' for x in pr)}" if len(pr) > 1 else ""
        return f"- {what} = {a / b:.2f} (ratio of medians{paired}; target ≤ 1.0): {'met' if a / b <= 1.0 else 'MISSED'}"

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
        lbl = "resharded Shard(0)->Shard(1)" if layout == "col" else "same sharding Shard(0)->Shard(0)"
        if a and b:
            t.append(ratio_line(f"load ({lbl}): ours / FsspecReader", sub, "ours_load", LOAD_REF, a, b))
        elif b:
            tr = [r for r in sub if r["contender"] == "ours_load" and r.get("timed_out")]
            if tr:
                t.append(
                    f"- load ({lbl}): ours stopped after {tr[0]['timeout_s']:.0f} s, FsspecReader {b:.2f} s: ratio > "
                    f"{tr[0]['timeout_s'] / b:.0f} (target ≤ 1.0): MISSED"
                )
    ms = [r["merge_stats"] for r in saves if r["contender"] == "ours" and r.get("ok") and r.get("merge_stats")]
    if ms:
        f = max(m["client_fraction"] for m in ms)
        t.append(f"- client-side consolidation bytes (merge_stats.client_fraction, max) = {f * 100:.4f} % (target ≤ 5 %): {'met' if f <= 0.05 else 'MISSED'}")
    if t:
        lines += ["Targets:", ""] + t
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=512, help="state dict size in MiB (default 512: llama-7B widths, 1 layer, vocab 8192)")
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="measurements per contender (default 1)")
    p.add_argument("--only", default=None, help="comma list of contenders by letter or name: " + ", ".join(f"{k}={v}" for k, v in ALL.items()))
    p.add_argument("--load-layouts", default="auto",
                   help="'auto' (col; row too if a col load hits --col-timeout), or a comma list of col,row")
    p.add_argument("--col-timeout", type=float, default=180.0, help="stop a col load after this many seconds of its timed call (default 180)")
    p.add_argument("--hard-timeout", type=float, default=900.0, help="kill any measurement whose processes run longer (default 900 s)")
    p.add_argument("--threads", type=int, default=None, help="thread_count for every storage that has one (default: library defaults)")
    p.add_argument("--max-shard-size", default="5GB", help="HFStorageWriter max_shard_size (default 5GB: one file)")
    p.add_argument("--block-size-mb", type=float, default=None,
                   help="s3fs default_block_size in MiB (default: not set, i.e. s3fs's own 50 MiB)")
    p.add_argument("--server", choices=("moto", "radosgw"), default="moto",
                   help="the S3 store: moto (default; its own process) or radosgw (a one-node Ceph cluster, tests/_radosgw.py)")
    p.add_argument("--moto-tmp", default=None, help="where moto spills objects (default: a folder in /dev/shm if writable)")
    p.add_argument("--sample-ms", type=float, default=5.0, help="RSS sampling period of the ranks in ms (0: off)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed tiny save/load before each measurement")
    p.add_argument("--no-verify-saves", action="store_true", help="skip reading every save back (loads are always verified)")
    p.add_argument("--md-out", default=None, help="also write the markdown report and the JSON lines to this file")
    return p.parse_args(argv)


def _start_moto(tmpdir: str):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=moto_main, args=(child, tmpdir), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise SystemExit("moto server did not start within 120 s")
    host, port, counting = parent.recv()
    return proc, parent, f"http://{host}:{port}", counting


def start_server(args, size: int, work: Path) -> tuple[dict, dict, object]:
    """Start the store: (srv for the counters, facts for the report, stop())."""
    if args.server == "moto":
        shm = Path("/dev/shm")
        if args.moto_tmp:
            moto_tmp = Path(tempfile.mkdtemp(prefix="bench_s3_moto_", dir=args.moto_tmp))
        elif shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 4 * size + (1 << 30):
            moto_tmp = Path(tempfile.mkdtemp(prefix="bench_s3_moto_", dir=shm))
        else:
            moto_tmp = work / "moto_tmp"
            moto_tmp.mkdir()
        proc, conn, endpoint, counting = _start_moto(str(moto_tmp))

        def stop() -> None:
            with contextlib.suppress(Exception):
                conn.send("stop")
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join()
            shutil.rmtree(moto_tmp, ignore_errors=True)

        srv = {"kind": "moto", "endpoint": endpoint, "counting": counting}
        facts = {"moto": _version("moto"), "moto_pid": proc.pid, "moto_tmp": str(moto_tmp), "moto_request_accounting": counting}
        return srv, facts, stop

    # radosgw: the tests' helper (scripts/radosgw.sh): mon + memstore OSD + radosgw on 127.0.0.1
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import _radosgw

    reason = _radosgw.radosgw_unavailable()
    if reason is not None:
        raise SystemExit(f"--server radosgw: {reason}")
    # A short state folder: Ceph's admin sockets (the perf counters) need paths under 108 bytes.
    state = tempfile.mkdtemp(prefix="hf-dcp-rgw-bench-")
    endpoint, stop = _radosgw.start_radosgw(state)
    run = Path(state, "run")
    pids = {}
    for name in ("rgw", "osd", "mon"):
        with contextlib.suppress(OSError, ValueError):
            pids[name] = int(Path(run, f"{name}.pid").read_text().strip())
    rgw_asok, osd_asok = run / "client.rgw.asok", run / "osd.0.asok"
    srv = {
        "kind": "radosgw",
        "endpoint": endpoint,
        "state": state,
        "pids": pids,
        "rgw_asok": str(rgw_asok) if rgw_asok.exists() else None,
        "osd_asok": str(osd_asok) if osd_asok.exists() else None,
    }
    s = radosgw_stats(srv)
    srv["qactive_idle"] = (s.get("rgw") or {}).get("qactive", 0)
    version = "?"
    with contextlib.suppress(Exception):
        version = subprocess.run(["radosgw", "--version"], capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    memstore = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(state, "ceph.conf").read_text().splitlines():
            if line.strip().startswith("memstore device bytes"):
                memstore = int(line.split("=", 1)[1])
    facts = {"ceph": version, "radosgw_state": state, "radosgw_pids": pids, "memstore_device_bytes": memstore,
             "radosgw_perf_counters": s.get("rgw") is not None}
    return srv, facts, stop


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    selected = list(ALL.values())
    if args.only:
        selected = []
        for tok in args.only.split(","):
            name = ALL.get(tok.strip(), tok.strip())
            if name not in ALL.values():
                raise SystemExit(f"--only: unknown contender {tok!r}; choose from {ALL}")
            selected.append(name)
    save_names = [n for n in SAVE.values() if n in selected]
    load_names = [n for n in LOAD.values() if n in selected]
    d = model_dims(args.size_mb)
    spec = model_spec(d)
    size = total_bytes(spec)

    for k, v in FAKE_AWS_ENV.items():
        os.environ[k] = v
    for k in UNSET_AWS_ENV:
        os.environ.pop(k, None)

    DEFAULT_DATA_ROOT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_s3_", dir=DEFAULT_DATA_ROOT))
    srv, facts, stop_server = start_server(args, size, work)
    try:
        return _run(args, t_start, save_names, load_names, d, spec, size, work, srv, facts)
    finally:
        stop_server()
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            DEFAULT_DATA_ROOT.rmdir()


def _run(args, t_start, save_names, load_names, d, spec, size, work, srv, facts) -> int:
    endpoint = srv["endpoint"]
    block = int(args.block_size_mb * MiB) if args.block_size_mb else None
    opts = storage_options(endpoint, block)
    import s3fs

    bucket = BUCKET_PREFIX + uuid.uuid4().hex[:12]
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir(bucket)
    cpu = os.cpu_count() or 1
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
        "torch_threads": max(1, cpu // args.ranks),
        "size_bytes": size,
        "world": args.ranks,
    }
    env = {
        "phase": "env",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "s3fs": _version("s3fs"),
        "fsspec": _version("fsspec"),
        "botocore": _version("botocore"),
        "aiobotocore": _version("aiobotocore"),
        "safetensors": _version("safetensors"),
        "hf_dcp_storage": _version("hf_dcp_storage"),
        "git": _git_rev(),
        "cpus": cpu,
        "cpu_model": _cpu_model(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        "server": srv["kind"],
        "endpoint": endpoint,
        "bucket": bucket,
        **facts,
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
    runner = Runner(args, work, spec, cfg, fs)
    runner.emit(env)
    try:
        keep: dict[str, str] = {}
        for rep in range(args.repeats):
            order = save_names if rep % 2 == 0 else save_names[::-1]
            for name in order:
                url = f"s3://{bucket}/{name}_r{rep}"
                if name in keep:  # this contender's previous checkpoint goes first: the store holds at most 3
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
            layouts = ["col"] if args.load_layouts == "auto" else [x.strip() for x in args.load_layouts.split(",")]
            done: list[str] = []
            while layouts:
                layout = layouts.pop(0)
                done.append(layout)
                stopped = set()
                for rep in range(args.repeats):
                    order = load_names if rep % 2 == 0 else load_names[::-1]
                    for name in order:
                        if name in stopped or src[name] not in keep:
                            continue
                        rec = runner.measure(
                            name, repeat=rep, phase="load", url=keep[src[name]], layout=layout,
                            call_timeout=args.col_timeout if layout == "col" else None,
                        )
                        if rec.get("timed_out"):
                            stopped.add(name)  # no point repeating a stopped measurement
                            if name == "ours_load":
                                probe = runner.probe_gets(keep["ours"])
                                if probe:
                                    n = col_get_count(spec, args.ranks)
                                    probe.update(phase="probe", col_gets_per_rank=n, world=args.ranks,
                                                 col_eta_s=n * args.ranks * probe["get_4k_s_median"])
                                    runner.emit(probe)
                if stopped and args.load_layouts == "auto" and "row" not in done and "row" not in layouts:
                    layouts.append("row")
        if "ours" in keep and not any(r.get("phase") == "probe" for r in runner.records):
            probe = runner.probe_gets(keep["ours"])  # what one small and one slab-sized GET cost on this store
            if probe:
                runner.emit({**probe, "phase": "probe"})
    finally:
        runner.jsonl.close()
        elapsed = time.time() - t_start
        table = summarize(runner.records, cfg, spec)
        print()
        print(table)
        print(f"\nfull run: {elapsed / 60:.1f} min")
        if args.md_out:
            _write_md(args.md_out, env, table, work / "results.jsonl", elapsed)
        with contextlib.suppress(Exception):
            fs.rm(bucket, recursive=True)
    return 0 if all(r.get("ok", True) or r.get("timed_out") for r in runner.records) and all(
        r.get("verified") is not False for r in runner.records
    ) else 1


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _write_md(path: str, env: dict, table: str, jsonl: Path, elapsed: float) -> None:
    d = env["dims"]
    bs = env["s3fs_default_block_size"]
    if env["server"] == "moto":
        title = "moto S3 on loopback"
        versions = f"moto {env['moto']}"
        machine = (
            f"moto server (ThreadedMotoServer, 127.0.0.1, own process, objects spilled to "
            f"`{env['moto_tmp'].rsplit('/', 1)[0]}`) shares the {env['cpus']} cores with the ranks"
        )
    else:
        title = "Ceph radosgw on loopback"
        versions = env.get("ceph", "ceph ?")
        ms = env.get("memstore_device_bytes")
        machine = (
            f"one-node Ceph cluster from `scripts/radosgw.sh` (ceph-mon, one memstore OSD"
            f"{f' of {ms / (1 << 30):.0f} GiB' if ms else ''} keeping objects in RAM, radosgw with the beast frontend; "
            f"127.0.0.1, no auth, pool size 1) shares the {env['cpus']} cores with the ranks"
        )
    head = [
        f"# bench_s3: {env['size_mib']} MiB bf16, {env['args']['ranks']} ranks, {title}, {env['cpus']} CPUs",
        "",
        f"- date {env['date']}; python {env['python']}, torch {env['torch']}, s3fs {env['s3fs']} (fsspec {env['fsspec']}, "
        f"aiobotocore {env['aiobotocore']}, botocore {env['botocore']}), {versions}, safetensors {env['safetensors']}, "
        f"hf_dcp_storage {env['hf_dcp_storage']} (git {env['git']})",
        f"- machine: {env['cpus']} × {env['cpu_model']}, {env['mem_gib']} GiB RAM; {machine}",
        f"- model: llama-7B widths (hidden {d['hidden']}, intermediate {d['inter']}, MHA {d['heads']} heads), vocab {d['vocab']}, "
        f"{d['layers']} layer(s) -> {env['tensors']} tensors, {env['size_bytes']} bytes; saved as Shard(0) DTensors",
        f"- s3fs storage options: {json.dumps(env['storage_options'])}; default_block_size "
        f"{'not set: s3fs default ' if not env['args']['block_size_mb'] else ''}{bs // MiB if bs else '?'} MiB",
        f"- thread_count {env['cfg']['threads'] or 'library defaults (ours 4, FsspecWriter 1)'}, torch threads per rank "
        f"{env['cfg']['torch_threads']}, warmup {env['cfg']['warmup']}, repeats {env['args']['repeats']}",
        f"- command: `python benchmarks/bench_s3.py {' '.join(env['argv'])}`; full run {elapsed / 60:.1f} min",
        "",
    ]
    raw = jsonl.read_text() if jsonl.exists() else ""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(head) + "\n" + table + "\n\n## Raw JSON lines\n\n```json\n" + raw + "```\n")


if __name__ == "__main__":
    sys.exit(main())
