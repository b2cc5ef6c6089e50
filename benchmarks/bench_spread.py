"""Who finishes an object-store save: the ranks (spread by bytes) or the coordinator alone.

    python -m benchmarks.bench_spread --baseline-rev 0913b56 --ranks 4 --repeats 3 \\
        --md-out benchmarks/results/spread-cpu-2core.md

A state dict whose every rank's run of every tensor is under S3's 5 MiB part minimum (what
FSDP over a thousand ranks gives a real model; here 48 row-sharded 2 MiB tensors over 4 ranks:
512 KiB runs, 96 MiB in all) is saved with ``dcp.save`` to Ceph radosgw on loopback
(``tests/support/radosgw.py``) and, as the generic fsspec path, to a ``file://`` folder with
``direct_write=False``. Every byte is staged, then assembled into its consolidated place: by
this tree, on the ranks the coordinator gave each part or file to; by ``--baseline-rev``
(checked out into a temporary git worktree), by the coordinator in ``finish``. Each variant runs
in a fresh process tree with its own ``PYTHONPATH``; save order alternates between repeats.

Reported, medians over ``--repeats``: the save's wall time (slowest rank), each rank's
``write_data`` time, the coordinator's ``finish`` time, and (this tree) the bytes each rank
assembled (``merge_stats.by_rank``). Every checkpoint is read back with ``safetensors`` and
compared with the state dict. The 2-core VM runs the ranks, radosgw, its OSD and monitor at once:
what matters is where the work goes (bytes per rank, the coordinator's ``finish``), not the
absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import (
    MiB,
    radosgw_unavailable,
    repeat_order,
    seal_aws_env,
    start_radosgw,
    storage_options,
    timed_subclass,
    write_report,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TENSORS, ROWS, COLS = 48, 1024, 1024  # bf16: 2 MiB each
S3_BLOCK_SIZE = (
    5 * MiB
)  # tests/support/storage_options.py's: s3fs buffers this much, then uploads parts this big


def _full(i: int):
    import torch

    g = torch.Generator().manual_seed(i)
    return torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16)


def _rank(rank: int, world: int, url: str, options: dict | None, out: str) -> None:
    """One rank: save, timing ``write_data`` (every rank) and ``finish`` (coordinator)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_dcp_storage import HFStorageWriter

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        f"layers.{i}.weight": distribute_tensor(_full(i), mesh, [Shard(0)], src_data_rank=None)
        for i in range(TENSORS)
    }
    writer = timed_subclass(HFStorageWriter, ["write_data", "finish"])(
        url, storage_options=options, direct_write=False, max_shard_size="24MB"
    )
    t = time.perf_counter()
    dcp.save(sd, storage_writer=writer)
    times = {**writer.bench_t, "save": time.perf_counter() - t}
    stats = writer.merge_stats if rank == 0 else None
    by_rank = getattr(stats, "by_rank", None) if stats is not None else None
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "times": times,
                "by_rank": by_rank,
                "client_bytes": stats.client_bytes if stats else None,
            }
        )
    )


def _child(args: argparse.Namespace) -> None:
    """(a fresh process, ``PYTHONPATH`` = the tree measured, then this one) Save once on ``--ranks``
    ranks."""
    # tests/support/dist.py's ranks (one torch thread each, DCP's failures with their traces, no
    # teardown abort), as the library's own distributed tests run.
    from tests.support.dist import run_ranks

    options = json.loads(args.options) if args.options else None
    with tempfile.TemporaryDirectory() as out:
        run_ranks(_rank_entry, args.ranks, args.url, options, out)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    print(json.dumps(ranks))


def _rank_entry(rank: int, world: int, url: str, options: dict | None, out: str) -> None:
    _rank(rank, world, url, options, out)


def _verify(url: str, options: dict | None) -> bool:
    """Read every file of the checkpoint with safetensors and compare with the originals."""
    import fsspec
    import torch
    from safetensors.torch import load as st_load

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    index = json.loads(fs.cat_file(f"{root}/model.safetensors.index.json"))
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(st_load(fs.cat_file(f"{root}/{name}")))
    return sorted(got) == sorted(f"layers.{i}.weight" for i in range(TENSORS)) and all(
        torch.equal(got[f"layers.{i}.weight"], _full(i)) for i in range(TENSORS)
    )


def _measure(src: Path, url: str, options: dict | None, ranks: int) -> list[dict]:
    # hf_dcp_storage from the tree measured (first); this tree's benchmark and tests.support after
    # it (an older tree's benchmarks/ and tests/, folders without __init__.py, do not shadow
    # them). This file run by path, so the child is this tree's, whichever tree it measures.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys([str(src), str(ROOT)])))
    cmd = [
        sys.executable,
        str(HERE / "bench_spread.py"),
        "--child",
        "--url",
        url,
        "--ranks",
        str(ranks),
        "--options",
        json.dumps(options) if options else "",
    ]
    r = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=900, cwd=src, check=False
    )
    if r.returncode != 0:
        raise RuntimeError(f"{src}: save failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _clear(url: str, options: dict | None) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    if fs.exists(root):
        fs.rm(root, recursive=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--baseline-rev",
        default="0913b56",
        help="git revision whose coordinator does the gathering",
    )
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--md-out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--options", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    reason = radosgw_unavailable()
    if reason is not None:
        raise SystemExit(f"radosgw: {reason}")
    seal_aws_env()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="hf_dcp_spread_") as tmp:
        base = Path(tmp, "baseline")
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(base), args.baseline_rev],
            cwd=ROOT,
            check=True,
        )
        server = start_radosgw(Path(tmp, "ceph"))
        try:
            import s3fs

            options = storage_options(server.endpoint, S3_BLOCK_SIZE)
            s3fs.S3FileSystem(**options).mkdir("bench-spread")
            trees = {"ranks (this tree)": ROOT, f"coordinator ({args.baseline_rev})": base}
            rows: dict[tuple[str, str], list[list[dict]]] = {}
            stores = (
                ("S3 (radosgw)", "s3://bench-spread/ckpt", options),
                ("file://, staged", Path(tmp, "ckpt").as_uri(), None),
            )
            for rep in range(args.repeats):
                for store, url, opts in stores:
                    for label, src in repeat_order(list(trees.items()), rep):
                        _clear(url, opts)
                        ranks = _measure(src, url, opts, args.ranks)
                        if not _verify(url, opts):
                            raise RuntimeError(
                                f"{label}, {store}: the checkpoint does not read back equal"
                            )
                        rows.setdefault((store, label), []).append(ranks)
                        print(
                            f"repeat {rep} {store} {label}: save "
                            f"{max(r['times']['save'] for r in ranks):.2f} s, finish "
                            f"{ranks[0]['times']['finish']:.2f} s",
                            flush=True,
                        )
        finally:
            server.stop()
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False
            )

    med = statistics.median
    lines = [
        (
            f"# bench_spread: {TENSORS} x {ROWS}x{COLS} bf16 ({TENSORS * ROWS * COLS * 2 >> 20} "
            f"MiB) row-sharded over {args.ranks} ranks, every run "
            f"{ROWS // args.ranks * COLS * 2 >> 10} KiB"
        ),
        "",
        (
            f"- tree {rev} against {args.baseline_rev}; {args.repeats} repeats, medians; 2-core "
            "VM shared by the ranks and the store; `max_shard_size=24MB`"
        ),
        (
            f"- command: `python -m benchmarks.bench_spread --baseline-rev {args.baseline_rev} "
            f"--ranks {args.ranks} --repeats {args.repeats}`"
        ),
        "",
        (
            "| store | who assembles | save s (slowest rank) | write_data s, per rank | finish s "
            "(coordinator) | bytes assembled per rank (this tree) |"
        ),
        "|---|---|---:|---|---:|---|",
    ]
    for (store, label), reps in rows.items():
        save = med(max(r["times"]["save"] for r in ranks) for ranks in reps)
        wd = [med(ranks[i]["times"]["write_data"] for ranks in reps) for i in range(args.ranks)]
        fin = med(ranks[0]["times"]["finish"] for ranks in reps)
        by = reps[-1][0].get("by_rank")
        by_s = (
            ", ".join(
                f"{int(v) / 2**20:.0f} MiB"
                for _, v in sorted(by.items(), key=lambda kv: int(kv[0]))
            )
            if by
            else "- (all by the coordinator)"
        )
        lines.append(
            f"| {store} | {label} | {save:.2f} | {', '.join(f'{x:.2f}' for x in wd)} | {fin:.2f} "
            f"| {by_s} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md_out:
        write_report(
            args.md_out,
            text
            + "\n```\n"
            + json.dumps({f"{k[0]} / {k[1]}": v for k, v in rows.items()})
            + "\n```\n",
        )


if __name__ == "__main__":
    main()
