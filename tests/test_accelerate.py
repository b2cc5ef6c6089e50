"""accelerate (the PyPI package) with ``hf_dcp_storage.integrations.accelerate``, on 2 CPU gloo
ranks, a tiny ``transformers`` Llama sharded with FSDP2 (``tests/support/accelerate_ranks.py``).

accelerate 1.16 refuses FSDP on CPU (``accelerate/state.py`` 947-974: ``DistributedType.FSDP``
only for the GPU-like ``MULTI_*`` types; ``Accelerator(cpu=True)`` is ``MULTI_CPU`` and the plugin
is dropped). The ``save_state`` and ``Trainer`` jobs set the distributed type to FSDP by hand after
the Accelerator is made (``tests/support/accelerate_ranks.py``); the others need no Accelerator in
FSDP mode.
Each is an uninterrupted job (save part-way, train on) and a fresh job (another init) that loads
the save and trains on to the same end, once for the module:

1. accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_model`` /
   ``load_fsdp_optimizer`` (as ``Trainer`` calls them), routed to ours, on local disk and on S3
   (moto);
2. ``Accelerator.save_state`` / ``load_state`` with the distributed type set to FSDP by hand
   (local disk: ``save_state`` makes its folder with ``os.makedirs``);
3. ``AcceleratorCheckpoints`` on S3: a step every step, keep the last 2 plus every 3rd; the resume
   loads step 3;
4. a LoRA adapter saved by ``save_fsdp_model(adapter_only=True)``, routed, on S3;
5. HF ``Trainer`` (6 steps, ``checkpoint-N`` every 2, ``save_total_limit=2``) resumed from
   ``checkpoint-4``, on local disk and on S3 through ``TrainerCheckpointMirror`` (Trainer's
   ``output_dir`` a local staging folder; the resume from a fresh one).

A kill during a save (the job SIGKILLed once rank 1's weights are written, ``run_job``) is a job
of its own, for ``AcceleratorCheckpoints`` and for ``Trainer`` on S3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("peft")

import accelerate
import accelerate.utils
import fsspec
import torch

from hf_dcp_storage.integrations.accelerate import AcceleratorCheckpoints, route_fsdp_checkpoints
from hf_dcp_storage.integrations.accelerate_trainer import TrainerCheckpointMirror
from tests.support import accelerate_ranks as ranks
from tests.support.accelerate_ranks import SAVE_AT, STEPS
from tests.support.dist import run_ranks
from tests.support.jobs import run_job
from tests.support.storage_options import fresh_bucket, s3_storage_options

WORLD = 2


def _records(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _pair(fn: Any, out: Path, *args: Any) -> dict[str, list[dict[str, Any]]]:
    """An uninterrupted job and a resumed one of ``fn``; their ranks' records."""
    run_ranks(fn, WORLD, *args, str(out / "first"), False)
    run_ranks(fn, WORLD, *args, str(out / "resumed"), True)
    return {"first": _records(out / "first"), "resumed": _records(out / "resumed")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str) -> Any:
    out = tmp_path_factory.mktemp("accelerate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # the spawned ranks inherit it: nothing is downloaded
        buckets = fresh_bucket(moto_endpoint)
        bucket, options = next(buckets)
        local = str(out / "utils_ckpt")
        s3_url, run_url = f"{bucket}/checkpoint-3", f"{bucket}/run"
        done = {
            "utils_local": _pair(ranks.fsdp_utils_run, out / "utils_local", local, None),
            "utils_s3": _pair(ranks.fsdp_utils_run, out / "utils_s3", s3_url, options),
            "save_state": _pair(ranks.save_state_run, out / "save_state", str(out / "state")),
            "steps": _pair(ranks.step_checkpoints_run, out / "steps", run_url, options),
            "save_state_s3": _pair(
                ranks.save_state_mirror_run,
                out / "save_state_s3",
                str(out / "state_staging"),
                f"{bucket}/state",
                options,
            ),
            "trainer": _pair(ranks.trainer_run, out / "trainer", str(out / "trainer_out")),
        }
        # Trainer to S3 through a mirror; the resume from a fresh staging folder (a new machine).
        remote = f"{bucket}/trainer"
        for name, resume in (("first", False), ("resumed", True)):
            staging, records = str(out / f"staging_{name}"), str(out / "trainer_s3" / name)
            run_ranks(ranks.trainer_run, WORLD, staging, records, resume, remote, options, None, 4)
        done["trainer_s3"] = {k: _records(out / "trainer_s3" / k) for k in ("first", "resumed")}
        run_ranks(ranks.peft_run, WORLD, f"{bucket}/adapter", options, str(out / "peft"))
        fs, root = fsspec.core.url_to_fs(bucket, **s3_storage_options(moto_endpoint))
        mirror = out / "s3"
        fs.get(f"{root}/", str(mirror), recursive=True)  # what the bucket holds, for the checks
        yield {
            **done,
            "out": out,
            "local": Path(local),
            "state": out / "state",
            "trainer_out": out / "trainer_out",
            "s3": mirror,
        }
        next(buckets, None)


def _assert_bitwise(first: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> None:
    for a, b in zip(first, resumed, strict=True):
        assert a["lr"] == b["lr"] and a["last_epoch"] == b["last_epoch"]
        for part in ("params", "optimizer"):
            assert a[part].keys() == b[part].keys() and a[part]
            for key, value in a[part].items():
                assert torch.equal(b[part][key], value), f"{part} {key}"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.arange(16).reshape(2, 8) % ranks.DIMS["vocab_size"]
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _assert_from_pretrained(folder: Path, full: dict[str, torch.Tensor]) -> None:
    """``folder`` loads with ``AutoModelForCausalLM.from_pretrained`` into the weights ``full``,
    and gives the logits that a model holding ``full`` gives."""
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    expected = transformers.LlamaForCausalLM(ranks.hf_config())
    expected.load_state_dict(full)
    assert loaded.state_dict().keys() == full.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in full.items())
    assert torch.equal(_logits(loaded), _logits(expected))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_fsdp_utils_functions_resume_bitwise(jobs: dict[str, Any], where: str) -> None:
    run = jobs[f"utils_{where}"]
    assert run["first"][0]["last_epoch"] == STEPS
    _assert_bitwise(run["first"], run["resumed"])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_fsdp_utils_functions_write_hf_folders(jobs: dict[str, Any], where: str) -> None:
    ckpt = jobs["local"] if where == "local" else jobs["s3"] / "checkpoint-3"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    model = ckpt / "pytorch_model_fsdp_0"
    # Ours: consolidated safetensors, index and companions; no .distcp / .metadata of DCP's.
    assert sorted(p.name for p in model.iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert sorted(p.name for p in (ckpt / "optimizer_0").iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "optimizer_state.json",
    ]
    _assert_from_pretrained(model, jobs[f"utils_{where}"]["first"][0]["full_at_save"])


def test_save_state_and_load_state_resume_bitwise(jobs: dict[str, Any]) -> None:
    run = jobs["save_state"]
    # AcceleratedScheduler steps once per process per optimizer step.
    assert run["first"][0]["last_epoch"] == STEPS * WORLD
    _assert_bitwise(run["first"], run["resumed"])
    names = sorted(p.name for p in jobs["state"].iterdir())
    # The model and the optimizer ours; scheduler and RNG states accelerate's own.
    assert names == [
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]
    assert (jobs["state"] / "pytorch_model_fsdp_0" / "model.safetensors.index.json").is_file()


def test_save_state_to_s3_through_the_mirror_resumes_bitwise(jobs: dict[str, Any]) -> None:
    run = jobs["save_state_s3"]
    assert run["first"][0]["last_epoch"] == STEPS * WORLD
    _assert_bitwise(run["first"], run["resumed"])
    ckpt = jobs["s3"] / "state" / f"checkpoint-{SAVE_AT}"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "COMMITTED",
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]
    _assert_from_pretrained(ckpt / "pytorch_model_fsdp_0", run["first"][0]["full_at_save"])
    # Only accelerate's small files were staged; the model and optimizer went to S3 directly.
    staged = jobs["out"] / "state_staging-first" / f"checkpoint-{SAVE_AT}"
    assert sorted(p.name for p in staged.iterdir()) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]


def test_trainer_checkpoints_go_through_ours_rotate_and_resume_bitwise(
    jobs: dict[str, Any],
) -> None:
    run = jobs["trainer"]
    assert [r["global_step"] for r in run["resumed"]] == [6, 6]
    _assert_bitwise(run["first"], run["resumed"])
    root = jobs["trainer_out"]
    # save_total_limit=2 removed checkpoint-2 (Trainer's own rotation, on local disk).
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    ckpt = root / "checkpoint-6"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "scheduler.pt",
        "trainer_state.json",
    ]
    assert sorted(p.name for p in (ckpt / "optimizer_0").iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "optimizer_state.json",
    ]
    _assert_from_pretrained(ckpt / "pytorch_model_fsdp_0", run["first"][0]["full_at_save"])


def test_step_checkpoints_keep_last_n_on_s3_and_resume_bitwise(jobs: dict[str, Any]) -> None:
    run = jobs["steps"]
    _assert_bitwise(run["first"], run["resumed"])
    root = jobs["s3"] / "run"
    # keep_last_n=2 keeps 4 and 5; keep_every=3 keeps 3; 1 and 2 were removed, whole.
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4", "step_5"]
    for step in (3, 4, 5):
        marker = json.loads((root / f"step_{step}" / "COMMITTED").read_text())
        assert marker["step"] == step and marker["world_size"] == WORLD
    _assert_from_pretrained(root / f"step_{SAVE_AT}", run["first"][0]["full_at_save"])


def test_an_incomplete_step_is_not_latest_and_the_previous_one_loads(
    jobs: dict[str, Any], tmp_path: Path
) -> None:
    # What a save killed before its commit leaves: a step folder with weights but no COMMITTED.
    root = tmp_path / "run"
    fs = fsspec.filesystem("file")
    fs.get(str(jobs["s3"] / "run" / "step_5"), str(root / "step_5"), recursive=True)
    fs.get(str(jobs["s3"] / "run" / "step_5"), str(root / "step_6"), recursive=True)
    (root / "step_6" / "COMMITTED").unlink()
    ckpts = AcceleratorCheckpoints(str(root))
    assert ckpts.latest() == 5
    import transformers

    model = transformers.LlamaForCausalLM(ranks.hf_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    extra = {"epoch": 0}
    assert ckpts.load(model, optimizer, scheduler, extra=extra) == 5
    assert extra == {"epoch": 50} and scheduler.last_epoch == STEPS * WORLD
    ckpts.close()


def test_a_peft_adapter_through_the_routed_function_loads_in_peft(jobs: dict[str, Any]) -> None:
    import peft
    import transformers
    from safetensors.torch import load_file

    folder = jobs["s3"] / "adapter" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "model.safetensors.index.json",
    ]
    adapter = torch.load(jobs["out"] / "peft" / "adapter.pt")
    saved = load_file(folder / "adapter_model.safetensors")
    assert saved.keys() == adapter.keys() and all(torch.equal(saved[k], adapter[k]) for k in saved)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(ranks.hf_config())
    model = peft.PeftModel.from_pretrained(base, folder)
    loaded = peft.get_peft_model_state_dict(model)
    assert loaded.keys() == adapter.keys()
    assert all(torch.equal(loaded[k], adapter[k]) for k in adapter)


def test_routing_replaces_and_restores_accelerates_functions_trainers_included() -> None:
    # Trainer binds accelerate's functions when it is imported: routed where they are bound.
    import transformers.trainer
    from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs

    original = accelerate.utils.fsdp_utils.save_fsdp_model
    binders = (accelerate.utils.fsdp_utils, accelerate.utils, accelerate.accelerator)
    with route_fsdp_checkpoints() as routing:
        for module in (*binders, transformers.trainer):
            for name in ("save_fsdp_model", "load_fsdp_model"):
                assert getattr(module, name) == getattr(routing, name), (module, name)
            for name in ("save_fsdp_optimizer", "load_fsdp_optimizer"):
                assert getattr(module, name) == getattr(routing, name), (module, name)
        # Trainer inspects the signature to pass adapter_only (PEFT); ours has accelerate's.
        assert get_fsdp_ckpt_kwargs() == {"adapter_only": True}
        with pytest.raises(RuntimeError, match=r"routed already: remove\(\) that routing first"):
            route_fsdp_checkpoints()
    for module in (*binders, transformers.trainer):
        assert module.save_fsdp_model is original


def test_another_accelerate_or_bad_arguments_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"storage_options='anon' must be None or a dict"):
        route_fsdp_checkpoints(storage_options="anon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'a/b' is not a plain file name"):
        route_fsdp_checkpoints(companions={"a/b": b""})
    original = accelerate.utils.fsdp_utils.save_fsdp_model
    monkeypatch.setattr(accelerate, "__version__", "1.17.0")
    with pytest.raises(
        RuntimeError,
        match=r"supports accelerate 1\.16\.x; found accelerate 1\.17\.0: install a supported one",
    ):
        route_fsdp_checkpoints()
    assert accelerate.utils.fsdp_utils.save_fsdp_model is original  # nothing was replaced


def test_an_optimizer_state_of_another_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    # One process, no process group: the routed functions need none.
    two = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(two.parameters())
    two(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    one = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with route_fsdp_checkpoints():
        accelerate.utils.save_fsdp_optimizer(None, None, optimizer, two, str(tmp_path))
        with pytest.raises(
            KeyError,
            match=r"optimizer_0 holds optimizer state 'optimizer\.state\.1\.weight\.[a-z_]+' that "
            r"this optimizer lacks: load it into the model and optimizer type that saved it",
        ):
            accelerate.utils.load_fsdp_optimizer(
                None, None, torch.optim.AdamW(one.parameters()), one, str(tmp_path)
            )


def test_trainer_checkpoints_to_s3_rotate_commit_and_resume_bitwise(jobs: dict[str, Any]) -> None:
    run = jobs["trainer_s3"]
    assert [r["global_step"] for r in run["resumed"]] == [6, 6]
    assert run["resumed"][0]["resumed_from"] == str(
        jobs["out"] / "staging_resumed" / "checkpoint-4"
    )
    _assert_bitwise(run["first"], run["resumed"])
    _assert_bitwise(jobs["trainer"]["first"], run["first"])  # the same run as on local disk
    root = jobs["s3"] / "trainer"
    # save_total_limit=2 applied on the bucket: checkpoint-2 removed; each one committed last.
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    ckpt = root / "checkpoint-6"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "COMMITTED",
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "scheduler.pt",
        "trainer_state.json",
    ]
    marker = json.loads((ckpt / "COMMITTED").read_text())
    assert marker["step"] == 6 and marker["world_size"] == WORLD
    # The heavy parts never touched the staging folder: Trainer's files only, empty folders none.
    staged = jobs["out"] / "staging_first" / "checkpoint-6"
    assert sorted(p.name for p in staged.iterdir()) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
        "scheduler.pt",
        "trainer_state.json",
    ]
    _assert_from_pretrained(ckpt / "pytorch_model_fsdp_0", run["first"][0]["full_at_save"])


def test_a_kill_during_a_trainer_save_to_s3_leaves_the_previous_checkpoint_latest(
    jobs: dict[str, Any], moto_s3: tuple[str, dict], tmp_path: Path
) -> None:
    bucket, options = moto_s3
    remote = f"{bucket}/trainer"
    env = {"HF_HUB_OFFLINE": "1"}
    killed = run_job(
        ranks.trainer_run,
        WORLD,
        *(str(tmp_path / "staging_killed"), str(tmp_path / "unused"), False, remote, options, 2),
        timeout=300,
        env=env,
    )
    assert killed.how() == ["killed", "killed"], [r.error[-3000:] for r in killed.ranks]
    fs, root = fsspec.core.url_to_fs(remote, **options)
    routing = route_fsdp_checkpoints(storage_options=options)
    mirror = TrainerCheckpointMirror(remote, tmp_path / "staging_new", routing, options)
    try:
        assert mirror.latest() == 2  # checkpoint-4 was being saved: not complete, not latest
        assert not fs.exists(f"{root}/checkpoint-4/COMMITTED")
        with pytest.raises(FileNotFoundError, match=r"checkpoint-4 is not a complete.*: \[2\]"):
            mirror.resume_checkpoint(4)
    finally:
        mirror.remove()
    # A fresh job resumes from the newest complete checkpoint, and ends where an uninterrupted
    # run ends, bit for bit; the incomplete checkpoint-4 is replaced by a complete one.
    after = tmp_path / "after"
    run_ranks(
        ranks.trainer_run, WORLD, str(tmp_path / "staging_new"), str(after), True, remote, options
    )
    resumed = _records(after)
    assert resumed[0]["resumed_from"] == str(tmp_path / "staging_new" / "checkpoint-2")
    _assert_bitwise(jobs["trainer_s3"]["first"], resumed)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) == ["checkpoint-4", "checkpoint-6"]
    assert all(fs.exists(f"{root}/checkpoint-{step}/COMMITTED") for step in (4, 6))


def test_a_kill_during_a_step_save_leaves_the_previous_step_latest_and_loadable(
    moto_s3: tuple[str, dict], tmp_path: Path
) -> None:
    bucket, options = moto_s3
    root = f"{bucket}/run"
    killed = run_job(
        ranks.killed_step_checkpoints_run,
        WORLD,
        root,
        options,
        timeout=240,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert killed.how() == ["killed", "killed"]
    ckpts = AcceleratorCheckpoints(root, storage_options=options)
    assert ckpts.latest() == 1  # step 2 was being saved: not complete, not latest
    fs, path = fsspec.core.url_to_fs(root, **options)
    assert fs.exists(f"{path}/step_1/COMMITTED") and not fs.exists(f"{path}/step_2/COMMITTED")
    import transformers

    model = transformers.LlamaForCausalLM(ranks.hf_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    extra = {"epoch": 0}
    assert ckpts.load(model, optimizer, scheduler, extra=extra) == 1
    # AcceleratedScheduler steps once per process per optimizer step.
    assert extra == {"epoch": 10} and scheduler.last_epoch == WORLD
    ckpts.close()
