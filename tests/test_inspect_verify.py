"""``inspect_checkpoint`` and ``verify_checkpoint`` on real checkpoints, sound and damaged.

Each damaged case breaks one thing in a checkpoint saved by ``HFStorageWriter`` (or by PyTorch's
own DCP writer, or by ``CheckpointManager``) and checks that verify names exactly that defect:
its file, its key, and what is wrong, and nothing else.
"""

from __future__ import annotations

import json
import re
import threading

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from hf_dcp_storage import CheckpointManager, HFStorageWriter
from hf_dcp_storage.tools.inspection import inspect_checkpoint
from hf_dcp_storage.tools.verify import BLOCK_BYTES, VerifyReport, verify_checkpoint
from tests.support.data import random_tensor, tensor_crc32

INDEX = "model.safetensors.index.json"
STAGING = ".hf_dcp_staging"
# Safetensors dtype names, written out rather than taken from the code under test.
NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.float16: "F16",
}

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state_dict() -> dict[str, torch.Tensor]:
    """Several dtypes, a scalar and an empty tensor; 86 KB, in several files at 8 KB each."""
    return {
        "layers.0.w": random_tensor((64, 300), torch.float32, 1),
        "layers.0.bf": random_tensor((33, 7), torch.bfloat16, 2),
        "layers.1.w": random_tensor((40, 100), torch.float16, 3),
        "ints": torch.arange(-50, 50, dtype=torch.int64),
        "bytes": random_tensor((100,), torch.uint8, 4),
        "small": random_tensor((5, 3), torch.int8, 5),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def _save(
    url: str,
    sd: dict[str, torch.Tensor],
    storage_options: dict | None = None,
    max_shard_size: str = "8KB",
) -> None:
    dcp.save(
        sd,
        storage_writer=HFStorageWriter(
            url, storage_options=storage_options, max_shard_size=max_shard_size
        ),
    )


def _fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def _index(url: str, storage_options: dict | None = None) -> dict:
    fs, root = _fs(url, storage_options)
    return json.loads(fs.cat_file(f"{root}/{INDEX}"))


def _write_index(url: str, index: dict) -> None:
    fs, root = _fs(url)
    fs.pipe_file(f"{root}/{INDEX}", json.dumps(index).encode())


def _flip_byte(url: str, key: str, at: int, storage_options: dict | None = None) -> str:
    """Flip one bit of byte ``at`` of tensor ``key``'s data in its file (any store); its file
    name."""
    fs, root = _fs(url, storage_options)
    name = _index(url, storage_options)["weight_map"][key]
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    n = int.from_bytes(data[:8], "little")
    pos = 8 + n + json.loads(data[8 : 8 + n])[key]["data_offsets"][0] + at
    data[pos] ^= 0x10
    fs.pipe_file(f"{root}/{name}", bytes(data))
    return name


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _only(report: VerifyReport, file: str | None, key: str | None, pattern: str) -> None:
    """The report holds exactly one problem: about ``file`` and ``key``, its message matching
    ``pattern``."""
    assert [(p.file, p.key) for p in report.problems] == [(file, key)], [
        p.message for p in report.problems
    ]
    assert re.search(pattern, report.problems[0].message), report.problems[0].message
    assert not report.ok


class _Recorder:
    """A real ``Progress``: what a progress bar would be told."""

    def __init__(self) -> None:
        self.starts: list[tuple[int, str]] = []
        self.done = 0
        self._lock = threading.Lock()

    def start(self, total_bytes: int, description: str) -> None:
        self.starts.append((total_bytes, description))

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes


# -- inspect ---------------------------------------------------------------------------------------


def _assert_describes(
    info, sd: dict[str, torch.Tensor], index: dict, fs: fsspec.AbstractFileSystem, root: str
) -> None:
    """``info`` lists exactly ``sd``: keys, dtypes, shapes, bytes, files, checksums and totals."""
    assert (info.format, info.committed) == ("hf", True)
    assert [t.key for t in info.tensors] == sorted(sd)
    for t in info.tensors:
        v = sd[t.key]
        assert (t.dtype, t.shape, t.nbytes, t.numel) == (
            NAMES[v.dtype],
            tuple(v.shape),
            _nbytes(v),
            v.numel(),
        ), t.key
        assert t.file == index["weight_map"][t.key]
        assert t.checksum == tensor_crc32(v)
    files = sorted(set(index["weight_map"].values()))
    assert [f.name for f in info.files] == files and len(files) >= 3
    for f in info.files:
        assert f.size == fs.size(f"{root}/{f.name}")
        assert f.tensors == sum(file == f.name for file in index["weight_map"].values())
    assert info.totals.tensors == len(sd) and info.totals.objects == 0
    assert info.totals.parameters == sum(v.numel() for v in sd.values())
    assert (
        info.totals.bytes == sum(_nbytes(v) for v in sd.values()) == index["metadata"]["total_size"]
    )
    per_dtype: dict[str, int] = {}
    for v in sd.values():
        per_dtype[NAMES[v.dtype]] = per_dtype.get(NAMES[v.dtype], 0) + _nbytes(v)
    assert info.totals.bytes_per_dtype == per_dtype


def test_inspect_lists_what_was_saved(url: str) -> None:
    sd = _state_dict()
    _save(url, sd)
    info = inspect_checkpoint(url, thread_count=3)
    fs, root = _fs(url)
    _assert_describes(info, sd, _index(url), fs, root)
    assert (info.has_commit_marker, info.has_training_state, info.has_staging) == (
        False,
        False,
        False,
    )
    assert info.notes == []
    out = json.loads(json.dumps(info.to_dict()))
    assert list(out) == [
        "url",
        "format",
        "committed",
        "has_commit_marker",
        "has_training_state",
        "has_staging",
        "files",
        "tensors",
        "totals",
        "notes",
    ]
    scalar = next(t for t in out["tensors"] if t["key"] == "scalar")
    assert scalar == {
        "key": "scalar",
        "dtype": "F32",
        "shape": [],
        "numel": 1,
        "nbytes": 4,
        "file": scalar["file"],
        "checksum": tensor_crc32(sd["scalar"]),
    }
    assert out["totals"]["bytes_per_dtype"]["F32"] == 64 * 300 * 4 + 4


def test_inspect_a_pytorch_dcp_checkpoint(url: str) -> None:
    sd = _state_dict()
    dcp.save({**sd, "meta": {"epoch": 3}}, checkpoint_id=url)
    info = inspect_checkpoint(url)
    assert (info.format, info.committed) == ("dcp", True)
    by_key = {t.key: t for t in info.tensors}
    assert sorted(by_key) == sorted([*sd, "meta.epoch"])
    for key, v in sd.items():
        t = by_key[key]
        assert (t.dtype, t.shape, t.nbytes, t.file, t.checksum) == (
            NAMES[v.dtype],
            tuple(v.shape),
            _nbytes(v),
            None,
            None,
        )
    obj = by_key["meta.epoch"]
    assert (obj.dtype, obj.shape, obj.file) == ("object", None, None) and obj.nbytes > 0
    assert (info.totals.tensors, info.totals.objects) == (len(sd), 1)
    assert info.totals.parameters == sum(v.numel() for v in sd.values())
    fs, root = _fs(url)
    distcp = sorted(
        n.rsplit("/", 1)[-1] for n in fs.ls(root, detail=False) if n.endswith(".distcp")
    )
    assert [f.name for f in info.files] == distcp
    assert all(f.size == fs.size(f"{root}/{f.name}") for f in info.files)
    json.dumps(info.to_dict())

    report = verify_checkpoint(url)
    assert report.ok and report.format == "dcp" and report.files_checked == len(distcp)
    assert report.notes == ["PyTorch DCP format records no checksums; structure checked only"]


def _manager_step(root: str) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    sd = _state_dict()
    optimizer = {"exp_avg": random_tensor((64, 300), torch.float32, 9), "step": torch.tensor(7)}
    CheckpointManager(root, max_shard_size="8KB").save(
        3, sd, training_state={"optim": optimizer, "epoch": 2}
    )
    return f"{root}/step_3", sd, optimizer


def test_inspect_and_verify_a_manager_step_folder(tmp_path) -> None:
    step, sd, optimizer = _manager_step(str(tmp_path / "run"))
    info = inspect_checkpoint(step)
    fs, root = _fs(step)
    _assert_describes(info, sd, _index(step), fs, root)
    assert (info.has_commit_marker, info.has_training_state, info.has_staging) == (
        True,
        True,
        False,
    )
    state = inspect_checkpoint(f"{step}/training_state")
    assert {t.key: t.shape for t in state.tensors} == {"optim.exp_avg": (64, 300), "optim.step": ()}

    progress = _Recorder()
    report = verify_checkpoint(step, progress=progress)
    assert report.ok, report.problems
    total = sum(_nbytes(v) for v in [*sd.values(), *optimizer.values()])
    assert (report.bytes_checked, report.tensors_checked, report.checksums_checked) == (
        total,
        len(sd) + 2,
        True,
    )
    assert report.files_checked == len(info.files) + len(state.files)
    assert progress.starts == [(total, "verify checksums")] and progress.done == total

    # Damage in the training state is named with its path inside the step folder.
    ts_url = f"{step}/training_state"
    name = _flip_byte(ts_url, "optim.exp_avg", 100)
    _only(
        verify_checkpoint(step),
        f"training_state/{name}",
        "optim.exp_avg",
        rf"^training_state/{name}: tensor 'optim.exp_avg' fails its checksum",
    )


def test_a_step_without_its_commit_marker_or_a_rank_file(tmp_path) -> None:
    step, _, _ = _manager_step(str(tmp_path / "run"))
    (tmp_path / "run/step_3/training_state/rank_00000.json").unlink()
    _only(
        verify_checkpoint(step),
        "training_state/rank_00000.json",
        None,
        r"missing: the step was saved by 1 ranks",
    )
    (tmp_path / "run/step_3/COMMITTED").unlink()
    _only(
        verify_checkpoint(step),
        "COMMITTED",
        None,
        r"^COMMITTED: step not committed: the marker CheckpointManager writes last is missing",
    )
    info = inspect_checkpoint(step)
    assert info.format == "hf" and not info.has_commit_marker


def test_not_a_checkpoint(tmp_path) -> None:
    for fn in (inspect_checkpoint, verify_checkpoint):
        with pytest.raises(
            FileNotFoundError,
            match=r"nope: no such checkpoint folder; give the folder that holds "
            r"model.safetensors.index.json",
        ):
            fn(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError,
        match=r"empty is not a checkpoint: it has no model.safetensors.index.json, "
        r"model.safetensors or .metadata",
    ):
        verify_checkpoint(str(tmp_path / "empty"))
    step, _, _ = _manager_step(str(tmp_path / "run"))
    with pytest.raises(
        FileNotFoundError,
        match=r"it is a run folder with step folders \(step_3\): give one of them",
    ):
        inspect_checkpoint(str(tmp_path / "run"))
    with pytest.raises(
        FileNotFoundError,
        match=r"\.safetensors: a file, not a checkpoint folder; give the folder that holds",
    ):
        inspect_checkpoint(f"{step}/{_index(step)['weight_map']['ints']}")


# -- verify: sound checkpoints ---------------------------------------------------------------------


def test_verify_a_sound_checkpoint_then_a_flipped_byte(url: str) -> None:
    sd = _state_dict()
    _save(url, sd)
    progress = _Recorder()
    report = verify_checkpoint(url, progress=progress, thread_count=3)
    assert report.ok, report.problems
    total = sum(_nbytes(v) for v in sd.values())
    assert (report.files_checked, report.tensors_checked, report.bytes_checked) == (
        len(set(_index(url)["weight_map"].values())),
        len(sd),
        total,
    )
    assert report.checksums_checked and report.notes == []
    assert progress.starts == [(total, "verify checksums")] and progress.done == total
    out = json.loads(json.dumps(report.to_dict()))
    assert out["ok"] is True and out["problems"] == []

    name = _flip_byte(url, "layers.0.bf", 5)
    _only(
        verify_checkpoint(url),
        name,
        "layers.0.bf",
        rf"^{name}: tensor 'layers.0.bf' fails its checksum \(crc32 of the bytes read "
        rf"[0-9a-f]{{8}}, the index records {tensor_crc32(sd['layers.0.bf'])}\)",
    )


def test_verify_on_s3(s3: tuple[str, dict]) -> None:
    bucket, options = s3
    url = f"{bucket}/run/ckpt"
    sd = {
        **_state_dict(),
        "big": random_tensor((600, 4096), torch.float32, 8),
    }  # 9.4 MiB: two blocks
    _save(url, sd, options, max_shard_size="2MB")
    info = inspect_checkpoint(url, storage_options=options)
    assert [t.key for t in info.tensors] == sorted(sd) and info.totals.bytes == sum(
        _nbytes(v) for v in sd.values()
    )
    report = verify_checkpoint(url, storage_options=options)
    assert report.ok, report.problems
    assert report.bytes_checked == info.totals.bytes
    name = _flip_byte(url, "big", BLOCK_BYTES + 3, options)
    _only(
        verify_checkpoint(url, storage_options=options),
        name,
        "big",
        rf"^{name}: tensor 'big' fails its checksum",
    )


@pytest.mark.parametrize("threads", [1, 8])
def test_the_checksum_pass_reads_each_tensor_byte_once(tmp_path, threads: int) -> None:
    url = str(tmp_path / "ck")
    # Blocks cut through the 17 MiB tensor and hold several small tensors at once.
    sd = {
        "a": random_tensor((3, 5), torch.float32, 1),
        "big": random_tensor((1100, 4096), torch.float32, 2),
        **_state_dict(),
    }
    _save(url, sd, max_shard_size="100MB")
    report = verify_checkpoint(url, thread_count=threads)
    assert report.ok, report.problems
    assert report.bytes_checked == sum(_nbytes(v) for v in sd.values()) > 2 * BLOCK_BYTES
    for at in (
        0,
        BLOCK_BYTES - 8 * 1024 - 7,
        1100 * 4096 * 4 - 1,
    ):  # first byte, near a block edge, last byte
        _flip_byte(url, "big", at)
        _only(
            verify_checkpoint(url, thread_count=threads),
            "model-00001-of-00001.safetensors",
            "big",
            r"tensor 'big' fails its checksum",
        )
        _flip_byte(url, "big", at)
    assert verify_checkpoint(url, thread_count=threads).ok


def test_structure_only(tmp_path) -> None:
    url = str(tmp_path / "ck")
    _save(url, _state_dict())
    _flip_byte(url, "ints", 0)
    report = verify_checkpoint(url, checksums=False)
    assert report.ok and report.bytes_checked == 0 and not report.checksums_checked
    assert report.notes == ["checksums not checked (checksums=False): structure only"]


def test_checkpoints_without_checksums_get_a_note(tmp_path) -> None:
    """A single ``model.safetensors`` and an index without a checksum table (as transformers
    writes)."""
    single = tmp_path / "single"
    single.mkdir()
    save_file(
        {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)},
        str(single / "model.safetensors"),
    )
    report = verify_checkpoint(str(single))
    assert report.ok and (report.files_checked, report.tensors_checked) == (1, 2)
    assert report.notes == [
        (
            "model.safetensors: a single file without an index records no checksums; structure "
            "checked only"
        )
    ]
    assert inspect_checkpoint(str(single)).totals.bytes == 28

    url = str(tmp_path / "ck")
    _save(url, _state_dict())
    index = _index(url)
    index["metadata"] = {"total_size": index["metadata"]["total_size"]}
    _write_index(url, index)
    report = verify_checkpoint(url)
    assert report.ok and not report.checksums_checked
    assert report.notes == [f"{INDEX}: no checksums recorded; structure checked only"]


# -- verify: one defect at a time ------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> tuple[str, dict]:
    """A local checkpoint of ``_state_dict()`` in three files, and its index."""
    url = str(tmp_path / "ck")
    _save(url, _state_dict())
    return url, _index(url)


def _file_of(index: dict, key: str) -> str:
    return index["weight_map"][key]


def test_a_truncated_file(saved) -> None:
    url, index = saved
    name = _file_of(index, "layers.0.w")
    path = f"{url}/{name}"
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 3)
    _only(
        verify_checkpoint(url),
        name,
        None,
        rf"^{name}: tensor data ends at byte \d+ but the file has \d+ bytes \(truncated\)",
    )


def test_a_corrupt_header(saved) -> None:
    url, index = saved
    name = _file_of(index, "ints")
    with open(f"{url}/{name}", "r+b") as f:
        f.write((2**40).to_bytes(8, "little"))
    _only(
        verify_checkpoint(url),
        name,
        None,
        rf"^{name}: header length 1099511627776 exceeds the 100000000-byte cap",
    )


def test_a_deleted_file(saved) -> None:
    url, index = saved
    name = _file_of(index, "ints")
    fs, _ = _fs(url)
    fs.rm_file(f"{url}/{name}")
    _only(
        verify_checkpoint(url),
        name,
        None,
        rf"^{name}: missing: the index names this file, but it does not exist",
    )
    with pytest.raises(
        FileNotFoundError, match=rf"{name}: file named by the checkpoint index does not exist"
    ):
        inspect_checkpoint(url)


def test_a_stray_file(saved) -> None:
    url, _ = saved
    save_file({"x": torch.ones(2)}, f"{url}/model-00009-of-00009.safetensors")
    _only(
        verify_checkpoint(url),
        "model-00009-of-00009.safetensors",
        None,
        r"stray file: the index does not name it, so no loader reads it",
    )


def test_an_index_key_the_header_lacks(saved) -> None:
    url, index = saved
    name = _file_of(index, "ints")
    index["weight_map"]["ghost"] = name
    _write_index(url, index)
    _only(
        verify_checkpoint(url),
        name,
        "ghost",
        rf"^{name}: the index maps tensor 'ghost' to this file, but its header has no such tensor",
    )


def test_a_header_key_the_index_lacks(saved) -> None:
    url, index = saved
    name = _file_of(index, "small")
    del index["weight_map"]["small"], index["metadata"]["checksums"]["small"]
    index["metadata"]["total_size"] -= 15
    _write_index(url, index)
    _only(
        verify_checkpoint(url),
        name,
        "small",
        rf"^{name}: tensor 'small' is in this file but not in the index, so no loader reaches it",
    )


def test_a_key_in_two_files(tmp_path) -> None:
    """A hand-made checkpoint (no checksums) whose second file holds the first one's key too."""
    url = str(tmp_path / "ck")
    (tmp_path / "ck").mkdir()
    save_file({"a": torch.ones(2)}, f"{url}/model-00001-of-00002.safetensors")
    save_file({"a": torch.ones(2), "b": torch.ones(3)}, f"{url}/model-00002-of-00002.safetensors")
    index = {
        "metadata": {"total_size": 20},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    _write_index(url, index)
    _only(
        verify_checkpoint(url),
        "model-00002-of-00002.safetensors",
        "a",
        r"tensor 'a' is stored here too, but the index maps it to "
        r"model-00001-of-00002.safetensors \(a key in two files\)",
    )


def test_a_wrong_total_size(saved) -> None:
    url, index = saved
    real = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = real + 1
    _write_index(url, index)
    _only(
        verify_checkpoint(url),
        INDEX,
        None,
        rf"^{INDEX}: metadata.total_size is {real + 1}, but the tensors the index names hold "
        rf"{real} bytes",
    )


def test_a_recorded_header_that_differs_from_its_file(saved) -> None:
    """Loaders read the index's copy of each header: a copy that no longer matches its file (a
    file replaced after the save) is reported, by the index."""
    url, index = saved
    name = _file_of(index, "layers.0.w")
    copy = json.loads(index["metadata"]["headers"][name]["header"])
    entry = copy["layers.0.w"]
    entry["shape"] = list(reversed(entry["shape"]))  # same bytes, another shape: still decodes
    assert len(set(entry["shape"])) > 1
    original = index["metadata"]["headers"][name]["header"]
    text = json.dumps(copy, separators=(",", ":"))
    assert len(text) <= len(original)
    index["metadata"]["headers"][name]["header"] = text.ljust(
        len(original)
    )  # the data starts where it did
    _write_index(url, index)
    _only(
        verify_checkpoint(url),
        INDEX,
        None,
        rf"metadata.headers\['{re.escape(name)}'\] differs from the header of {re.escape(name)}",
    )


def test_trailing_bytes(saved) -> None:
    url, index = saved
    name = _file_of(index, "scalar")
    with open(f"{url}/{name}", "ab") as f:
        f.write(b"\0" * 16)
    _only(verify_checkpoint(url), name, None, rf"^{name}: 16 trailing bytes after the last tensor")


@pytest.mark.parametrize(
    "raw, pattern",
    [
        (b"{not json", r"not valid JSON"),
        (b'{"metadata": {}}', r'needs a "weight_map" object mapping tensor names to file names'),
        (b'{"weight_map": {"a": 1}}', r'needs a "weight_map" object'),
    ],
    ids=["json", "no-weight-map", "weight-map-values"],
)
def test_a_malformed_index(saved, raw: bytes, pattern: str) -> None:
    url, _ = saved
    with open(f"{url}/{INDEX}", "wb") as f:
        f.write(raw)
    _only(verify_checkpoint(url), INDEX, None, rf"^{INDEX}: {pattern}")
    with pytest.raises(ValueError, match=pattern):
        inspect_checkpoint(url)


def test_an_index_naming_a_file_outside_the_folder(saved) -> None:
    url, index = saved
    index["weight_map"]["ints"] = "../elsewhere.safetensors"
    _write_index(url, index)
    report = verify_checkpoint(url)
    assert report.problems[0].file == INDEX
    assert (
        "weight_map names file '../elsewhere.safetensors', which is not a plain relative path "
        "inside the checkpoint folder" in report.problems[0].message
    )
    # 'ints' then reaches no file: its own file reports it as a tensor the index does not name.
    assert [(p.file, p.key) for p in report.problems[1:]] == [(_file_of(index, "scalar"), "ints")]


def _leave_staging(url: str) -> None:
    """What a save leaves when it stops before removing its staging folder (its record)."""
    fs, root = _fs(url)
    fs.makedirs(f"{root}/{STAGING}", exist_ok=True)
    fs.pipe_file(f"{root}/{STAGING}/save.json", b"{}")


def test_a_leftover_staging_folder(saved) -> None:
    url, _ = saved
    _leave_staging(url)
    _only(
        verify_checkpoint(url),
        f"{STAGING}/",
        None,
        rf"^{STAGING}/: a save's staging folder is left over .*delete it once no save is running",
    )
    assert inspect_checkpoint(url).has_staging


@pytest.mark.parametrize(
    "edit, key, pattern, note",
    [
        (
            lambda m: m["checksums"].update(ints="xyz"),
            "ints",
            r"metadata.checksums\['ints'\] is 'xyz', not a CRC32 of 8 hex digits",
            None,
        ),
        (
            lambda m: m["checksums"].pop("ints"),
            "ints",
            r"records no checksum for tensor 'ints' \(in model-\d+-of-\d+.safetensors\)",
            None,
        ),
        (
            lambda m: m["checksums"].update(ghost="00000000"),
            "ghost",
            r"metadata.checksums records tensor 'ghost', which the weight_map does not name",
            None,
        ),
        (
            lambda m: m.update(checksum_algorithm="md5"),
            None,
            r"metadata.checksum_algorithm is 'md5'; this version reads only 'crc32'",
            "malformed",
        ),
        (
            lambda m: m.update(checksums=["00000000"]),
            None,
            r"metadata.checksums must map tensor names to CRC32 values of 8 hex digits",
            "malformed",
        ),
    ],
    ids=["bad-value", "missing-key", "unknown-key", "algorithm", "not-a-table"],
)
def test_a_malformed_checksum_table(
    saved, edit, key: str | None, pattern: str, note: str | None
) -> None:
    url, index = saved
    edit(index["metadata"])
    _write_index(url, index)
    report = verify_checkpoint(url)
    _only(report, INDEX, key, rf"^{INDEX}: {pattern}")
    if note:
        assert (
            report.notes == [f"{INDEX}: checksums not checked: the checksum table is malformed"]
            and not report.checksums_checked
        )
    else:
        # Every other tensor is still checked.
        unchecked = 800 if key == "ints" else 0
        assert (
            report.checksums_checked
            and report.bytes_checked == index["metadata"]["total_size"] - unchecked
        )


def test_an_interrupted_save(saved) -> None:
    url, index = saved
    fs, _ = _fs(url)
    fs.rm_file(f"{url}/{INDEX}")
    report = verify_checkpoint(url)
    _only(
        report,
        None,
        None,
        r"^not committed: there is no model.safetensors.index.json \(the commit marker, written "
        r"last\).*; save it again$",
    )
    assert report.format == "incomplete"
    _leave_staging(url)
    first, *others = sorted(set(index["weight_map"].values()))
    with open(f"{url}/{first}", "r+b") as f:
        f.write(b"\xff" * 8)  # an unreadable header is left out of the inspection, with a note
    _only(
        verify_checkpoint(url),
        None,
        None,
        r"\.hf_dcp_staging/ is left: an interrupted save; `hf-dcp consolidate` can finish it",
    )
    info = inspect_checkpoint(url)
    assert (info.format, info.committed, info.has_staging) == ("incomplete", False, True)
    assert [f.name for f in info.files] == others
    assert {t.key for t in info.tensors} == {
        k for k, f in index["weight_map"].items() if f != first
    }
    assert any(
        n.startswith(f"unreadable header, left out: {first}: header length") for n in info.notes
    ), info.notes


@pytest.mark.parametrize("damage", ["delete", "truncate", "metadata"])
def test_a_damaged_dcp_checkpoint(tmp_path, damage: str) -> None:
    url = str(tmp_path / "ck")
    dcp.save(_state_dict(), checkpoint_id=url)
    if damage == "metadata":
        (tmp_path / "ck/.metadata").write_bytes(b"not a pickle")
        _only(
            verify_checkpoint(url),
            ".metadata",
            None,
            r"^\.metadata: cannot be read as DCP metadata \(UnpicklingError",
        )
        return
    name = next(p.name for p in (tmp_path / "ck").iterdir() if p.suffix == ".distcp")
    if damage == "delete":
        (tmp_path / "ck" / name).unlink()
        _only(
            verify_checkpoint(url), name, None, rf"^{name}: missing: \.metadata places data in it"
        )
    else:
        with open(tmp_path / "ck" / name, "r+b") as f:
            f.truncate(f.seek(0, 2) - 1)
        _only(
            verify_checkpoint(url),
            name,
            None,
            rf"^{name}: \d+ bytes, but \.metadata places data up to byte \d+ \(truncated\)",
        )


def test_bad_thread_count(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"thread_count=0 must be an int >= 1"):
        verify_checkpoint(str(tmp_path), thread_count=0)
    with pytest.raises(ValueError, match=r"thread_count=-2 must be an int >= 1"):
        inspect_checkpoint(str(tmp_path), thread_count=-2)
