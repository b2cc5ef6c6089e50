"""Proof of exact resume: a crashed FSDP2 run, restarted from its last complete step, ends
bitwise where an uninterrupted run ends; and a 2-rank checkpoint continues on 1 and 4 ranks.

The training run (``tests/support/training.py``): a tiny MLP under FSDP2 with dropout, AdamW, a
LambdaLR warmup/decay schedule, a shuffling DataLoader + DistributedSampler whose position is
checkpointed, and per-step draws from the torch, NumPy and Python RNGs, 12 steps over an epoch
boundary. What is exact and what is a tolerance:

* same world size (2 ranks, per-rank RNG seeds that differ): losses and final parameters are
  compared with ``==`` / ``torch.equal``: bitwise;
* another world size (1 and 4 ranks): the run is built to be world-size independent except for
  float summation order (see ``tests/support/training.py``), so losses and parameters are compared
  with ``rtol=1e-5`` (parameters also ``atol=1e-6``); measured differences are ~1e-7.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hf_dcp_storage import CheckpointManager
from tests.support.data import read_checkpoint
from tests.support.dist import run_ranks
from tests.support.training import TOTAL, train

pytestmark = pytest.mark.distributed

SAVE_EVERY = 3
CRASH_STEP = 9  # rank 1 dies in the middle of saving this step
RESUME_STEP = 6  # the last complete step before the crash
OTHER_WORLD_RESUME = 6  # the global-mode reference saves this step for the other-world-size runs


def _result(out: Path) -> tuple[dict, dict[int, float], dict[str, torch.Tensor]]:
    result = json.loads((out / "result.json").read_text())
    losses = {int(k): v for k, v in result["losses"].items()}
    return result, losses, torch.load(out / "params.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two uninterrupted 2-rank runs in one spawn: ``local`` (no checkpoints at all) and
    ``global`` (saves step 6 into ``global_run``, the source of the other-world-size resumes)."""
    tmp = tmp_path_factory.mktemp("reference")
    configs = [
        {"mode": "local", "out": str(tmp / "local"), "steps": TOTAL},
        {
            "mode": "global",
            "out": str(tmp / "global"),
            "steps": TOTAL,
            "root": str(tmp / "global_run"),
            "save_at": [OTHER_WORLD_RESUME],
        },
    ]
    run_ranks(train, 2, configs)
    return {"local": tmp / "local", "global": tmp / "global", "global_run": tmp / "global_run"}


def test_crash_mid_save_then_restart_continues_bitwise(
    reference: dict[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "run"
    _, ref_losses, ref_params = _result(reference["local"])
    assert sorted(ref_losses) == list(range(1, TOTAL + 1))

    # Run B: the same run, saving every 3 steps (keep_last_n=2); rank 1 dies (os._exit) inside
    # the save of step 9, after writing its bytes of the model file, before the commit marker.
    crashed = {
        "mode": "local",
        "out": str(tmp_path / "crashed"),
        "steps": TOTAL,
        "root": str(root),
        "save_every": SAVE_EVERY,
        "crash_at": CRASH_STEP,
        "crash_rank": 1,
    }
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)) as failure:
        run_ranks(train, 2, [crashed])
    if isinstance(
        failure.value, mp.ProcessExitedException
    ):  # else rank 0 saw its peer vanish first
        assert (failure.value.error_index, failure.value.exit_code) == (1, 1), failure.value
    # On disk: steps 3 and 6 complete; step 9 a partial folder (model file, rank JSONs) without
    # the model index or the commit marker.
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_6", "step_9"]
    for step in (3, 6):
        assert (root / f"step_{step}" / "COMMITTED").is_file()
    partial = sorted(p.name for p in (root / "step_9").iterdir())
    assert "COMMITTED" not in partial and "model.safetensors.index.json" not in partial
    assert "model-00001-of-00001.safetensors" in partial, partial
    assert CheckpointManager(str(root), keep_last_n=2).latest() == RESUME_STEP

    # Restart (fresh processes): resume from latest(), prune the partial step, go on to step 12,
    # saving every 3 steps again, asynchronously this time.
    restarted = {
        "mode": "local",
        "out": str(tmp_path / "restarted"),
        "steps": TOTAL,
        "root": str(root),
        "save_every": SAVE_EVERY,
        "resume": True,
        "async_save": True,
    }
    run_ranks(train, 2, [restarted])
    result, losses, params = _result(tmp_path / "restarted")
    assert result["latest"] == RESUME_STEP
    assert sorted(result["before_prune"]) == ["step_3", "step_6", "step_9"]
    assert result["pruned"] == [CRASH_STEP]  # the partial step goes at the first prune...
    assert sorted(result["after_prune"]) == ["step_3", "step_6"]  # ...and nothing else
    assert result["sched_after_load"] == RESUME_STEP  # LambdaLR's position came back

    # The proof: the resumed steps are bitwise those of the uninterrupted run, and so are the
    # final parameters.
    assert sorted(losses) == list(range(RESUME_STEP + 1, TOTAL + 1))
    assert losses == {s: ref_losses[s] for s in losses}
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        assert torch.equal(params[k], v), k

    # Retention: saves at 9 and 12 with keep_last_n=2 leave exactly those two.
    assert result["final_checkpoints"] == [9, 12]
    assert sorted(p.name for p in root.iterdir()) == ["step_12", "step_9"]
    assert all((root / f"step_{s}" / "COMMITTED").is_file() for s in (9, 12))
    # The consolidated weights of the last (async) step are the final parameters, readable
    # without DCP.
    on_disk, _ = read_checkpoint(root / "step_12")
    assert on_disk.keys() == ref_params.keys()
    for k, v in ref_params.items():
        assert torch.equal(on_disk[k], v), k


@pytest.mark.parametrize("world", [1, 4])
def test_two_rank_checkpoint_continues_on_another_world_size(
    reference: dict[str, Path], tmp_path: Path, world: int
) -> None:
    # Equal within float tolerance only: summation order depends on the world size.
    _, ref_losses, ref_params = _result(reference["global"])
    root = reference["global_run"]
    assert CheckpointManager(str(root)).all_checkpoints() == [OTHER_WORLD_RESUME]
    cfg = {
        "mode": "global",
        "out": str(tmp_path / f"world{world}"),
        "steps": TOTAL,
        "root": str(root),
        "resume": True,
    }
    run_ranks(train, world, [cfg])
    result, losses, params = _result(tmp_path / f"world{world}")
    assert result["latest"] == OTHER_WORLD_RESUME and result["pruned"] == []
    assert sorted(losses) == list(range(OTHER_WORLD_RESUME + 1, TOTAL + 1))
    for s, loss in losses.items():
        assert math.isclose(loss, ref_losses[s], rel_tol=1e-5), (s, loss, ref_losses[s])
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=k)
