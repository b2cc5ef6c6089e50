"""Progress reporting for long operations (verify, consolidate, convert): a tiny protocol.

Library functions take an optional ``Progress`` and report bytes as they move them; the
command line passes a tqdm bar when stderr is a terminal, everything else passes nothing.
``advance`` is called from I/O threads, so implementations must be thread-safe.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NO_PROGRESS", "NullProgress", "Progress"]


class Progress(Protocol):
    def start(self, total_bytes: int, description: str) -> None:
        """A new phase begins: ``total_bytes`` will be reported through ``advance``."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes of the current phase are done (any thread)."""


class NullProgress:
    """Reports nothing."""

    def start(self, total_bytes: int, description: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass


NO_PROGRESS: Progress = NullProgress()
