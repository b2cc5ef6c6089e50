"""The commands of ``hf-dcp`` (``tools/cli.py`` parses their arguments): each calls the library
function that does the work and prints its result, as text or (``--json``) as JSON; each
returns the exit status.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .output import (
    EXIT_FAILED,
    EXIT_OK,
    fmt_count,
    fmt_size,
    fmt_steps,
    fmt_when,
    print_json,
    print_table,
    progress_for,
)

__all__ = [
    "run_consolidate",
    "run_convert",
    "run_inspect",
    "run_ls",
    "run_prune",
    "run_verify",
]


def run_inspect(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``hf-dcp inspect``: what a checkpoint holds."""
    from .inspection import inspect_checkpoint

    info = inspect_checkpoint(args.path, storage_options=options, thread_count=args.threads)
    if args.json:
        return print_json(info.to_dict())
    d = info.to_dict()
    totals = d["totals"]
    print(
        f"{d['url']}: {d['format']} checkpoint, "
        f"{'committed' if d['committed'] else 'NOT committed'}"
    )
    for note in d.get("notes", []):
        print(f"  note: {note}")
    print(
        f"  {fmt_count(len(d['files']), 'file')}, {fmt_count(totals['tensors'], 'tensor')}, "
        f"{totals['parameters']:,} parameters, {fmt_size(totals['bytes'])}"
    )
    if totals.get("bytes_per_dtype"):
        print(
            "  by dtype: "
            + ", ".join(f"{k} {fmt_size(v)}" for k, v in sorted(totals["bytes_per_dtype"].items()))
        )
    if d["files"]:
        print()
        print_table(
            ["FILE", "SIZE", "TENSORS"],
            [[f["name"], fmt_size(f["size"]), f["tensors"]] for f in d["files"]],
            right={1, 2},
        )
    if d["tensors"] and not args.summary:
        print()
        rows = [
            [
                t["key"],
                t["dtype"],
                str(list(t["shape"])),
                fmt_size(t["nbytes"]),
                t.get("file") or "-",
            ]
            for t in d["tensors"]
        ]
        print_table(["KEY", "DTYPE", "SHAPE", "SIZE", "FILE"], rows, right={3})
    return EXIT_OK


def run_verify(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``hf-dcp verify``: every defect; ``EXIT_FAILED`` when there is one."""
    from .verify import verify_checkpoint

    with progress_for() as progress:
        report = verify_checkpoint(
            args.path,
            storage_options=options,
            thread_count=args.threads,
            checksums=not args.no_checksums,
            progress=progress,
        )
    status = EXIT_OK if report.ok else EXIT_FAILED
    if args.json:
        print_json(report.to_dict())
        return status
    for p in report.problems:
        print(f"FAIL {p.message}")  # messages start with the file and name the key
    for note in report.notes:
        print(f"note: {note}")
    checked = (
        f"{fmt_count(report.files_checked, 'file')}, "
        f"{fmt_count(report.tensors_checked, 'tensor')}, {fmt_size(report.bytes_checked)} read"
    )
    checks = "structure and checksums" if report.checksums_checked else "structure only"
    verdict = "sound" if report.ok else f"NOT sound: {fmt_count(len(report.problems), 'problem')}"
    print(f"{report.url}: {verdict} ({checks}; {checked})")
    return status


def run_consolidate(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``hf-dcp consolidate``: finish an interrupted save (and ``--verify`` it)."""
    from .consolidate import consolidate_checkpoint

    with progress_for() as progress:
        report = consolidate_checkpoint(
            args.src,
            args.dst,
            storage_options=options,
            thread_count=args.threads,
            overwrite=args.overwrite,
            progress=progress,
        )
    result: dict[str, Any] = {"consolidate": report.to_dict()}
    status = EXIT_OK
    if args.verify:
        from .verify import verify_checkpoint

        with progress_for() as progress:
            checked = verify_checkpoint(
                report.url, storage_options=options, thread_count=args.threads, progress=progress
            )
        result["verify"] = checked.to_dict()
        status = EXIT_OK if checked.ok else EXIT_FAILED
    if args.json:
        print_json(result)
        return status
    if report.already_complete:
        print(
            f"{report.url}: already a complete checkpoint; nothing to consolidate (any leftover "
            "staging removed)"
        )
    else:
        print(
            f"consolidated {report.url}: {fmt_count(len(report.files), 'file')}, "
            f"{fmt_count(report.tensors, 'tensor')}, {fmt_size(report.tensor_bytes)} (the save "
            f"wrote {report.mode}; {fmt_size(report.moved_bytes)} moved by this process) in "
            f"{report.seconds:.1f} s"
        )
    if args.verify:
        checked_d = result["verify"]
        for p in checked_d["problems"]:
            print(f"FAIL {p['message']}")
        print(f"verify: {'sound' if status == EXIT_OK else 'NOT sound'}")
    return status


def run_convert(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``hf-dcp convert``: DCP to HF, or HF to DCP, as SRC's format says."""
    from . import convert

    mapping = convert.load_key_mapping(args.key_mapping) if args.key_mapping else None
    source = _source_format(args.src, options)
    with progress_for() as progress:
        if source == "dcp":
            report = convert.convert_dcp_to_hf(
                args.src,
                args.dst,
                storage_options=options,
                key_mapping=mapping,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                thread_count=args.threads,
                overwrite=args.overwrite,
                progress=progress,
            )
        else:
            report = convert.convert_hf_to_dcp(
                args.src,
                args.dst,
                storage_options=options,
                key_mapping=mapping,
                dtype=args.dtype,
                thread_count=args.threads,
                overwrite=args.overwrite,
                progress=progress,
            )
    target = "hf" if source == "dcp" else "dcp"
    if args.json:
        return print_json({"source_format": source, "target_format": target, **report.to_dict()})
    data_files = [
        f for f in report.files if f.endswith((".safetensors", ".distcp"))
    ]  # not the index / .metadata
    print(
        f"converted {args.src} ({source}) -> {args.dst} ({target}): "
        f"{fmt_count(report.tensors, 'tensor')}, {fmt_size(report.bytes)} in "
        f"{fmt_count(len(data_files), 'file')}, {report.seconds:.1f} s"
    )
    if report.skipped:
        print(
            f"skipped {len(report.skipped)} entries: "
            f"{', '.join(report.skipped[:20])}{' ...' if len(report.skipped) > 20 else ''}"
        )
    if report.unused_rules:
        print(
            f"warning: key-mapping rules that matched no key: {', '.join(report.unused_rules)}",
            file=sys.stderr,
        )
    return EXIT_OK


def run_ls(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``hf-dcp ls``: the step checkpoints of a run folder."""
    from ..steps.runs import list_steps

    steps = list_steps(args.run_dir, storage_options=options)
    if args.json:
        return print_json([s.to_dict() for s in steps])
    if not steps:
        print(f"{args.run_dir}: no step checkpoints")
        return EXIT_OK
    rows = [
        [
            s.step,
            "complete" if s.complete else "incomplete",
            fmt_size(s.size),
            s.files,
            fmt_when(s.modified),
            s.name,
        ]
        for s in steps
    ]
    print_table(["STEP", "STATUS", "SIZE", "FILES", "MODIFIED", "NAME"], rows, right={0, 2, 3})
    return EXIT_OK


def run_prune(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``hf-dcp prune``: retention on a run folder."""
    from ..steps.runs import prune_run

    result = prune_run(
        args.run_dir,
        keep_last_n=args.keep,
        keep_every=args.keep_every,
        dry_run=args.dry_run,
        include_unfinished=args.include_unfinished,
        storage_options=options,
    )
    if args.json:
        return print_json(result.to_dict())
    verb = "would remove" if result.dry_run else "removed"
    print(f"{verb}: {fmt_steps(result.removed)}")
    print(f"kept: {fmt_steps(result.kept)}")
    if result.in_progress:
        print(
            "left alone, may be a save in progress (--include-unfinished removes them): "
            f"{fmt_steps(result.in_progress)}"
        )
    return EXIT_OK


def _source_format(src: str, options: dict[str, Any]) -> str:
    """``dcp`` when SRC has DCP's ``.metadata``, else ``hf`` (convert checks the rest)."""
    from ..io import fsio
    from .dcp_format import DCP_METADATA

    fs, root = fsio.resolve(src, options)
    return "dcp" if fsio.exists(fs, fsio.join(root, DCP_METADATA)) else "hf"
