"""The trainer integrations' tests (``tests/integrations/``), run in the venv they need.

torchtitan 0.3.0 and Lightning come with another fsspec than the dev set's (torchtitan's
``datasets<4.8`` caps fsspec at 2026.2.0; the dev set's s3fs pins 2026.9.0), so they live in
``.venv-integrations`` (``scripts/setup/integrations_venv.sh``, which ``scripts/test.sh`` runs
first, pinned in ``requirements-integrations.txt``). This test runs those tests there, on this
checkout, in a process of their own, and passes only if every one of them ran and passed. Run
directly in that venv, ``tests/integrations/`` needs no help: the test then skips.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-integrations"
PYTHON = VENV / "bin" / "python"
TIMEOUT_S = 900


@pytest.mark.distributed
def test_the_trainer_integrations_pass_in_their_own_venv() -> None:
    if os.environ.get("HF_DCP_TEST_INTEGRATIONS") == "0":
        pytest.skip("HF_DCP_TEST_INTEGRATIONS=0: the trainer-integration tests are turned off")
    if not PYTHON.exists():
        pytest.skip(
            f"{VENV.name} is missing: run scripts/setup/integrations_venv.sh (scripts/test.sh "
            "does) to test the torchtitan and Lightning integrations"
        )
    if Path(sys.prefix).resolve() == VENV.resolve():
        pytest.skip(f"this interpreter is {VENV.name}'s: tests/integrations/ runs here directly")
    # This checkout's package first, whichever checkout the venv's editable install points at.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [str(PYTHON), "-m", "pytest", "tests/integrations", "-q", "-rs", "-p", "no:cacheprovider"]
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    out = done.stdout + done.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert done.returncode == 0, f"{' '.join(cmd)} failed (exit {done.returncode}):\n{out[-8000:]}"
    assert re.search(r"\b\d+ passed\b", summary) and not re.search(
        r"skipped|deselected|xfail", summary
    ), f"not every integration test ran: {summary}\n{out[-4000:]}"
