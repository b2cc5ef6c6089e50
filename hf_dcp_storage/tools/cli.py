"""``hf-dcp``: the command line of a checkpoint owner (also ``python -m hf_dcp_storage``).

Every command works on a local path or any fsspec URL; ``--storage-option`` passes fsspec
options (credentials, endpoint). This module parses the arguments; each command
(``tools/commands.py``) only prints: the work is done by library functions (``inspection``,
``verify``, ``consolidate``, ``convert``, ``runs``) that Python code can call the same way.

Exit status: 0 success (for ``verify``: the checkpoint is sound); 1 the command failed, or
``verify`` found problems; 2 a usage error. A failure prints one line on stderr, never a
traceback (``--debug`` adds it).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .. import __version__
from . import commands
from .output import EXIT_FAILED

__all__ = ["main", "parse_storage_options"]


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
    except BaseException as exc:
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
            raise ValueError(
                f"--storage-option {item!r}: expected KEY=VALUE (a string) or KEY:=JSON (e.g. "
                "anon:=true)"
            )
        parsed: Any = value
        if key.endswith(":"):
            key = key[:-1]
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--storage-option {item!r}: the value after ':=' must be JSON ({exc.msg})"
                ) from None
        *parents, leaf = key.split(".")
        node = options
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(
                    f"--storage-option {item!r}: {p!r} is already set to a value, it cannot also "
                    "hold keys"
                )
        node[leaf] = parsed
    return options


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option, repeatable: KEY=VALUE for a string, KEY:=JSON for a typed "
        "value (anon:=true); dotted keys nest (client_kwargs.endpoint_url=http://127.0.0.1:9000)",
    )
    common.add_argument(
        "--threads", type=_positive_int, default=8, metavar="N", help="I/O threads (default 8)"
    )
    common.add_argument("--debug", action="store_true", help="show the traceback of a failure")

    parser = argparse.ArgumentParser(
        prog="hf-dcp",
        description="Inspect, verify, finish, convert and prune Hugging Face safetensors "
        "checkpoints written by torch.distributed.checkpoint, on local disk or any fsspec store "
        "(s3://, gs://, memory://, ...).",
    )
    parser.add_argument("--version", action="version", version=f"hf-dcp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, run: Callable[[argparse.Namespace, dict[str, Any]], int], summary: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=summary, description=summary)
        p.set_defaults(run=run)
        return p

    p = command(
        "inspect",
        commands.run_inspect,
        "what a checkpoint holds: committed or not, files, keys with dtype/shape/size/file, totals",
    )
    p.add_argument("path", help="checkpoint folder (HF safetensors, or PyTorch DCP .distcp)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--summary", action="store_true", help="files and totals only, no per-key table")

    p = command(
        "verify",
        commands.run_verify,
        "check structure (headers, offsets, index, stray or missing files) and recorded "
        "checksums; exit 0 only when sound",
    )
    p.add_argument("path", help="checkpoint folder")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--no-checksums", action="store_true", help="check the structure only; read no tensor data"
    )

    p = command(
        "consolidate",
        commands.run_consolidate,
        "finish a save that stopped before its index was written (coordinator killed, finish "
        "failed)",
    )
    p.add_argument("src", help="folder of the interrupted save")
    p.add_argument(
        "dst", nargs="?", help="write the checkpoint here instead of completing SRC in place"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a complete checkpoint at DST")
    p.add_argument("--verify", action="store_true", help="verify the result afterwards")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(
        "convert",
        commands.run_convert,
        "PyTorch DCP (.distcp) to a consolidated HF checkpoint, or HF to DCP (the direction "
        "follows SRC's format)",
    )
    p.add_argument("src", help="source checkpoint folder (.distcp + .metadata, or HF safetensors)")
    p.add_argument("dst", help="destination folder")
    p.add_argument(
        "--key-mapping",
        metavar="FILE",
        help='JSON object: source key -> target key or null (drop); "{}" matches layer numbers',
    )
    p.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16, fp32, ...")
    p.add_argument(
        "--max-shard-size", default="5GB", help="most tensor bytes per output HF file (default 5GB)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(
        "ls",
        commands.run_ls,
        "step checkpoints of a run folder: complete or not, size, modification time",
    )
    p.add_argument("run_dir", help="run folder holding step_N checkpoints")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(
        "prune",
        commands.run_prune,
        "apply retention to a run folder, with CheckpointManager's rules",
    )
    p.add_argument("run_dir", help="run folder holding step_N checkpoints")
    p.add_argument(
        "--keep",
        type=_positive_int,
        required=True,
        metavar="N",
        help="keep the newest N complete steps",
    )
    p.add_argument(
        "--keep-every",
        type=_positive_int,
        metavar="K",
        help="also keep every complete step that is a multiple of K",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="say what would be removed; remove nothing"
    )
    p.add_argument(
        "--include-unfinished",
        action="store_true",
        help="also remove incomplete steps newer than the newest complete one (only when no job is "
        "saving to RUN_DIR)",
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


def _describe(exc: BaseException) -> str:
    """One line for a failure: the root error's message (DCP wraps errors per rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = failures[min(failures)]  # the lowest rank's
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            exc = inner
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(
        exc, (OSError, ValueError, LookupError, ImportError, TimeoutError, RuntimeError, TypeError)
    ):
        return message
    return (
        f"{type(exc).__name__}: {message} (unexpected: run again with --debug and report the "
        "traceback)"
    )
