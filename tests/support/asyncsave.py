"""The state dicts and checks of the async-save tests (``test_async_save.py``,
``test_process_async.py``).

Every tensor is rebuilt identically by any process from its key name (``original_tensors``); a
"training step" changes every tensor in place; ``assert_same_checkpoints`` compares an async save
with the synchronous save of the same state dict, file by file and byte for byte.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping

import fsspec
import torch
from safetensors.torch import load as st_load

from tests.support.data import assert_same, random_tensor, seed_of

__all__ = [
    "LARGE",
    "TENSORS",
    "assert_same_checkpoints",
    "checkpoint_files",
    "checkpoint_tensors",
    "original_tensors",
    "train_step",
]

# Key -> (shape, dtype). Odd row counts make uneven Shard(0) chunks on two ranks.
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((96, 32), torch.bfloat16),
    "model.layers.0.mlp.up_proj.weight": ((33, 16), torch.float32),
    "model.norm.weight": ((32,), torch.float32),
    "step": ((3,), torch.int64),
}
# Two ranks also save a 12 MiB matrix: 6 MiB per rank, so on S3 each rank uploads a multipart part
# of its own into the consolidated file (parts under 5 MiB would all be gathered by rank 0).
LARGE = {"model.layers.0.mlp.down_proj.weight": ((3072, 2048), torch.bfloat16)}


def original_tensors(
    spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, torch.Tensor]:
    """The full tensors, rebuilt identically by any process from their key names."""
    return {key: random_tensor(shape, dtype, seed_of(key)) for key, (shape, dtype) in spec.items()}


def train_step(state_dict: Mapping[str, torch.Tensor]) -> None:
    """What an optimizer step does to the saved objects: change every tensor in place."""
    for tensor in state_dict.values():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        local.add_(1)


def checkpoint_files(url: str, options: dict | None) -> dict[str, bytes]:
    """``path relative to url -> content`` of every object under ``url`` (any fsspec store)."""
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    root = root.rstrip("/")
    return {posixpath.relpath(p, root): fs.cat_file(p) for p in sorted(fs.find(root))}


def checkpoint_tensors(files: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's files, parsed by ``safetensors`` itself."""
    index = json.loads(files["model.safetensors.index.json"])
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(st_load(files[name]))
    assert set(out) == set(index["weight_map"]), (
        f"files hold {sorted(out)}, index lists {sorted(index['weight_map'])}"
    )
    return out


def assert_same_checkpoints(
    async_url: str, sync_url: str, options: dict | None, originals: Mapping[str, torch.Tensor]
) -> None:
    """Byte-identical folders, holding exactly ``originals`` (the values before the change)."""
    got, expected = checkpoint_files(async_url, options), checkpoint_files(sync_url, options)
    assert sorted(got) == sorted(expected), (
        f"async save wrote {sorted(got)}, sync save {sorted(expected)}"
    )
    differ = [name for name in expected if got[name] != expected[name]]
    assert not differ, f"async save differs from the sync save in {differ}"
    saved = checkpoint_tensors(got)
    assert set(saved) == set(originals)
    for key, original in originals.items():
        assert_same(saved[key], original, f"{async_url}: {key}")
