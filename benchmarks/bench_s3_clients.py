"""S3 client transports side by side: the requests this project sends (multipart part uploads,
ranged GETs, small whole-object PUTs) through s3fs/aiobotocore as the library sends them, through
s3torchconnector's CRT client and through obstore (Rust ``object_store``), on the same server.

It answers one question: would another client make our object-store saves and loads faster? A
transport is adopted behind ``stores/`` only if it beats s3fs by >= 1.3x here (issue 32, item 3).

Operations (each one object of ``--size-mb``, cut into ``--part-mb`` pieces, ``--in-flight`` of
them at once, every contender with the same numbers):

  upload     one multipart upload: create, the parts, complete
  get        the whole object as ranged GETs of ``--part-mb``, into memory
  small_put  ``--small-count`` whole-object PUTs of 64 KiB (the records and index a save writes)

Contenders:

  s3fs        this library's own requests (``stores/s3_requests.S3``: s3fs's aiobotocore client,
              our retry policy): parts from a thread pool as ``Uploader`` sends them, GETs through
              ``S3.get_spans`` on s3fs's event loop, as a load sends them
  crt         s3torchconnector 1.5's ``S3Client`` (AWS CRT): ``put_object`` streamed in parts
              (its ``part_size`` = ``--part-mb``, its own concurrency), ranged readers from a
              thread pool; its writes through the ETag proxy (radosgw's empty ETag in the
              CompleteMultipartUpload answer fails the CRT client, which uploads even 64 KiB
              in a multipart upload: ``_etag_proxy``)
  s3fs_proxy  ``s3fs`` through the same proxy: the proxy's own cost, for the writes
  obstore     obstore 0.12 ``S3Store``: ``put`` with ``chunk_size``/``max_concurrency``, then
              ``get_range_async`` calls, ``--in-flight`` at once, on one event loop

Each measurement is a fresh process (imports and the client built outside the timed region,
one HEAD first so each has a connection), contenders interleaved repeat by repeat, medians. CPU
is the process's user+system time over the timed region (every thread, the Rust ones too): on a
2-core machine whose server shares the cores, client CPU is server time lost.

    python -m benchmarks.bench_s3_clients --repeats 5 \\
        --md-out benchmarks/results/s3_clients-cpu-2core.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    Runner,
    collect_garbage,
    env_record,
    interleave,
    make_work_dir,
    median,
    run_single,
    seal_aws_env,
    server_stats,
    start_server,
    stats_delta,
    storage_options,
)

__all__ = ["main"]

MiB = 1 << 20
REGION = "us-east-1"
CONTENDERS = {
    "upload": ["s3fs", "s3fs_proxy", "crt", "obstore"],
    "get": ["s3fs", "crt", "obstore"],
    "small_put": ["s3fs", "s3fs_proxy", "crt", "obstore"],
}
SMALL = 64 * 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pieces(job: dict) -> list[tuple[int, int]]:
    size, part = job["size_mb"] * MiB, job["part_mb"] * MiB
    return [(s, min(s + part, size)) for s in range(0, size, part)]


def _payload(size: int) -> bytearray:
    # Distinct bytes (no compression or dedup anywhere can shortcut them), cheap to make.
    import numpy as np

    return bytearray(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())


# -- the three clients: each returns (prepare, run) for one operation; prepare is untimed -------


def _s3fs_ops(job: dict, key: str, data: bytearray | None) -> Any:
    import s3fs

    from hf_dcp_storage.stores.retry import RetryPolicy
    from hf_dcp_storage.stores.s3_requests import S3

    s3 = S3(s3fs.S3FileSystem(**job["opts"]), RetryPolicy())
    path = f"{job['bucket']}/{key}"
    pieces, n = _pieces(job), job["in_flight"]

    def warm() -> None:
        s3.head(f"{job['bucket']}/{job['source']}")

    if job["op"] == "upload":
        assert data is not None
        # Filled part buffers, as the store's Uploader hands them over (botocore takes bytes or
        # bytearray bodies, not views); cut before the timed region.
        chunks = [data[s:e] for s, e in pieces]

        def run() -> None:
            upload = s3.create_upload(path)
            with ThreadPoolExecutor(n) as pool:
                parts = list(
                    pool.map(
                        lambda i: s3.upload_part_of(path, upload, i + 1, chunks[i]),
                        range(len(pieces)),
                    )
                )
            s3.complete_upload(path, upload, parts)

    elif job["op"] == "get":
        src = f"{job['bucket']}/{job['source']}"

        def run() -> None:
            got = s3.get_spans([(src, s, e) for s, e in pieces], concurrency=n)
            assert sum(map(len, got)) == job["size_mb"] * MiB

    else:
        assert data is not None

        def run() -> None:
            with ThreadPoolExecutor(n) as pool:
                list(
                    pool.map(
                        lambda i: s3.put(f"{path}/{i}", data[i * SMALL : (i + 1) * SMALL]),
                        range(job["small_count"]),
                    )
                )

    return warm, run


def _crt_ops(job: dict, key: str, data: bytearray | None) -> Any:
    from s3torchconnector import S3ClientConfig, S3ReaderConstructor
    from s3torchconnector._s3client import S3Client

    config = S3ClientConfig(force_path_style=True, part_size=job["part_mb"] * MiB)
    client = S3Client(REGION, endpoint=job["endpoint"], s3client_config=config)
    bucket, pieces, n = job["bucket"], _pieces(job), job["in_flight"]

    def warm() -> None:
        client.head_object(bucket, job["source"])

    if job["op"] == "upload":
        assert data is not None
        view = memoryview(data)

        def run() -> None:
            writer = client.put_object(bucket, key)
            for s, e in pieces:
                writer.write(view[s:e])
            writer.close()

    elif job["op"] == "get":
        ranged = S3ReaderConstructor.range_based()

        def one(piece: tuple[int, int]) -> int:
            reader = client.get_object(bucket, job["source"], reader_constructor=ranged)
            reader.seek(piece[0])
            return len(reader.read(piece[1] - piece[0]))

        def run() -> None:
            with ThreadPoolExecutor(n) as pool:
                assert sum(pool.map(one, pieces)) == job["size_mb"] * MiB

    else:
        assert data is not None

        small = [bytes(data[i * SMALL : (i + 1) * SMALL]) for i in range(job["small_count"])]

        def put(i: int) -> None:
            writer = client.put_object(bucket, f"{key}/{i}")
            writer.write(small[i])  # its writer takes bytes only
            writer.close()

        def run() -> None:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(put, range(job["small_count"])))

    return warm, run


def _obstore_ops(job: dict, key: str, data: bytearray | None) -> Any:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        job["bucket"],
        endpoint=job["endpoint"],
        region=REGION,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    pieces, n = _pieces(job), job["in_flight"]

    def warm() -> None:
        obstore.head(store, job["source"])

    async def bounded(calls: list[Any]) -> list[Any]:
        gate = asyncio.Semaphore(n)

        async def one(call: Any) -> Any:
            async with gate:
                return await call()

        return await asyncio.gather(*(one(c) for c in calls))

    if job["op"] == "upload":
        assert data is not None
        view = memoryview(data)

        def run() -> None:
            obstore.put(
                store,
                key,
                (view[s:e] for s, e in pieces),
                use_multipart=True,
                chunk_size=job["part_mb"] * MiB,
                max_concurrency=n,
            )

    elif job["op"] == "get":

        def run() -> None:
            calls = [
                lambda s=s, e=e: obstore.get_range_async(store, job["source"], start=s, end=e)
                for s, e in pieces
            ]
            got = asyncio.run(bounded(calls))
            assert sum(len(memoryview(b)) for b in got) == job["size_mb"] * MiB

    else:
        assert data is not None

        small = [bytes(data[i * SMALL : (i + 1) * SMALL]) for i in range(job["small_count"])]

        def run() -> None:
            calls = [
                lambda i=i: obstore.put_async(store, f"{key}/{i}", small[i])
                for i in range(job["small_count"])
            ]
            asyncio.run(bounded(calls))

    return warm, run


OPS = {"s3fs": _s3fs_ops, "s3fs_proxy": _s3fs_ops, "crt": _crt_ops, "obstore": _obstore_ops}


def single_main(job: dict) -> None:
    """One measurement in a fresh process: build the client, warm it, time the operation."""
    os.environ["AWS_ENDPOINT_URL"] = job["endpoint"]
    os.environ["AWS_REGION"] = REGION
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    size = job["size_mb"] * MiB if job["op"] == "upload" else SMALL * job["small_count"]
    data = None if job["op"] == "get" else _payload(size)
    warm, run = OPS[job["name"]](job, job["key"], data)
    warm()
    s0 = server_stats(job["server"])
    cpu0, t0 = _cpu_s(), time.perf_counter()
    run()
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    rec = {"wall_s": wall, "cpu_s": cpu, "server": stats_delta(s0, server_stats(job["server"]))}
    Path(job["result"]).write_text(json.dumps([rec]))


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    head = (
        "| op | contender | median s | runs s | MiB/s | s3fs / this (speed-up) | client CPU s "
        "| requests (GET / PUT) | MiB to server / from server |"
    )
    out = [head, "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for op, names in CONTENDERS.items():
        med = {
            n: median([r["wall_s"] for r in rows if r["op"] == op and r["contender"] == n])
            for n in names
        }
        mib = args.size_mb if op != "small_put" else SMALL * args.small_count / MiB
        for n in names:
            mine = [r for r in rows if r["op"] == op and r["contender"] == n]
            if not mine or med[n] is None:
                continue
            srv = mine[-1]["server"] or {}
            ops = srv.get("ops") or {}
            gets = sum(v["requests"] for k, v in ops.items() if k.startswith("Get"))
            puts = sum(v["requests"] for k, v in ops.items() if k.startswith("Put"))
            base = med.get("s3fs_proxy" if n == "crt" and op != "get" else "s3fs")
            out.append(
                f"| {op} | {n} | {med[n]:.3f} | "
                + ", ".join(f"{r['wall_s']:.2f}" for r in mine)
                + f" | {mib / med[n]:.0f} | {base / med[n]:.2f} | "
                f"{median([r['cpu_s'] for r in mine]):.2f} | "
                f"{srv.get('requests', 0)} ({gets} / {puts}) | "
                f"{(srv.get('bytes_in') or 0) / MiB:.0f} / "
                f"{(srv.get('bytes_out') or 0) / MiB:.0f} |"
            )
    out.append("")
    out.append(
        "Speed-up: s3fs's median over the contender's (> 1: the contender is faster); "
        "the CRT uploads and PUTs are compared with s3fs through the same proxy. "
        "Requests and bytes: the server's counters over the last repeat's timed region."
    )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["moto", "radosgw"], default="radosgw")
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--part-mb", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--small-count", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", default=",".join(CONTENDERS))
    p.add_argument("--md-out", type=Path)
    args = p.parse_args()
    seal_aws_env()
    if args.server == "radosgw":
        os.environ.setdefault("RADOSGW_MEMSTORE_GIB", "6")
    work = make_work_dir("bench_s3_clients")
    runner = Runner(work)
    env = env_record(["s3fs", "s3torchconnector", "obstore"], with_cpu_model=True)
    env.update({k: v for k, v in vars(args).items() if k != "md_out"})
    runner.emit(env)
    server = start_server(args.server, size=2 * args.size_mb * MiB, work=work)
    from benchmarks._etag_proxy import EtagProxy

    try:
        import s3fs

        opts = storage_options(server.endpoint)
        fs = s3fs.S3FileSystem(**opts)
        bucket = f"bench-clients-{int(time.time())}"
        fs.mkdir(bucket)
        source = "source.bin"
        fs.pipe(f"{bucket}/{source}", bytes(_payload(args.size_mb * MiB)))
        with EtagProxy(server.endpoint) as proxy:
            for op in args.ops.split(","):
                for rep, name in interleave(CONTENDERS[op], args.repeats):
                    proxied = op != "get" and name in ("crt", "s3fs_proxy")
                    endpoint = proxy.endpoint if proxied else server.endpoint
                    job = runner.job(
                        name, op=op, bucket=bucket, source=source, key=f"{op}_{name}_{rep}"
                    )
                    job.update(
                        endpoint=endpoint,
                        opts=storage_options(endpoint),
                        server=server.handle,
                        **{
                            k: getattr(args, k)
                            for k in ("size_mb", "part_mb", "in_flight", "small_count")
                        },
                    )
                    rec = run_single(single_main, job, sample_ms=0)[0]
                    runner.emit({"phase": "op", "op": op, "contender": name, "repeat": rep, **rec})
                    runner.discard(job)
                    if op != "get":  # a get writes nothing
                        fs.rm(f"{bucket}/{job['key']}", recursive=True)
                    collect_garbage(server.handle)
    finally:
        server.stop()
        runner.close()
    rows = [r for r in runner.records if r.get("phase") == "op"]
    table = (
        f"# bench_s3_clients ({args.server}, {args.size_mb} MiB in {args.part_mb} MiB pieces, "
        f"{args.in_flight} in flight, {args.repeats} repeats, git {env['git']}, {env['date']})\n\n"
        + _table(rows, args)
    )
    runner.report(table, args.md_out)


if __name__ == "__main__":
    main()
