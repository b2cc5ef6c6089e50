"""A checkpoint saved over in place under one name (Lightning's ``last.ckpt``): ``steps/named.py``.

The previous checkpoint must stay loadable until the new one is committed, whatever moment a
crash comes at. The kill chain saves one name over and over on two gloo ranks, SIGKILLing the
whole job at three moments of a save over a flat checkpoint and over a version: mid-write (rank
1 has written its first slab of the new weights), committed (the new version's ``COMMITTED`` is
written, ``CURRENT`` not yet), switched (``CURRENT`` is written, the old checkpoint not yet
touched) and removing (the old checkpoint's marker is gone, its files not yet). After each kill a
fresh process resolves the name and loads it: the old step before the switch, the new one after. A
clean save then leaves the name holding one checkpoint only.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import fsspec
import pytest
import torch

from hf_dcp_storage.steps import folder as ckpt_folder
from hf_dcp_storage.steps import named
from hf_dcp_storage.steps.control import Control
from hf_dcp_storage.steps.retention import COMMIT_MARKER
from tests.support.data import assert_same
from tests.support.jobs import kill_job, run_job
from tests.support.killpoints import arm

moto_only = pytest.mark.parametrize("s3_endpoint", ["moto"], indirect=True)
JOB_TIMEOUT_S = 120.0

# (step saved, moment the job is killed at or None, the step the name must load afterwards)
_CHAIN = (
    (1, None, 1),  # the first save under the name: flat
    (2, "writing", 1),  # over a flat checkpoint
    (3, "committed", 1),
    (4, "switched", 4),  # the flat checkpoint's files stay behind, CURRENT names step 4
    (5, None, 5),  # removes them
    (6, "writing", 5),  # over a version
    (7, "committed", 5),
    (8, "removing", 8),
    (9, "switched", 9),
    (10, None, 10),
)


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return {"emb": torch.randn(1024, 256, generator=g), "norm": torch.randn(256, generator=g)}


def _state(step: int) -> dict[str, Any]:
    return {"m": torch.full((64,), float(step)), "epoch": step}


def _arm(moment: str) -> None:
    """Make this job die at ``moment`` of its save (the process dies: the patches go with it)."""
    if moment == "writing":
        arm("early-write", "job", 1)
        return
    write_atomic, remove = named.fsio.write_atomic, named.fsio.remove
    if moment == "committed":

        def die_before_switch(*args: Any) -> None:
            kill_job()

        named._switch = die_before_switch
    elif moment == "switched":

        def current_then_die(fs: Any, path: str, data: bytes) -> None:
            write_atomic(fs, path, data)
            if path.endswith("/" + named.CURRENT_MARKER):
                kill_job()

        named.fsio.write_atomic = current_then_die
    elif moment == "removing":
        switched = []  # CURRENT written by this process: the old checkpoint goes from here on

        def note_current(fs: Any, path: str, data: bytes) -> None:
            write_atomic(fs, path, data)
            switched.append(path.endswith("/" + named.CURRENT_MARKER))

        def marker_then_die(fs: Any, path: str) -> None:
            existed = (
                any(switched) and path.endswith("/" + COMMIT_MARKER) and named.fsio.exists(fs, path)
            )
            remove(fs, path)
            if existed:
                kill_job()

        named.fsio.write_atomic, named.fsio.remove = note_current, marker_then_die
    else:
        raise ValueError(moment)


def _save_job(
    rank: int, world: int, url: str, options: dict | None, step: int, moment: str | None
) -> None:
    from tests.support.killchain import _sharded

    control = Control()
    fs, name = ckpt_folder.locate(url, options)
    tensors, payload = ckpt_folder.prepare(control, step, _state(step))
    if moment is not None:
        _arm(moment)
    named.save(
        control,
        fs,
        name,
        step,
        _sharded(_weights(step), world),
        tensors,
        payload,
        {"storage_options": options, "rank_timeout": 10.0},
    )


def _loaded_step(url: str, options: dict | None) -> int:
    """What a fresh process finds under the name: its step, after checking every byte it loads."""
    fs, name = fsspec.core.url_to_fs(url, **(options or {}))
    folder = named.resolve(fs, name)
    assert folder is not None, (
        f"{url}: no loadable checkpoint under the name: {sorted(fs.find(name))}"
    )
    step = json.loads(fs.cat_file(f"{folder}/COMMITTED"))["step"]
    weights, state = (
        {k: torch.zeros_like(v) for k, v in _weights(0).items()},
        {"m": torch.zeros(64), "epoch": -1},
    )
    ckpt_folder.load(fs, folder, weights, state, rank=0, reader_io={"storage_options": options})
    for key, value in _weights(step).items():
        assert_same(weights[key], value, f"{url} step {step}: {key}")
    assert torch.equal(state["m"], torch.full((64,), float(step))) and state["epoch"] == step
    return step


def _entries(url: str, options: dict | None) -> list[str]:
    fs, name = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/", 1)[1] for p in fs.ls(name))


def _chain(url: str, options: dict | None) -> None:
    for step, moment, expected in _CHAIN:
        ended = run_job(_save_job, 2, url, options, step, moment, timeout=JOB_TIMEOUT_S)
        if moment is None:
            ended.check_returned()
        else:
            assert ended.how() == ["killed", "killed"], (
                f"step {step}, kill at {moment}: {ended.ranks}"
            )
        assert _loaded_step(url, options) == expected, f"after step {step} (killed at {moment})"
        if moment is None and step > 1:
            # A clean save leaves one checkpoint: CURRENT and its version, nothing a kill left.
            entries = _entries(url, options)
            assert (
                entries[0] == named.CURRENT_MARKER
                and len(entries) == 2
                and entries[1].startswith(f"{named.VERSION_PREFIX}{step}-")
            ), entries


@pytest.mark.distributed
def test_kills_while_a_name_is_saved_over_on_local_disk(tmp_path) -> None:
    _chain(str(tmp_path / "last.ckpt"), None)


@pytest.mark.distributed
@moto_only
def test_kills_while_a_name_is_saved_over_on_s3(s3) -> None:
    bucket, options = s3
    _chain(f"{bucket}/run-{uuid.uuid4().hex[:8]}/last.ckpt", options)


# -- one process -------------------------------------------------------------------------------


def _save_here(url: str, step: int) -> str:
    control = Control()
    fs, name = ckpt_folder.locate(url, None)
    tensors, payload = ckpt_folder.prepare(control, step, _state(step))
    return named.save(control, fs, name, step, _weights(step), tensors, payload, {})


def test_a_name_is_flat_until_saved_over_then_versioned_and_removed_markers_first(tmp_path) -> None:
    url = str(tmp_path / "last.ckpt")
    assert _save_here(url, 1) == url
    assert "COMMITTED" in _entries(url, None) and named.CURRENT_MARKER not in _entries(url, None)
    second = _save_here(url, 2)
    assert second.startswith(f"{url}/{named.VERSION_PREFIX}2-")
    assert _entries(url, None) == sorted(
        [named.CURRENT_MARKER, second.rsplit("/", 1)[1]]
    )  # the flat one is gone
    assert _loaded_step(url, None) == 2
    fs, name = ckpt_folder.locate(url, None)
    named.remove(fs, name)
    assert not fs.exists(name) and named.resolve(fs, name) is None


@pytest.mark.parametrize(
    "pointer",
    [b"not json", b'{"version": "../elsewhere"}', b'{"step": 3}'],
    ids=["garbled", "escaping", "no-version"],
)
def test_a_current_marker_not_written_here_is_refused_naming_it(tmp_path, pointer: bytes) -> None:
    url = str(tmp_path / "last.ckpt")
    _save_here(url, 1)
    (tmp_path / "last.ckpt" / named.CURRENT_MARKER).write_bytes(pointer)
    fs, name = ckpt_folder.locate(url, None)
    with pytest.raises(
        ValueError, match=r"CURRENT: not a pointer to a checkpoint version .* remove the file"
    ):
        named.resolve(fs, name)
