"""The GPU check script (``scripts/gpu_check.py``) stays runnable: its CPU smoke mode runs the
same steps (save with and without direct I/O, load, load into fp32, thread- and process-based
async saves compared byte for byte, the manager) on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dcp_storage.io.direct import open_direct

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _direct_io_works(folder: Path) -> bool:
    """Whether ``folder``'s filesystem takes ``O_DIRECT`` (tmpfs does not)."""
    probe = folder / "probe"
    probe.touch()
    fd = open_direct(str(probe), write=True)
    if fd is not None:
        os.close(fd)
    probe.unlink()
    return fd is not None


def test_gpu_check_script_runs_on_cpu(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--allow-cpu", "--ranks", "2", "--size-gb", "0.005",
            "--out", str(tmp_path / "out"), "--work", str(work),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("GPU CHECK OK")
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["failures"] == [] and report["env"]["ranks"] == 2
    side = report["ranks"][0]["results"]["cpu"]
    # What the script saved, checked here too: the direct, buffered, thread- and process-async
    # saves are the same files, byte for byte, and hold the state dict's bytes.
    sync = _files(work / "cpu_sync")
    assert "model.safetensors.index.json" in sync
    for other in ("cpu_buffered", "cpu_async", "cpu_process"):
        assert _files(work / other) == sync, f"{other} differs from cpu_sync"
    index = json.loads(sync["model.safetensors.index.json"])
    assert index["metadata"]["total_size"] == side["bytes"] > 0
    # The direct save went direct exactly where the filesystem takes O_DIRECT.
    assert (side["direct_io_mib"] > 0) == _direct_io_works(work), side["direct_io_mib"]
    assert "| cpu |" in (tmp_path / "out" / "gpu_check.md").read_text()
