#!/usr/bin/env python
"""GPU check: a CUDA-sharded state dict saved and loaded through HFStorageWriter/HFStorageReader
under NCCL, against the same state dict on CPU. One command, a few minutes at most.

    python scripts/gpu_check.py                      # every visible GPU, ~2 GiB of bf16
    python scripts/gpu_check.py --size-gb 0.5 --out DIR
    python scripts/gpu_check.py --allow-cpu --ranks 2 --size-gb 0.02   # no GPU: the same steps on
    CPU (smoke test)

One rank per GPU (a 1-device mesh when there is one GPU), process group ``cpu:gloo,cuda:nccl``
(``--backend nccl``: plain NCCL, where the manager's own collectives take a gloo group).
A llama-like bf16 state dict, every tensor a ``Shard(0)`` DTensor made on the device. For each
side (``cuda``: the tensors on the GPUs; ``cpu``: the same values on CPU DTensors):

* ``save``: ``dcp.save`` to local disk, wall time (max over ranks) and GB/s, with the default
  ``direct_io`` (``O_DIRECT`` where the filesystem takes it: ``direct MiB`` says how much went
  direct) and the pinned buffers the slabs went through (``pinned buffers``: host buffers, and
  the page-locked aligned buffers a direct save copies device slabs into); ``save buffered``:
  the same with ``direct_io=False``, whose files must be byte-identical;
* ``load``: ``dcp.load`` into zeroed tensors of the same placement, checked equal to the saved ones;
* ``load_fp32``: the same into float32 destinations (the dtype converted on the destination's
  device);
* ``async``: ``dcp.async_save`` with an extra gloo group: the time the caller is blocked (the
  device-to-host staging) and the time until the checkpoint is complete; its files must be
  byte-identical to the synchronous save's; ``process async``: the same through DCP's background
  process (``AsyncCheckpointerType.PROCESS``), staged by a ``DefaultStager`` into pinned (on
  CUDA), shared memory;
* (the device side only) ``CheckpointManager`` saves a step with a training-state tensor on the
  device and resumes it: its own collectives on this backend; then two async saves with
  ``reuse_staging`` (one kept, pinned host copy refilled) and a resume.

Prints a markdown table and writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out``
(default ``$OUT`` when set, else ``./gpu_check_out``). Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hf_dcp_storage import CheckpointManager, HFStorageReader, HFStorageWriter
from hf_dcp_storage.io import aligned

GB = 1e9


def shapes(size_gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like keys (hidden 4096, MLP 11008, GQA k/v 1024) with as many layers as fit."""
    hidden, inter, kv, vocab = 4096, 11008, 1024, 32000
    per_layer = [
        ("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]  # fmt: skip
    layer_bytes = sum(2 * torch.Size(s).numel() for _, s in per_layer)
    layers = max(1, int(size_gb * GB // layer_bytes))
    if size_gb * GB < layer_bytes:  # a smoke test: scale the widths down instead
        factor = max(1, int((layer_bytes / (size_gb * GB)) ** 0.5))
        per_layer = [(k, tuple(max(1, d // factor) for d in s)) for k, s in per_layer]
        vocab //= factor
        hidden //= factor
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        out += [(f"model.layers.{i}.{k}", s) for k, s in per_layer]
    return [*out, ("model.norm.weight", (hidden,))]


def _state_dict(
    spec: list[tuple[str, tuple[int, ...]]],
    mesh: Any,
    dtype: torch.dtype = torch.bfloat16,
    fill: bool = True,
) -> dict[str, DTensor]:
    """Shard(0) DTensors on ``mesh``'s device, values a function of the key alone (made on rank 0's
    generator, identical on every rank, so any rank can check any shard)."""
    out = {}
    for i, (key, shape) in enumerate(spec):
        gen = torch.Generator(device=mesh.device_type).manual_seed(i)
        full = (
            torch.randn(shape, generator=gen, device=mesh.device_type, dtype=torch.float32).to(
                dtype
            )
            if fill
            else torch.zeros(shape, device=mesh.device_type, dtype=dtype)
        )
        out[key] = distribute_tensor(full, mesh, [Shard(0)])
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _timed(device: str, fn: Any) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _same(a: dict[str, DTensor], b: dict[str, DTensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k].to_local().to(b[k].dtype), b[k].to_local())]


def _rank(rank: int, world: int, args: dict[str, Any], init: str) -> None:
    device = args["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's background save process meets there
    dist.init_process_group(
        args["backend"] if device == "cuda" else "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
    )
    async_group = dist.new_group(backend="gloo")
    spec = shapes(args["size_gb"])
    root = Path(args["work"])
    results: dict[str, Any] = {}
    failures: list[str] = []
    for side in [device, "cpu"] if device == "cuda" else ["cpu"]:
        mesh = init_device_mesh(side, (world,))
        sd = _state_dict(spec, mesh)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values())  # of the global tensors
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out: dict[str, Any] = {"bytes": nbytes}
        writer = HFStorageWriter(root / f"{side}_sync")
        out["save_s"] = _timed(side, lambda: dcp.save(sd, storage_writer=writer))  # noqa: B023 - called within the iteration
        out["direct_io_mib"] = writer.merge_stats.direct_io_bytes / 2**20
        pool = writer._host.pool
        out["pinned_buffers"] = pool.made if pool is not None and pool.pin else 0
        out["pinned_aligned"] = len(
            aligned._PINNED
        )  # the direct writes' buffers the slabs were copied into
        out["save_buffered_s"] = _timed(
            side,
            lambda: dcp.save(
                sd,  # noqa: B023 - called within the iteration
                storage_writer=HFStorageWriter(root / f"{side}_buffered", direct_io=False),  # noqa: B023 - called within the iteration
            ),
        )
        back = _state_dict(spec, mesh, fill=False)
        out["load_s"] = _timed(
            side,
            lambda: dcp.load(back, storage_reader=HFStorageReader(root / f"{side}_sync")),  # noqa: B023 - called within the iteration
        )
        failures += [f"{side} load: {k}" for k in _same(sd, back)]
        back32 = _state_dict(spec, mesh, dtype=torch.float32, fill=False)
        out["load_fp32_s"] = _timed(
            side,
            lambda: dcp.load(back32, storage_reader=HFStorageReader(root / f"{side}_sync")),  # noqa: B023 - called within the iteration
        )
        failures += [f"{side} load_fp32: {k}" for k in _same(sd, back32)]
        back = back32 = {}  # free them before the next step
        _sync(side)
        t = time.perf_counter()
        response = dcp.async_save(
            sd, storage_writer=HFStorageWriter(root / f"{side}_async"), process_group=async_group
        )
        out["async_blocked_s"] = time.perf_counter() - t
        getattr(response, "upload_completion", response).result()
        out["async_total_s"] = time.perf_counter() - t
        _sync(side)
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=side == "cuda",
                use_shared_memory=True,
                use_async_staging=False,
                use_non_blocking_copy=side == "cuda",
            )
        )
        t = time.perf_counter()
        response = dcp.async_save(
            sd,
            storage_writer=HFStorageWriter(root / f"{side}_process"),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        out["process_blocked_s"] = time.perf_counter() - t
        getattr(response, "upload_completion", response).result()
        out["process_total_s"] = time.perf_counter() - t
        stager.close()
        dist.barrier()
        out["extra_peak_rss_mib"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        ) / 1024
        if rank == 0:
            names = sorted(p.name for p in (root / f"{side}_sync").iterdir())
            for other in ("async", "process", "buffered"):
                _match, mismatch, errors = filecmp.cmpfiles(
                    root / f"{side}_sync", root / f"{side}_{other}", names, shallow=False
                )
                failures += [f"{side} {other} differs: {n}" for n in mismatch + errors]
        if side == device:
            # The manager on this backend: its own collectives, training-state tensors on the
            # device.
            mgr = CheckpointManager(root / f"{side}_run", keep_last_n=1)
            first = next(iter(sd))
            state = {"step": 7, "moment": sd[first]}
            mgr.save(7, {first: sd[first]}, training_state=state)
            restored = {"step": 0, "moment": _state_dict(spec[:1], mesh, fill=False)[first]}
            if (
                mgr.load(
                    {first: _state_dict(spec[:1], mesh, fill=False)[first]}, training_state=restored
                )
                != 7
                or restored["step"] != 7
            ):
                failures.append(f"{side} manager: resumed step {restored['step']}")
            failures += [
                f"{side} manager: {k}" for k in _same({"m": sd[first]}, {"m": restored["moment"]})
            ]
            # Async saves refilling one kept host copy (pinned, non-blocking copies on CUDA).
            with CheckpointManager(
                root / f"{side}_reuse", keep_last_n=2, reuse_staging=True
            ) as reuse:
                for step in (8, 9):
                    reuse.save(step, {first: sd[first]}, async_save=True)
                back = {first: _state_dict(spec[:1], mesh, fill=False)[first]}
                if reuse.load(back) != 9:
                    failures.append(f"{side} manager reuse_staging: did not resume step 9")
                failures += [
                    f"{side} manager reuse_staging: {k}" for k in _same({first: sd[first]}, back)
                ]
        results[side] = out
        sd = {}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "results": results, "failures": failures})
    if rank == 0:
        Path(args["work"], "result.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _table(per_rank: list[dict[str, Any]]) -> list[str]:
    lines = [
        (
            "| tensors on | GB | save s (GB/s) | direct MiB | pinned buffers: host / aligned | "
            "save buffered s | load s (GB/s) | load into fp32 s | async: blocked / total s | "
            "process async: blocked / total s | extra peak host RSS/rank MiB |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side in per_rank[0]["results"]:
        worst = {
            k: max(r["results"][side][k] for r in per_rank) for k in per_rank[0]["results"][side]
        }
        gb = per_rank[0]["results"][side]["bytes"] / GB  # global sizes: the same on every rank
        lines.append(
            f"| {side} | {gb:.2f} | {worst['save_s']:.2f} ({gb / worst['save_s']:.2f}) | "
            f"{worst['direct_io_mib']:.0f} | {worst['pinned_buffers']} / "
            f"{worst['pinned_aligned']} | {worst['save_buffered_s']:.2f} | {worst['load_s']:.2f} "
            f"({gb / worst['load_s']:.2f}) | {worst['load_fp32_s']:.2f} | "
            f"{worst['async_blocked_s']:.2f} / {worst['async_total_s']:.2f} | "
            f"{worst['process_blocked_s']:.2f} / {worst['process_total_s']:.2f} | "
            f"{worst['extra_peak_rss_mib']:.0f} |"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="total bf16 bytes of the state dict")
    ap.add_argument("--ranks", type=int, help="ranks (default: one per visible GPU)")
    ap.add_argument(
        "--allow-cpu", action="store_true", help="without a GPU, run the same steps on CPU tensors"
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--work", help="where the checkpoints go (default: a temp folder, removed)")
    ap.add_argument(
        "--backend",
        default="cpu:gloo,cuda:nccl",
        help="the process group's backend on GPUs (also: nccl)",
    )
    args = ap.parse_args()
    if torch.cuda.is_available():
        device, world = "cuda", args.ranks or torch.cuda.device_count()
    elif args.allow_cpu:
        device, world = "cpu", args.ranks or 2
    else:
        print(
            "gpu_check: no CUDA device visible (torch.cuda.is_available() is False); pass "
            "--allow-cpu for a CPU smoke run",
            file=sys.stderr,
        )
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    init = f"file://{work / 'rendezvous'}"
    t = time.perf_counter()
    mp.spawn(
        _rank,
        args=(
            world,
            {"device": device, "size_gb": args.size_gb, "work": str(work), "backend": args.backend},
            init,
        ),
        nprocs=world,
        join=True,
    )
    per_rank = json.loads((work / "result.json").read_text())
    failures = [f for r in per_rank for f in r["failures"]]
    env = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "ranks": world, "size_gb": args.size_gb,
        "backend": args.backend if device == "cuda" else "gloo",
        "wall_s": round(time.perf_counter() - t, 1),
    }  # fmt: skip
    text = (
        "\n".join(
            [
                f"gpu_check: {json.dumps(env)}",
                "",
                *_table(per_rank),
                "",
                "failures: " + (", ".join(failures) if failures else "none"),
            ]
        )
        + "\n"
    )
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(
        json.dumps({"env": env, "ranks": per_rank, "failures": failures}, indent=1)
    )
    (out / "gpu_check.md").write_text(text)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print("GPU CHECK OK" if not failures else "GPU CHECK FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
