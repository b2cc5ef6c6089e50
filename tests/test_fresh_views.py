"""No decision about what another process may have written comes from a cache.

fsspec filesystems are shared per process and keep a listings cache; a process that listed a
folder (``latest()``, a save's clean-up of its destination) would otherwise answer later
``exists``/``ls``/``info``/``find`` from that listing after other ranks or jobs wrote into it.
These tests pin both halves: the library asks only through ``io/fsio.py``'s fresh queries, and on
S3 with the cache on (the default) one process lists, another writes, the first decides right.
"""

from __future__ import annotations

import ast
import json
import pathlib
import uuid

import pytest
import torch

import hf_dcp_storage
from hf_dcp_storage.io import fsio as _fsio

# The fsspec calls that read a store's metadata or whole files (each may be answered from the
# listings cache, or sized from it). Only io/fsio.py may make them, each after ``forget``.
_METADATA_CALLS = {
    "exists",
    "lexists",
    "isdir",
    "isfile",
    "info",
    "size",
    "sizes",
    "ls",
    "find",
    "glob",
    "walk",
    "du",
    "cat",
    "cat_file",
    "open",
    "modified",
    "checksum",
    "ukey",
    "head",
    "tail",
    "expand_path",
}


def _fs_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, call)`` of every ``<something fs>.<metadata call>(...)`` in a module."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _METADATA_CALLS
        ):
            receiver = ast.unparse(node.func.value)
            if receiver.split(".")[-1].endswith("fs"):
                found.append((node.lineno, f"{receiver}.{node.func.attr}"))
    return found


def test_only_fsio_queries_a_store_directly() -> None:
    package = pathlib.Path(hf_dcp_storage.__file__).parent
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() == "io/fsio.py":
            continue
        calls = _fs_calls(ast.parse(path.read_text(), str(path)))
        if calls:
            offenders[str(path.relative_to(package))] = calls
    assert offenders == {}, (
        "query the store through io/fsio.py (fresh, never from fsspec's listings cache): "
        f"{offenders}"
    )


def test_the_scan_sees_a_direct_call() -> None:
    # The check above must be able to fail.
    assert _fs_calls(
        ast.parse(
            "def f(self, fs):\n    fs.exists(p)\n    self.fs.find(p)\n    os.path.exists(p)\n"
        )
    ) == [(2, "fs.exists"), (3, "self.fs.find")]


def test_forget_drops_listings_of_every_folder_below() -> None:
    # A memory filesystem has no listings cache: use fsspec's own DirCache on a stand-in.
    from fsspec.dircache import DirCache

    class _Fs:
        dircache = DirCache()

        def _strip_protocol(self, p: str) -> str:
            return p

        def invalidate_cache(self, p: str) -> None:
            while p:
                self.dircache.pop(p, None)
                p = p.rpartition("/")[0]

    fs = _Fs()
    for key in (
        "b",
        "b/run",
        "b/run/step_1",
        "b/run/step_1/.hf_dcp_staging",
        "b/run/step_10",
        "b/other",
    ):
        fs.dircache[key] = []
    _fsio.forget(fs, "b/run/step_1")  # type: ignore[arg-type]
    assert sorted(fs.dircache) == ["b/other", "b/run/step_10"]


# -- S3 with fsspec's defaults: one shared instance per process, listings cache on ---------------


def _user_options(endpoint: str) -> dict:
    """What a user passes: credentials and an endpoint; fsspec's instance and listings caches on."""
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


def _other_process(endpoint: str):
    """A filesystem with caches of its own: what another process (rank, job, tool) writes with."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **_user_options(endpoint))


def _fresh_keys(endpoint: str, bucket: str) -> list[str]:
    fs = _other_process(endpoint)
    return sorted(p.split("/", 1)[1] for p in fs.find(bucket))


@pytest.fixture
def bucket(s3_endpoint: str):
    fs = _other_process(s3_endpoint)
    name = f"hf-dcp-fresh-{uuid.uuid4().hex[:16]}"
    fs.mkdir(name)
    yield name
    fs.rm(name, recursive=True)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def test_every_query_sees_what_another_process_wrote_after_this_one_listed(
    s3_endpoint: str, bucket: str
) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**_user_options(s3_endpoint))  # the process-wide instance a user gets
    other = _other_process(s3_endpoint)
    d = f"{bucket}/run/step_1"
    other.pipe_file(f"{d}/a", b"1")

    def prime() -> None:
        fs.invalidate_cache()
        fs.find(f"{bucket}/run", withdirs=True)  # caches run/, step_1/ and everything seen

    prime()
    other.pipe_file(f"{d}/.hf_dcp_staging/save.json", b"{}")
    other.pipe_file(f"{d}/a", b"1234")
    # fsspec's own answers are stale here: this is the cache the library must not trust.
    assert not fs.exists(f"{d}/.hf_dcp_staging") and fs.size(f"{d}/a") == 1
    prime()
    other.pipe_file(f"{d}/.hf_dcp_staging/rank00000.json", b"{}")
    other.pipe_file(f"{d}/b", b"22")
    assert _fsio.exists(fs, f"{d}/.hf_dcp_staging/rank00000.json")
    assert _fsio.isfile(fs, f"{d}/b") and _fsio.size(fs, f"{d}/b") == 2
    prime()
    other.pipe_file(f"{d}/a", b"123456")
    assert _fsio.size(fs, f"{d}/a") == 6 and _fsio.read_all(fs, f"{d}/a") == b"123456"
    with _fsio.open_read(fs, f"{d}/a", 2) as f:
        assert f.read() == b"123456"
    prime()
    other.pipe_file(f"{bucket}/run/step_2/c", b"3")
    assert _fsio.isdir(fs, f"{bucket}/run/step_2")
    assert "step_2" in _fsio.list_names(fs, f"{bucket}/run")
    assert f"{bucket}/run/step_2" in {
        e["name"].rstrip("/") for e in _fsio.list_entries(fs, f"{bucket}/run")
    }
    prime()
    other.pipe_file(f"{d}/.hf_dcp_staging/x.rank00001", b"4")
    assert "x.rank00001" in {p.rsplit("/", 1)[1] for p in _fsio.find_entries(fs, d)}
    assert ".hf_dcp_staging/x.rank00001" in _fsio.list_tree(fs, d)
    prime()
    other.pipe_file(f"{d}/.hf_dcp_staging/late", b"5")
    other.rm(f"{d}/b")
    assert not _fsio.exists(fs, f"{d}/b")
    prime()
    other.pipe_file(f"{d}/.hf_dcp_staging/later", b"6")
    _fsio.remove_tree(fs, f"{d}/.hf_dcp_staging")
    assert [k for k in _fresh_keys(s3_endpoint, bucket) if ".hf_dcp_staging" in k] == []


def test_a_long_lived_process_sees_what_another_wrote(s3_endpoint: str, bucket: str) -> None:
    import torch.distributed.checkpoint as dcp

    from hf_dcp_storage import CheckpointManager, HFStorageWriter, list_steps, prune_run

    opts = _user_options(s3_endpoint)
    run = f"s3://{bucket}/run"
    manager = CheckpointManager(run, keep_last_n=1, storage_options=opts)
    assert manager.latest() is None  # this process has now listed the (empty) run folder
    # Another process saves step 1 completely.
    other = _other_process(s3_endpoint)
    dcp.save(
        {"w": torch.arange(6.0)},
        storage_writer=HFStorageWriter(
            f"{run}/step_1", storage_options={**opts, "skip_instance_cache": True}
        ),
        no_dist=True,
    )
    other.pipe_file(
        f"{bucket}/run/step_1/COMMITTED",
        json.dumps({"step": 1, "world_size": 1, "format": 1}).encode(),
    )
    assert manager.latest() == 1
    assert [s.step for s in list_steps(run, storage_options=opts) if s.complete] == [1]
    # It also leaves junk in the step folder: this process must see it when it decides.
    other.pipe_file(f"{bucket}/run/step_1/.hf_dcp_staging/leftover", b"x")
    # Saving step 2 here prunes step 1 (keep_last_n=1): every key of it goes, seen or not.
    manager.save(2, {"w": torch.arange(6.0) + 1})
    assert not [k for k in _fresh_keys(s3_endpoint, bucket) if k.startswith("run/step_1/")]
    # The other process writes a step 3 folder's leftovers; prune from here sees them as incomplete.
    other.pipe_file(f"{bucket}/run/step_3/model-00001-of-00001.safetensors", b"partial")
    result = prune_run(run, keep_last_n=1, include_unfinished=True, storage_options=opts)
    assert result.removed == (3,)
    assert [k for k in _fresh_keys(s3_endpoint, bucket) if "step_3" in k] == []


def test_a_manager_save_leaves_no_staging_behind(s3_endpoint: str, bucket: str) -> None:
    # The reported leak: the manager lists the step folder, then the writers stage into it.
    from hf_dcp_storage import CheckpointManager, verify_checkpoint

    run = f"s3://{bucket}/run"
    manager = CheckpointManager(run, keep_last_n=3, storage_options=_user_options(s3_endpoint))
    manager.save(1, {"w": torch.randn(64, 32)}, {"opt": {"m": torch.randn(16)}, "epoch": 3})
    keys = _fresh_keys(s3_endpoint, bucket)
    assert [k for k in keys if ".hf_dcp_staging" in k] == [], keys
    assert verify_checkpoint(f"{run}/step_1", storage_options=_user_options(s3_endpoint)).ok
