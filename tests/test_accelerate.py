"""accelerate (the PyPI package) with ``hf_dcp_storage.integrations.accelerate``, on 2 CPU gloo
ranks, a tiny ``transformers`` Llama sharded with FSDP2 (``_accelerate_ranks.py``).

accelerate 1.16 refuses FSDP on CPU (``accelerate/state.py`` 947-974: ``DistributedType.FSDP``
only for the GPU-like ``MULTI_*`` types; ``Accelerator(cpu=True)`` is ``MULTI_CPU`` and the plugin
is dropped). The ``save_state`` and ``Trainer`` jobs set the distributed type to FSDP by hand after
the Accelerator is made (``_accelerate_ranks.py``); the others need no Accelerator in FSDP mode.
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
   ``checkpoint-4`` (local disk: Trainer makes its folders with ``os.makedirs``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "accelerate",
    reason="accelerate is not installed in this interpreter: tests/test_integrations.py runs "
    "tests/integrations in .venv-integrations (created by scripts/setup/integrations_venv.sh)",
)

import accelerate
import accelerate.utils
import fsspec
import torch

from hf_dcp_storage.integrations.accelerate import AcceleratorCheckpoints, route_fsdp_checkpoints
from tests.integrations import _accelerate_ranks as ranks
from tests.integrations._accelerate_ranks import SAVE_AT, STEPS
from tests.support.dist import run_ranks
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
            "trainer": _pair(ranks.trainer_run, out / "trainer", str(out / "trainer_out")),
        }
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
    config = ranks.lora_config(peft.LoraConfig.from_pretrained(folder))
    model = peft.PeftModel.from_pretrained(base, folder, config=config)
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
