"""Quantized-load benchmark: a resharded ``dcp.load`` of quantized checkpoints into bf16
``Shard(0)`` DTensors on ``--ranks`` ranks, from local disk (files in the page cache) or an S3
server on loopback (``--store moto|radosgw``), contenders interleaved repeat by repeat:

  ours         ``HFStorageReader(dequantize=torch.bfloat16)``
  torch        ``QuantizedHuggingFaceStorageReader(target_dtype=torch.bfloat16)`` (local disk and
               FP8 only: it reads local folders alone, and in torch 2.13 its ``dcp.load`` of MXFP4
               fills only part of each row, so its time there would be of another, smaller load)
  ours_raw     ``HFStorageReader()`` loading the same stored bytes as they are (float8 / uint8
               destinations): the same bytes with no dequantization
  ours_bf16    ``HFStorageReader()`` loading a bf16 checkpoint of the dequantized weights (2x the
               FP8 bytes, 4x MXFP4's): what loading the model costs without the quantized files

Two folders, written once by one process (several files, an index, a ``config.json``):

  fp8    DeepSeek-V3-like ``float8_e4m3fn`` weights (7168 x 2048 and 2048 x 7168) with float32
         ``weight_scale_inv`` of 128 x 128 blocks, ``--fp8-mb`` of weights
  mxfp4  gpt-oss-like ``*_blocks`` ``[8, 2880, 90, 16]`` uint8 with ``*_scales``, ``--mxfp4-mb``

Throughput is the quantized folder's stored bytes per second of the slowest rank (for
``ours_bf16``, of the same model loaded from its bf16 files). Each rank also records a
CRC32 of what it loaded, so the table says whether ours gave the same bits as torch's reader.
Usage: ``python -m benchmarks.bench_quantized [--store radosgw] --repeats 5 --md-out F``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import zlib
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness import (
    env_record,
    git_rev,
    init_dist,
    interleave,
    make_work_dir,
    remove_work_dir,
    run_ranks,
    seal_aws_env,
    start_server,
    storage_options,
    timed_call,
    write_report,
)

__all__ = ["main"]

MiB = 1 << 20
_FILE_BYTES = 128 * MiB


def _fp8_tensors(size_mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = [(7168, 2048), (2048, 7168)]
    out: dict[str, torch.Tensor] = {}
    for i in range(max(1, size_mb * MiB // (7168 * 2048))):
        rows, cols = shapes[i % 2]
        w = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) / 100
        out[f"layers.{i}.mlp.weight"] = w
        out[f"layers.{i}.mlp.weight_scale_inv"] = scale
    return out


def _mxfp4_tensors(size_mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    shape = (8, 2880, 90, 16)
    out: dict[str, torch.Tensor] = {}
    for i in range(max(1, size_mb * MiB // (8 * 2880 * 90 * 16))):
        out[f"layers.{i}.experts.up_blocks"] = torch.randint(
            0, 256, shape, dtype=torch.uint8, generator=g
        )
        out[f"layers.{i}.experts.up_scales"] = torch.randint(
            118, 134, shape[:-1], dtype=torch.uint8, generator=g
        )
    return out


def _write_folder(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        if (
            size + t.nbytes > _FILE_BYTES
            and files[-1]
            and not key.endswith(("_scale_inv", "_scales"))
        ):
            files.append({})
            size = 0
        files[-1][key] = t
        size += t.nbytes
    weight_map = {}
    for i, part in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps(config))


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one load (spawned fresh): time it, record a CRC32 of what it loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist, mesh = init_dist(rank, world, job["rdzv"], timeout_s=1800)
    raw = job["name"] == "ours_raw"  # ours_bf16: a bf16 folder, loaded as stored
    sd = {}
    for key, (stored_shape, shape, stored_dtype) in job["weights"].items():
        dtype = getattr(torch, stored_dtype) if raw else torch.bfloat16
        size = stored_shape if raw else shape
        sd[key] = distribute_tensor(
            torch.zeros(size, dtype=dtype), mesh, [Shard(0)], src_data_rank=None
        )
    if job["name"] == "torch":
        from torch.distributed.checkpoint.quantized_hf_storage import (
            QuantizedHuggingFaceStorageReader,
        )

        reader: Any = QuantizedHuggingFaceStorageReader(
            job["url"], thread_count=job["threads"], target_dtype=torch.bfloat16
        )
    else:
        from hf_dcp_storage import HFStorageReader

        reader = HFStorageReader(
            job["url"],
            storage_options=job["opts"],
            thread_count=job["threads"],
            dequantize=torch.bfloat16 if job["name"] == "ours" else None,
        )
    timed = timed_call(dist, lambda: dcp.load(sd, storage_reader=reader))
    crc = 0
    for key in sorted(sd):
        crc = zlib.crc32(sd[key].to_local().contiguous().view(torch.uint8).numpy(), crc)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "wall_s": timed.wall_s, "crc": crc})
    if rank == 0:
        Path(job["result"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="fp8,mxfp4")
    p.add_argument("--store", choices=["local", "moto", "radosgw"], default="local")
    p.add_argument("--fp8-mb", type=int, default=512)
    p.add_argument("--mxfp4-mb", type=int, default=256)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=4, help="reader threads, every contender")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--md-out", type=Path)
    args = p.parse_args()
    seal_aws_env()
    work = make_work_dir("bench_quantized")
    env = env_record(["safetensors", "s3fs"], with_cpu_model=True, work=work)
    rows: list[dict] = []
    server, opts, fs = None, None, None
    if args.store != "local":
        import s3fs

        size = (args.fp8_mb + args.mxfp4_mb) * MiB
        server = start_server(args.store, size=size, work=work)
        opts = storage_options(server.endpoint)
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("bench-quantized")
    try:
        for case in [c for c in args.cases.split(",") if c]:
            if case == "fp8":
                tensors = _fp8_tensors(args.fp8_mb)
                config = {
                    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}
                }
                contenders = ["ours", "torch", "ours_raw", "ours_bf16"]
            else:
                tensors = _mxfp4_tensors(args.mxfp4_mb)
                config = {"quantization_config": {"quant_method": "mxfp4"}}
                contenders = ["ours", "ours_raw", "ours_bf16"]
            if fs is not None:
                contenders = [c for c in contenders if c != "torch"]  # local folders only
            folder = work / case
            _write_folder(folder, tensors, config)
            _write_folder(work / f"{case}_bf16", _dequantized_tensors(folder, tensors), {})
            urls = {"": str(folder), "_bf16": str(work / f"{case}_bf16")}
            if fs is not None:
                for tail, local in list(urls.items()):
                    urls[tail] = f"s3://bench-quantized/{case}{tail}"
                    fs.put(local + "/", urls[tail] + "/", recursive=True)
            weights = {
                k: (list(t.shape), _dequantized(t.shape), str(t.dtype).removeprefix("torch."))
                for k, t in tensors.items()
                if not k.endswith(("_scale_inv", "_scales"))
            }
            stored = sum(tensors[k].nbytes for k in weights)
            del tensors
            for rep, name in interleave(contenders, args.repeats):
                tag = f"{case}_{name}_{rep}"
                job = {
                    "name": name,
                    "url": urls["_bf16" if name == "ours_bf16" else ""],
                    "opts": opts,
                    "weights": weights,
                    "threads": args.threads,
                    "rdzv": str(work / f"rdzv_{tag}"),
                    "result": str(work / f"result_{tag}.json"),
                    "t0_file": str(work / f"t0_{tag}"),
                }
                per_rank = run_ranks(rank_main, job, args.ranks, sample_ms=0)
                wall = max(r["wall_s"] for r in per_rank)
                row = {
                    "case": case,
                    "contender": name,
                    "repeat": rep,
                    "wall_s": wall,
                    "stored_mib": stored / MiB,
                    "gb_s": stored / wall / 1e9,
                    "crcs": [r["crc"] for r in sorted(per_rank, key=lambda r: r["rank"])],
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
            remove_work_dir(folder)
            remove_work_dir(work / f"{case}_bf16")
    finally:
        if server is not None:
            server.stop()
        remove_work_dir(work)
    table = _table(rows, args)
    print(table)
    if args.md_out:
        raw = "\n".join(json.dumps(r) for r in [env, *rows]) + "\n"
        write_report(str(args.md_out), table, raw)


def _dequantized_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of ``folder`` dequantized into bf16 (by our reader, in this process)."""
    import torch.distributed.checkpoint as dcp

    from hf_dcp_storage import HFStorageReader

    out = {
        k: torch.empty(_dequantized(t.shape), dtype=torch.bfloat16)
        for k, t in tensors.items()
        if not k.endswith(("_scale_inv", "_scales"))
    }
    reader = HFStorageReader(folder, dequantize=torch.bfloat16)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _dequantized(shape: torch.Size) -> list[int]:
    if len(shape) == 4:  # MXFP4 blocks [..., G, B] -> [..., G * 2 * B]
        return [*shape[:-2], shape[-2] * shape[-1] * 2]
    return list(shape)


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    where = "local disk, page cache warm" if args.store == "local" else args.store
    out = [
        (
            f"# bench_quantized ({where}, {args.ranks} ranks, {args.threads} threads each, "
            f"{args.repeats} repeats, git {git_rev()})"
        ),
        "",
        (
            "| case | contender | stored MiB | median s | runs s | GB/s stored "
            "| ours' throughput / this one's | same bits as torch |"
        ),
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case]
        names = dict.fromkeys(r["contender"] for r in rs)
        walls = {n: [r["wall_s"] for r in rs if r["contender"] == n] for n in names}
        med = {n: statistics.median(w) for n, w in walls.items()}
        crcs = {n: next(r["crcs"] for r in rs if r["contender"] == n) for n in names}
        mib = rs[0]["stored_mib"]
        for name in names:
            same = (
                ""
                if "torch" not in crcs or name == "ours_raw"
                else str(crcs[name] == crcs["torch"])
            )
            out.append(
                f"| {case} | {name} | {mib:.0f} | {med[name]:.2f} | "
                f"{', '.join(f'{w:.2f}' for w in walls[name])} | {mib * MiB / med[name] / 1e9:.2f} "
                f"| {med[name] / med['ours']:.2f}x | {same} |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    main()
