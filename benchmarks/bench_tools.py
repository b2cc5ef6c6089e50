"""Speed and memory of the ``hf-dcp`` tools on a llama-like checkpoint (local disk).

Each operation is the library call behind an ``hf-dcp`` command, made in a fresh process and
timed around the call; memory is how far the process's peak RSS grows past what the imports
(torch, DCP, the library) already took. The command line adds about 3 s of Python start and
imports, and about 270 MiB, to every command.

    python -m benchmarks.bench_tools --size-gb 1.0 --md-out benchmarks/results/tools-cpu-2core.md

Measured: ``inspect``; ``verify`` with a cold page cache (every tensor read and checksummed);
``consolidate`` of a save whose ``finish`` failed, staged path (all bytes merged) and direct
path (only the index missing); ``convert`` of PyTorch's own ``.distcp`` format to HF and back,
against the naive way (``dcp.load`` of the whole state dict, then an HF save), whose memory is
the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from benchmarks._harness import (
    DATA_ROOT,
    GiB,
    MiB,
    model_dims,
    model_spec,
    total_bytes,
    write_report,
)
from hf_dcp_storage import HFStorageWriter

__all__ = ["naive_convert"]


class _FinishFails(HFStorageWriter):
    """A save that dies between its last byte and its index: what ``consolidate`` finishes."""

    def finish(self, metadata, results) -> None:  # type: ignore[override]
        raise RuntimeError("coordinator lost (benchmark)")


def _state_dict(spec, fill: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if not fill:
        return {k: torch.zeros(shape, dtype=torch.bfloat16) for k, shape in spec}
    return {
        k: torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
        for k, shape in spec
    }


def _drop_cache(folder: Path) -> None:
    """Evict the folder's pages (fsync first, so every page is clean), so reads hit the disk."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_CHILD = """
import importlib, json, sys, time
module, name = sys.argv[1].split(":")
fn = getattr(importlib.import_module(module), name)
args, kwargs = json.loads(sys.argv[2])
import torch.distributed.checkpoint, hf_dcp_storage.writer  # the imports every command pays

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS: the imports' own peak is not ours
before = status_kib("VmRSS")
t = time.perf_counter(); fn(*args, **kwargs); dt = time.perf_counter() - t
print(dt, before / 1024, status_kib("VmHWM") / 1024)
"""


def _timed(fn: str, *args: str, **kwargs: object) -> tuple[float, float]:
    """``(seconds, peak RSS growth MiB)`` of ``module:function(*args, **kwargs)`` in a fresh process
    (``python -c``: it finds ``benchmarks`` as this one did, from the working directory or
    ``PYTHONPATH``)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, fn, json.dumps([args, kwargs])],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{fn}{args} failed:\n{proc.stderr[-3000:]}")
    seconds, before, after = map(float, proc.stdout.split()[-3:])
    return seconds, after - before


def naive_convert(src: str, dst: str) -> None:
    """What one would write without the tool: load the whole state dict, then save it as HF."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(src).read_metadata()
    sd = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in meta.state_dict_metadata.items()
    }
    dcp.load(sd, storage_reader=FileSystemReader(src))
    dcp.save(sd, storage_writer=HFStorageWriter(dst))


def _interrupted(folder: Path, spec, direct_write: bool | None) -> None:
    """A save of ``spec`` whose ``finish`` failed: bytes and records written, no index."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        dcp.save(
            _state_dict(spec, fill=False),
            storage_writer=_FinishFails(
                str(folder), max_shard_size="512MiB", direct_write=direct_write
            ),
        )
    except BaseException as exc:  # DCP's CheckpointException
        if "coordinator lost" not in str(exc):
            raise
    _drop_cache(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="state dict size in GiB (bf16)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs of each operation; medians reported"
    )
    ap.add_argument(
        "--data-root", default=str(DATA_ROOT), help="scratch folder (same disk as the checkout)"
    )
    ap.add_argument("--md-out", help="write the results table here (markdown)")
    args = ap.parse_args()

    spec = model_spec(model_dims(args.size_gb))
    nbytes = total_bytes(spec)
    Path(args.data_root).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench_tools_", dir=args.data_root))
    rows: list[tuple[str, float, float, str]] = []

    def measure(
        name: str,
        prepare: Callable[[], None],
        fn: str,
        *fargs: str,
        note: str = "",
        **kwargs: object,
    ) -> None:
        times, growth = [], []
        for _ in range(args.repeats):
            prepare()
            t, extra = _timed(fn, *fargs, **kwargs)
            times.append(t)
            growth.append(extra)
        rows.append((name, sorted(times)[len(times) // 2], max(growth), note))
        print(f"{name}: {rows[-1][1]:.2f} s, peak RSS +{rows[-1][2]:.0f} MiB", flush=True)

    try:
        ckpt, distcp = scratch / "hf", scratch / "distcp"
        sd = _state_dict(spec)
        dcp.save(sd, storage_writer=HFStorageWriter(str(ckpt), max_shard_size="512MiB"))
        dcp.save(sd, checkpoint_id=str(distcp))
        del sd
        opts = {"thread_count": args.threads}
        staged, direct = scratch / "staged", scratch / "direct"
        out_hf, out_dcp, out_naive = scratch / "conv_hf", scratch / "conv_dcp", scratch / "naive_hf"

        def fresh(folder: Path, cold: Path) -> Callable[[], None]:
            def prepare() -> None:
                shutil.rmtree(folder, ignore_errors=True)
                _drop_cache(cold)

            return prepare

        measure(
            "inspect",
            lambda: None,
            "hf_dcp_storage:inspect_checkpoint",
            str(ckpt),
            note="headers only",
            **opts,
        )
        measure(
            "verify (cold cache)",
            lambda: _drop_cache(ckpt),
            "hf_dcp_storage:verify_checkpoint",
            str(ckpt),
            note="reads and checksums every byte",
            **opts,
        )
        measure(
            "consolidate, staged save",
            lambda: _interrupted(staged, spec, False),
            "hf_dcp_storage:consolidate_checkpoint",
            str(staged),
            note="merges every byte",
            **opts,
        )
        measure(
            "consolidate, direct save",
            lambda: _interrupted(direct, spec, None),
            "hf_dcp_storage:consolidate_checkpoint",
            str(direct),
            note="writes the index only",
            **opts,
        )
        measure(
            "convert .distcp -> HF",
            fresh(out_hf, distcp),
            "hf_dcp_storage:convert_dcp_to_hf",
            str(distcp),
            str(out_hf),
            note="whole-tensor chunks (a one-process save)",
            **opts,
        )
        measure(
            "convert HF -> .distcp",
            fresh(out_dcp, ckpt),
            "hf_dcp_storage:convert_hf_to_dcp",
            str(ckpt),
            str(out_dcp),
            **opts,
        )
        measure(
            "naive .distcp -> HF (dcp.load all, HF save)",
            fresh(out_naive, distcp),
            "benchmarks.bench_tools:naive_convert",
            str(distcp),
            str(out_naive),
            note="holds the whole state dict",
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    largest = max(total_bytes([s]) for s in spec)
    lines = [
        (
            f"# hf-dcp tools, {nbytes / GiB:.2f} GiB llama-like bf16 checkpoint ({len(spec)} "
            f"tensors, largest {largest / MiB:.0f} MiB), local disk"
        ),
        "",
        (
            f"`python -m benchmarks.bench_tools --size-gb {args.size_gb} --threads {args.threads} "
            f"--repeats {args.repeats}`; {os.cpu_count()} CPUs. Each operation is the library "
            "call behind the `hf-dcp` command, in a fresh process, timed around the call (the "
            "command adds ~3 s of Python start and torch import, and ~270 MiB); median time, "
            f"largest peak-RSS growth over the imports, of {args.repeats} runs."
        ),
        "",
        "| operation | time | throughput | peak RSS over imports | note |",
        "|---|---:|---:|---:|---|",
    ]
    for name, t, extra, note in rows:
        # inspect reads headers only and a direct consolidate writes one index: no throughput.
        rate = (
            "-"
            if name.startswith("inspect") or "index only" in note
            else f"{nbytes / MiB / t:.0f} MiB/s"
        )
        lines.append(f"| {name} | {t:.2f} s | {rate} | {extra:.0f} MiB | {note} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md_out:
        write_report(args.md_out, text)


if __name__ == "__main__":
    main()
