#!/usr/bin/env python
"""The full kill matrix: every moment of a save x whole job / one rank x every store, plus bare
saves.

    .venv/bin/python -m scripts.experiments.kill_matrix [--stores local,moto,radosgw,gcs,azure]
    [--md-out FILE]

For each store it runs ``tests/support/killchain.kill_chain`` twice (the whole job SIGKILLed at each
moment, then one rank alone at each moment; 2 gloo ranks on CPU) and ``bare_kill`` at every
moment a bare ``HFStorageWriter`` save has (killed, ``hf-dcp consolidate``, saved again). Every
check is the suite's (``tests/test_kill.py`` runs a subset); this prints one row per kill and a
summary table, in markdown. moto runs in this process on 127.0.0.1; radosgw is started by
``scripts/setup/radosgw.sh`` where Ceph is installed (``scripts/setup/install_radosgw.sh``), else
skipped; gcs and azure are fake-gcs-server and Azurite on 127.0.0.1
(``tests/support/objectservers.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.support.killchain import KillOutcome, bare_kill, kill_chain, moments_for
from tests.support.killpoints import BARE_MOMENTS, MOMENTS

_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    "AWS_CONFIG_FILE": "/nonexistent/aws_config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws_credentials",
}


@contextlib.contextmanager
def _store(name: str, scratch: str) -> Iterator[tuple[str, dict | None] | None]:
    """``(base URL, storage_options)`` of a fresh place on ``name``; ``None`` where it cannot
    run."""
    if name == "local":
        yield os.path.join(scratch, "local"), None
        return
    if name in ("gcs", "azure"):
        yield from _gcs_azure(name)
        return
    os.environ.update(_AWS)
    import s3fs

    if name == "moto":
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint, stop = f"http://{host}:{port}", server.stop
    else:
        from tests.support import radosgw

        reason = radosgw.radosgw_unavailable()
        if reason is not None:
            print(f"radosgw skipped: {reason}", file=sys.stderr)
            yield None
            return
        endpoint, stop = radosgw.start_radosgw()
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    bucket = f"kill-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
    try:
        yield f"s3://{bucket}", options
    finally:
        stop()


def _gcs_azure(name: str) -> Iterator[tuple[str, dict] | None]:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from tests.support import objectservers
    from tests.support.storage_options import azure_options, gcs_options

    reason = (
        objectservers.gcs_unavailable() if name == "gcs" else objectservers.azurite_unavailable()
    )
    if reason is not None:
        print(f"{name} skipped: {reason}", file=sys.stderr)
        yield None
        return
    endpoint, stop = (
        objectservers.start_fake_gcs() if name == "gcs" else objectservers.start_azurite()
    )
    options = gcs_options(endpoint) if name == "gcs" else azure_options(endpoint)
    place = f"kill-{uuid.uuid4().hex[:12]}"
    fs, _ = __import__("hf_dcp_storage.io.fsio", fromlist=["resolve"]).resolve(
        ("gs://" if name == "gcs" else "az://") + place, {**options, "skip_instance_cache": True}
    )
    fs.mkdir(place)
    try:
        yield ("gs://" if name == "gcs" else "az://") + place, options
    finally:
        stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default="local,moto,radosgw")
    parser.add_argument("--kinds", default="job,rank")
    parser.add_argument("--md-out", help="write the markdown here too")
    args = parser.parse_args()
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    rows: list[tuple[str, str, KillOutcome]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill_matrix_") as scratch:
        for store in args.stores.split(","):
            with _store(store, scratch) as place:
                if place is None:
                    continue
                base, options = place
                for kind in args.kinds.split(","):
                    work = os.path.join(scratch, f"{store}-{kind}")
                    os.makedirs(work)
                    url = f"{base}/run-{kind}"
                    for o in kill_chain(url, options, moments_for(url, MOMENTS), kind, work):
                        rows.append((store, "manager", o))
                        print(_row(store, "manager", o), flush=True)
                    for moment in moments_for(url, BARE_MOMENTS):
                        o = bare_kill(f"{base}/bare-{kind}-{moment}", options, moment, kind)
                        rows.append((store, "bare+consolidate", o))
                        print(_row(store, "bare+consolidate", o), flush=True)
    text = _markdown(rows, time.monotonic() - started)
    print(text)
    if args.md_out:
        Path(args.md_out).write_text(text)
    return 0 if all(o.survived for _, _, o in rows) else 1


def _row(store: str, what: str, o: KillOutcome) -> str:
    survivors = ", ".join(f"{s:.1f}" for s in o.survivor_seconds) or "-"
    return (
        f"| {store} | {what} | {o.kind} | {o.moment} | {'/'.join(o.ends)} | {survivors} | "
        f"{'yes' if o.survived else 'NO: ' + '; '.join(o.problems)} |"
    )


def _markdown(rows: list[tuple[str, str, KillOutcome]], seconds: float) -> str:
    lines = [
        (
            f"# Kill matrix, {time.strftime('%Y-%m-%d')}, {platform.machine()} "
            f"{os.cpu_count()}-core CPU VM"
        ),
        "",
        (
            f"`python -m scripts.experiments.kill_matrix`; 2 gloo ranks per job; {seconds:.0f} s "
            "in all. Every kill is checked as in"
        ),
        (
            "`tests/support/killchain.py`: older steps byte-identical and `latest()`, the killed "
            "step never listed"
        ),
        (
            "complete nor loaded, the next save sound with no staged object, record or open "
            "upload left."
        ),
        "",
        (
            "| store | save | killed | moment | ranks ended | survivors' seconds from the kill to "
            "their end | survived |"
        ),
        "|---|---|---|---|---|---:|---|",
        *(_row(*r) for r in rows),
        "",
        "| store | save | killed | kills tried | survived |",
        "|---|---|---|---:|---:|",
    ]
    groups: dict[tuple[str, str, str], list[KillOutcome]] = {}
    for store, what, o in rows:
        groups.setdefault((store, what, o.kind), []).append(o)
    for (store, what, kind), outs in groups.items():
        lines.append(
            f"| {store} | {what} | {kind} | {len(outs)} | {sum(o.survived for o in outs)} |"
        )
    lines.append(f"| **all** | | | **{len(rows)}** | **{sum(o.survived for _, _, o in rows)}** |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
