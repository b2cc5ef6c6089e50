"""``CheckpointManager``: step folders, commit marker, retention, training state and RNG, resume."""

from __future__ import annotations

import math
import random

import fsspec
import numpy as np
import pytest
import torch

from hf_dcp_storage import CheckpointManager
from hf_dcp_storage.steps.retention import RetentionPolicy, parse_step, step_name, to_remove
from tests.support.data import assert_same, read_checkpoint

# -- pure rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,step",
    [
        ("step_0", 0),
        ("step_7", 7),
        ("step_1000", 1000),
        ("step_01", None),
        ("step_-1", None),
        ("step_5.tmp", None),
        ("Step_5", None),
        ("step_", None),
        ("xstep_5", None),
    ],
)
def test_step_names_are_parsed_strictly(name: str, step: int | None) -> None:
    assert parse_step(name) == step


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_bad_steps_are_refused(bad) -> None:
    with pytest.raises(ValueError, match=r"must be an int >= 0"):
        step_name(bad)


def test_retention_keeps_newest_multiples_and_in_flight() -> None:
    steps = {0: True, 100: True, 200: False, 300: True, 400: True, 500: True, 600: False}
    assert to_remove(steps, RetentionPolicy(2)) == [0, 100, 200, 300, 600]
    assert to_remove(steps, RetentionPolicy(2, keep_every=300)) == [
        100,
        200,
        600,
    ]  # 0 and 300 kept forever
    assert to_remove(steps, RetentionPolicy(2), in_flight=[600]) == [0, 100, 200, 300]
    with pytest.raises(ValueError, match=r"keep_last_n=0 must be an int >= 1"):
        RetentionPolicy(0)


# -- one process ---------------------------------------------------------------------------------


class _Counter:
    """A ``Stateful`` with a tensor, a tuple, int keys, a non-finite float and bytes (a pickle a
    dataloader made of itself, as torchtitan's does)."""

    def __init__(self) -> None:
        self.seen = 0
        self.weights = torch.zeros(3)
        self.extra = {
            "best": math.inf,
            "ids": (1, 2),
            7: "seven",
            "loader": b"\x80\x05\x95\x00 not utf-8 \xff",
        }

    def state_dict(self) -> dict:
        return {"seen": self.seen, "weights": self.weights, "extra": self.extra}

    def load_state_dict(self, sd: dict) -> None:
        self.seen, self.weights, self.extra = sd["seen"], sd["weights"], sd["extra"]


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
    }


def test_save_load_latest_retention_and_exact_rng(url: str) -> None:
    mgr = CheckpointManager(url, keep_last_n=2)
    assert mgr.latest() is None and mgr.all_checkpoints() == []
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    counter = _Counter()
    for step in (10, 20, 30):
        counter.seen = step
        counter.weights = torch.full((3,), float(step))
        mgr.save(
            step, _model(step), {"optim": opt, "counter": counter, "epoch": step // 10, "note": "x"}
        )
    assert mgr.all_checkpoints() == [20, 30]  # keep_last_n=2: step 10 pruned
    assert mgr.latest() == 30
    # The step folder is a plain HF checkpoint; the training state sits inside it.
    fs, root = fsspec.core.url_to_fs(url)
    names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(f"{root}/step_30", detail=False))
    assert names == [
        "COMMITTED",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "training_state",
    ]

    # Draws after the save must be replayed after the load.
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    mgr.save(40, _model(40), {"counter": counter})
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    new_model = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    new_counter = _Counter()
    state = {"counter": new_counter}
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert mgr.load(new_model, state) == 40
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected_draws
    for k, v in _model(40).items():
        assert_same(new_model[k], v, k)
    assert new_counter.seen == 30 and torch.equal(new_counter.weights, torch.full((3,), 30.0))
    assert new_counter.extra == {
        "best": math.inf,
        "ids": (1, 2),
        7: "seven",
        "loader": b"\x80\x05\x95\x00 not utf-8 \xff",
    }

    # An older step with the optimizer, into a fresh optimizer (state not created yet).
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    plain = {"optim": opt2, "epoch": None, "note": None}
    assert mgr.load({k: torch.zeros_like(v) for k, v in _model(0).items()}, plain, step=30) == 30
    assert plain["epoch"] == 3 and plain["note"] == "x"
    ref = opt.state_dict()
    got = opt2.state_dict()
    assert (
        got["param_groups"][0]["lr"] == 0.1
        and got["param_groups"][0]["betas"] == ref["param_groups"][0]["betas"]
    )
    for pid, st in ref["state"].items():
        for name, t in st.items():
            assert torch.equal(got["state"][pid][name], t), (pid, name)


def test_weights_load_with_plain_hf_tools(tmp_path) -> None:
    mgr = CheckpointManager(str(tmp_path / "run"))
    mgr.save(5, _model(5), {"opt": {"lr": 0.1}})
    tensors, _index = read_checkpoint(tmp_path / "run" / "step_5")
    assert set(tensors) == set(_model(5))  # no training state in the model files


def test_incomplete_steps_are_invisible_and_pruned_and_other_folders_untouched(tmp_path) -> None:
    root = tmp_path / "run"
    mgr = CheckpointManager(str(root), keep_last_n=1)
    mgr.save(1, _model(1))
    # A crashed save: a folder with files but no marker; and folders that are not steps.
    (root / "step_2" / "training_state").mkdir(parents=True)
    (root / "step_2" / "model.safetensors.index.json").write_text("{}")
    (root / "step_02").mkdir()
    (root / "logs").mkdir()
    (root / "notes.txt").write_text("keep me")
    assert mgr.latest() == 1
    with pytest.raises(
        FileNotFoundError, match=r"step 2 is not a complete checkpoint here; complete steps: \[1\]"
    ):
        mgr.load(_model(0), step=2)
    mgr.save(3, _model(3))
    assert sorted(p.name for p in root.iterdir()) == ["logs", "notes.txt", "step_02", "step_3"]


def test_refusals_come_before_anything_is_written(tmp_path) -> None:
    root = tmp_path / "run"
    mgr = CheckpointManager(str(root))
    mgr.save(1, _model(1))
    before = sorted(str(p) for p in root.rglob("*"))
    with pytest.raises(
        TypeError,
        match=r"training state 'sched.fn' is a function, which is saved neither as a tensor nor as "
        r"JSON",
    ):
        mgr.save(2, _model(2), {"sched": {"fn": lambda: 0}})
    with pytest.raises(
        FileExistsError,
        match=r"step_1 is already a complete checkpoint; pass CheckpointManager\(..., "
        r"overwrite=True\)",
    ):
        mgr.save(1, _model(9))
    assert sorted(str(p) for p in root.rglob("*")) == before
    with pytest.raises(FileNotFoundError, match=r"no complete step checkpoint to load"):
        CheckpointManager(str(tmp_path / "empty")).load(_model(0))
    with pytest.raises(KeyError, match=r"training state \['missing'\] is not in the checkpoint"):
        mgr.load(_model(0), {"missing": 1})
    CheckpointManager(str(root), overwrite=True).save(1, _model(9))
    out = _model(0)
    mgr.load(out)
    assert_same(out["model.norm.weight"], _model(9)["model.norm.weight"], "overwritten")


def test_async_save_commits_after_the_write_and_snapshots_the_tensors(tmp_path) -> None:
    mgr = CheckpointManager(str(tmp_path / "run"), keep_last_n=1)
    sd = _model(1)
    counter = _Counter()
    counter.weights = torch.ones(3)
    fut = mgr.save(1, sd, {"counter": counter}, async_save=True)
    for t in sd.values():
        t.add_(100)  # training goes on: must not leak into the checkpoint
    counter.weights.add_(100)
    assert fut.result(timeout=60) == 1
    assert mgr.latest() == 1
    out, state = _model(0), {"counter": _Counter()}
    mgr.load(out, state)
    for k, v in _model(1).items():
        assert_same(out[k], v, k)
    assert torch.equal(state["counter"].weights, torch.ones(3))
    # A second async save prunes the first only after its own commit.
    mgr.save(2, _model(2), async_save=True)
    mgr.wait()
    assert mgr.all_checkpoints() == [2]


def test_reused_staging_copy_keeps_each_step_its_own_values(tmp_path) -> None:
    """With ``reuse_staging`` every async save refills the one host copy made at the first: each
    step still holds the values it had when saved (the next save waits for the previous one
    before refilling), and ``close`` frees the copy without ending the manager."""
    sd = _model(1)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(str(tmp_path / "run"), keep_last_n=5, reuse_staging=True) as mgr:
        stagers = None
        for step in (1, 2, 3):
            expected[step] = {k: v.clone() for k, v in sd.items()}
            mgr.save(step, sd, async_save=True)
            stagers = stagers or mgr._background._stagers
            assert stagers is not None and mgr._background._stagers is stagers  # one copy, refilled
            for t in sd.values():
                t.add_(100)  # training right after the call: must not leak into this step
            for k, t in sd.items():
                t.copy_(expected[step][k] + 1)  # the next step's values
        mgr.wait()
        for step in (1, 2, 3):
            out = _model(0)
            mgr.load(out, step=step)
            for k, v in expected[step].items():
                assert_same(out[k], v, f"step {step}: {k}")
        mgr.close()
        assert mgr._background._stagers is None
        mgr.save(4, _model(4), async_save=True)  # a fresh copy after close
    assert mgr._background._stagers is None  # the with block closed it again
    out = _model(0)
    assert CheckpointManager(str(tmp_path / "run")).load(out) == 4
    assert_same(out["model.norm.weight"], _model(4)["model.norm.weight"], "step 4")


# -- two ranks, FSDP2 ------------------------------------------------------------------------------


def _fsdp_run(rank: int, world: int, root: str) -> None:
    """Train a tiny FSDP2 model 3 steps, save steps 1..3 (keep 2), then load step 3 into a fresh
    model and optimizer: parameters, optimizer state and each rank's RNG continue exactly."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.fsdp import fully_shard

    class OptimState(Stateful):
        def __init__(self, model, opt) -> None:
            self.model, self.opt = model, opt

        def state_dict(self):
            return get_optimizer_state_dict(self.model, self.opt)

        def load_state_dict(self, sd) -> None:
            set_optimizer_state_dict(self.model, self.opt, sd)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = build()
    mgr = CheckpointManager(root, keep_last_n=2)
    torch.manual_seed(100 + rank)  # ranks draw different data
    for step in (1, 2, 3):
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(
            step,
            get_model_state_dict(model),
            {"optim": OptimState(model, opt), "progress": {"step": step}},
        )
    assert mgr.all_checkpoints() == [2, 3]
    expected_draw = torch.rand(3)
    expected_params = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    expected_optim = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in _flat(get_optimizer_state_dict(model, opt)).items()
    }

    model2, opt2 = build()
    torch.manual_seed(999)
    state = {"optim": OptimState(model2, opt2), "progress": None}
    model_sd = get_model_state_dict(model2)
    assert mgr.load(model_sd, state) == 3
    assert state["progress"] == {"step": 3}
    assert torch.equal(torch.rand(3), expected_draw), f"rank {rank}: RNG not restored"
    for k, v in get_model_state_dict(model2).items():
        assert torch.equal(v.full_tensor(), expected_params[k]), k
    got_optim = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in _flat(get_optimizer_state_dict(model2, opt2)).items()
    }
    assert got_optim.keys() == expected_optim.keys()
    for k, v in expected_optim.items():
        assert torch.equal(got_optim[k], v) if isinstance(v, torch.Tensor) else got_optim[k] == v, k
    dist.barrier()


def _flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, list):
            out.update(_flat(dict(enumerate(v)), key + "."))
        else:
            out[key] = v
    return out


@pytest.mark.distributed
def test_two_fsdp_ranks_resume_exactly_and_one_process_reads_the_weights(tmp_path) -> None:
    from tests.support.dist import run_ranks

    root = str(tmp_path / "run")
    run_ranks(_fsdp_run, 2, root)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_2", "step_3"]
    assert sorted(
        p.name
        for p in (tmp_path / "run" / "step_3" / "training_state").iterdir()
        if p.name.startswith("rank_")
    ) == ["rank_00000.json", "rank_00001.json"]
    # Another world size (one process): the weights and the plain values come back.
    mgr = CheckpointManager(root)
    weights = {
        k: torch.zeros(v.shape, dtype=v.dtype)
        for k, v in read_checkpoint(tmp_path / "run" / "step_3")[0].items()
    }
    state = {"progress": None}
    assert mgr.load(weights, state) == 3
    assert state == {"progress": {"step": 3}}
    on_disk, _ = read_checkpoint(tmp_path / "run" / "step_3")
    for k, v in on_disk.items():
        assert_same(weights[k], v, k)


def test_on_s3_steps_commit_prune_and_resume(s3) -> None:
    bucket, options = s3
    mgr = CheckpointManager(f"{bucket}/run1", keep_last_n=1, storage_options=options)
    counter = _Counter()
    for step in (1, 2):
        counter.seen = step
        mgr.save(step, _model(step), {"counter": counter})
    fs = fsspec.filesystem("s3", **options)
    root = f"{bucket.removeprefix('s3://')}/run1"
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] == ["step_2"]
    assert mgr.all_checkpoints() == [2]
    out, state = _model(0), {"counter": _Counter()}
    assert mgr.load(out, state) == 2
    assert state["counter"].seen == 2
    for k, v in _model(2).items():
        assert_same(out[k], v, k)


def _disagreeing_ranks(rank: int, world: int, root: str) -> None:
    """Every rank raises, none is left waiting in a collective: steps differ, then a value only
    rank 1 holds cannot be saved."""
    mgr = CheckpointManager(root)
    with pytest.raises(
        ValueError, match=r"ranks save different steps \[1, 2\]; all ranks must save the same step"
    ):
        mgr.save(1 + rank, _model(1))
    with pytest.raises(TypeError, match=r"^rank 1: training state 'extra' is a set"):
        mgr.save(1, _model(1), {"extra": {1, 2} if rank == 1 else [1, 2]})
    assert mgr.all_checkpoints() == []


@pytest.mark.distributed
def test_a_refusal_on_one_rank_is_raised_on_every_rank(tmp_path) -> None:
    from tests.support.dist import run_ranks

    run_ranks(_disagreeing_ranks, 2, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists() or list((tmp_path / "run").iterdir()) == []
