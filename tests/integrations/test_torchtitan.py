"""torchtitan (the PyPI package) with ``HFCheckpointManager``, on 2 CPU gloo ranks.

The llama3 debug model, FSDP2, torchtitan's optimizer, lr-scheduler and dataloader containers and
its training-loop order (``_titan.py``). Two jobs, run once for the module:

1. an uninterrupted 6-step reference run, and three runs that stop early after saving: local disk
   with ``async_mode="disabled"`` (every 2 steps, keep all), local with ``"async"`` (every step,
   keep 2), and S3 (moto) with ``"async_with_pinned_mem"`` (DCP's background process; every 2
   steps, keep 2);
2. fresh jobs (another model init) that resume them, latest or ``load_step``, and finish, the last
   step being the HF export; a load with ``exclude_from_loading``; a full resume from a model-only
   step (refused); an ``initial_load_in_hf`` from the S3 export into an empty S3 folder.

Then each test checks one outcome: bitwise-identical continuation, retention, the export's logits in
``transformers``, the S3 export, the initial load, the exclusions, the refusal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed in this interpreter: tests/test_integrations.py runs "
    "tests/integrations in .venv-integrations (created by scripts/setup/integrations_venv.sh)",
)

import fsspec
import torch
from safetensors.torch import load, load_file

from hf_dcp_storage.integrations.torchtitan import HFCheckpointManager
from tests.integrations import _titan
from tests.integrations._titan import STEPS, Run
from tests.support.dist import run_ranks
from tests.support.storage_options import fresh_bucket, s3_storage_options

WORLD = 2
RESUMED = {"sync": 4, "thread": 3, "s3": 4}  # the step each phase-2 job resumes from


def _hf_config() -> dict[str, Any]:
    """The debug model's ``config.json``, as ``transformers`` writes it."""
    import transformers

    return transformers.LlamaConfig(**_titan.llama_dims(_titan.model_spec())).to_dict()


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("titan")
    buckets = fresh_bucket(moto_endpoint)
    bucket, options = next(buckets)
    export = {"last_save_model_only": True, "last_save_in_hf": True, "export_dtype": "float32"}
    configs = {
        "sync": dict(
            folder=str(out / "sync"),
            interval=2,
            keep_latest_k=0,
            async_mode="disabled",
            # Every step folder a complete HF folder: the config transformers reads.
            hf_companions={"config.json": _hf_config()},
            **export,
        ),
        "thread": dict(
            folder=str(out / "thread"), interval=1, keep_latest_k=2, async_mode="async", **export
        ),
        "s3": dict(
            folder=f"{bucket}/run",
            interval=2,
            keep_latest_k=2,
            async_mode="async_with_pinned_mem",
            storage_options=options,
            max_shard_size="4MB",
            **export,
        ),
    }
    first = [
        Run("reference"),
        Run("sync-1", stop_at=5, checkpoint=configs["sync"]),
        Run("thread-1", stop_at=4, checkpoint=configs["thread"]),
    ]
    first.append(Run("s3-1", stop_at=4, checkpoint=configs["s3"]))
    run_ranks(_titan.job, WORLD, first, str(out))
    listed = {
        "first": {name: _steps(cfg["folder"], moto_endpoint) for name, cfg in configs.items()}
    }
    second = [
        Run(
            f"{name}-2",
            checkpoint=cfg,
            init_seed=1,
            load_step=RESUMED[name] if name == "thread" else -1,
        )
        for name, cfg in configs.items()
    ]
    second += [
        Run(
            "exclude",
            checkpoint={**configs["sync"], "exclude_from_loading": ["lr_scheduler"]},
            load_step=4,
            init_seed=1,
            load_only=True,
        ),
        Run(
            "model-only", checkpoint=configs["sync"], init_seed=1, load_only=True, expect_error=True
        ),
        Run(
            "initial",
            checkpoint={
                "folder": f"{bucket}/fresh",
                "initial_load_path": f"{bucket}/run/step_{STEPS}",
                "initial_load_in_hf": True,
                "storage_options": options,
            },
            init_seed=2,
            load_only=True,
        ),
    ]
    fp8 = _fp8_export(out, bucket, options)
    second.append(
        Run(
            "initial-fp8",
            checkpoint={
                "folder": f"{bucket}/fresh-fp8",
                "initial_load_path": fp8,
                "initial_load_in_hf": True,
                "initial_load_in_hf_quantized": True,
                "storage_options": options,
            },
            init_seed=2,
            load_only=True,
        )
    )
    run_ranks(_titan.job, WORLD, second, str(out))
    listed["second"] = {name: _steps(cfg["folder"], moto_endpoint) for name, cfg in configs.items()}
    records = {
        p.name: [torch.load(p / f"rank{r}.pt") for r in range(WORLD)]
        for p in out.iterdir()
        if (p / "rank0.pt").exists()
    }
    s3_export = {
        p.rsplit("/", 1)[-1]: b
        for p, b in _s3_files(f"{bucket}/run/step_{STEPS}", moto_endpoint).items()
    }
    yield {"out": out, "records": records, "listed": listed, "s3_export": s3_export}
    next(buckets, None)


def _fp8_export(out: Path, bucket: str, options: dict) -> str:
    """The reference weights in HF keys as a DeepSeek-like FP8 block-wise folder on S3, one
    process quantizing (``fp8_block_quantize``, the default filter's tensors); its URL."""
    from safetensors.torch import save_file

    from hf_dcp_storage.format.quantized import fp8_block_quantize
    from hf_dcp_storage.plan.fp8export import default_filter

    spec = _titan.model_spec()
    hf = spec.state_dict_adapter(spec.model, None).to_hf(torch.load(out / "reference" / "full.pt"))
    tensors: dict[str, torch.Tensor] = {}
    for key, value in hf.items():
        if default_filter(key, value.shape):
            tensors[key], tensors[key + "_scale_inv"] = fp8_block_quantize(value)
        else:
            tensors[key] = value.contiguous()
    folder = out / "fp8"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    fs, root = fsspec.core.url_to_fs(f"{bucket}/fp8", **options)
    fs.put(str(folder) + "/", root + "/", recursive=True)
    return f"{bucket}/fp8"


def _steps(folder: str, endpoint: str) -> dict[str, bool]:
    """``step_N -> committed?`` under a run folder (local or on the moto endpoint)."""
    fs, root = fsspec.core.url_to_fs(
        folder, **(s3_storage_options(endpoint) if folder.startswith("s3://") else {})
    )
    return {
        p.rsplit("/", 1)[-1]: fs.exists(f"{p}/COMMITTED") for p in sorted(fs.ls(root, detail=False))
    }


def _s3_files(folder: str, endpoint: str) -> dict[str, bytes]:
    """The weights' files of an S3 step folder (not its training state or marker)."""
    fs, root = fsspec.core.url_to_fs(folder, **s3_storage_options(endpoint))
    return {
        p: fs.cat_file(p)
        for p in fs.ls(root, detail=False)
        if p.endswith((".safetensors", ".json"))
    }


@pytest.mark.parametrize("name", ["sync", "thread", "s3"])
def test_a_resumed_job_continues_bitwise_identically(titan: dict[str, Any], name: str) -> None:
    reference, first, second = (
        titan["records"][k] for k in ("reference", f"{name}-1", f"{name}-2")
    )
    for rank in range(WORLD):
        ref = reference[rank]
        # Saving does not disturb training, and the resumed job replays exactly what was lost.
        assert first[rank]["losses"] == {s: ref["losses"][s] for s in first[rank]["losses"]}
        assert second[rank]["loaded"]["step"] == RESUMED[name]
        assert second[rank]["losses"] == {
            s: ref["losses"][s] for s in range(RESUMED[name] + 1, STEPS + 1)
        }
        for part in ("params", "optimizer"):
            assert second[rank][part].keys() == ref[part].keys()
            for key, value in ref[part].items():
                assert torch.equal(second[rank][part][key], value), f"rank {rank} {part} {key}"


def test_steps_are_committed_and_kept_as_keep_latest_k_says(titan: dict[str, Any]) -> None:
    committed = {
        phase: {n: sorted(s for s, done in steps.items() if done) for n, steps in runs.items()}
        for phase, runs in titan["listed"].items()
    }
    assert committed["first"] == {
        "sync": ["step_2", "step_4"],
        "thread": ["step_3", "step_4"],
        "s3": ["step_2", "step_4"],
    }
    # sync keeps every step (keep_latest_k=0); thread re-saved steps 4 and 5 after load_step=3.
    assert committed["second"] == {
        "sync": ["step_2", "step_4", "step_6"],
        "thread": ["step_5", "step_6"],
        "s3": ["step_4", "step_6"],
    }
    assert all(
        all(steps.values()) for runs in titan["listed"].values() for steps in runs.values()
    ), "an uncommitted step folder was left"


def test_the_last_step_is_an_hf_export_with_the_logits_of_the_trained_model(
    titan: dict[str, Any],
) -> None:
    transformers = pytest.importorskip("transformers")
    folder = Path(titan["out"]) / "sync" / f"step_{STEPS}"
    reference = titan["out"] / "reference"
    full = torch.load(reference / "full.pt")
    spec = _titan.model_spec()
    adapter = spec.state_dict_adapter(spec.model, None)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    exported = {
        k: v
        for f in sorted(set(index["weight_map"].values()))
        for k, v in load_file(folder / f).items()
    }
    expected = adapter.to_hf(full)
    assert exported.keys() == expected.keys() and all(
        torch.equal(exported[k], expected[k]) for k in expected
    )
    # Weights only: the training state folder holds the ranks' JSON files, no tensors.
    assert sorted(os.listdir(folder / "training_state")) == ["rank_00000.json", "rank_00001.json"]

    # The config is the manager's companion file (hf_companions): no copying by hand.
    written = json.loads((folder / "config.json").read_text())
    assert written == json.loads(json.dumps(_hf_config()))  # JSON: int keys become strings
    hf_model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    titan_model = spec.model.build()
    titan_model.load_state_dict(full)
    tokens = torch.randint(
        0, spec.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        ours, theirs = titan_model.eval()(tokens), hf_model(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_the_s3_export_holds_the_same_tensors_as_the_local_one(titan: dict[str, Any]) -> None:
    local = Path(titan["out"]) / "sync" / f"step_{STEPS}"
    files = titan["s3_export"]
    theirs = {
        k: v
        for name, data in files.items()
        if name.endswith(".safetensors")
        for k, v in load(data).items()
    }
    ours = {k: v for f in local.glob("*.safetensors") for k, v in load_file(f).items()}
    assert len(files) == 1 + 7  # the index and 7 files of at most 4 MB (max_shard_size) ...
    assert theirs.keys() == ours.keys() and all(
        torch.equal(theirs[k], ours[k]) for k in ours
    )  # ... holding the same tensors


def test_initial_load_in_hf_from_s3_restores_the_exported_weights(titan: dict[str, Any]) -> None:
    for rank, (got, ref) in enumerate(
        zip(titan["records"]["initial"], titan["records"]["reference"], strict=True)
    ):
        for key, value in ref["params"].items():
            assert torch.equal(got["params"][key], value), f"rank {rank} {key}"


def test_initial_load_in_hf_quantized_dequantizes_an_fp8_folder_from_s3(
    titan: dict[str, Any],
) -> None:
    """Each rank holds the weights kept in float32 as exported, and the FP8 ones dequantized
    (``fp8_block_dequantize``, bit-identical to torch's reader: ``tests/test_quantized_load.py``)
    within FP8's rounding of the exported values; at least one weight was quantized."""
    from hf_dcp_storage.format.quantized import fp8_block_dequantize

    folder = Path(titan["out"]) / "fp8"
    stored = load_file(folder / "model.safetensors")
    hf = {
        k: fp8_block_dequantize(v, stored[k + "_scale_inv"], (0, 0))
        if k + "_scale_inv" in stored
        else v
        for k, v in stored.items()
        if not k.endswith("_scale_inv")
    }
    assert any(k + "_scale_inv" in stored for k in hf)
    spec = _titan.model_spec()
    expected = spec.state_dict_adapter(spec.model, None).from_hf(hf)
    full = torch.load(Path(titan["out"]) / "reference" / "full.pt")
    quantized = {k for k, v in expected.items() if not torch.equal(v, full[k])}
    assert quantized and quantized < set(full)
    reference = titan["records"]["reference"]
    for rank, got in enumerate(titan["records"]["initial-fp8"]):
        for key, ref in reference[rank]["params"].items():
            value = got["params"][key]
            if key not in quantized:
                assert torch.equal(value, ref), f"rank {rank} {key}"
                continue
            # Round to nearest e4m3: half an ulp (2**-4 relative), or half the subnormal step
            # (2**-10 of the block's scale, amax / 448, at most the tensor's amax / 448).
            bound = ref.abs() * 2**-4 + full[key].abs().max() / 448 * 2**-10
            assert ((value - ref).abs() <= bound).all(), f"rank {rank} {key}"


def test_exclude_from_loading_leaves_those_states_fresh(titan: dict[str, Any]) -> None:
    for record in titan["records"]["exclude"]:
        # Step 4 restored the train state and the dataloader (4 batches of 2) but not the scheduler.
        assert record["loaded"] == {"step": 4, "last_epoch": 0, "position": 8}


def test_a_full_resume_from_a_weights_only_step_is_refused_with_the_way_out(
    titan: dict[str, Any],
) -> None:
    for record in titan["records"]["model-only"]:
        assert (
            "is not in the checkpoint" in record["error"]
            and "last_save_model_only=True holds the weights only" in record["error"]
        )
        assert "checkpoint.load_step" in record["error"]


def test_config_accepts_hf_on_remote_folders_and_checks_the_rest() -> None:
    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager

    remote = {
        "folder": "s3://bucket/run",
        "last_save_in_hf": True,
        "initial_load_in_hf": True,
        "initial_load_path": "s3://bucket/hf",
    }
    with pytest.raises(ValueError, match="last_save_in_hf is not supported with a remote"):
        CheckpointManager.Config(**remote)
    config = HFCheckpointManager.Config(**remote, storage_options={"anon": True})
    assert isinstance(config, BaseCheckpointManager.Config)  # what Trainer.Config.checkpoint holds
    # ... and what the Trainer builds from it (disabled here: no components are touched).
    built = HFCheckpointManager.Config().build(
        dataloader=None,
        model_parts=[],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
    )
    assert type(built) is HFCheckpointManager and not built.enable
    with pytest.raises(ValueError, match="last_save_in_hf=True requires last_save_model_only=True"):
        HFCheckpointManager.Config(last_save_in_hf=True, last_save_model_only=False)
    with pytest.raises(ValueError, match="keep_latest_k cannot be negative"):
        HFCheckpointManager.Config(keep_latest_k=-1)  # torchtitan's own rules still hold
    # A quantized HF folder on a remote store: read (and dequantized) by ours.
    remote = HFCheckpointManager.Config(
        initial_load_in_hf=True, initial_load_in_hf_quantized=True, initial_load_path="s3://b/hf"
    )
    assert remote.initial_load_in_hf_quantized and remote.initial_load_path == "s3://b/hf"
    with pytest.raises(ValueError, match=r"initial_load_in_hf_quantized=True requires"):
        HFCheckpointManager.Config(initial_load_in_hf=True, initial_load_in_hf_quantized=True)
    with pytest.raises(ValueError, match=r"storage_options='key=x' must be None or a dict"):
        HFCheckpointManager.Config(storage_options="key=x")
