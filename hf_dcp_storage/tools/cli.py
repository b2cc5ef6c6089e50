"""``hf-dcp``: the command line of a checkpoint owner (also ``python -m hf_dcp_storage``).

Every command works on a local path or any fsspec URL; ``--storage-option`` passes fsspec
options (credentials, endpoint). This module only parses arguments and prints: the work is done
by library functions (``inspection``, ``verify``, ``consolidate``, ``convert``, ``runs``) that
Python code can call the same way.

Exit status: 0 success (for ``verify``: the checkpoint is sound); 1 the command failed, or
``verify`` found problems; 2 a usage error. A failure prints one line on stderr, never a
traceback (``--debug`` adds it).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from .. import __version__
from .progress import NO_PROGRESS, Progress

__all__ = ["main", "parse_storage_options"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (the console script exits with it)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        options = parse_storage_options(args.storage_option)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return args.run(args, options)
    except KeyboardInterrupt:
        print("hf-dcp: interrupted", file=sys.stderr)
        return 130
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, SystemExit):
            raise
        if args.debug:
            traceback.print_exc()
        print(f"hf-dcp {args.command}: error: {_describe(exc)}", file=sys.stderr)
        return EXIT_FAILED


def parse_storage_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` (a string) and ``KEY:=JSON`` (a typed value) into fsspec storage options.

    Dotted keys nest: ``client_kwargs.endpoint_url=http://127.0.0.1:9000`` gives
    ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}``. Values stay strings unless
    given with ``:=``, so a numeric access key is never turned into a number.

    Raises:
        ValueError: an item without ``=``, an empty key, or ``:=`` with invalid JSON.
    """
    options: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.rstrip(":"):
            raise ValueError(f"--storage-option {item!r}: expected KEY=VALUE (a string) or KEY:=JSON (e.g. anon:=true)")
        parsed: Any = value
        if key.endswith(":"):
            key = key[:-1]
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--storage-option {item!r}: the value after ':=' must be JSON ({exc.msg})") from None
        *parents, leaf = key.split(".")
        node = options
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--storage-option {item!r}: {p!r} is already set to a value, it cannot also hold keys")
        node[leaf] = parsed
    return options


# -- commands ----------------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from .inspection import inspect_checkpoint

    info = inspect_checkpoint(args.path, storage_options=options, thread_count=args.threads)
    if args.json:
        return _print_json(info.to_dict())
    d = info.to_dict()
    totals = d["totals"]
    print(f"{d['url']}: {d['format']} checkpoint, {'committed' if d['committed'] else 'NOT committed'}")
    for note in d.get("notes", []):
        print(f"  note: {note}")
    print(f"  {_count(len(d['files']), 'file')}, {_count(totals['tensors'], 'tensor')}, {totals['parameters']:,} parameters, {_size(totals['bytes'])}")
    if totals.get("bytes_per_dtype"):
        print("  by dtype: " + ", ".join(f"{k} {_size(v)}" for k, v in sorted(totals["bytes_per_dtype"].items())))
    if d["files"]:
        print()
        _table(["FILE", "SIZE", "TENSORS"], [[f["name"], _size(f["size"]), f["tensors"]] for f in d["files"]], right={1, 2})
    if d["tensors"] and not args.summary:
        print()
        rows = [[t["key"], t["dtype"], str(list(t["shape"])), _size(t["nbytes"]), t.get("file") or "-"] for t in d["tensors"]]
        _table(["KEY", "DTYPE", "SHAPE", "SIZE", "FILE"], rows, right={3})
    return EXIT_OK


def _verify(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from .verify import verify_checkpoint

    with _progress(args) as progress:
        report = verify_checkpoint(args.path, storage_options=options, thread_count=args.threads, checksums=not args.no_checksums, progress=progress)
    status = EXIT_OK if report.ok else EXIT_FAILED
    if args.json:
        _print_json(report.to_dict())
        return status
    for p in report.problems:
        print(f"FAIL {p.message}")  # messages start with the file and name the key
    for note in report.notes:
        print(f"note: {note}")
    checked = f"{_count(report.files_checked, 'file')}, {_count(report.tensors_checked, 'tensor')}, {_size(report.bytes_checked)} read"
    checks = "structure and checksums" if report.checksums_checked else "structure only"
    verdict = "sound" if report.ok else f"NOT sound: {_count(len(report.problems), 'problem')}"
    print(f"{report.url}: {verdict} ({checks}; {checked})")
    return status


def _consolidate(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from .consolidate import consolidate_checkpoint

    with _progress(args) as progress:
        report = consolidate_checkpoint(args.src, args.dst, storage_options=options, thread_count=args.threads, overwrite=args.overwrite, progress=progress)
    result: dict[str, Any] = {"consolidate": report.to_dict()}
    status = EXIT_OK
    if args.verify:
        from .verify import verify_checkpoint

        with _progress(args) as progress:
            checked = verify_checkpoint(report.url, storage_options=options, thread_count=args.threads, progress=progress)
        result["verify"] = checked.to_dict()
        status = EXIT_OK if checked.ok else EXIT_FAILED
    if args.json:
        _print_json(result)
        return status
    if report.already_complete:
        print(f"{report.url}: already a complete checkpoint; nothing to consolidate (any leftover staging removed)")
    else:
        print(
            f"consolidated {report.url}: {_count(len(report.files), 'file')}, {_count(report.tensors, 'tensor')}, {_size(report.tensor_bytes)} "
            f"(the save wrote {report.mode}; {_size(report.moved_bytes)} moved by this process) in {report.seconds:.1f} s"
        )
    if args.verify:
        checked_d = result["verify"]
        for p in checked_d["problems"]:
            print(f"FAIL {p['message']}")
        print(f"verify: {'sound' if status == EXIT_OK else 'NOT sound'}")
    return status


def _convert(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from . import convert

    mapping = convert.load_key_mapping(args.key_mapping) if args.key_mapping else None
    source = _source_format(args.src, options)
    with _progress(args) as progress:
        if source == "dcp":
            report = convert.convert_dcp_to_hf(
                args.src, args.dst, storage_options=options, key_mapping=mapping, dtype=args.dtype,
                max_shard_size=args.max_shard_size, thread_count=args.threads, overwrite=args.overwrite, progress=progress,
            )
        else:
            report = convert.convert_hf_to_dcp(
                args.src, args.dst, storage_options=options, key_mapping=mapping, dtype=args.dtype,
                thread_count=args.threads, overwrite=args.overwrite, progress=progress,
            )
    target = "hf" if source == "dcp" else "dcp"
    if args.json:
        return _print_json({"source_format": source, "target_format": target, **report.to_dict()})
    data_files = [f for f in report.files if f.endswith((".safetensors", ".distcp"))]  # not the index / .metadata
    print(
        f"converted {args.src} ({source}) -> {args.dst} ({target}): {_count(report.tensors, 'tensor')}, {_size(report.bytes)} "
        f"in {_count(len(data_files), 'file')}, {report.seconds:.1f} s"
    )
    if report.skipped:
        print(f"skipped {len(report.skipped)} entries: {', '.join(report.skipped[:20])}{' ...' if len(report.skipped) > 20 else ''}")
    if report.unused_rules:
        print(f"warning: key-mapping rules that matched no key: {', '.join(report.unused_rules)}", file=sys.stderr)
    return EXIT_OK


def _ls(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from ..steps.runs import list_steps

    steps = list_steps(args.run_dir, storage_options=options)
    if args.json:
        return _print_json([s.to_dict() for s in steps])
    if not steps:
        print(f"{args.run_dir}: no step checkpoints")
        return EXIT_OK
    rows = [[s.step, "complete" if s.complete else "incomplete", _size(s.size), s.files, _when(s.modified), s.name] for s in steps]
    _table(["STEP", "STATUS", "SIZE", "FILES", "MODIFIED", "NAME"], rows, right={0, 2, 3})
    return EXIT_OK


def _prune(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from ..steps.runs import prune_run

    result = prune_run(
        args.run_dir, keep_last_n=args.keep, keep_every=args.keep_every, dry_run=args.dry_run,
        include_unfinished=args.include_unfinished, storage_options=options,
    )
    if args.json:
        return _print_json(result.to_dict())
    verb = "would remove" if result.dry_run else "removed"
    print(f"{verb}: {_steps(result.removed)}")
    print(f"kept: {_steps(result.kept)}")
    if result.in_progress:
        print(f"left alone, may be a save in progress (--include-unfinished removes them): {_steps(result.in_progress)}")
    return EXIT_OK


# -- argument parsing ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-option", "-o", action="append", metavar="KEY=VALUE",
        help="fsspec storage option, repeatable: KEY=VALUE for a string, KEY:=JSON for a typed value "
        "(anon:=true); dotted keys nest (client_kwargs.endpoint_url=http://127.0.0.1:9000)",
    )
    common.add_argument("--threads", type=_positive_int, default=8, metavar="N", help="I/O threads (default 8)")
    common.add_argument("--debug", action="store_true", help="show the traceback of a failure")

    parser = argparse.ArgumentParser(
        prog="hf-dcp",
        description="Inspect, verify, finish, convert and prune Hugging Face safetensors checkpoints written by "
        "torch.distributed.checkpoint, on local disk or any fsspec store (s3://, gs://, memory://, ...).",
    )
    parser.add_argument("--version", action="version", version=f"hf-dcp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace, dict[str, Any]], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(run=run)
        return p

    p = command("inspect", _inspect, "what a checkpoint holds: committed or not, files, keys with dtype/shape/size/file, totals")
    p.add_argument("path", help="checkpoint folder (HF safetensors, or PyTorch DCP .distcp)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--summary", action="store_true", help="files and totals only, no per-key table")

    p = command("verify", _verify, "check structure (headers, offsets, index, stray or missing files) and recorded checksums; exit 0 only when sound")
    p.add_argument("path", help="checkpoint folder")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-checksums", action="store_true", help="check the structure only; read no tensor data")

    p = command("consolidate", _consolidate, "finish a save that stopped before its index was written (coordinator killed, finish failed)")
    p.add_argument("src", help="folder of the interrupted save")
    p.add_argument("dst", nargs="?", help="write the checkpoint here instead of completing SRC in place")
    p.add_argument("--overwrite", action="store_true", help="replace a complete checkpoint at DST")
    p.add_argument("--verify", action="store_true", help="verify the result afterwards")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("convert", _convert, "PyTorch DCP (.distcp) to a consolidated HF checkpoint, or HF to DCP (the direction follows SRC's format)")
    p.add_argument("src", help="source checkpoint folder (.distcp + .metadata, or HF safetensors)")
    p.add_argument("dst", help="destination folder")
    p.add_argument("--key-mapping", metavar="FILE", help='JSON object: source key -> target key or null (drop); "{}" matches layer numbers')
    p.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16, fp32, ...")
    p.add_argument("--max-shard-size", default="5GB", help="most tensor bytes per output HF file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("ls", _ls, "step checkpoints of a run folder: complete or not, size, modification time")
    p.add_argument("run_dir", help="run folder holding step_N checkpoints")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("prune", _prune, "apply retention to a run folder, with CheckpointManager's rules")
    p.add_argument("run_dir", help="run folder holding step_N checkpoints")
    p.add_argument("--keep", type=_positive_int, required=True, metavar="N", help="keep the newest N complete steps")
    p.add_argument("--keep-every", type=_positive_int, metavar="K", help="also keep every complete step that is a multiple of K")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    p.add_argument(
        "--include-unfinished", action="store_true",
        help="also remove incomplete steps newer than the newest complete one (only when no job is saving to RUN_DIR)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


# -- output -------------------------------------------------------------------------------------------


class _Bar:
    """A tqdm bar on stderr per phase; ``advance`` may come from any I/O thread."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()

    def start(self, total_bytes: int, description: str) -> None:
        from tqdm import tqdm

        with self._lock:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(nbytes)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class _Quiet:
    def __enter__(self) -> Progress:
        return NO_PROGRESS

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(args: argparse.Namespace) -> _Bar | _Quiet:
    """A progress bar only where someone watches: stderr is a terminal."""
    return _Bar() if sys.stderr.isatty() else _Quiet()


def _source_format(src: str, options: dict[str, Any]) -> str:
    """``dcp`` when SRC has DCP's ``.metadata``, else ``hf`` (convert checks the rest)."""
    from ..io import fsio

    fs, root = fsio.resolve(src, options)
    return "dcp" if fsio.exists(fs, fsio.join(root, ".metadata")) else "hf"


def _describe(exc: BaseException) -> str:
    """One line for a failure: the root error's message (DCP wraps errors per rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            exc = inner
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (OSError, ValueError, LookupError, ImportError, TimeoutError, RuntimeError, TypeError)):
        return message
    return f"{type(exc).__name__}: {message} (unexpected: run again with --debug and report the traceback)"


def _print_json(obj: Any) -> int:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def _table(header: list[str], rows: list[list[Any]], right: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())


def _size(n: int) -> str:
    """Decimal units, as ``max_shard_size="5GB"`` counts them."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts is not None else "-"


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(f"step_{s}" for s in steps) if steps else "none"
