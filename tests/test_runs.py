"""``runs``: listing, pruning and removing the step checkpoints of a run folder (``hf-dcp
ls/prune``).

Runs are built by real ``CheckpointManager`` saves plus hand-made leftovers: a crashed older
save, a newer unfinished one (a save possibly still running), and names that are not steps
(``step_01`` even with a marker inside, ``notes.txt``), which must never be listed or touched.
"""

from __future__ import annotations

import json
import posixpath
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import fsspec
import pytest
import torch

from hf_dcp_storage import CheckpointManager
from hf_dcp_storage.steps.retention import COMMIT_MARKER, RetentionPolicy, to_remove
from hf_dcp_storage.steps.runs import (
    PruneResult,
    StepInfo,
    _posix_mtime,
    list_steps,
    prune_run,
    remove_step,
    step_status,
)

COMPLETE = (10, 20, 30, 40)
OLD_CRASH, IN_FLIGHT = 15, 50  # incomplete: older than the newest complete step, and newer
# Files of the non-steps; they must come through every listing and pruning byte for byte.
OTHERS = {"notes.txt": b"keep me", "step_01/COMMITTED": b"{}", "step_01/weights.bin": b"\0" * 64}


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(32, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
    }


def _put(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    fs.makedirs(
        posixpath.dirname(path), exist_ok=True
    )  # local disk needs the folder; elsewhere a no-op
    fs.pipe_file(path, data)


def _build_run(url: str, options: dict | None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Steps ``COMPLETE`` saved by the manager (nothing pruned), then the leftovers and
    non-steps."""
    mgr = CheckpointManager(url, keep_last_n=len(COMPLETE), storage_options=options)
    for step in COMPLETE:
        mgr.save(step, _model(step), {"epoch": step // 10})
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    _put(fs, f"{root}/step_{OLD_CRASH}/training_state/rank_00000.json", b'{"values": {}}')
    _put(fs, f"{root}/step_{OLD_CRASH}/model-00001-of-00001.safetensors", b"\1" * 1000)
    _put(fs, f"{root}/step_{IN_FLIGHT}/model-00001-of-00001.safetensors", b"\2" * 300)
    for rel, data in OTHERS.items():
        _put(fs, f"{root}/{rel}", data)
    return fs, root


def _files(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes, read one by one (independent of ``list_steps``)."""
    fs.invalidate_cache(root)
    return {posixpath.relpath(p, root): fs.cat_file(p) for p in fs.find(root)}


def _snapshot(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, tuple[int, float | None]]:
    """Every file under ``root`` with its size and modification time: one listing, to see that
    nothing was written or deleted."""
    fs.invalidate_cache(root)
    return {
        posixpath.relpath(p, root): (info["size"], _posix_mtime(info))
        for p, info in fs.find(root, detail=True).items()
    }


def _check_listing(
    url: str, options: dict | None, fs: fsspec.AbstractFileSystem, root: str, t0: float, t1: float
) -> list[StepInfo]:
    infos = list_steps(url, storage_options=options)
    assert [(i.step, i.complete) for i in infos] == [
        (10, True),
        (OLD_CRASH, False),
        (20, True),
        (30, True),
        (40, True),
        (IN_FLIGHT, False),
    ]
    files = _files(fs, root)
    for info in infos:
        prefix = f"step_{info.step}/"
        mine = {rel: data for rel, data in files.items() if rel.startswith(prefix)}
        assert info.name == f"step_{info.step}"
        assert info.url.rstrip("/").endswith(f"/step_{info.step}")
        assert (info.files, info.size) == (len(mine), sum(len(d) for d in mine.values())), info
        assert (f"{prefix}{COMMIT_MARKER}" in mine) == info.complete
        # Object stores keep whole seconds; file systems may stamp a tick before time.time().
        assert info.modified is not None and t0 - 2 <= info.modified <= t1 + 2, (info, t0, t1)
    committed = [i.modified for i in infos if i.complete]
    assert committed == sorted(committed)  # saved in step order, so committed in step order
    assert json.loads(json.dumps([i.to_dict() for i in infos]))[0]["step"] == 10
    return infos


def _check_pruning(
    url: str, options: dict | None, fs: fsspec.AbstractFileSystem, root: str
) -> None:
    before = (_snapshot(fs, root), list_steps(url, storage_options=options))
    steps = {s: s in COMPLETE for s in (*COMPLETE, OLD_CRASH, IN_FLIGHT)}
    # keep the newest 2 (30, 40) and multiples of 20 (20, 40); the crashed 15 goes; 50 may be a
    # save.
    dry = prune_run(url, keep_last_n=2, keep_every=20, dry_run=True, storage_options=options)
    assert dry == PruneResult(
        removed=(10, OLD_CRASH), kept=(20, 30, 40), in_progress=(IN_FLIGHT,), dry_run=True
    )
    assert list(dry.removed) == to_remove(steps, RetentionPolicy(2, 20), in_flight=[IN_FLIGHT])
    assert (_snapshot(fs, root), list_steps(url, storage_options=options)) == before
    dry_all = prune_run(
        url,
        keep_last_n=2,
        keep_every=20,
        dry_run=True,
        include_unfinished=True,
        storage_options=options,
    )
    assert (dry_all.removed, dry_all.in_progress) == ((10, OLD_CRASH, IN_FLIGHT), ())
    assert (_snapshot(fs, root), list_steps(url, storage_options=options)) == before

    done = prune_run(url, keep_last_n=2, keep_every=20, storage_options=options)
    assert done == PruneResult(
        removed=(10, OLD_CRASH), kept=(20, 30, 40), in_progress=(IN_FLIGHT,), dry_run=False
    )
    assert done.to_dict() == {
        "removed": [10, OLD_CRASH],
        "kept": [20, 30, 40],
        "in_progress": [IN_FLIGHT],
        "dry_run": False,
    }
    after = _snapshot(fs, root)
    assert {rel: before[0][rel] for rel in after} == after  # the survivors untouched
    assert {rel.split("/")[0] for rel in after} == {
        "notes.txt",
        "step_01",
        "step_20",
        "step_30",
        "step_40",
        f"step_{IN_FLIGHT}",
    }
    assert {rel: fs.cat_file(f"{root}/{rel}") for rel in OTHERS} == OTHERS

    # The tool and the training job agree: the manager (which knows no save is running) removes
    # what the tool removes with include_unfinished.
    expected = prune_run(
        url, keep_last_n=1, dry_run=True, include_unfinished=True, storage_options=options
    )
    assert expected.removed == (20, 30, IN_FLIGHT)
    assert CheckpointManager(url, keep_last_n=1, storage_options=options).prune() == list(
        expected.removed
    )
    assert [(i.step, i.complete) for i in list_steps(url, storage_options=options)] == [(40, True)]
    assert {
        rel: data for rel, data in _files(fs, root).items() if not rel.startswith("step_40/")
    } == OTHERS


# -- local path, file://, memory:// ---------------------------------------------------------------


def test_list_steps_reports_every_step_with_real_sizes_and_times(url: str) -> None:
    t0 = time.time()
    fs, root = _build_run(url, None)
    infos = _check_listing(url, None, fs, root, t0, time.time())
    assert next(i for i in infos if i.step == IN_FLIGHT).size == 300


def test_prune_run_applies_the_managers_rules_and_leaves_other_names(url: str) -> None:
    fs, root = _build_run(url, None)
    _check_pruning(url, None, fs, root)


def test_remove_step_takes_the_marker_first_and_only_the_step(url: str) -> None:
    mgr = CheckpointManager(url)
    mgr.save(1, _model(1))
    fs, root = fsspec.core.url_to_fs(url)
    _put(fs, f"{root}/notes.txt", b"keep me")
    (full,) = list_steps(url)
    marker = len(fs.cat_file(f"{root}/step_1/{COMMIT_MARKER}"))
    # What an interrupted remove_step leaves (its first deletion is the marker): an incomplete
    # step, which nothing loads and the next prune removes.
    fs.rm_file(f"{root}/step_1/{COMMIT_MARKER}")
    (half,) = list_steps(url)
    assert (half.complete, half.files, half.size) == (False, full.files - 1, full.size - marker)
    assert mgr.latest() is None
    remove_step(fs, root, 1)
    remove_step(fs, root, 2)  # not there: nothing to do
    assert list_steps(url) == []
    assert _files(fs, root) == {"notes.txt": b"keep me"}


def test_a_missing_run_folder_is_an_error_for_the_tool_and_no_steps_for_the_manager(
    url: str,
) -> None:
    with pytest.raises(ValueError, match=r"keep_last_n=0 must be an int >= 1"):
        prune_run(url, keep_last_n=0)  # refused before the folder is even looked at
    with pytest.raises(
        FileNotFoundError,
        match=r"ckpt: no such run folder \(nothing is stored under it\); give the folder that "
        r"holds the step_N checkpoints",
    ):
        list_steps(url)
    with pytest.raises(FileNotFoundError, match=r"no such run folder"):
        prune_run(url, keep_last_n=1)
    assert CheckpointManager(url).all_checkpoints() == []
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root)
    assert list_steps(url) == []
    # A save that crashed before its first file left an empty folder: an incomplete step.
    fs.makedirs(f"{root}/step_3/training_state")
    (empty,) = list_steps(url)
    assert (empty.step, empty.complete, empty.files, empty.size, empty.modified) == (
        3,
        False,
        0,
        0,
        None,
    )
    assert CheckpointManager(url).prune() == [3]
    assert list_steps(url) == []


_T = datetime(2026, 11, 30, 18, 6, 9, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(
    "info,expected",
    [
        ({"mtime": _T + 0.25, "created": 0.0}, _T + 0.25),  # local disk: mtime wins over created
        ({"LastModified": datetime(2026, 11, 30, 18, 6, 9, tzinfo=timezone.utc)}, _T),  # s3fs
        (
            {"LastModified": datetime(2026, 11, 30, 19, 6, 9, tzinfo=timezone(timedelta(hours=1)))},
            _T,
        ),
        ({"last_modified": datetime(2026, 11, 30, 18, 6, 9)}, _T),  # naive: UTC
        ({"updated": "2026-11-30T18:06:09Z"}, _T),  # ISO string
        ({"created": _T}, _T),  # memory://
        ({"LastModified": "", "created": int(_T)}, _T),  # s3fs' placeholder for "unknown"
        ({"size": 3}, None),
        ({"mtime": True}, None),
    ],
)
def test_modification_times_of_every_backend_become_posix_seconds(
    info: dict, expected: float | None
) -> None:
    assert _posix_mtime(info) == expected


# -- S3 -------------------------------------------------------------------------------------------


def test_on_s3_one_listing_reports_and_prunes_the_run(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/run1"
    t0 = time.time()
    fs, root = _build_run(url, options)
    _check_listing(url, options, fs, root, t0, time.time())
    _check_pruning(url, options, fs, root)
    with pytest.raises(FileNotFoundError, match=r"s3://.*/nothing-here: no such run folder"):
        list_steps(f"{bucket}/nothing-here", storage_options=options)


@pytest.fixture
def proxied_run(s3_endpoint: str) -> Iterator[tuple[object, str, dict]]:
    """``(proxy, s3://bucket/run, options through a fault proxy)``, botocore's retries off."""
    s3fs = pytest.importorskip("s3fs")
    from tests.support.faultproxy import FaultProxy
    from tests.support.storage_options import s3_storage_options

    direct = s3fs.S3FileSystem(**s3_storage_options(s3_endpoint))
    bucket = f"hf-dcp-runs-{uuid.uuid4().hex[:16]}"
    direct.mkdir(bucket)
    with FaultProxy(upstream=s3_endpoint) as proxy:
        options = {
            **s3_storage_options(proxy.endpoint),
            "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
        }
        yield proxy, f"s3://{bucket}/run", options
        assert proxy.errors == []
    direct.rm(bucket, recursive=True)


def test_on_s3_a_remove_cut_short_leaves_an_incomplete_step(proxied_run) -> None:
    """The bulk delete of the folder fails (403): the marker is already gone, so the step is
    incomplete, never "complete" with files missing; and the wire shows the marker went first."""
    from tests.support.faultproxy import Fault

    proxy, url, options = proxied_run
    CheckpointManager(url, storage_options=options).save(1, _model(1))
    fs, root = fsspec.core.url_to_fs(url, **options)
    (full,) = list_steps(url, storage_options=options)
    proxy.clear()
    proxy.add_fault(Fault("403", method="POST", query_has="delete"))
    with pytest.raises(PermissionError):
        remove_step(fs, root, 1)
    deletes = [
        (r.method, r.path) for r in proxy.requests if r.method == "DELETE" or "delete" in r.query
    ]
    assert deletes[0] == ("DELETE", f"/{root}/step_1/{COMMIT_MARKER}"), deletes
    assert deletes[1][0] == "POST", deletes
    (half,) = list_steps(url, storage_options=options)
    assert (half.complete, half.files) == (False, full.files - 1)
    assert prune_run(
        url, keep_last_n=1, include_unfinished=True, storage_options=options
    ).removed == (1,)
    assert _files(fs, root) == {}


def _check_step_status(url: str, options: dict | None) -> None:
    fs, root = _build_run(url, options)
    _put(fs, f"{root}/step_99", b"a file named like a step is not one")
    status = step_status(fs, root)
    assert status == {10: True, 15: False, 20: True, 30: True, 40: True, 50: False}
    assert status == {info.step: info.complete for info in list_steps(url, storage_options=options)}
    assert step_status(fs, root + "-missing", missing_ok=True) == {}


def test_step_status_agrees_with_the_full_listing(url: str) -> None:
    """Retention's cheap view (top-level listing + one marker check per step) sees exactly the
    steps and completeness the full listing sees, files named like steps included."""
    _check_step_status(url, None)


def test_on_s3_step_status_agrees_with_the_full_listing(s3) -> None:
    bucket, options = s3
    _check_step_status(f"{bucket}/run", options)
