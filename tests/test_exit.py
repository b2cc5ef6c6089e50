"""A job's ranks exit cleanly and the same way every time: nothing of the library is alive when
the interpreter finalizes, and the last async save is committed, not cut off.

Real processes (``tests/support/exit_script.py``), started with ``subprocess`` so that Python's own
exit runs (multiprocessing's children leave through ``os._exit``, skipping it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dcp_storage import list_steps

pytestmark = pytest.mark.distributed

_SCRIPT = Path(__file__).parent / "support" / "exit_script.py"


def _run_job(tmp_path: Path, mode: str) -> list[subprocess.CompletedProcess]:
    rendezvous, run = tmp_path / "rendezvous", tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(_SCRIPT), str(r), "2", str(rendezvous), str(run), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("mode", ["sync", "async-open"])
def test_ranks_exit_with_nothing_of_ours_alive_and_the_last_step_committed(
    tmp_path: Path, mode: str
) -> None:
    for rank, done in enumerate(_run_job(tmp_path, mode)):
        story = (
            f"rank {rank} ({mode}): exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
        )
        assert done.returncode == 0, story
        assert "terminate called" not in done.stderr and "Aborted" not in done.stderr, story
        assert "MAIN DONE" in done.stdout, story
        assert "ALIVE AT EXIT: []" in done.stdout, story
    assert [s.step for s in list_steps(str(tmp_path / "run")) if s.complete] == [1, 2]
