"""Shared fixtures: a checkpoint URL per backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec
import pytest


@pytest.fixture(params=["local", "file", "memory"])
def url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh checkpoint location: a plain local path, a ``file://`` URL, or ``memory://``."""
    if request.param == "local":
        yield str(tmp_path / "ckpt")
    elif request.param == "file":
        yield f"file://{tmp_path}/ckpt"
    else:
        # Unique root so tests do not interfere through the process-wide memory filesystem.
        root = f"/{uuid.uuid4().hex}"
        yield f"memory://{root}/ckpt"
        fsspec.filesystem("memory").rm(root, recursive=True)
