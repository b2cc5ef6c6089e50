"""torchtune (the PyPI package, 0.6.1) with ``HFCheckpointer``, on 2 CPU gloo ranks.

torchtune's own ``CheckpointClient`` drives ours (``_tune.py``: an FSDP2-sharded tiny torchtune
Llama 3, AdamW, torchtune's cosine schedule). Two jobs, run once for the module:

1. an uninterrupted 3-epoch reference run, and three runs that stop after saving epoch 2: local
   disk with async intermediate saves (the client's ``_save_checkpoint_async``), local with
   synchronous ones (the client's ``_save_checkpoint_sync``), and S3 (moto: the base model and the
   run folder there) with ``steps_run`` in the progress, keeping 2 steps; plus a synchronous
   resume, which is refused;
2. fresh jobs (another model init) that resume each of them through the client's
   ``load_distributed_checkpoint`` and finish, the last epoch's save being the final one.

Then each test checks one outcome: bitwise-identical continuation (weights, optimizer, LR, the
recipe state read back), the folder names and retention, the final folder in ``transformers``,
the refusal. A kill during a save and the sharded base load are jobs of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtune",
    reason="torchtune is not installed in this interpreter: tests/test_integrations.py runs "
    "tests/integrations in .venv-integrations (created by scripts/setup/integrations_venv.sh)",
)

import fsspec
import torch

from tests.integrations import _tune
from tests.integrations._tune import EPOCHS, STEPS_PER_EPOCH, Run
from tests.support.dist import run_ranks
from tests.support.jobs import run_job
from tests.support.storage_options import fresh_bucket, s3_storage_options

WORLD = 2


@pytest.fixture(scope="module")
def tune(tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str) -> Any:
    out = tmp_path_factory.mktemp("tune")
    base = out / "base"
    _tune.write_base(base)
    buckets = fresh_bucket(moto_endpoint)
    bucket, options = next(buckets)
    fs, root = fsspec.core.url_to_fs(f"{bucket}/base", **options)
    fs.put(str(base) + "/", root + "/", recursive=True)
    local = {"checkpoint_dir": str(base)}
    configs = {
        "async": {**local, "output_dir": str(out / "async")},
        "sync": {**local, "output_dir": str(out / "sync")},
        "s3": {
            "checkpoint_dir": f"{bucket}/base",
            "output_dir": f"{bucket}/run",
            "storage_options": options,
            "keep_last_n": 2,
        },
    }
    first = [
        Run("reference", checkpointer={**local, "output_dir": str(out / "reference-run")}),
        Run("async-1", checkpointer=configs["async"], stop_after_epochs=2),
        Run("sync-1", checkpointer=configs["sync"], stop_after_epochs=2, async_checkpointing=False),
        Run(
            "full-1",
            checkpointer={**configs["sync"], "output_dir": str(out / "full"), "async_save": True},
            stop_after_epochs=2,
            async_checkpointing=False,
        ),
        Run("s3-1", checkpointer=configs["s3"], stop_after_epochs=2, steps_run=True),
    ]
    run_ranks(_tune.job, WORLD, first, str(out))
    listed = {"first": {n: _steps(c["output_dir"], moto_endpoint) for n, c in configs.items()}}
    second = [
        Run(f"{name}-2", checkpointer=cfg, resume=True, init_seed=1, steps_run=name == "s3")
        for name, cfg in configs.items()
    ]
    # torchtune's synchronous resume: full tensors from load_base_checkpoint, sharded by it.
    second.append(
        Run(
            "full-2",
            checkpointer={**configs["sync"], "output_dir": str(out / "full")},
            resume=True,
            async_checkpointing=False,
            init_seed=1,
        )
    )
    run_ranks(_tune.job, WORLD, second, str(out))
    listed["second"] = {n: _steps(c["output_dir"], moto_endpoint) for n, c in configs.items()}
    records = {
        p.name: [torch.load(p / f"rank{r}.pt") for r in range(WORLD)]
        for p in out.iterdir()
        if (p / "rank0.pt").exists()
    }
    yield {"out": out, "records": records, "listed": listed, "bucket": bucket, "options": options}
    next(buckets, None)


def _steps(folder: str, endpoint: str) -> dict[str, bool]:
    """``step_N -> committed?`` under a run folder (local or on the moto endpoint)."""
    fs, root = fsspec.core.url_to_fs(
        folder, **(s3_storage_options(endpoint) if folder.startswith("s3://") else {})
    )
    return {
        p.rsplit("/", 1)[-1]: fs.exists(f"{p}/COMMITTED") for p in sorted(fs.ls(root, detail=False))
    }


@pytest.mark.parametrize("name", ["async", "sync", "s3", "full"])
def test_a_resumed_run_continues_bitwise_identically(tune: dict[str, Any], name: str) -> None:
    for rank in range(WORLD):
        reference, resumed = tune["records"]["reference"][rank], tune["records"][f"{name}-2"][rank]
        assert resumed["resumed"] is not None
        for key, value in reference["weights"].items():
            assert torch.equal(resumed["weights"][key], value), (rank, key)
        assert reference["optimizer"].keys() == resumed["optimizer"].keys()
        for pid, state in reference["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(resumed["optimizer"][pid][key], value), (rank, pid, key)
        # The schedule, rebuilt from epochs_run, goes on where it was.
        assert resumed["lrs"] == reference["lrs"][2 * STEPS_PER_EPOCH :]
        assert resumed["last_lr"] == reference["last_lr"]
        assert resumed["losses"] == reference["losses"][2 * STEPS_PER_EPOCH :]


@pytest.mark.parametrize("name", ["async", "sync", "s3"])
def test_the_recipe_state_comes_back_per_rank(tune: dict[str, Any], name: str) -> None:
    for rank in range(WORLD):
        state = tune["records"][f"{name}-2"][rank]["resumed"]
        assert state["seed"] == 7
        assert state["epochs_run"] == 2
        assert state["total_epochs"] == EPOCHS
        assert state["max_steps_per_epoch"] == STEPS_PER_EPOCH
        assert state["dataloader"] == {"epoch": 2, "sampler": [1, rank]}  # this rank's own
        assert state["steps_run"] == (2 * STEPS_PER_EPOCH if name == "s3" else None)


def test_step_folders_are_named_by_steps_run_else_epochs_and_retention_keeps_n(
    tune: dict[str, Any],
) -> None:
    listed = tune["listed"]
    # torchtune 0.6.1's progress has no step count: folders count epochs run.
    assert listed["first"]["async"] == {"step_1": True, "step_2": True}
    assert listed["second"]["async"] == {"step_1": True, "step_2": True, "step_3": True}
    assert listed["second"]["sync"] == listed["second"]["async"]
    # With steps_run (later torchtune), folders count optimizer steps; keep_last_n=2.
    assert listed["first"]["s3"] == {"step_2": True, "step_4": True}
    assert listed["second"]["s3"] == {"step_4": True, "step_6": True}


@pytest.mark.parametrize("name", ["async", "s3"])
def test_the_final_folder_loads_in_transformers_with_torchtune_logits(
    tune: dict[str, Any], name: str
) -> None:
    import transformers

    if name == "s3":
        fs, root = fsspec.core.url_to_fs(f"{tune['bucket']}/run/step_6", **tune["options"])
        folder = tune["out"] / "s3-final"
        fs.get(root + "/", str(folder) + "/", recursive=True)
    else:
        folder = tune["out"] / "async" / f"step_{EPOCHS}"
    # The base folder's config.json, copied as it is.
    assert (folder / "config.json").read_bytes() == (
        tune["out"] / "base" / "config.json"
    ).read_bytes()
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    model = _tune.new_model(0).eval()
    model.load_state_dict(tune["records"]["reference"][0]["weights"])
    tokens = _tune.batch(99, 0, 0)
    with torch.no_grad():
        expected = model(tokens)
        actual = hf(tokens).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def _killed_at_epoch_2(rank: int, world: int, run: Run, out: str) -> None:
    from hf_dcp_storage.integrations.torchtune import HFCheckpointer
    from tests.support.killpoints import arm

    save, saves = HFCheckpointer.save_checkpoint, []

    def second_save_dies(self: HFCheckpointer, *args: Any, **kwargs: Any) -> None:
        saves.append(1)
        if len(saves) == 2:  # rank 1 SIGKILLs the job once its weights are written
            arm("late-write", "job", 1)
        save(self, *args, **kwargs)

    HFCheckpointer.save_checkpoint = second_save_dies  # type: ignore[method-assign]
    _tune.job(rank, world, [run], out)


def test_a_kill_during_a_save_leaves_the_previous_step_latest(tmp_path: Path) -> None:
    from hf_dcp_storage import CheckpointManager

    base = tmp_path / "base"
    _tune.write_base(base)
    cfg = {"checkpoint_dir": str(base), "output_dir": str(tmp_path / "run")}
    result = run_job(
        _killed_at_epoch_2,
        WORLD,
        Run("killed", checkpointer=cfg, async_checkpointing=False),
        str(tmp_path),
        timeout=240,
    )
    assert result.how() == ["killed", "killed"]
    assert _steps(cfg["output_dir"], "") == {"step_1": True, "step_2": False}
    assert CheckpointManager(cfg["output_dir"]).latest() == 1
    run_ranks(_tune.job, WORLD, [Run("after", checkpointer=cfg, resume=True)], str(tmp_path))
    for rank in range(WORLD):
        assert torch.load(tmp_path / "after" / f"rank{rank}.pt")["resumed"]["epochs_run"] == 1


def _base_into(rank: int, world: int, base: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from hf_dcp_storage.integrations.torchtune import HFCheckpointer

    model = _tune.new_model(5)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    HFCheckpointer(base, f"{out}/unused", "LLAMA3").load_base_into(model)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    torch.save(full, f"{out}/base_into_{rank}.pt")


def test_a_base_model_loads_into_a_sharded_model(tmp_path: Path) -> None:
    base = tmp_path / "base"
    expected = _tune.write_base(base)
    run_ranks(_base_into, WORLD, str(base), str(tmp_path))
    for rank in range(WORLD):
        loaded = torch.load(tmp_path / f"base_into_{rank}.pt")
        assert loaded.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key


def test_an_unsupported_model_type_or_step_path_is_refused(tmp_path: Path) -> None:
    from hf_dcp_storage.integrations.torchtune import SUPPORTED_MODEL_TYPES, HFCheckpointer

    with pytest.raises(ValueError, match=r"model_type='PHI3_MINI': HFCheckpointer converts"):
        HFCheckpointer(str(tmp_path), str(tmp_path / "out"), "PHI3_MINI")
    assert "LLAMA3" in SUPPORTED_MODEL_TYPES
    _tune.write_base(tmp_path / "base")
    ckpt = HFCheckpointer(str(tmp_path / "base"), str(tmp_path / "out"), "LLAMA3")
    with pytest.raises(ValueError, match=r"checkpoint_path='.*epoch_2': name a step folder"):
        ckpt.load_checkpoint({"model": {}}, checkpoint_path=str(tmp_path / "epoch_2"))
    with pytest.raises(ValueError, match=r"adapter_only=True: HFCheckpointer saves full models"):
        ckpt.save_checkpoint({"model": {}}, epoch=0, adapter_only=True)
