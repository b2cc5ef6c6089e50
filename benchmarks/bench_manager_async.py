"""Time the training loop is blocked by ``CheckpointManager.save(..., async_save=True)``, with and
without ``reuse_staging``, over consecutive saves of one state dict.

    python -m benchmarks.bench_manager_async --size-mb 512 --saves 4 \\
        --md-out benchmarks/results/2026-11_manager-staging-cpu-2core.md

One process (no process group), local disk, a float32 state dict of ``--size-mb`` in 64 MiB
tensors, changed (``add_(1)``) between saves as training would. Each variant runs in a fresh
process. Per save: **blocked** (the call until it returns: DCP's staging copy plus planning),
**total** (until the step is committed), the process's RSS after the commit. Without reuse DCP
allocates a fresh host copy at every save; with it the copy made at the first save is refilled.
Every step is loaded back and compared with the values it had when saved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _child(reuse: bool, size_mb: int, saves: int, root: str) -> list[dict]:
    from hf_dcp_storage import CheckpointManager

    n = max(1, size_mb // 64)
    sd = {f"w{i}": torch.full((16 << 20,), float(i)) for i in range(n)}  # 64 MiB each
    out = []
    with CheckpointManager(root, keep_last_n=saves, reuse_staging=reuse) as mgr:
        for step in range(1, saves + 1):
            t0 = time.perf_counter()
            fut = mgr.save(step, sd, async_save=True)
            blocked = time.perf_counter() - t0
            fut.result()
            total = time.perf_counter() - t0
            out.append(
                {"step": step, "blocked_s": blocked, "total_s": total, "rss_mib": _rss_mib()}
            )
            for t in sd.values():
                t.add_(1)
        for step in range(1, saves + 1):
            back = {k: torch.empty_like(v) for k, v in sd.items()}
            mgr.load(back, step=step)
            if not all(torch.all(back[f"w{i}"] == i + step - 1) for i in range(n)):
                raise RuntimeError(f"step {step} does not hold the values it was saved with")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--md-out")
    ap.add_argument("--child", choices=["reuse", "fresh"], help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child == "reuse", args.size_mb, args.saves, args.root)))
        return
    results = {}
    for variant in ("fresh", "reuse"):
        with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1]) as tmp:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                variant,
                "--root",
                str(Path(tmp) / "run"),
                "--size-mb",
                str(args.size_mb),
                "--saves",
                str(args.saves),
            ]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    lines = [
        (
            f"# CheckpointManager async save: staging reuse ({args.size_mb} MiB float32, "
            f"{args.saves} saves, 1 process, local disk)"
        ),
        "",
        (
            f"- command: `python -m benchmarks.bench_manager_async --size-mb {args.size_mb} "
            f"--saves {args.saves}`; torch {torch.__version__}"
        ),
        "",
        (
            "| reuse_staging | blocked, save 1 | blocked, saves 2+ (median) | total, saves 2+ "
            "(median) | RSS after the last save |"
        ),
        "|---|---:|---:|---:|---:|",
    ]
    for variant, rows in results.items():
        later = rows[1:] or rows
        lines.append(
            f"| {variant == 'reuse'} | {rows[0]['blocked_s']:.3f} s | "
            f"{statistics.median(r['blocked_s'] for r in later):.3f} s | "
            f"{statistics.median(r['total_s'] for r in later):.2f} s | {rows[-1]['rss_mib']:.0f} "
            "MiB |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md_out:
        Path(args.md_out).write_text(text + "\n```\n" + json.dumps(results) + "\n```\n")


if __name__ == "__main__":
    main()
