"""Lightning (the PyPI package) with ``HFModelParallelStrategy``: ``Trainer(accelerator="cpu",
devices=2)`` fitting an FSDP2 model on gloo, checkpoints on local disk and S3 (moto).

Each fit is ``_lightning_fit.py`` run as a script of its own (Lightning starts rank 1 by running
``sys.argv`` again, which must not be pytest). Two fits, once for the module:

1. 4 epochs, fresh: ``ModelCheckpoint`` on S3 keeping the 2 epochs of lowest ``train_loss`` plus
   ``last.ckpt`` (so Lightning removes and overwrites checkpoints there), and one on local disk
   keeping every epoch;
2. a fresh process resuming with ``Trainer.fit(ckpt_path=<the earliest S3 checkpoint kept>)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lightning",
    reason="Lightning is not installed in this interpreter: tests/test_integrations.py runs "
    "tests/integrations in .venv-integrations (created by scripts/setup/integrations_venv.sh)",
)

import fsspec
import torch
from safetensors.torch import load, load_file

from hf_dcp_storage.integrations.lightning import HFModelParallelStrategy
from tests.support.storage_options import fresh_bucket, s3_storage_options

SCRIPT = Path(__file__).with_name("_lightning_fit.py")
EPOCHS = 4
FIT_TIMEOUT_S = 300
README = "a toy model, saved by HFModelParallelStrategy\n"  # a companion file of every epoch


def _fit(out: Path, **spec: Any) -> list[dict[str, Any]]:
    """Run one fit; returns its ranks' records (plus ``full``: the full weights, on rank 0's)."""
    out.mkdir(parents=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps({"out": str(out / "records"), **spec}))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(spec_file)],
        capture_output=True,
        text=True,
        timeout=FIT_TIMEOUT_S,
        cwd=out,
        check=False,
    )
    assert done.returncode == 0, (
        f"fit failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    records = [torch.load(out / "records" / f"rank{r}.pt") for r in range(2)]
    records[0]["full"] = torch.load(out / "records" / "full.pt")
    return records


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning")
    buckets = fresh_bucket(moto_endpoint)
    bucket, options = next(buckets)
    best_dir, all_dir = f"{bucket}/best", str(out / "all")
    first = _fit(
        out / "first",
        best_dir=best_dir,
        all_dir=all_dir,
        storage_options=options,
        companions={"README.md": README},
    )
    kept = first[0]["checkpoints"][best_dir]["best_k"]
    resume_from = min(
        kept, key=lambda p: int(p.rsplit("=", 1)[1].split(".")[0])
    )  # .../best-epoch=N.ckpt
    resumed = _fit(out / "resumed", ckpt_path=resume_from, storage_options=options)
    fs, root = fsspec.core.url_to_fs(best_dir, **s3_storage_options(moto_endpoint))
    s3_files = {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}
    yield {
        "first": first,
        "resumed": resumed,
        "resume_from": resume_from,
        "best_dir": best_dir,
        "all_dir": all_dir,
        "s3_files": s3_files,
    }
    next(buckets, None)


def _weights(files: dict[str, bytes], folder: str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder's weights, read with safetensors from its files' bytes."""
    index = json.loads(files[f"{folder}/model.safetensors.index.json"])
    return {
        k: v
        for name in sorted(set(index["weight_map"].values()))
        for k, v in load(files[f"{folder}/{name}"]).items()
    }


def test_every_epoch_is_a_folder_of_safetensors_weights(fits: dict[str, Any]) -> None:
    root = Path(fits["all_dir"])
    assert sorted(os.listdir(root)) == [f"all-epoch={e}.ckpt" for e in range(EPOCHS)]
    final = root / f"all-epoch={EPOCHS - 1}.ckpt"
    assert sorted(os.listdir(final)) == [
        "COMMITTED",
        "README.md",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "training_state",
    ]
    assert json.loads((final / "COMMITTED").read_text())["step"] == EPOCHS * 4
    assert (final / "README.md").read_text() == README  # the strategy's companions
    saved = load_file(final / "model-00001-of-00001.safetensors")
    full = fits["first"][0]["full"]
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in full)


def test_model_checkpoint_keeps_top_k_and_last_on_s3(fits: dict[str, Any]) -> None:
    losses = fits["first"][0]["losses"]
    best = sorted(sorted(losses, key=losses.get)[:2])
    files = fits["s3_files"]
    folders = {name.split("/", 1)[0] for name in files}
    assert folders == {f"best-epoch={e}.ckpt" for e in best} | {
        "last.ckpt"
    }  # the others were removed, whole
    assert all(
        f"{f}/COMMITTED" in files for f in folders - {"last.ckpt"}
    )  # saved once: flat checkpoint folders
    assert sorted(
        p.rsplit("/", 1)[1] for p in fits["first"][0]["checkpoints"][fits["best_dir"]]["best_k"]
    ) == [f"best-epoch={e}.ckpt" for e in best]
    # last.ckpt was saved over every epoch, each time into a version of its own that CURRENT
    # names once committed, the one it replaced removed after: one version is left.
    version = json.loads(files["last.ckpt/CURRENT"])["version"]
    assert {name.split("/")[1] for name in files if name.startswith("last.ckpt/")} == {
        "CURRENT",
        version,
    }
    assert (
        f"last.ckpt/{version}/COMMITTED" in files
        and json.loads(files[f"last.ckpt/{version}/COMMITTED"])["step"] == EPOCHS * 4
    )
    last, full = _weights(files, f"last.ckpt/{version}"), fits["first"][0]["full"]
    assert last.keys() == full.keys() and all(torch.equal(last[k], full[k]) for k in full)


def test_a_fit_resumed_from_s3_continues_exactly(fits: dict[str, Any]) -> None:
    resumed_epoch = int(fits["resume_from"].rsplit("=", 1)[1].split(".")[0])
    assert resumed_epoch < EPOCHS - 1  # something is left to train
    for first, resumed in zip(fits["first"], fits["resumed"], strict=True):
        assert resumed["global_step"] == first["global_step"] == EPOCHS * 4
        assert resumed["losses"] == {
            e: first["losses"][e] for e in range(resumed_epoch + 1, EPOCHS)
        }
        assert resumed["lr"] == first["lr"]
        for part in ("params", "optimizer"):
            assert resumed[part].keys() == first[part].keys()
            for key, value in first[part].items():
                assert torch.equal(resumed[part][key], value), f"{part} {key}"


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"storage_options='anon' must be None or a dict"):
        HFModelParallelStrategy(storage_options="anon")
    with pytest.raises(ValueError, match=r"'a/b' is not a plain file name"):
        HFModelParallelStrategy(companions={"a/b": b""})
    strategy = HFModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    with pytest.raises(
        TypeError,
        match=r"save_checkpoint\(\.\.\., storage_options=\.\.\.\) is not supported: pass them "
        r"once, as HFModelParallelStrategy\(storage_options=\.\.\.\)",
    ):
        strategy.save_checkpoint(
            {"state_dict": {}}, tmp_path / "a.ckpt", storage_options={"anon": True}
        )
    checkpoint = {
        "state_dict": {"w": torch.zeros(2)},
        "global_step": 3,
        "hyper_parameters": {"activation": torch.nn.ReLU()},
    }
    with pytest.raises(
        TypeError,
        match=r"training state 'lightning.hyper_parameters.activation' is a "
        r"ReLU.*save_hyperparameters of plain values",
    ):
        strategy.save_checkpoint(checkpoint, tmp_path / "b.ckpt")
    assert not (tmp_path / "b.ckpt").exists()
    with pytest.raises(
        FileNotFoundError,
        match=r"is not a complete checkpoint of HFModelParallelStrategy \(no COMMITTED marker, and "
        r"no CURRENT naming a complete version\)",
    ):
        strategy.load_checkpoint(tmp_path / "missing.ckpt")
