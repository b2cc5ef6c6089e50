"""Kill tests: SIGKILL of the whole job or of one rank at moments spread over a save.

The chain of jobs and every check live in ``tests/support/killchain.py`` (shared with
``scripts/experiments/kill_matrix.py``, which runs the full matrix and writes the results file).
Here: every moment with the whole job killed, and the moments where one rank dies alone that differ
most (the coordinator while planning, a rank mid-write, a rank before the ranks meet, the
coordinator while pruning), on local disk and S3; and a bare writer save followed by
``hf-dcp consolidate``.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.support.jobs import run_job
from tests.support.killchain import bare_kill, kill_chain, moments_for, open_uploads, summary
from tests.support.killpoints import MOMENTS, arm

pytestmark = pytest.mark.distributed

# The suite's share of the matrix (scripts/experiments/kill_matrix.py runs every moment x kind x
# store, and radosgw): every moment with the whole job killed on local disk; on S3 (moto) the
# moments where S3 differs (open uploads, gathering, completing, the commit, pruning); one rank
# alone where the survivors' path differs most (the coordinator while planning, a rank mid-write,
# before the ranks meet, the coordinator while pruning).
_S3_JOB = ("record-written", "finishing", "completing", "index-written", "before-commit", "pruning")
_LOCAL_RANK = ("planning", "early-write", "late-write", "pruning")
_S3_RANK = ("finishing",)
_BARE = ("early-write", "finishing", "before-index", "index-written")
moto_only = pytest.mark.parametrize("s3_endpoint", ["moto"], indirect=True)


def _run(kind: str, moments: tuple[str, ...], url: str, options: dict | None, scratch: str) -> None:
    outcomes = kill_chain(url, options, moments_for(url, moments), kind, scratch)
    assert [o.moment for o in outcomes] == list(moments_for(url, moments))
    assert all(o.survived for o in outcomes), summary(outcomes)


@pytest.mark.parametrize(
    "kind, moments", [("job", MOMENTS), ("rank", _LOCAL_RANK)], ids=["whole-job", "one-rank"]
)
def test_kills_on_local_disk(tmp_path, kind: str, moments: tuple[str, ...]) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    _run(kind, moments, str(tmp_path / "run"), None, str(scratch))


@moto_only
@pytest.mark.parametrize(
    "kind, moments", [("job", _S3_JOB), ("rank", _S3_RANK)], ids=["whole-job", "one-rank"]
)
def test_kills_on_s3(s3, tmp_path, kind: str, moments: tuple[str, ...]) -> None:
    bucket, options = s3
    _run(kind, moments, f"{bucket}/run-{uuid.uuid4().hex[:8]}", options, str(tmp_path))


@moto_only
@pytest.mark.parametrize("moment", _BARE)
def test_a_killed_bare_save_is_consolidated_or_refused_then_saved_again(s3, moment: str) -> None:
    bucket, options = s3
    outcome = bare_kill(f"{bucket}/bare-{uuid.uuid4().hex[:8]}", options, moment, "job")
    assert outcome.survived, summary([outcome])


def _two_big_files(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4096, 768, generator=g), "b": torch.randn(4096, 768, generator=g)}


def _save_two_files(rank: int, world: int, url: str, options: dict, seed: int, kill: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_dcp_storage import HFStorageWriter

    if kill:
        arm("completing", "job", rank)
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)
        for k, v in _two_big_files(seed).items()
    }
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(
            url, storage_options=options, max_shard_size="8MB", overwrite=True
        ),
    )


@moto_only
@pytest.mark.parametrize("lost", [False, True], ids=["finished", "an-upload-lost"])
def test_a_save_killed_while_completing_is_finished_but_a_stale_file_is_never_taken_for_it(
    s3, lost: bool
) -> None:
    # The path holds an older checkpoint with the same layout (same file names and sizes); the
    # new save dies after completing its first file's upload, its second still open.
    import s3fs
    import torch.distributed.checkpoint as dcp

    from hf_dcp_storage import HFStorageReader, consolidate_checkpoint
    from hf_dcp_storage.format.index import INDEX_NAME

    bucket, options = s3
    url = f"{bucket}/two-{uuid.uuid4().hex[:8]}"
    run_job(_save_two_files, 2, url, options, 1, False).check_returned()
    assert run_job(_save_two_files, 2, url, options, 2, True).how() == ["killed", "killed"]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    uploads = open_uploads(url, options)
    assert len(uploads) == 1 and not fs.exists(f"{url}/{INDEX_NAME}"), uploads
    if lost:
        # A lifecycle rule (or a later save) aborted the open upload: the old object of that
        # name, the same size, must not pass for the new save's file.
        from hf_dcp_storage.stores.retry import RetryPolicy
        from hf_dcp_storage.stores.s3_requests import S3

        s3 = S3(fs, RetryPolicy())
        for key, upload_id in s3.list_uploads(url.removeprefix("s3://") + "/"):
            s3.abort_upload(f"{url.removeprefix('s3://').split('/')[0]}/{key}", upload_id)
        with pytest.raises(
            ValueError,
            match=r"multipart uploads of \['model-00002-of-00002.safetensors'\] no longer exist",
        ):
            consolidate_checkpoint(url, storage_options=options)
        assert not fs.exists(f"{url}/{INDEX_NAME}")
        return
    consolidate_checkpoint(url, storage_options=options)
    dest = {k: torch.zeros_like(v) for k, v in _two_big_files(2).items()}
    dcp.load(
        dest,
        storage_reader=HFStorageReader(url, storage_options=options, verify=True),
        no_dist=True,
    )
    assert all(torch.equal(dest[k], v) for k, v in _two_big_files(2).items())
    assert open_uploads(url, options) == []


# GCS and Azure (fake-gcs-server, Azurite): a bare save killed while the coordinator assembles
# the files (GCS: composed the first, Azure: committed the first block list), then consolidated
# from the records (assembled again: idempotent) and saved again. Every moment x kind on both,
# manager saves too: scripts/experiments/kill_matrix.py --stores gcs,azure.
@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_a_bare_save_killed_while_assembling_is_consolidated_on_gcs_and_azure(
    request, store: str
) -> None:
    bucket, options = request.getfixturevalue(store)
    outcome = bare_kill(f"{bucket}/bare-{uuid.uuid4().hex[:8]}", options, "completing", "job")
    assert outcome.survived, summary([outcome])


def test_fake_gcs_server_ignores_the_generation_preconditions_of_compose_sources(gcs) -> None:
    # Why a composed GCS file is checked against its parts (stores/gcs.py, _check_composed): GCS
    # answers 412 to a compose whose source is no longer at the generation the compose requires;
    # fake-gcs-server (1.54) composes whatever the name holds now, and keeps the destination's old
    # generation when it composes onto an existing object.
    import gcsfs

    from hf_dcp_storage.stores.gcs_requests import GCS
    from hf_dcp_storage.stores.retry import RetryPolicy

    bucket, options = gcs
    g = GCS(gcsfs.GCSFileSystem(skip_instance_cache=True, **options), RetryPolicy(max_attempts=1))
    root = bucket.removeprefix("gs://")
    first = g.put(f"{root}/part", b"old bytes")
    g.put(f"{root}/part", b"NEW BYTES")
    made = g.compose(f"{root}/file", [(f"{root}/part", str(first["generation"]))])  # GCS: 412
    assert g.get_range(f"{root}/file", 0, 9) == b"NEW BYTES"
    again = g.compose(f"{root}/file", [(f"{root}/part", None)])
    assert again["generation"] == made["generation"]  # GCS: a new generation for every write


def test_a_gcs_part_changed_after_its_upload_never_enters_a_committed_file(gcs) -> None:
    # The one failure of the GCS kill matrix: a consolidated file that was its two parts in the
    # wrong order (part 2's bytes, then part 1's: the CRC32 the load found, 505cb4a4, is exactly
    # that file's `emb`). Here the parts of a killed save are changed under their names after
    # their uploads (swapped), which GCS's generation preconditions refuse and fake-gcs-server
    # does not: consolidate must refuse to commit what they compose, not write an index for it.
    import gcsfs

    from hf_dcp_storage import consolidate_checkpoint
    from hf_dcp_storage.format.index import INDEX_NAME
    from tests.support.killchain import _bare_job

    bucket, options = gcs
    url = f"{bucket}/swapped-{uuid.uuid4().hex[:8]}"
    assert run_job(_bare_job, 2, url, options, ("before-index", "job"), timeout=120).how() == [
        "killed",
        "killed",
    ]
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
    root = url.removeprefix("gs://")
    parts = sorted(
        p
        for p in fs.find(f"{root}/.hf_dcp_staging/parts")
        if "/model-00001-of-00002.safetensors.part" in p
    )
    assert len(parts) == 2, parts
    one, two = fs.cat_file(parts[0]), fs.cat_file(parts[1])
    fs.pipe_file(parts[0], two)
    fs.pipe_file(parts[1], one)
    with pytest.raises(
        RuntimeError,
        match=r"model-00001-of-00002.safetensors: composed from its 2 parts, it is not their bytes "
        r"in order",
    ):
        consolidate_checkpoint(url, storage_options=options)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{INDEX_NAME}") and not fs.exists(
        f"{root}/model-00001-of-00002.safetensors"
    )
