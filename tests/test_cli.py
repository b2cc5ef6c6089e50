"""``hf-dcp``: every command run as a subprocess against real checkpoints, local and on S3 (moto).

What is asserted is what a user sees: the exit status, what stdout says (or its JSON), one line
on stderr for a mistake (a traceback only with ``--debug``), no progress output when stderr is
not a terminal and a progress bar when it is, and the files the command leaves behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import fsspec
import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from hf_dcp_storage import CheckpointManager, HFStorageWriter
from tests.support.data import random_tensor, read_checkpoint, seed_of

CLI = [sys.executable, "-m", "hf_dcp_storage"]
# The command line is the same code on every S3 server (the library's S3 tests cover both moto and
# radosgw); here moto alone keeps the subprocess-heavy tests short.
moto_only = pytest.mark.parametrize("s3_endpoint", ["moto"], indirect=True)
TENSORS = {
    "embed.weight": ((64, 32), torch.float32),
    "layers.0.w": ((32, 32), torch.bfloat16),
    "layers.1.w": ((32, 32), torch.bfloat16),
    "steps": ((3,), torch.int64),
}


def _sd() -> dict[str, torch.Tensor]:
    return {k: random_tensor(shape, dtype, seed_of(k)) for k, (shape, dtype) in TENSORS.items()}


def _option_args(options: dict | None) -> list[str]:
    """The fixture's storage options as ``-o`` arguments (strings plain, the rest as JSON)."""
    args: list[str] = []
    for key, value in (options or {}).items():
        if isinstance(value, dict):
            args += [x for k, v in value.items() for x in ("-o", f"{key}.{k}={v}")]
        elif isinstance(value, str):
            args += ["-o", f"{key}={value}"]
        else:
            args += ["-o", f"{key}:={json.dumps(value)}"]
    return args


def run(
    *args: str, options: dict | None = None, check: int | None = 0
) -> subprocess.CompletedProcess[str]:
    """``python -m hf_dcp_storage ARGS``; asserts the exit status when ``check`` is not None."""
    proc = subprocess.run(
        [*CLI, *args, *_option_args(options)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check is not None:
        assert proc.returncode == check, (
            f"exit {proc.returncode}, expected "
            f"{check}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def _save(url: str, options: dict | None = None, **kw) -> None:
    dcp.save(
        _sd(),
        storage_writer=HFStorageWriter(url, storage_options=options, max_shard_size=5000, **kw),
    )


def _flip_byte(fs, path: str, offset: int) -> None:
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0x01
    fs.pipe_file(path, bytes(data))


def _data_offset(fs, path: str, key: str) -> int:
    """Absolute offset of ``key``'s first byte in safetensors file ``path``."""
    head = fs.cat_file(path, start=0, end=8)
    n = int.from_bytes(head, "little")
    header = json.loads(fs.cat_file(path, start=8, end=8 + n))
    return 8 + n + header[key]["data_offsets"][0]


class _FinishFails(HFStorageWriter):
    def finish(self, metadata, results) -> None:  # type: ignore[override]
        raise RuntimeError("coordinator lost")


# -- inspect ---------------------------------------------------------------------------------------


def test_inspect_prints_files_keys_and_totals_and_json(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _save(url)
    out = run("inspect", url).stdout
    assert f"{url}: hf checkpoint, committed" in out
    lines = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line and line.split()[0] in TENSORS
    }
    assert (
        lines["embed.weight"][1:3] == ["F32", "[64,"]
        and lines["layers.0.w"][1] == "BF16"
        and lines["steps"][1] == "I64"
    )
    info = json.loads(run("inspect", url, "--json").stdout)
    assert info["committed"] is True and info["format"] == "hf"
    assert {t["key"]: (t["dtype"], t["shape"]) for t in info["tensors"]} == {
        "embed.weight": ("F32", [64, 32]),
        "layers.0.w": ("BF16", [32, 32]),
        "layers.1.w": ("BF16", [32, 32]),
        "steps": ("I64", [3]),
    }
    assert info["totals"]["bytes"] == sum(t.numel() * t.element_size() for t in _sd().values())
    assert len(info["files"]) >= 2  # max_shard_size=5000 spreads the 12 KB over several files


@moto_only
def test_inspect_and_verify_on_s3(s3) -> None:
    bucket, options = s3
    url = f"{bucket}/ckpt"
    _save(url, options)
    info = json.loads(run("inspect", url, "--json", options=options).stdout)
    assert info["committed"] and info["totals"]["tensors"] == len(TENSORS)
    total = sum(t.numel() * t.element_size() for t in _sd().values())
    assert (
        run("verify", url, options=options)
        .stdout.strip()
        .endswith(f"files, 4 tensors, {total / 1000:.2f} kB read)")
    )
    fs = s3fs.S3FileSystem(**options)
    index = json.loads(fs.cat_file(f"{url}/model.safetensors.index.json"))
    file = index["weight_map"]["layers.1.w"]
    _flip_byte(fs, f"{url}/{file}", _data_offset(fs, f"{url}/{file}", "layers.1.w") + 10)
    proc = run("verify", url, options=options, check=1)
    assert f"FAIL {file}: tensor 'layers.1.w' fails its checksum" in proc.stdout
    assert "NOT sound: 1 problem" in proc.stdout


# -- verify ----------------------------------------------------------------------------------------


def test_verify_sound_then_corrupted_reports_file_and_key_with_exit_1(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _save(url)
    proc = run("verify", url)
    total = sum(t.numel() * t.element_size() for t in _sd().values())
    assert (
        proc.stdout.strip()
        == f"{url}: sound (structure and checksums; {_files(url)} files, 4 tensors, "
        f"{total / 1000:.2f} kB read)"
    )
    assert proc.stderr == ""  # not a terminal: no progress bar
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["embed.weight"]
    fs = fsspec.filesystem("file")
    _flip_byte(fs, f"{url}/{file}", _data_offset(fs, f"{url}/{file}", "embed.weight") + 100)
    proc = run("verify", url, check=1)
    assert proc.stdout.splitlines()[0].startswith(
        f"FAIL {file}: tensor 'embed.weight' fails its checksum"
    )
    report = json.loads(run("verify", url, "--json", check=1).stdout)
    assert [(p["file"], p["key"]) for p in report["problems"]] == [(file, "embed.weight")]
    # Structure alone is sound: --no-checksums reads no tensor data and exits 0.
    assert (
        run("verify", url, "--no-checksums")
        .stdout.splitlines()[-1]
        .startswith(f"{url}: sound (structure only")
    )
    (tmp_path / "ckpt" / "model-99999-of-99999.safetensors").write_bytes(b"x")
    proc = run("verify", url, "--no-checksums", check=1)
    assert "model-99999-of-99999.safetensors" in proc.stdout and "NOT sound" in proc.stdout


def _files(url: str) -> int:
    return len([p for p in Path(url).iterdir() if p.suffix == ".safetensors"])


def test_progress_bar_only_on_a_terminal(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _save(url)
    master, slave = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, and tqdm fits its bar to that: give it 80.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    seen = bytearray()

    def drain() -> None:  # concurrently, so a full terminal buffer never blocks the command
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the other end is closed
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        proc = subprocess.run(
            [*CLI, "verify", url],
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    assert proc.returncode == 0, proc.stdout
    assert b"verify checksums:" in seen and b"B/s" in seen, bytes(
        seen
    )  # the bar, drawn then cleared


# -- consolidate -----------------------------------------------------------------------------------


def test_consolidate_finishes_an_interrupted_save_and_verifies_it(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    with pytest.raises(BaseException, match="coordinator lost"):
        dcp.save(_sd(), storage_writer=_FinishFails(url, max_shard_size=5000, direct_write=False))
    assert json.loads(run("inspect", url, "--json").stdout)["committed"] is False
    assert run("verify", url, check=1).stdout.count("FAIL") >= 1
    proc = run("consolidate", url, "--verify")
    assert proc.stdout.startswith(f"consolidated {url}: ") and "verify: sound" in proc.stdout
    tensors, _ = read_checkpoint(url)
    assert all(
        torch.equal(tensors[k].view(torch.uint8), v.view(torch.uint8)) for k, v in _sd().items()
    )
    assert "already a complete checkpoint" in run("consolidate", url).stdout


@moto_only
def test_consolidate_on_s3_and_to_another_folder(s3, tmp_path: Path) -> None:
    bucket, options = s3
    url = f"{bucket}/run/step_3"
    with pytest.raises(BaseException, match="coordinator lost"):
        dcp.save(
            _sd(), storage_writer=_FinishFails(url, storage_options=options, max_shard_size=5000)
        )
    proc = run("consolidate", url, str(tmp_path / "copy"), options=options, check=1)
    assert (
        proc.stderr.startswith("hf-dcp consolidate: error: ")
        and "can only be completed in place" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    report = json.loads(run("consolidate", url, "--json", "--verify", options=options).stdout)
    assert report["consolidate"]["mode"] == "s3" and report["verify"]["problems"] == []


# -- convert ---------------------------------------------------------------------------------------


def test_convert_dcp_to_hf_with_key_mapping_and_dtype_then_back(tmp_path: Path) -> None:
    src, hf, back = tmp_path / "dcp", tmp_path / "hf", tmp_path / "dcp_again"
    dcp.save(_sd(), checkpoint_id=str(src))  # PyTorch's own .distcp format
    mapping = tmp_path / "map.json"
    mapping.write_text(
        json.dumps(
            {
                "embed.weight": "model.embed_tokens.weight",
                "layers.{}.w": "model.layers.{}.mlp.weight",
                "steps": None,
            }
        )
    )
    proc = run("convert", str(src), str(hf), "--key-mapping", str(mapping), "--dtype", "bf16")
    assert proc.stdout.startswith(f"converted {src} (dcp) -> {hf} (hf): 3 tensors")
    tensors, _ = read_checkpoint(hf)
    want = _sd()
    assert sorted(tensors) == [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.weight",
        "model.layers.1.mlp.weight",
    ]
    assert torch.equal(
        tensors["model.embed_tokens.weight"], want["embed.weight"].to(torch.bfloat16)
    )
    assert torch.equal(tensors["model.layers.1.mlp.weight"], want["layers.1.w"])
    assert run("verify", str(hf)).returncode == 0
    # And back: DCP's own reader loads what convert wrote.
    proc = run("convert", str(hf), str(back), "--json")
    assert json.loads(proc.stdout)["target_format"] == "dcp"
    loaded = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(loaded, storage_reader=FileSystemReader(str(back)))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    # A second conversion onto a complete checkpoint is refused, in one line, and leaves it alone.
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    proc = run("convert", str(src), str(hf), check=1)
    assert (
        proc.stderr.startswith("hf-dcp convert: error: ")
        and "overwrite" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    assert "Traceback" in run("convert", str(src), str(hf), "--debug", check=1).stderr


@moto_only
def test_convert_local_dcp_into_s3(s3, tmp_path: Path) -> None:
    bucket, options = s3
    src = tmp_path / "dcp"
    dcp.save(_sd(), checkpoint_id=str(src))
    run("convert", str(src), f"{bucket}/hf", options=options)
    fs = s3fs.S3FileSystem(**options)
    index = json.loads(fs.cat_file(f"{bucket}/hf/model.safetensors.index.json"))
    assert sorted(index["weight_map"]) == sorted(TENSORS)
    assert run("verify", f"{bucket}/hf", options=options).returncode == 0


# -- ls and prune ----------------------------------------------------------------------------------


def _run_folder(root: str, options: dict | None = None) -> None:
    mgr = CheckpointManager(root, keep_last_n=10, storage_options=options)
    for step in (100, 200, 300, 400):
        mgr.save(step, {"w": torch.full((256,), float(step))}, {"step": step})


def test_ls_and_prune_locally(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _run_folder(str(root))
    partial = root / "step_500"
    partial.mkdir()
    (partial / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 100)
    out = run("ls", str(root)).stdout.splitlines()
    assert out[0].split() == ["STEP", "STATUS", "SIZE", "FILES", "MODIFIED", "NAME"]
    assert [(r.split()[0], r.split()[1]) for r in out[1:]] == [
        ("100", "complete"),
        ("200", "complete"),
        ("300", "complete"),
        ("400", "complete"),
        ("500", "incomplete"),
    ]
    listed = json.loads(run("ls", str(root), "--json").stdout)
    sizes = {s["step"]: s["size"] for s in listed}
    assert sizes[500] == 100 and sizes[100] == sum(
        p.stat().st_size for p in (root / "step_100").rglob("*") if p.is_file()
    )

    dry = run("prune", str(root), "--keep", "2", "--dry-run").stdout
    assert (
        "would remove: step_100, step_200" in dry and "step_500" in dry
    )  # left alone: may be in progress
    assert sorted(p.name for p in root.iterdir()) == [
        "step_100",
        "step_200",
        "step_300",
        "step_400",
        "step_500",
    ]
    result = json.loads(
        run("prune", str(root), "--keep", "2", "--keep-every", "200", "--json").stdout
    )
    assert result == {
        "removed": [100],
        "kept": [200, 300, 400],
        "in_progress": [500],
        "dry_run": False,
    }
    run("prune", str(root), "--keep", "1", "--include-unfinished")
    assert sorted(p.name for p in root.iterdir()) == ["step_400"]


@moto_only
def test_ls_and_prune_on_s3(s3) -> None:
    bucket, options = s3
    root = f"{bucket}/run"
    _run_folder(root, options)
    listed = json.loads(run("ls", root, "--json", options=options).stdout)
    assert [(s["step"], s["complete"]) for s in listed] == [
        (100, True),
        (200, True),
        (300, True),
        (400, True),
    ]
    assert (
        "removed: step_100, step_200, step_300"
        in run("prune", root, "--keep", "1", options=options).stdout
    )
    assert [s["step"] for s in json.loads(run("ls", root, "--json", options=options).stdout)] == [
        400
    ]


# -- mistakes --------------------------------------------------------------------------------------


def test_mistakes_are_one_line_with_the_right_exit_status(tmp_path: Path) -> None:
    proc = run("ls", str(tmp_path / "nope"), check=1)
    assert (
        proc.stdout == ""
        and proc.stderr.startswith("hf-dcp ls: error: ")
        and len(proc.stderr.splitlines()) == 1
    )
    proc = run("prune", str(tmp_path), "--keep", "0", check=2)  # argparse: usage error
    assert "'0' is not an integer >= 1" in proc.stderr
    proc = run("inspect", str(tmp_path), "-o", "novalue", check=2)
    assert "expected KEY=VALUE" in proc.stderr
    proc = run("convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--dtype", "int7", check=1)
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_console_script_is_installed(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("hf-dcp")
    assert script.exists(), (
        f"{script}: the package's console script is not installed (pip install -e .)"
    )
    proc = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and proc.stdout.startswith("hf-dcp ")
