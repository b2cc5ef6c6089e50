"""Soak: dozens of saves and loads to S3 (moto) through the fault proxy, with seeded faults.

    .venv/bin/python -m scripts.experiments.soak_s3 --saves 60 --seed 1 --ranks 2 --md-out
    benchmarks/results/X.md

Starts a moto server on 127.0.0.1 (port 0) in this process, then runs ``tests/support/soak.py``'s
``soak``: ``--saves`` single-process saves and ``--multi-rank-saves`` saves on ``--ranks`` gloo
ranks, every one under a random, bounded fault schedule (some fatal), each completed save
loaded through faults and straight from moto, each failed one checked for an index and open
uploads, then saved again. Prints a markdown table of the figures and every problem found;
exits 1 if there was any. The suite runs a short version (``tests/test_soak.py``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shlex
import sys
from pathlib import Path


def _machine() -> str:
    mem = ""
    try:
        kb = int(
            next(
                line
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            ).split()[1]
        )
        mem = f", {kb / 2**20:.1f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}){mem}"


def _versions() -> str:
    import moto
    import s3fs
    import torch

    import hf_dcp_storage

    return (
        f"python {platform.python_version()}, torch {torch.__version__}, s3fs {s3fs.__version__}, "
        f"moto {moto.__version__}, hf_dcp_storage {hf_dcp_storage.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=60, help="single-process saves (default 60)")
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of the state dicts and fault schedules (default 1)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="world size of the multi-rank saves (default 2; 1: none)",
    )
    parser.add_argument(
        "--multi-rank-saves",
        type=int,
        default=12,
        help="saves on --ranks ranks, one run_ranks job (default 12)",
    )
    parser.add_argument(
        "--fatal-rate",
        type=float,
        default=0.17,
        help="share of saves given a fault that outlasts the retries",
    )
    parser.add_argument(
        "--no-bucket-faults",
        action="store_true",
        help="no faults on a bucket's own requests (listings, DeleteObjects), as in the suite",
    )
    parser.add_argument(
        "--md-out", type=Path, help="also write the header and table to this markdown file"
    )
    parser.add_argument("--quiet", action="store_true", help="no line per save")
    args = parser.parse_args(argv)
    if args.saves < 0 or args.multi_rank_saves < 0 or args.ranks < 1:
        parser.error("--saves and --multi-rank-saves must be >= 0, --ranks >= 1")

    from moto.server import ThreadedMotoServer

    from tests.support import soak
    from tests.support.storage_options import (
        FAKE_AWS_ENV,
        UNSET_AWS_ENV,
    )  # the suite's sealed, fake AWS environment

    os.environ.update(FAKE_AWS_ENV)  # inherited by the spawned ranks
    for name in UNSET_AWS_ENV:
        os.environ.pop(name, None)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request at INFO
    multi = args.multi_rank_saves if args.ranks > 1 else 0
    command = "python -m scripts.experiments.soak_s3 " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    started = datetime.datetime.now().isoformat(timespec="seconds")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        report = soak.soak(
            f"http://{host}:{port}",
            args.saves,
            args.seed,
            multi_rank_saves=multi,
            world=args.ranks,
            fatal_rate=args.fatal_rate,
            bucket_faults=not args.no_bucket_faults,
            log=None if args.quiet else print,
        )
    finally:
        server.stop()
    header = "\n".join(
        [
            f"# soak_s3: {args.saves} + {multi} saves through the fault proxy, moto S3 on loopback",
            "",
            f"- date {started}; machine: {_machine()}; {_versions()}",
            f"- command: `{command}`; seed {args.seed}",
            (
                f"- retry policy {soak.POLICY}; bounded schedules: at most {soak.BOUNDED_FIRES} "
                f"failing fires per save or load; fatal share {args.fatal_rate}; bucket requests "
                f"faulted: {not args.no_bucket_faults}"
            ),
            "",
        ]
    )
    text = header + "\n" + report.markdown()
    print(text)
    if args.md_out is not None:
        args.md_out.write_text(text)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
