"""torchtune save benchmark: the final (weights-only) save of an FSDP2-sharded torchtune Llama 3 of
about ``--model-gb`` GB (bf16) on ``--ranks`` gloo ranks, to local disk, through torchtune 0.6.1's
own ``CheckpointClient.save_checkpoint`` where it takes the checkpointer; contenders interleaved
repeat by repeat, each a fresh job:

  ours      ``HFCheckpointer``: the client keeps the model sharded and calls it on every rank;
            every rank writes its own shards of one consolidated HF folder
  full_hf   torchtune's ``FullModelHFCheckpointer``: the client gathers the full model onto rank 0
            (``training.gather_cpu_state_dict``), which converts and writes the HF files alone
  dcp       torchtune's ``DistributedCheckpointer.save_checkpoint({"model": ...})``: every rank
            writes ``.distcp`` files (DCP's own format, not an HF folder). Called directly:
            0.6.1's client passes it ``intermediate_checkpoint=``, which it does not take

``save s`` is the slowest rank's call (all ranks leave together); ``durable s`` adds an
``os.sync()`` after it, since the contenders leave different amounts in the page cache
(``FileSystemWriter`` with ``sync_files=False``, safetensors' ``save_file``, ours' direct I/O).
The machine has 2 cores: with more ranks per host, the gather's single writer loses more.
Usage (in .venv-integrations, which has torchtune): ``python -m benchmarks.bench_torchtune
--repeats 5 --md-out benchmarks/results/torchtune-cpu-2core.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
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
    timed_call,
    write_report,
)

__all__ = ["main"]

GB = 1e9
CONTENDERS = ("ours", "full_hf", "dcp")


def _dims(model_gb: float) -> dict[str, int]:
    """Llama-3.2-1B-like widths (GQA); layers chosen for ``model_gb`` GB of bf16 weights."""
    dims = {
        "vocab_size": 32000,
        "embed_dim": 2048,
        "num_heads": 16,
        "num_kv_heads": 8,
        "intermediate_dim": 8192,
        "max_seq_len": 2048,
    }
    d, f, v = dims["embed_dim"], dims["intermediate_dim"], dims["vocab_size"]
    per_layer = 2 * d * d + 2 * d * (d // 2) + 3 * d * f + 2 * d
    layers = max(1, round((model_gb * GB / 2 - 2 * v * d) / per_layer))
    return {**dims, "num_layers": layers}


def _hf_config(dims: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": dims["vocab_size"],
        "hidden_size": dims["embed_dim"],
        "intermediate_size": dims["intermediate_dim"],
        "num_hidden_layers": dims["num_layers"],
        "num_attention_heads": dims["num_heads"],
        "num_key_value_heads": dims["num_kv_heads"],
        "head_dim": dims["embed_dim"] // dims["num_heads"],
        "torch_dtype": "bfloat16",
    }


def _write_base(folder: Path, dims: dict[str, int]) -> None:
    """The base HF folder ``FullModelHFCheckpointer`` reads first (its weight map decides the
    output files): zeros in HF keys, one file, and ``config.json``."""
    from safetensors.torch import save_file
    from torchtune.models import convert_weights
    from torchtune.models.llama3 import llama3

    with torch.device("meta"):
        model = llama3(**dims)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    tune = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    hf = convert_weights.tune_to_hf(
        tune,
        num_heads=dims["num_heads"],
        num_kv_heads=dims["num_kv_heads"],
        dim=dims["embed_dim"],
    )
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(_hf_config(dims)))


def rank_main(rank: int, world: int, job: dict) -> None:
    """One rank of one save (spawned fresh): build and shard the model, time the save."""
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import fully_shard
    from torchtune import training
    from torchtune.models.llama3 import llama3
    from torchtune.training.checkpointing._checkpoint_client import (
        CheckpointClient,
        TrainingProgress,
    )

    torch.set_num_threads(1)
    dist, _ = init_dist(rank, world, job["rdzv"], timeout_s=1800)
    with torch.device("meta"):
        model = llama3(**job["dims"]).to(torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.copy_(torch.randn(local.shape, generator=g).to(torch.bfloat16))
    name, out = job["name"], job["out"]
    components = {
        "ours": {
            "_component_": "hf_dcp_storage.integrations.torchtune.HFCheckpointer",
            "checkpoint_dir": job["base"],
            "output_dir": out,
            "model_type": "LLAMA3",
            "companions": {},
        },
        "full_hf": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": job["base"],
            "checkpoint_files": ["model.safetensors"],
            "output_dir": out,
            "model_type": "LLAMA3",
        },
    }
    if name == "dcp":
        from torchtune.training import DistributedCheckpointer

        checkpointer = DistributedCheckpointer(checkpoint_dir=job["base"], output_dir=out)

        def call() -> None:
            checkpointer.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)
    else:
        cfg = OmegaConf.create({"device": "cpu", "checkpointer": components[name]})
        client = CheckpointClient(cfg)
        if name == "full_hf":
            client.load_base_checkpoint()  # it learns the output files' weight map here
        progress = TrainingProgress(seed=0, epochs_run=1, total_epochs=1, max_steps_per_epoch=1)

        def call() -> None:
            client.save_checkpoint(model, None, progress, epoch=0)  # the final save

    timed = timed_call(dist, call)
    start = time.perf_counter()
    if rank == 0:
        os.sync()
    dist.barrier()
    synced = time.perf_counter() - start
    written = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file()) if rank == 0 else 0
    gathered: list[Any] = [None] * world
    record = {"rank": rank, "save_s": timed.wall_s, "sync_s": synced, "bytes": written}
    dist.all_gather_object(gathered, record)
    if rank == 0:
        Path(job["result"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-gb", type=float, default=1.07)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--md-out", type=Path)
    args = p.parse_args()
    work = make_work_dir("bench_torchtune")
    env = {
        **env_record(["torchtune", "torchao", "safetensors"], with_cpu_model=True, work=work),
        "args": vars(args) | {"md_out": str(args.md_out)},
    }
    print(json.dumps(env), flush=True)
    dims = _dims(args.model_gb)
    rows: list[dict] = []
    try:
        _write_base(work / "base", dims)
        for rep, name in interleave(CONTENDERS, args.repeats):
            tag = f"{name}_{rep}"
            out = work / f"out_{tag}"
            job = {
                "name": name,
                "dims": dims,
                "base": str(work / "base"),
                "out": str(out),
                "rdzv": str(work / f"rdzv_{tag}"),
                "result": str(work / f"result_{tag}.json"),
                "t0_file": str(work / f"t0_{tag}"),
            }
            per_rank = run_ranks(rank_main, job, args.ranks, sample_ms=0)
            row = {
                "contender": name,
                "repeat": rep,
                "save_s": max(r["save_s"] for r in per_rank),
                "durable_s": max(r["save_s"] + r["sync_s"] for r in per_rank),
                "bytes": sum(r["bytes"] for r in per_rank),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        remove_work_dir(work)
    table = _table(rows, args, dims)
    print(table)
    if args.md_out:
        raw = "\n".join(json.dumps(r) for r in [env, *rows]) + "\n"
        write_report(str(args.md_out), table, raw)


def _table(rows: list[dict], args: argparse.Namespace, dims: dict[str, int]) -> str:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["contender"] == name)

    out = [
        (
            f"# bench_torchtune (torchtune 0.6.1, local disk, {args.ranks} ranks, a "
            f"{dims['num_layers']}-layer Llama 3 in bf16, {args.repeats} repeats, git {git_rev()})"
        ),
        "",
        "| contender | GB written | median save s | runs s | median durable s | this / ours |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name in CONTENDERS:
        runs = [r["save_s"] for r in rows if r["contender"] == name]
        gb = next(r["bytes"] for r in rows if r["contender"] == name) / GB
        out.append(
            f"| {name} | {gb:.2f} | {med(name, 'save_s'):.2f} | "
            f"{', '.join(f'{w:.2f}' for w in runs)} | {med(name, 'durable_s'):.2f} | "
            f"{med(name, 'save_s') / med('ours', 'save_s'):.2f}x |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
