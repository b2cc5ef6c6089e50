"""Ceph radosgw for the S3 tests: a throwaway one-node cluster on 127.0.0.1
(``scripts/setup/radosgw.sh``).

A real S3 implementation next to moto: one monitor, one OSD keeping its data in memory
(memstore) and radosgw, without authentication between them, every file under one state
folder. It takes a few seconds to start. The S3 user has access key ``testing`` and secret
``testing``, like the fake AWS environment of the moto tests, so the same ``storage_options``
work against both.

Pure standard library: the Ceph programs come from the distribution
(``scripts/setup/install_radosgw.sh`` installs them with apt-get when run as root); without them
:func:`radosgw_unavailable` says why, so the caller can skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "INSTALL_SCRIPT",
    "SCRIPT",
    "RadosgwError",
    "radosgw",
    "radosgw_unavailable",
    "start_radosgw",
]

_ROOT = Path(__file__).resolve().parents[2]
_SCRIPTS = _ROOT / "scripts" / "setup"
SCRIPT = _SCRIPTS / "radosgw.sh"
INSTALL_SCRIPT = _SCRIPTS / "install_radosgw.sh"

# What scripts/setup/radosgw.sh runs.
REQUIRED_PROGRAMS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool")

# Set to 0 / false / no / off to skip the radosgw tests even where Ceph is installed.
ENV_SWITCH = "HF_DCP_TEST_RADOSGW"


class RadosgwError(RuntimeError):
    """The cluster did not start; the message holds the script's reason and log tail."""


def radosgw_unavailable() -> str | None:
    """``None`` if radosgw can be started here, else a one-line reason (for ``pytest.skip``)."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return f"radosgw tests disabled by {ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    if not sys.platform.startswith("linux"):
        return f"radosgw tests need Linux (this is {sys.platform})"
    if shutil.which("bash") is None:
        return "radosgw tests need bash"
    if not SCRIPT.is_file():
        return f"{SCRIPT} is missing"
    missing = [p for p in REQUIRED_PROGRAMS if shutil.which(p) is None]
    if missing:
        return (
            f"Ceph radosgw is not installed (missing: {', '.join(missing)}); install it with "
            f"`sudo {INSTALL_SCRIPT.relative_to(_ROOT)}` (Debian/Ubuntu: apt-get install radosgw "
            "ceph-mon ceph-osd)"
        )
    return None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("CEPH_ARGS", "CEPH_CONF"):  # the developer's Ceph settings must not leak in
        env.pop(name, None)
    return env


def start_radosgw(
    state_dir: str | os.PathLike[str] | None = None, timeout: float = 120
) -> tuple[str, Callable[[], None]]:
    """Start a cluster; return ``(endpoint, stop)``, endpoint being ``http://127.0.0.1:<port>``.

    ``state_dir`` (created; must not hold a cluster already) receives the configuration, the
    monitor's store, logs and pid files; by default a fresh short folder under the temp dir
    (unix socket paths are limited to 107 bytes). ``stop()`` kills the daemons and removes the
    state; it is idempotent. A watchdog started by the script also stops the cluster when this
    process exits without calling ``stop()`` (killed, crashed).

    Raises :class:`RadosgwError` with the script's reason and log tail if it does not start
    within ``timeout`` seconds.
    """
    reason = radosgw_unavailable()
    if reason is not None:
        raise RadosgwError(reason)
    if state_dir is None:
        state_dir = tempfile.mkdtemp(prefix="hf-dcp-rgw-")
    state = os.fspath(state_dir)
    env = _env()
    env["RADOSGW_START_TIMEOUT"] = str(int(timeout))

    def stop() -> None:
        subprocess.run(
            ["bash", str(SCRIPT), "stop", state],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )

    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), "start", state, str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout + 30,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        stop()
        raise RadosgwError(f"{SCRIPT.name} start did not finish within {timeout + 30:.0f}s") from e
    lines = proc.stdout.strip().splitlines()
    endpoint = lines[-1].strip() if lines else ""
    if proc.returncode != 0 or not endpoint.startswith("http://127.0.0.1:"):
        stop()
        raise RadosgwError(
            f"{SCRIPT.name} start failed (exit "
            f"{proc.returncode}):\n{proc.stderr.strip()}\n{proc.stdout.strip()}".rstrip()
        )
    return endpoint, stop


@contextlib.contextmanager
def radosgw(state_dir: str | os.PathLike[str] | None = None, timeout: float = 120) -> Iterator[str]:
    """``with radosgw() as endpoint: ...``: :func:`start_radosgw`, stopped on exit."""
    endpoint, stop = start_radosgw(state_dir, timeout)
    try:
        yield endpoint
    finally:
        stop()
