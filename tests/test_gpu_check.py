"""The GPU check script (``scripts/gpu_check.py``) stays runnable: its CPU smoke mode runs the
same steps (save with and without direct I/O, load, load into fp32, thread- and process-based
async saves compared byte for byte, the manager) on 2 gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_gpu_check_script_runs_on_cpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--allow-cpu", "--ranks", "2", "--size-gb", "0.005", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("GPU CHECK OK")
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["failures"] == [] and report["env"]["ranks"] == 2
    side = report["ranks"][0]["results"]["cpu"]
    assert side["bytes"] > 0 and side["async_blocked_s"] <= side["async_total_s"]
    assert side["process_blocked_s"] <= side["process_total_s"]  # DCP's process-based async save ran
    assert side["direct_io_mib"] >= 0 and side["save_buffered_s"] > 0
    assert "| cpu |" in (tmp_path / "out" / "gpu_check.md").read_text()
