#!/usr/bin/env python
"""End-to-end demo: train with FSDP2 on 2 CPU ranks, save a Hugging Face checkpoint, reload it
resharded.

1. 2 ranks (gloo, CPU) build a tiny transformer language model, shard it with FSDP2
   ``fully_shard``, train a few AdamW steps on synthetic data and save the sharded state dict
   with ``dcp.save(..., storage_writer=HFStorageWriter(...))``. Rank 0 also keeps a reference
   copy of the full trained tensors (gathered with ``DTensor.full_tensor()``) in a temp folder.
2. The parent checks every ``*.safetensors`` file with ``safetensors.torch.load_file`` against
   the index and the reference.
3. The checkpoint is loaded back with ``HFStorageReader`` on 1 rank (plain tensors) and on
   3 ranks (FSDP2, uneven shards); every parameter must equal the reference bit for bit.

Run:  python examples/demo_fsdp.py [--out DIR] [--steps N] [--overwrite] [--clean]
The process exits non-zero on any mismatch; its last line says OK or FAILED.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hf_dcp_storage import HFSavePlanner, HFStorageReader, HFStorageWriter

# Model and data sizes: ~3.6M fp32 parameters (~14 MB). VOCAB and DIM are not multiples of 3,
# so the 3-rank reload gets uneven FSDP shards.
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 1000, 256, 4, 4, 32, 8
MAX_SHARD_SIZE = "4MB"  # a few output files for ~14 MB of tensors
SEED = 1234
LR = 3e-3
TRAIN_WORLD = 2
LOAD_WORLDS = (1, 3)
REFERENCE_NAME = "reference.pt"
CHECKPOINT_GLOBS = ("model.safetensors.index.json", "model.safetensors", "model-*-of-*.safetensors")
MB = 1e6


# -- model and data ---------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.fc_in = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc_in(self.mlp_norm(x))))


class TinyLM(nn.Module):
    """A tiny GPT-style language model (token + position embeddings, blocks, untied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(world: int, seed: int) -> nn.Module:
    """The demo model initialised from ``seed``; FSDP2-sharded over all ranks when ``world > 1``."""
    torch.manual_seed(seed)
    model = TinyLM()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def synthetic_batch(seed: int) -> torch.Tensor:
    """Arithmetic token sequences (random start, stride 1 or 2), so next-token loss falls
    quickly."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 3, (BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``batch``."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def eval_loss(model: nn.Module) -> float:
    """Loss on one fixed batch (the same on every rank), to show the loaded model behaves the
    same."""
    with torch.no_grad():
        return lm_loss(model, synthetic_batch(SEED + 10_000)).item()


# -- distributed jobs (run in every rank) -----------------------------------------------------


@dataclass(frozen=True)
class Job:
    """What one spawned group of ranks does; pickled to every rank."""

    phase: str  # "train" or "load"
    world: int
    out_dir: str
    work_dir: str  # private temp folder: rendezvous files, reference copy, results
    steps: int = 0
    overwrite: bool = False

    @property
    def result_path(self) -> Path:
        return Path(self.work_dir) / f"result-{self.phase}-{self.world}.json"


def log0(msg: str) -> None:
    """Print from rank 0 only."""
    if dist.get_rank() == 0:
        print(msg, flush=True)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes across all ranks (barriers on both sides)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every state-dict tensor; a collective under FSDP2."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def train_and_save(job: Job) -> dict[str, Any]:
    """Train with FSDP2, save with ``HFStorageWriter``, and keep a full reference copy (rank 0)."""
    model = build_model(job.world, SEED)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(job.steps):
        loss = lm_loss(model, synthetic_batch(SEED + 100 * step + dist.get_rank()))
        optim.zero_grad()
        loss.backward()
        optim.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / job.world)
        log0(f"  step {step + 1:3d}/{job.steps}  loss {losses[-1]:.4f}")
    state = model.state_dict()  # DTensor shards: each rank holds only its part
    writer = HFStorageWriter(job.out_dir, max_shard_size=MAX_SHARD_SIZE, overwrite=job.overwrite)
    save_s = timed(lambda: dcp.save(state, storage_writer=writer, planner=HFSavePlanner()))
    reference = full_state(model)
    if dist.get_rank() == 0:
        torch.save(reference, Path(job.work_dir) / REFERENCE_NAME)
    return {"losses": losses, "save_s": save_s, "eval_loss": eval_loss(model)}


def poison(model: nn.Module) -> None:
    """Fill every parameter with NaN, so a value the load does not write cannot pass the check."""
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))


def load_and_verify(job: Job) -> dict[str, Any]:
    """Load the checkpoint into a fresh (re-)sharded model and compare it with the reference."""
    model = build_model(job.world, SEED + 1)
    poison(model)
    state = model.state_dict()
    load_s = timed(lambda: dcp.load(state, storage_reader=HFStorageReader(job.out_dir)))
    loaded = full_state(model)
    reference = torch.load(Path(job.work_dir) / REFERENCE_NAME, weights_only=True)
    mismatched = sorted(
        k for k in reference if k not in loaded or not torch.equal(loaded[k], reference[k])
    )
    mismatched += sorted(k for k in loaded if k not in reference)
    return {"load_s": load_s, "mismatched": mismatched, "eval_loss": eval_loss(model)}


PHASES: dict[str, Callable[[Job], dict[str, Any]]] = {
    "train": train_and_save,
    "load": load_and_verify,
}


def worker(rank: int, job: Job) -> None:
    """Entry point of one spawned rank: join the gloo group, run the phase, rank 0 writes
    results."""
    torch.set_num_threads(1)  # the ranks share a few cores
    rendezvous = Path(job.work_dir) / f"rendezvous-{job.phase}-{job.world}"
    dist.init_process_group(
        "gloo",
        init_method=rendezvous.as_uri(),
        rank=rank,
        world_size=job.world,
        timeout=timedelta(minutes=5),
    )
    try:
        result = PHASES[job.phase](job)
        if rank == 0:
            job.result_path.write_text(json.dumps(result))
        dist.barrier()
    except CheckpointException as exc:  # a BaseException, which torch's spawn would not forward
        raise RuntimeError(f"rank {rank}: {exc}") from None
    finally:
        dist.destroy_process_group()


def run_job(job: Job) -> dict[str, Any]:
    """Spawn ``job.world`` ranks for ``job`` and return rank 0's result."""
    mp.spawn(worker, args=(job,), nprocs=job.world, join=True)
    return json.loads(job.result_path.read_text())


# -- checks and report (parent process) -------------------------------------------------------


def check_files(out_dir: Path, reference: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """Read every output file with ``safetensors``; return (problems, index total_size)."""
    from safetensors.torch import load_file

    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    total_size = int(index["metadata"]["total_size"])
    problems, seen, nbytes = [], {}, 0
    print(f"  {'file':<36} {'tensors':>7} {'bytes':>12}")
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(path)
        print(f"  {path.name:<36} {len(tensors):>7} {path.stat().st_size:>12,}")
        for key, tensor in tensors.items():
            seen[key] = path.name
            nbytes += tensor.numel() * tensor.element_size()
            if key not in reference or not torch.equal(tensor, reference[key]):
                problems.append(f"{path.name}: {key!r} differs from the trained parameter")
    if seen != weight_map:
        problems.append("the index weight_map does not match the tensors found in the files")
    if set(seen) != set(reference):
        problems.append(f"keys missing from the files: {sorted(set(reference) - set(seen))}")
    if nbytes != total_size:
        problems.append(f"index total_size {total_size} != {nbytes} bytes of tensor data")
    return problems, total_size


def existing_checkpoint(out_dir: Path) -> list[str]:
    """Names of checkpoint files already in ``out_dir`` (empty when there are none)."""
    return sorted({p.name for pattern in CHECKPOINT_GLOBS for p in out_dir.glob(pattern)})


def resolve_out_dir(args: argparse.Namespace) -> tuple[Path, bool]:
    """The output folder and whether this run created it; exits if it would clobber a checkpoint."""
    if args.out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = Path("demo_output") / f"run-{stamp}"
        while out_dir.exists():
            stamp += "x"
            out_dir = Path("demo_output") / f"run-{stamp}"
    else:
        out_dir = Path(args.out)
    out_dir = out_dir.resolve()
    if out_dir.exists() and not out_dir.is_dir():
        sys.exit(f"error: --out {out_dir} exists and is not a folder")
    found = existing_checkpoint(out_dir) if out_dir.exists() else []
    if found and not args.overwrite:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        sys.exit(
            f"error: {out_dir} already holds a checkpoint ({shown}); pass --overwrite to replace "
            "it, or choose another --out"
        )
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir, created


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", help="checkpoint folder (default: a fresh folder under ./demo_output/)"
    )
    parser.add_argument("--steps", type=int, default=8, help="training steps (default: 8)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint already in --out"
    )
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument(
        "--keep", action="store_true", default=True, help="keep the checkpoint (the default)"
    )
    keep.add_argument(
        "--clean",
        dest="keep",
        action="store_false",
        help="delete the output folder after a successful run, if this run created it",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def rate(nbytes: int, seconds: float) -> str:
    """``"0.123 s (456.7 MB/s)"``."""
    return f"{seconds:.3f} s ({nbytes / MB / max(seconds, 1e-9):.1f} MB/s)"


def report_loads(
    loads: dict[int, dict[str, Any]], trained_loss: float, total_size: int
) -> list[str]:
    """Print each reload's time and check; return the problems found."""
    problems = []
    for world, res in loads.items():
        status = (
            "all parameters equal"
            if not res["mismatched"]
            else f"{len(res['mismatched'])} MISMATCHED"
        )
        print(
            f"  load on {world} rank(s): {rate(total_size, res['load_s'])}, {status}, eval loss "
            f"{res['eval_loss']:.6f}"
        )
        problems += [f"load on {world} rank(s): {k!r} differs" for k in res["mismatched"]]
        if abs(res["eval_loss"] - trained_loss) > 1e-4 * max(1.0, abs(trained_loss)):
            problems.append(
                f"load on {world} rank(s): eval loss {res['eval_loss']} != {trained_loss}"
            )
    return problems


def run_demo(args: argparse.Namespace, out_dir: Path, work_dir: str) -> list[str]:
    """Train and save, check the files, reload on 1 and 3 ranks; return every problem found."""
    print(
        f"[1/4] training {args.steps} steps on {TRAIN_WORLD} CPU ranks (FSDP2), then saving to "
        f"{out_dir}"
    )
    trained = run_job(Job("train", TRAIN_WORLD, str(out_dir), work_dir, args.steps, args.overwrite))
    reference = torch.load(Path(work_dir) / REFERENCE_NAME, weights_only=True)
    params = sum(t.numel() for t in reference.values())
    print(
        f"  {len(reference)} tensors, {params:,} parameters; eval loss {trained['eval_loss']:.6f}"
    )
    print("[2/4] checking the files with safetensors.torch.load_file")
    problems, total_size = check_files(out_dir, reference)
    print(f"  index total_size: {total_size:,} bytes ({total_size / MB:.2f} MB)")
    print(f"  save on {TRAIN_WORLD} ranks: {rate(total_size, trained['save_s'])}")
    print(f"[3/4] reloading with HFStorageReader on {' and '.join(map(str, LOAD_WORLDS))} rank(s)")
    loads = {w: run_job(Job("load", w, str(out_dir), work_dir)) for w in LOAD_WORLDS}
    problems += report_loads(loads, trained["eval_loss"], total_size)
    print(
        f"[4/4] hf-dcp verify {out_dir}  (the command line: structure and every recorded checksum)"
    )
    return problems + run_verify(out_dir)


def run_verify(out_dir: Path) -> list[str]:
    """``hf-dcp verify`` on the checkpoint, as a user would run it; its verdict is a problem if not
    0."""
    proc = subprocess.run(
        [sys.executable, "-m", "hf_dcp_storage", "verify", str(out_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    print("\n".join(f"  {line}" for line in (proc.stdout + proc.stderr).strip().splitlines()))
    return [] if proc.returncode == 0 else [f"hf-dcp verify exited {proc.returncode}"]


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when every check passed."""
    args = parse_args(argv)
    out_dir, created = resolve_out_dir(args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_dcp_demo_") as work_dir:
        try:
            problems = run_demo(args, out_dir, work_dir)
        except Exception as exc:  # noqa: BLE001 - a rank failed: mp.spawn re-raises with its traceback
            print(exc, file=sys.stderr)
            problems = [f"{type(exc).__name__}: a rank failed (its traceback is on stderr)"]
    elapsed = time.perf_counter() - start
    if problems:
        print("\n".join(f"  problem: {p}" for p in problems))
        print(
            f"DEMO FAILED: {len(problems)} problem(s) after {elapsed:.1f} s; output left in "
            f"{out_dir}"
        )
        return 1
    if not args.keep and created:
        shutil.rmtree(out_dir)
        print(f"  removed {out_dir} (--clean)")
    else:
        print(f"  checkpoint kept in {out_dir}")
    print(
        "DEMO OK: trained, saved, verified with safetensors and hf-dcp, reloaded on 1 and 3 "
        f"ranks in {elapsed:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
