"""Finishing interrupted saves from their records: ``consolidate_checkpoint``.

A save is interrupted two ways here, both real: the coordinator process is killed
(``os._exit``) at the start of ``finish``, after every rank has written its bytes and its record
(2 gloo ranks, local disk and S3); or, in one process, ``finish`` fails with an error (any store).
Either way the folder has data and records but no index. The consolidated result must be
byte-identical, file for file, to an uninterrupted save of the same tensors.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import fsspec
import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hf_dcp_storage import HFStorageWriter
from hf_dcp_storage import writer as writer_module
from hf_dcp_storage.format.header import TensorEntry, encode_header
from hf_dcp_storage.plan.layout import layout_from_files
from hf_dcp_storage.session.records import ItemRecord, RankRecord, RecordError, SaveRecord
from hf_dcp_storage.tools.consolidate import consolidate_checkpoint
from hf_dcp_storage.tools.inspection import inspect_checkpoint
from tests.support.checks import raises_in_checkpoint
from tests.support.data import folder_bytes, random_tensor, seed_of
from tests.support.dist import run_ranks

STAGING = ".hf_dcp_staging"
INDEX = "model.safetensors.index.json"
# Several files; the S3 case's 20 MiB tensor gives each of 2 ranks a 10 MiB run, uploaded as its
# own multipart part, while the small tensors' runs are staged and gathered.
MAX_SHARD = 4000
SHAPES = {
    "a.rows": ((12, 8), torch.float32, Shard(0)),
    "b.cols": ((6, 10), torch.bfloat16, Shard(1)),
    "c.replicated": ((5,), torch.float64, Replicate()),
    "d.ints": ((7, 3), torch.int32, Shard(0)),
}
BIG = {"big.rows": ((5120, 1024), torch.float32, Shard(0))}


def _full(big: bool) -> dict[str, torch.Tensor]:
    shapes = {**SHAPES, **(BIG if big else {})}
    return {k: random_tensor(shape, dtype, seed_of(k)) for k, (shape, dtype, _) in shapes.items()}


def _reference(tmp_path: Path, big: bool) -> dict[str, bytes]:
    """Files of an uninterrupted one-process save of the same tensors."""
    ref = tmp_path / "reference"
    dcp.save(
        _full(big),
        storage_writer=HFStorageWriter(str(ref), max_shard_size=MAX_SHARD, overwrite=True),
    )
    return folder_bytes(ref)


def _killed_in_finish(
    rank: int,
    world: int,
    url: str,
    options: dict | None,
    big: bool,
    direct: bool | None,
    gather_memory: str | int,
) -> None:
    """(spawned) Save 2-rank DTensors; the coordinator dies as ``finish`` starts."""
    if rank == 0:
        writer_module.HFStorageWriter.finish = lambda *args: os._exit(17)  # type: ignore[method-assign]
    mesh = init_device_mesh("cpu", (world,))
    shapes = {**SHAPES, **(BIG if big else {})}
    sd = {k: distribute_tensor(t, mesh, [shapes[k][2]]) for k, t in _full(big).items()}
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(
            url,
            storage_options=options,
            max_shard_size=MAX_SHARD,
            direct_write=direct,
            gather_memory=gather_memory,
        ),
    )


def _kill_coordinator_in_finish(
    url: str,
    options: dict | None = None,
    *,
    big: bool = False,
    direct: bool | None = None,
    gather_memory: str | int = "2GB",
) -> None:
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        run_ranks(_killed_in_finish, 2, url, options, big, direct, gather_memory)


class _FinishFails(HFStorageWriter):
    def finish(self, metadata, results) -> None:  # type: ignore[override]
        raise RuntimeError("coordinator lost")


def _fail_in_finish(
    url: str, options: dict | None = None, *, big: bool = False, direct: bool | None = None
) -> None:
    with raises_in_checkpoint(RuntimeError, "coordinator lost"):
        dcp.save(
            _full(big),
            storage_writer=_FinishFails(
                url, storage_options=options, max_shard_size=MAX_SHARD, direct_write=direct
            ),
        )


def _tree(url: str, options: dict | None = None) -> dict[str, bytes]:
    """``relative path -> bytes`` of every file under ``url``, on any store."""
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    if not fs.exists(root):
        return {}
    return {posixpath.relpath(p, root): fs.cat_file(p) for p in fs.find(root)}


def _staging(tree: dict[str, bytes]) -> list[str]:
    return sorted(n for n in tree if n.startswith(STAGING + "/"))


def _committed(tree: dict[str, bytes]) -> dict[str, bytes]:
    return {n: b for n, b in tree.items() if not n.startswith(STAGING + "/")}


# -- interrupted for real: the coordinator killed, 2 ranks ---------------------------------------


@pytest.mark.distributed
def test_local_save_whose_coordinator_died_is_committed_in_place(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _kill_coordinator_in_finish(url)
    before = _tree(url)
    assert INDEX not in before
    assert _staging(before) == [
        f"{STAGING}/rank00000.json",
        f"{STAGING}/rank00001.json",
        f"{STAGING}/save.json",
    ]
    report = consolidate_checkpoint(url)
    assert (report.mode, report.moved_bytes, report.already_complete, report.tensors) == (
        "direct",
        0,
        False,
        len(SHAPES),
    )
    # The bytes were already in place: only the index was missing, and it is exactly what the
    # uninterrupted save writes (same layout, same checksums).
    assert _tree(url) == _reference(tmp_path, big=False)


@pytest.mark.distributed
@pytest.mark.parametrize("gather", ["network", "store"])
def test_s3_save_whose_coordinator_died_is_completed_in_place(
    s3, tmp_path: Path, gather: str
) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_1"
    _kill_coordinator_in_finish(
        url, options, big=True, gather_memory="2GB" if gather == "network" else 0
    )
    fs = s3fs.S3FileSystem(**options)
    name = bucket.removeprefix("s3://")
    assert fs.list_multipart_uploads(name), "the killed save leaves its uploads open"
    with pytest.raises(
        ValueError, match=r"was being saved to S3: .* can only be completed in place"
    ):
        consolidate_checkpoint(url, str(tmp_path / "elsewhere"), storage_options=options)
    assert not (tmp_path / "elsewhere").exists()
    report = consolidate_checkpoint(url, storage_options=options)
    assert report.mode == "s3"
    # Each rank's 10 MiB run was its own part. Staged in the store, the small runs were fetched
    # and sent again; gathered over the ranks' network, their parts were uploaded before the
    # coordinator died and the ranks' records name them: nothing moves again.
    if gather == "store":
        assert 0 < report.moved_bytes < 100_000
    else:
        assert report.moved_bytes == 0
    assert _tree(url, options) == _reference(tmp_path, big=True)
    assert fs.list_multipart_uploads(name) == []


# -- interrupted by an error in finish, one process ----------------------------------------------


@pytest.mark.parametrize("direct", [None, False], ids=["auto", "staged"])
def test_failed_finish_is_consolidated_in_place_on_any_store(
    url: str, direct: bool | None, tmp_path: Path
) -> None:
    _fail_in_finish(url, direct=direct)
    assert INDEX not in _tree(url)
    report = consolidate_checkpoint(url)
    assert report.mode == (
        "direct" if direct is None and not url.startswith("memory") else "staged"
    )
    assert _tree(url) == _reference(tmp_path, big=False)


def test_staged_save_is_consolidated_into_another_store_and_the_source_is_left_alone(
    tmp_path: Path,
) -> None:
    src = str(tmp_path / "interrupted")
    _fail_in_finish(src, direct=False)
    before = _tree(src)
    dst = f"memory://{tmp_path.name}/consolidated"
    try:
        report = consolidate_checkpoint(src, dst)
        assert report.mode == "staged" and report.moved_bytes == sum(
            len(b) for n, b in _reference(tmp_path, False).items() if n != INDEX
        )
        assert _tree(dst) == _reference(tmp_path, big=False)
        assert _tree(src) == before
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_direct_save_is_copied_to_another_folder(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "interrupted"), str(tmp_path / "copy")
    _fail_in_finish(src)
    report = consolidate_checkpoint(src, dst)
    assert report.mode == "direct" and report.moved_bytes > 0
    assert _tree(dst) == _reference(tmp_path, big=False)
    assert INDEX not in _tree(src)


def test_s3_failed_finish_with_uploads_gone_is_refused_before_anything_is_written(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_2"
    _fail_in_finish(url, options, big=True)
    fs = s3fs.S3FileSystem(**options)
    name = bucket.removeprefix("s3://")
    uploads = fs.list_multipart_uploads(name)
    assert uploads
    for u in uploads:  # as a bucket lifecycle rule or another save would
        fs.call_s3("abort_multipart_upload", Bucket=name, Key=u["Key"], UploadId=u["UploadId"])
    before = _tree(url, options)
    with pytest.raises(
        ValueError,
        match=r"multipart uploads of \['model-.*'\] no longer exist .* save the checkpoint again",
    ):
        consolidate_checkpoint(url, storage_options=options)
    assert _tree(url, options) == before and INDEX not in before


# -- refusals --------------------------------------------------------------------------------------


def test_a_rank_that_never_recorded_its_writes_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _fail_in_finish(url)
    os.remove(tmp_path / "ckpt" / STAGING / "rank00000.json")
    before = _tree(url)
    with pytest.raises(
        ValueError,
        match=r"ranks \[0\] of 1 never finished writing .* cannot be consolidated; save the "
        r"checkpoint again",
    ):
        consolidate_checkpoint(url)
    assert _tree(url) == before


def test_records_of_two_different_saves_are_refused(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _fail_in_finish(a)
    _fail_in_finish(b)
    rank = Path(b, STAGING, "rank00000.json")
    rank.write_bytes(Path(a, STAGING, "rank00000.json").read_bytes())
    with pytest.raises(ValueError, match=r"rank00000.json belongs to another save"):
        consolidate_checkpoint(b)


def test_a_file_written_in_place_that_went_missing_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _fail_in_finish(url)
    victim = min(p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".safetensors")
    victim.unlink()
    with pytest.raises(
        ValueError,
        match=rf"{victim.name}: the save wrote it in place at \d+ bytes, but it is missing now",
    ):
        consolidate_checkpoint(url)
    assert not (tmp_path / "ckpt" / INDEX).exists()


def test_complete_destination_is_refused_without_overwrite(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "interrupted"), str(tmp_path / "dst")
    _fail_in_finish(src, direct=False)
    dcp.save({"other": torch.ones(3)}, storage_writer=HFStorageWriter(dst))
    before = _tree(dst)
    with pytest.raises(
        FileExistsError, match=r"already holds a complete checkpoint .* overwrite=True"
    ):
        consolidate_checkpoint(src, dst)
    assert _tree(dst) == before
    consolidate_checkpoint(src, dst, overwrite=True)
    assert _tree(dst) == _reference(tmp_path, big=False)


def test_complete_checkpoint_is_left_as_it_is_and_leftovers_cleared(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save(_full(False), storage_writer=HFStorageWriter(url, max_shard_size=MAX_SHARD))
    # As if the save died while removing its staging folder, after the index.
    (tmp_path / "ckpt" / STAGING).mkdir()
    (tmp_path / "ckpt" / STAGING / "save.json").write_text("{}")
    report = consolidate_checkpoint(url)
    assert report.already_complete
    assert _tree(url) == _reference(tmp_path, big=False)
    with pytest.raises(
        ValueError, match=r"already a complete checkpoint .* nothing to consolidate"
    ):
        consolidate_checkpoint(url, str(tmp_path / "copy"))


def test_folder_without_a_save_record_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    with pytest.raises(
        FileNotFoundError,
        match=r"nothing to consolidate: no model.safetensors.index.json and no save record",
    ):
        consolidate_checkpoint(str(tmp_path / "x"))


# -- the records themselves (pure) ----------------------------------------------------------------


def test_records_round_trip_and_damaged_ones_are_refused() -> None:
    header = encode_header([TensorEntry("w", torch.bfloat16, (2, 3), 0, 12)])
    save = SaveRecord(
        "abc", "s3", 2, (("model-00001-of-00001.safetensors", header),), {0: "upload-1"}
    )
    assert SaveRecord.decode(save.encode(), "save.json") == save
    layout = layout_from_files(save.files, "save.json")
    assert layout.weight_map == {
        "w": "model-00001-of-00001.safetensors"
    } and layout.tensor_start == {"w": len(header)}
    item = ItemRecord(
        "w", (1, 0), (1, 3), 6, 0, None, 0xDEADBEEF, ({"PartNumber": 1, "ETag": '"e1"'},)
    )
    rank = RankRecord("abc", 1, (item,))
    assert RankRecord.decode(rank.encode(), "rank00001.json") == rank
    with pytest.raises(
        RecordError, match=r"save.json: record format 2; this version reads format 1"
    ):
        SaveRecord.decode(save.encode().replace(b'"format":1', b'"format":2'), "save.json")
    with pytest.raises(RecordError, match=r"rank00001.json: not valid JSON"):
        RankRecord.decode(rank.encode()[:-5], "rank00001.json")
    with pytest.raises(RecordError, match=r"save.json: not a valid save record \(mode 'tape'"):
        SaveRecord.decode(save.encode().replace(b'"s3"', b'"tape"'), "save.json")


def test_inspect_describes_an_unfinished_save_from_its_record(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _fail_in_finish(url)
    info = inspect_checkpoint(url)
    assert info.format == "incomplete" and not info.committed
    assert {t.key: t.shape for t in info.tensors} == {
        k: shape for k, (shape, _, _) in SHAPES.items()
    }
    assert any(
        "1 of 1 ranks done); every rank recorded its writes: `hf-dcp consolidate` can finish it"
        in n
        for n in info.notes
    ), info.notes
    os.remove(tmp_path / "ckpt" / STAGING / "rank00000.json")
    assert any(
        "ranks [0] have not recorded their writes" in n for n in inspect_checkpoint(url).notes
    )
