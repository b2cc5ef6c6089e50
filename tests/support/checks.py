"""Test helpers: look inside DCP's wrapped errors."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
from torch.distributed.checkpoint.api import CheckpointException


@contextlib.contextmanager
def raises_in_checkpoint(
    exc_type: type[BaseException], match: str
) -> Iterator[list[BaseException]]:
    """Expect a ``CheckpointException`` whose rank failures include ``exc_type`` matching ``match``.

    DCP wraps every error raised inside save/load (it derives from ``BaseException``). Errors
    from ``read_metadata`` are re-raised by DCP as ``AssertionError`` carrying our message, so for
    those pass ``exc_type=AssertionError``.
    """
    found: list[BaseException] = []
    with pytest.raises(CheckpointException) as info:
        yield found
    found.extend(exc for exc, _ in info.value.failures.values())
    hits = [e for e in found if isinstance(e, exc_type) and re.search(match, str(e))]
    assert hits, f"no {exc_type.__name__} matching {match!r} among {[repr(e) for e in found]}"
