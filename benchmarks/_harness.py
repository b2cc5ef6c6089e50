"""What the benchmarks share: a sealed environment, S3 servers, rank processes, sampling, records,
reports.

A benchmark built on this module runs in this order (the parent is "the orchestrator"):

1. ``seal_aws_env()`` before any S3 client or rank process exists (ranks inherit the environment),
   then ``start_server("moto" | "radosgw", ...)`` for an S3 store on loopback: a ``Server`` with the
   ``endpoint``, ``facts`` for the report, a ``handle`` (a JSON-able dict that rank processes may
   receive) and ``stop()``. ``storage_options(endpoint)`` are the s3fs options for it.
2. ``runner = Runner(work)``; per measurement ``job = runner.job(name, **fields)`` (unique
   ``rdzv``, ``result`` and ``t0_file`` paths under ``work``), ``run_ranks(rank_main, job, world,
   sample_ms=...)`` in a ``try``, ``runner.discard(job)`` in its ``finally``; ``interleave(names,
   repeats)`` gives the order of the contenders, forward on even repeats and backward on odd ones.
3. Each rank (``rank_main(rank, world, job)``, a module-level function, spawned fresh):
   ``init_dist`` (gloo, ``file://`` rendezvous), ``timed_call`` around the one measured call,
   ``gather_results`` (rank 0 writes every rank's record to ``job["result"]``), then
   ``dist.destroy_process_group()``.
4. ``run_ranks`` returns those per-rank records, each with the extra peak RSS that the parent's
   ``ProcSampler`` saw inside the rank's ``CallWindow`` merged in; ``runner.emit(rec)`` prints one
   JSON line, appends it to ``work/results.jsonl`` and to ``runner.records``.
5. The report: ``env_record(...)`` is the first JSON line (versions and machine facts);
   ``median``/``fmt``/``fmt_mib``/``paired_ratios`` for the tables; ``write_report(path, text,
   raw)``.

The workload is shared too: a llama-like bf16 state dict (``model_dims`` for bench_save_load's
GQA model, ``wide_model_dims`` for bench_s3's llama-7B widths; ``model_spec``), whose every shard
any process can regenerate bit for bit (``make_shard``, ``original_full``, ``expected_local``,
``same_bits``), as ``Shard(0)`` or ``Shard(1)`` DTensors (``dtensor_state_dict``).

The server instrumentation lives with the servers: moto runs behind a WSGI middleware that counts
requests and bytes per S3 operation; radosgw exposes its perf counters on an admin socket.
``server_stats(handle)`` snapshots either (with the store's CPU seconds) and ``stats_delta`` is the
difference of two snapshots. Nothing here imports torch or the library at module level: the moto
server process imports this module.
"""

from __future__ import annotations

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
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from tests.support.storage_options import FAKE_AWS_ENV, UNSET_AWS_ENV, s3_storage_options

if TYPE_CHECKING:
    import torch

__all__ = [  # noqa: RUF022 - grouped by topic
    "GiB",
    "MiB",
    "DATA_ROOT",
    "REPO",
    # environment
    "FAKE_AWS_ENV",
    "UNSET_AWS_ENV",
    "seal_aws_env",
    "storage_options",
    # servers
    "Server",
    "start_server",
    "start_moto",
    "start_radosgw",
    "radosgw_unavailable",
    "server_stats",
    "stats_delta",
    "osd_used_bytes",
    "collect_garbage",
    "wait_idle",
    # synthetic model
    "Dims",
    "model_dims",
    "wide_model_dims",
    "model_spec",
    "total_bytes",
    "local_shape",
    "shard_dim",
    "make_shard",
    "original_full",
    "expected_local",
    "same_bits",
    "contiguous_stride",
    "dtensor_state_dict",
    # proc sampling
    "status_kib",
    "proc_cpu_s",
    "proc_rss_mib",
    "sys_busy_s",
    "CallWindow",
    "ProcSampler",
    # ranks
    "CallTimeout",
    "Timed",
    "init_dist",
    "timed_call",
    "gather_results",
    "timed_subclass",
    "run_ranks",
    "run_single",
    # records
    "Runner",
    "select",
    "repeat_order",
    "interleave",
    "max_over",
    "make_work_dir",
    "remove_work_dir",
    # format
    "median",
    "fmt",
    "fmt_mib",
    "paired_ratios",
    # reports
    "version",
    "git_rev",
    "cpu_model",
    "fs_type",
    "mem_gib",
    "env_record",
    "write_report",
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA_ROOT = HERE / "_data"  # git-ignored, same disk as the checkout: work folders, rendezvous files
MiB = 1 << 20
GiB = 1 << 30
_CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


# ------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------


def seal_aws_env() -> None:
    """Set the tests' fake credentials (``FAKE_AWS_ENV``) and drop ``UNSET_AWS_ENV`` in
    ``os.environ`` (spawned ranks inherit it): nothing from the developer's machine (profiles,
    real keys, a configured endpoint, a proxy) reaches a benchmark."""
    os.environ.update(FAKE_AWS_ENV)
    for k in UNSET_AWS_ENV:
        os.environ.pop(k, None)


def storage_options(endpoint: str, block_size: int | None = None) -> dict:
    """The tests' ``s3_storage_options`` (the same for moto and radosgw), with
    ``default_block_size`` only when given (otherwise s3fs's own default, 50 MiB, applies)."""
    opts: dict[str, Any] = s3_storage_options(endpoint)
    del opts["default_block_size"]
    if block_size:
        opts["default_block_size"] = block_size
    return opts


# ------------------------------------------------------------------------------------------------
# S3 servers on loopback: moto (own process, request accounting) and Ceph radosgw
# (tests/support/radosgw.py)
# ------------------------------------------------------------------------------------------------


@dataclass
class Server:
    """A running store. ``handle`` is what ``server_stats`` and friends take (JSON-able: it can go
    into job dicts and records); ``facts`` go into the ``env`` record; ``stop()`` is idempotent."""

    kind: str
    endpoint: str
    handle: dict
    facts: dict
    stop: Callable[[], None] = field(repr=False)


def start_server(kind: str, *, size: int, work: Path, moto_tmp: str | None = None) -> Server:
    """Start ``kind`` ("moto" or "radosgw") for checkpoints of about ``size`` bytes.

    moto spills objects to a fresh folder in ``moto_tmp`` if given, else in /dev/shm when it is
    writable and has room for four checkpoints, else in ``work``. Raises ``SystemExit`` with the
    reason when radosgw cannot run here."""
    if kind == "moto":
        shm = Path("/dev/shm")
        if moto_tmp:
            spill = Path(tempfile.mkdtemp(prefix="bench_s3_moto_", dir=moto_tmp))
        elif (
            shm.is_dir()
            and os.access(shm, os.W_OK)
            and shutil.disk_usage(shm).free > 4 * size + GiB
        ):
            spill = Path(tempfile.mkdtemp(prefix="bench_s3_moto_", dir=shm))
        else:
            spill = work / "moto_tmp"
            spill.mkdir()
        return start_moto(spill)
    if kind == "radosgw":
        reason = radosgw_unavailable()
        if reason is not None:
            raise SystemExit(f"--server radosgw: {reason}")
        return start_radosgw()
    raise ValueError(f"server kind {kind!r}: choose 'moto' or 'radosgw'")


def start_moto(spill: Path, timeout: float = 120) -> Server:
    """A moto server in its own process (its CPU use stays out of the ranks' GIL); ``stop()`` also
    removes ``spill``, where moto puts objects over ~5 MiB."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_moto_main, args=(child, str(spill)), daemon=True)
    proc.start()
    if not conn.poll(timeout):
        proc.kill()
        raise SystemExit(f"moto server did not start within {timeout:.0f} s")
    host, port, counting = conn.recv()

    def stop() -> None:
        with contextlib.suppress(Exception):
            conn.send("stop")
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join()
        shutil.rmtree(spill, ignore_errors=True)

    endpoint = f"http://{host}:{port}"
    handle = {"kind": "moto", "endpoint": endpoint, "counting": counting}
    facts = {
        "moto": version("moto"),
        "moto_pid": proc.pid,
        "moto_tmp": str(spill),
        "moto_request_accounting": counting,
    }
    return Server("moto", endpoint, handle, facts, stop)


def _radosgw_module() -> Any:
    from tests.support import radosgw

    return radosgw


def radosgw_unavailable() -> str | None:
    """``None`` if ``tests/support/radosgw.py`` can start a cluster here, else the one-line
    reason."""
    return _radosgw_module().radosgw_unavailable()


def start_radosgw(state_dir: str | os.PathLike[str] | None = None) -> Server:
    """A one-node Ceph cluster (ceph-mon, memstore OSD, radosgw on 127.0.0.1) through
    ``tests/support/radosgw.py`` (``scripts/setup/radosgw.sh``); ``stop()`` kills it and removes its
    state."""
    # A short state folder: Ceph's admin sockets (the perf counters) need paths under 108 bytes.
    state = (
        os.fspath(state_dir)
        if state_dir is not None
        else tempfile.mkdtemp(prefix="hf-dcp-rgw-bench-")
    )
    endpoint, stop = _radosgw_module().start_radosgw(state)
    run = Path(state, "run")
    pids = {}
    for name in ("rgw", "osd", "mon"):
        with contextlib.suppress(OSError, ValueError):
            pids[name] = int(Path(run, f"{name}.pid").read_text().strip())
    rgw_asok, osd_asok = run / "client.rgw.asok", run / "osd.0.asok"
    handle: dict[str, Any] = {
        "kind": "radosgw",
        "endpoint": endpoint,
        "state": state,
        "pids": pids,
        "rgw_asok": str(rgw_asok) if rgw_asok.exists() else None,
        "osd_asok": str(osd_asok) if osd_asok.exists() else None,
    }
    s = _radosgw_stats(handle)
    handle["qactive_idle"] = (s.get("rgw") or {}).get("qactive", 0)
    ceph = "?"
    with contextlib.suppress(Exception):
        ceph = subprocess.run(
            ["radosgw", "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.strip()
    memstore = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(state, "ceph.conf").read_text().splitlines():
            if line.strip().startswith("memstore device bytes"):
                memstore = int(line.split("=", 1)[1])
    facts = {
        "ceph": ceph,
        "radosgw_state": state,
        "radosgw_pids": pids,
        "memstore_device_bytes": memstore,
        "radosgw_perf_counters": s.get("rgw") is not None,
    }
    return Server("radosgw", endpoint, handle, facts, stop)


# ---- moto: the server process and its request accounting ----

STATS_PATH = "/__bench__/stats"  # the counting middleware answers its snapshot here


def _classify(env: dict) -> str:
    """The S3 operation of a WSGI request."""
    method, qs = env.get("REQUEST_METHOD", ""), env.get("QUERY_STRING", "")
    bucket_only = env.get("PATH_INFO", "").strip("/").count("/") == 0
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
        return "DeleteObjects" if "delete" in qs else "POST"
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

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.ops: dict[
            str, list[float]
        ] = {}  # op -> [requests, bytes_in, bytes_out, copied, busy_s]
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
        return {
            "ops": ops,
            "inflight": inflight,
            "cpu_s": time.process_time(),
            "rss_mib": mem.get("VmRSS"),
            "hwm_mib": mem.get("VmHWM"),
        }

    def _record(self, op: str, nin: int, nout: int, copied: int, busy: float) -> None:
        with self.lock:
            row = self.ops.setdefault(op, [0, 0, 0, 0, 0.0])
            row[0] += 1
            row[1] += nin
            row[2] += nout
            row[3] += copied
            row[4] += busy
            self.inflight -= 1

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        if environ.get("PATH_INFO") == STATS_PATH:
            body = json.dumps(self.snapshot()).encode()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        op = _classify(environ)
        nin = int(
            environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get("CONTENT_LENGTH") or 0
        )
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

    def _iterate(self, result: Any, op: str, nin: int, copied: int, t0: float) -> Iterator[bytes]:
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


def _moto_main(conn: Any, tmpdir: str) -> None:
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
            self._server = make_server(
                self._ip_address, self._port, app, True, request_handler=MotoRequestHandler
            )
            type(self).counting = True
            self._server_ready_event.set()
            self._server.serve_forever()

    try:
        server = CountingMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    except Exception:  # noqa: BLE001 - moto internals changed: plain server, no request accounting
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    host, port = server.get_host_and_port()
    conn.send((host, port, CountingMotoServer.counting))
    with contextlib.suppress(EOFError):
        conn.recv()  # "stop", or the parent went away
    server.stop()


def _moto_stats(endpoint: str) -> dict | None:
    try:
        with urllib.request.urlopen(endpoint + STATS_PATH, timeout=30) as r:
            return {"kind": "moto", **json.load(r)}
    except Exception:  # noqa: BLE001 - best effort: any failure reads as unknown
        return None


# ---- radosgw: perf counters over the admin socket, daemons' CPU from /proc ----

# radosgw's "rgw" perf counters kept: requests; GET/HEAD object requests ("get" counts HEAD too)
# and the bytes sent; PutObject/UploadPart requests and the bytes received; requests in progress.
RGW_COUNTERS = ("req", "get", "get_b", "put", "put_b", "qactive")


def _asok(path: str, cmd: dict, timeout: float = 10.0) -> dict:
    """One command on a Ceph admin socket: the JSON command and a NUL out; a 4-byte big-endian
    length and the JSON answer back."""

    def recv(s: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            c = s.recv(min(1 << 16, n - len(buf)))
            if not c:
                raise OSError("admin socket closed")
            buf += c
        return bytes(buf)

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(cmd).encode() + b"\0")
        return json.loads(recv(s, struct.unpack(">I", recv(s, 4))[0]))


def _radosgw_stats(handle: dict) -> dict:
    out: dict = {"kind": "radosgw", "cpu_by": {}, "rss_mib": {}}
    for name, pid in handle["pids"].items():
        cpu = proc_cpu_s(pid)
        if cpu is not None:
            out["cpu_by"][name] = cpu
            out["rss_mib"][name] = proc_rss_mib(pid)
    out["cpu_s"] = sum(out["cpu_by"].values())
    if handle.get("rgw_asok"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            d = _asok(handle["rgw_asok"], {"prefix": "perf dump"})["rgw"]
            out["rgw"] = {k: d.get(k, 0) for k in RGW_COUNTERS}
    return out


def osd_used_bytes(handle: dict) -> int | None:
    """Bytes the memstore OSD reports in use (its statfs; refreshed by the OSD every few s)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(_asok(handle["osd_asok"], {"prefix": "perf dump"})["osd"]["stat_bytes_used"])
    return None


def server_stats(handle: dict | None) -> dict | None:
    """A snapshot of the store's counters (moto: per-operation accounting; radosgw: perf
    counters and daemon CPU), or None where there is none."""
    if not handle:
        return None
    if handle["kind"] == "moto":
        return _moto_stats(handle["endpoint"]) if handle.get("counting") else None
    return _radosgw_stats(handle)


def stats_delta(a: dict | None, b: dict | None) -> dict | None:
    """Requests/bytes/CPU between two ``server_stats`` snapshots of the store."""
    if not a or not b:
        return None
    if b.get("kind") == "radosgw":
        out: dict = {
            "server_cpu_s": round(b["cpu_s"] - a["cpu_s"], 3),
            "server_cpu_by": {
                k: round(v - a["cpu_by"].get(k, 0.0), 3) for k, v in b["cpu_by"].items()
            },
            "server_rss_mib": b["rss_mib"],
            "server_copied": None,  # not counted on radosgw
        }
        ra, rb = a.get("rgw"), b.get("rgw")
        if ra and rb:
            d = {k: rb[k] - ra[k] for k in ("req", "get", "get_b", "put", "put_b")}

            def op(requests: int, bytes_in: int, bytes_out: int) -> dict:
                return {
                    "requests": requests,
                    "bytes_in": bytes_in,
                    "bytes_out": bytes_out,
                    "copied": 0,
                    "busy_s": None,
                }

            out.update(
                requests=d["req"],
                bytes_in=d["put_b"],
                bytes_out=d["get_b"],
                ops={
                    "GetObject/HeadObject": op(d["get"], 0, d["get_b"]),
                    "PutObject/UploadPart": op(d["put"], d["put_b"], 0),
                    "other": op(d["req"] - d["get"] - d["put"], 0, 0),
                },
            )
        return out
    ops = {}
    for name, row in b["ops"].items():
        d = [x - y for x, y in zip(row, a["ops"].get(name, [0, 0, 0, 0, 0.0]), strict=False)]
        if d[0]:
            ops[name] = {
                "requests": int(d[0]),
                "bytes_in": int(d[1]),
                "bytes_out": int(d[2]),
                "copied": int(d[3]),
                "busy_s": round(d[4], 3),
            }
    return {
        "requests": sum(o["requests"] for o in ops.values()),
        "bytes_in": sum(o["bytes_in"] for o in ops.values()),
        "bytes_out": sum(o["bytes_out"] for o in ops.values()),
        "server_copied": sum(o["copied"] for o in ops.values()),
        "server_cpu_s": round(b["cpu_s"] - a["cpu_s"], 3),
        "server_rss_mib": b.get("rss_mib"),
        "ops": ops,
    }


def collect_garbage(handle: dict) -> None:
    """radosgw: run its garbage collector now, so deleted multipart data leaves the RAM-backed
    OSD before the next measurement rather than during one; nothing on moto."""
    if handle["kind"] != "radosgw":
        return
    state = handle["state"]
    with contextlib.suppress(Exception):
        subprocess.run(
            [
                "radosgw-admin",
                "-c",
                f"{state}/ceph.conf",
                "-n",
                "client.rgw",
                "--log-file",
                f"{state}/log/radosgw-admin.log",
                "--admin-socket",
                "",
                "gc",
                "process",
                "--include-all",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
            check=False,
        )


def wait_idle(handle: dict) -> None:
    """Wait until the store has no request in progress (after ranks were killed mid-request);
    at most 300 s on moto, 60 s on radosgw."""
    deadline = time.time() + (300 if handle["kind"] == "moto" else 60)
    while time.time() < deadline:
        s = server_stats(handle)
        if not s:
            return
        if s["kind"] == "moto" and s["inflight"] == 0:
            return
        # radosgw's qactive reads 1 on an idle gateway here: compare with its idle reading
        if s["kind"] == "radosgw" and (s.get("rgw") or {}).get("qactive", 0) <= handle.get(
            "qactive_idle", 0
        ):
            return
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------------
# /proc sampling: memory of the measured processes, CPU of processes and of the machine
# ------------------------------------------------------------------------------------------------


def status_kib(pid: int | str = "self") -> dict[str, int] | None:
    """VmRSS, RssAnon, RssFile (KiB) of a process; None once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"VmRSS:", b"RssAnon:", b"RssFile:")):
                    k, v = line.split(b":", 1)
                    out[k.decode()] = int(v.split()[0])
    except OSError:
        return None
    return out if len(out) == 3 else None


def proc_rss_mib(pid: int | str) -> int | None:
    """VmRSS of a process in whole MiB; None once it is gone."""
    st = status_kib(pid)
    return None if st is None else st["VmRSS"] // 1024


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process, in seconds (its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


def sys_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat user+nice+system+irq+
    softirq+steal): across a timed call, minus the ranks' and the store's own CPU, it shows what
    anything else on the machine took from the measurement."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _CLK_TCK
    return None


class CallWindow:
    """In the measured process: baseline memory and wall-clock bounds of the timed call.

    The 5 ms sampling itself runs in the parent (``ProcSampler``), so no extra thread competes
    for this process's GIL or CPU; the parent keeps the samples that fall inside [ts0, ts1].
    """

    def start(self) -> None:
        self.base = status_kib()
        self.ru0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.ts0 = time.time()

    def stop(self) -> dict:
        self.ts1 = time.time()
        end = status_kib()
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
    """Parent-side thread sampling /proc/<pid>/status of child processes every ``period`` s
    (``period`` 0: no thread, no samples)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.pids: list[int] = []
        self.samples: dict[int, list[tuple[float, dict[str, int]]]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self, pids: list[int]) -> ProcSampler:
        self.pids = list(pids)
        self.samples = {p: [] for p in self.pids}
        if self.period > 0:
            self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for p in self.pids:
                st = status_kib(p)
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
# Synthetic model: llama-like bf16 state dicts, deterministic random bits per (key, rank, world)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    inter: int
    kv: int  # GQA: k/v projection output features
    layers: int


# (vocab, hidden, intermediate, kv) presets, largest first; TinyLlama-like at the top.
_PRESETS = [
    (32000, 2048, 5632, 256),
    (16000, 1024, 2816, 256),
    (8000, 512, 1408, 128),
    (2048, 256, 704, 64),
]
# (vocab, hidden, intermediate), MHA (k/v as wide as q); llama-7B widths first, then halvings for
# smoke tests whose target is smaller than one 7B-wide layer.
_WIDE_PRESETS = [
    (8192, 4096, 11008),
    (4096, 2048, 5504),
    (2048, 1024, 2752),
    (1024, 512, 1376),
    (512, 256, 704),
]


def model_dims(size_gb: float) -> Dims:
    """bench_save_load's model (GQA): a preset whose embeddings are small next to the target, then
    the layer count."""
    target = size_gb * GiB
    for v, h, i, kv in _PRESETS:
        fixed = (2 * v * h + h) * 2
        per_layer = (2 * h * h + 2 * kv * h + 3 * h * i + 2 * h) * 2
        if fixed <= target / 4 or (v, h, i, kv) == _PRESETS[-1]:
            layers = max(1, round((target - fixed) / per_layer))
            return Dims(v, h, i, kv, layers)
    raise AssertionError("unreachable: the last preset always fits")


def wide_model_dims(size_mb: float) -> Dims:
    """bench_s3's model: llama-7B widths, MHA (k/v as wide as q), few layers and a small vocab,
    about ``size_mb`` MiB."""
    target = size_mb * MiB
    for v, h, i in _WIDE_PRESETS:
        fixed = (2 * v * h + h) * 2
        per_layer = (4 * h * h + 3 * h * i + 2 * h) * 2
        if fixed + per_layer <= target * 1.1 or (v, h, i) == _WIDE_PRESETS[-1]:
            return Dims(v, h, i, h, max(1, round((target - fixed) / per_layer)))
    raise AssertionError("unreachable: the last preset always fits")


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


def total_bytes(spec: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the bf16 state dict ``spec`` describes."""
    return sum(math.prod(s) * 2 for _, s in spec)


def local_shape(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """(row offset, rows) of ``rank``'s Shard(0) chunk, as DTensor (torch.chunk) splits dim 0."""
    step = -(-shape[0] // world)
    start = min(rank * step, shape[0])
    return start, min(shape[0], start + step) - start


def shard_dim(shape: tuple[int, ...], layout: str) -> int:
    """The dimension a tensor is sharded on: "row" -> 0; "col" -> 1 (1-D tensors stay on 0)."""
    return 1 if layout == "col" and len(shape) >= 2 else 0


def make_shard(key: str, shape: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """Deterministic random bf16 bits for ``rank``'s Shard(0) chunk of ``key`` (any bit pattern)."""
    import torch

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


def original_full(key: str, shape: tuple[int, ...], world: int) -> torch.Tensor:
    """The whole tensor as saved: the Shard(0) chunks of the saving ranks, concatenated."""
    import torch

    return torch.cat([make_shard(key, shape, r, world) for r in range(world)])


def expected_local(
    key: str, shape: tuple[int, ...], rank: int, world: int, layout: str
) -> torch.Tensor:
    """What ``rank`` must hold of ``key`` after a load into ``layout`` (see ``shard_dim``)."""
    dim = shard_dim(shape, layout)
    if dim == 0:
        return make_shard(key, shape, rank, world)
    start, n = local_shape((shape[dim],), rank, world)
    return original_full(key, shape, world).narrow(dim, start, n)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (the data holds NaN patterns, so no float ==)."""
    import torch

    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))
    )


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


def dtensor_state_dict(
    spec: Sequence[tuple[str, tuple[int, ...]]],
    mesh: Any,
    rank: int,
    world: int,
    *,
    fill: str,
    layout: str = "row",
) -> dict:
    """``rank``'s state dict of ``spec`` as DTensors sharded by ``layout`` (see ``shard_dim``).
    ``fill="data"``: the original bits (row layout only); otherwise zeros, allocated and touched
    before any timed call, so a load destination is already in the RSS baseline."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    sd = {}
    for key, shape in spec:
        dim = shard_dim(shape, layout)
        if fill == "data":
            if dim != 0:
                raise ValueError(
                    f"fill='data' makes Shard(0) chunks only; got layout={layout!r} for {key} "
                    f"{shape}"
                )
            local = make_shard(key, shape, rank, world)
        else:
            _, n = local_shape((shape[dim],), rank, world)
            local = torch.zeros(
                [n if d == dim else s for d, s in enumerate(shape)], dtype=torch.bfloat16
            )
        sd[key] = DTensor.from_local(
            local,
            mesh,
            [Shard(dim)],
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )
    return sd


# ------------------------------------------------------------------------------------------------
# Rank processes: rendezvous, the timed region, result collection, spawning with timeouts
# ------------------------------------------------------------------------------------------------


class CallTimeout(Exception):
    """The timed call ran past ``run_ranks(call_timeout=...)``; the ranks were killed."""


class Timed(NamedTuple):
    """What ``timed_call`` measured on one rank."""

    result: Any
    call_s: float  # start -> the call returned
    wall_s: float  # start -> after the trailing barrier (every rank done)
    mem: dict  # CallWindow.stop(): baseline, window bounds, ru_maxrss growth


def init_dist(rank: int, world: int, rdzv: str, timeout_s: float | None = None) -> tuple[Any, Any]:
    """Join a gloo group through the ``file://`` rendezvous ``rdzv``; ``(torch.distributed, 1-D CPU
    mesh)``. ``timeout_s``: the collectives' timeout (default: torch's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    kw = {} if timeout_s is None else {"timeout": _dt.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world, **kw)
    return dist, init_device_mesh("cpu", (world,))


def timed_call(
    dist: Any,
    call: Callable[[], T],
    *,
    before: Callable[[], None] | None = None,
    started: Callable[[], None] | None = None,
    trailing_barrier: bool = True,
) -> Timed:
    """The measured region of one rank, the same on every rank.

    Sequence: garbage collected, then the collector off (no pauses inside); barrier; ``before()``
    (untimed snapshots); the ``CallWindow`` starts; barrier; start; ``started()``; ``call()``;
    ``call_s``; barrier unless ``trailing_barrier`` is False; ``wall_s``; the window stops; the
    collector on again."""
    gc.collect()
    gc.disable()
    try:
        dist.barrier()
        if before is not None:
            before()
        win = CallWindow()
        win.start()
        dist.barrier()
        t0 = time.perf_counter()
        if started is not None:
            started()
        result = call()
        t_call = time.perf_counter() - t0
        if trailing_barrier:
            dist.barrier()
        t_wall = time.perf_counter() - t0
        return Timed(result, t_call, t_wall, win.stop())
    finally:
        gc.enable()


def gather_results(dist: Any, rank: int, world: int, rec: dict, path: str) -> None:
    """Collective: every rank's ``rec`` to rank 0, which writes the list (by rank) to ``path`` as
    JSON; returns after a barrier, so the file is complete when any rank exits."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()


def timed_subclass(
    cls: type, names: Sequence[str], around: Callable[[Any, str], Any] | None = None
) -> type:
    """A subclass of ``cls`` whose methods ``names`` add their wall time to ``self.bench_t[name]``
    (benchmark-only instrumentation; no behaviour change). ``around(self, name)``, if given, is a
    context manager entered before the method's clock starts and left after it stops."""

    def wrap(name: str) -> Callable:
        orig = getattr(cls, name)

        def method(self: Any, *a: Any, **kw: Any) -> Any:
            with around(self, name) if around is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                try:
                    return orig(self, *a, **kw)
                finally:
                    t = self.__dict__.setdefault("bench_t", {})
                    t[name] = t.get(name, 0.0) + time.perf_counter() - t0

        return method

    return type(f"Timed{cls.__name__}", (cls,), {n: wrap(n) for n in names if hasattr(cls, n)})


def _with_peaks(per_rank: list[dict], sampler: ProcSampler) -> list[dict]:
    """Merge the sampled extra peak into each record that carries a ``CallWindow``; drop the raw
    window."""
    for rec in per_rank:
        if "pid" in rec:
            rec.update(sampler.peak_extra(rec))
            for k in ("base_kib", "end_kib", "ts0", "ts1", "pid"):
                rec.pop(k, None)
    return per_rank


def run_ranks(
    main: Callable[[int, int, dict], None],
    job: dict,
    world: int,
    *,
    sample_ms: float,
    call_timeout: float | None = None,
    hard_timeout: float | None = None,
) -> list[dict]:
    """Run ``main(rank, world, job)`` on ``world`` fresh spawned processes, sampling their RSS every
    ``sample_ms`` (0: off); the per-rank records ``main`` wrote to ``job["result"]``.

    Raises ``CallTimeout`` when the timed call, started at the time rank 0 wrote to
    ``job["t0_file"]``, runs past ``call_timeout`` seconds, ``TimeoutError`` when the processes run
    past ``hard_timeout`` seconds (either way every rank is killed first), and torch's
    ``ProcessRaisedException`` / ``ProcessExitedException`` when a rank fails."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        main, args=(world, job), nprocs=world, join=False, start_method="spawn"
    )
    sampler = ProcSampler(sample_ms / 1000).start([p.pid for p in ctx.processes])
    start = time.time()
    try:
        while not ctx.join(timeout=1.0):
            now = time.time()
            t0 = None
            if call_timeout is not None:
                with contextlib.suppress(OSError, ValueError):
                    t0 = float(Path(job["t0_file"]).read_text())
            over_call = t0 is not None and now - t0 > call_timeout
            if over_call or (hard_timeout is not None and now - start > hard_timeout):
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                if over_call:
                    raise CallTimeout(f"call still running after {now - t0:.0f} s; ranks killed")
                raise TimeoutError(
                    f"measurement still running after {now - start:.0f} s; ranks killed"
                )
    finally:
        sampler.stop()
    with open(job["result"]) as f:
        return _with_peaks(json.load(f), sampler)


def run_single(fn: Callable[[dict], None], job: dict, *, sample_ms: float) -> list[dict]:
    """``fn(job)`` in one fresh spawned process (no process group), sampled like ``run_ranks``;
    the records it wrote to ``job["result"]``. Raises ``RuntimeError`` if it exits non-zero."""
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=fn, args=(job,))
    p.start()
    sampler = ProcSampler(sample_ms / 1000).start([p.pid])
    try:
        p.join()
    finally:
        sampler.stop()
    if p.exitcode != 0:
        raise RuntimeError(f"{fn.__name__} exited with {p.exitcode}")
    with open(job["result"]) as f:
        return _with_peaks(json.load(f), sampler)


# ------------------------------------------------------------------------------------------------
# Records: jobs, JSON lines, the order of the contenders
# ------------------------------------------------------------------------------------------------


class Runner:
    """The bookkeeping of one run: numbered jobs with their own files, one JSON line per record.

    ``emit`` prints the record as one JSON line, appends it to ``work/<jsonl>`` (unless ``jsonl``
    is None) and to ``records``; ``close()`` closes that file."""

    def __init__(self, work: Path, jsonl: str | None = "results.jsonl") -> None:
        self.work = work
        self.records: list[dict] = []
        self.seq = 0
        self.jsonl = open(work / jsonl, "a") if jsonl else None  # noqa: SIM115 - closed by close()

    def emit(self, rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if self.jsonl is not None:
            self.jsonl.write(line + "\n")
            self.jsonl.flush()
        self.records.append(rec)

    def job(self, name: str, **fields: Any) -> dict:
        """A job dict for one measurement: ``name``, ``tag`` (``NNN_name``, unique in the run), the
        paths ``rdzv``, ``result`` and ``t0_file`` under ``work``, then ``fields``."""
        self.seq += 1
        tag = f"{self.seq:03d}_{name}"
        return {
            "name": name,
            "tag": tag,
            "rdzv": str(self.work / f"rdzv_{tag}"),
            "result": str(self.work / f"result_{tag}.json"),
            "t0_file": str(self.work / f"t0_{tag}"),
            **fields,
        }

    def discard(self, job: dict) -> None:
        """Remove the job's rendezvous, result and start-time files (those that exist)."""
        for p in (job["rdzv"], job["result"], job["t0_file"]):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()

    def report(self, table: str, md_out: str | os.PathLike[str] | None) -> None:
        """The run's end: ``table`` printed and, with ``md_out``, written there with every record
        as raw JSON lines; the work folder removed."""
        print(table)
        if md_out:
            write_report(str(md_out), table, "".join(json.dumps(r) + "\n" for r in self.records))
        remove_work_dir(self.work)


def select(only: str | None, choices: dict[str, str], what: str = "contender") -> list[str]:
    """The names an ``--only`` comma list picks (each by letter or name), in ``choices``' order;
    every name when ``only`` is empty. Raises ``SystemExit`` naming the unknown entry and the
    choices."""
    if not only:
        return list(choices.values())
    picked = set()
    for tok in only.split(","):
        name = choices.get(tok.strip(), tok.strip())
        if name not in choices.values():
            raise SystemExit(f"--only: unknown {what} {tok.strip()!r}; choose from {choices}")
        picked.add(name)
    return [n for n in choices.values() if n in picked]


def repeat_order(names: Sequence[T], rep: int) -> list[T]:
    """``names`` in order for an even repeat ``rep``, reversed for an odd one, so a slow drift of
    the machine does not always favour the same contender."""
    return list(names) if rep % 2 == 0 else list(names)[::-1]


def interleave(names: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """``(repeat, name)`` for ``repeats`` repeats of ``names``, each in ``repeat_order``."""
    for rep in range(repeats):
        for name in repeat_order(names, rep):
            yield rep, name


def max_over(per_rank: list[dict], key: str) -> Any:
    """The largest non-None ``key`` over the ranks' records, or None."""
    vals = [r[key] for r in per_rank if r.get(key) is not None]
    return max(vals) if vals else None


def make_work_dir(prefix: str, parent: str | None = None) -> Path:
    """A fresh folder ``<parent>/<prefix>XXXX`` (default parent: ``DATA_ROOT``, created as
    needed)."""
    root = Path(parent).resolve() if parent else DATA_ROOT
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def remove_work_dir(work: Path) -> None:
    """Delete ``work``, then ``DATA_ROOT`` if that left it empty."""
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        DATA_ROOT.rmdir()


# ------------------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------------------


def median(xs: Sequence[float | None]) -> float | None:
    """Median of the non-None values, or None."""
    import statistics

    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    """``x`` formatted with ``spec``; "-" for None."""
    return "-" if x is None else format(x, spec)


def fmt_mib(n: float | None) -> str:
    """Bytes as "12.3 MiB"; "-" for None."""
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def paired_ratios(rows: list[dict], a: str, b: str) -> list[float]:
    """time_s of contender ``a`` / of ``b`` per repeat, for the repeats where both ran (and are not
    ``ok: False``), by repeat: contenders of one repeat run back to back, which cancels slow
    drifts."""
    by = {(r["contender"], r["repeat"]): r["time_s"] for r in rows if r.get("ok", True)}
    return [by[(a, k)] / by[(b, k)] for (n, k) in sorted(by) if n == a and (b, k) in by]


# ------------------------------------------------------------------------------------------------
# Reports: versions, machine facts, the results file
# ------------------------------------------------------------------------------------------------


def version(mod: str) -> str:
    """The installed version of distribution ``mod``, or "?"."""
    try:
        from importlib.metadata import version as _v

        return _v(mod)
    except Exception:  # noqa: BLE001 - best effort: any failure reads as unknown
        return "?"


def git_rev() -> str:
    """The checkout's commit, with "+dirty" when the library folder has uncommitted changes."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "hf_dcp_storage"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) or "?"
    except Exception:  # noqa: BLE001 - best effort: any failure reads as unknown
        return "?"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def fs_type(path: Path) -> str:
    """\"<fstype> on <device>" of the mount holding ``path``."""
    best, fstype = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], f"{parts[2]} on {parts[0]}"
    return fstype


def mem_gib() -> float:
    """The machine's RAM in GiB, one decimal."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)


def env_record(
    packages: Sequence[str], *, with_cpu_model: bool = False, work: Path | None = None
) -> dict:
    """The first JSON line of a run: ``phase: env``, date, python, torch, the versions of
    ``packages``, git, cpus, the CPU model (``with_cpu_model``), RAM, and the work folder with its
    file system (``work``). The caller appends its own keys."""
    import torch

    rec: dict[str, Any] = {
        "phase": "env",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{p: version(p) for p in packages},
        "git": git_rev(),
        "cpus": os.cpu_count() or 1,
    }
    if with_cpu_model:
        rec["cpu_model"] = cpu_model()
    rec["mem_gib"] = mem_gib()
    if work is not None:
        rec.update(work_dir=str(work), fs=fs_type(work))
    return rec


def write_report(path: str, text: str, raw_jsonl: str | None = None) -> None:
    """Write ``text`` to ``path`` (folders created), then, if given, the raw JSON lines under a
    "## Raw JSON lines" heading in a json code block."""
    if raw_jsonl is not None:
        text += "\n\n## Raw JSON lines\n\n```json\n" + raw_jsonl + "```\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
