"""What ``hf-dcp`` prints: exit statuses, a progress bar where someone watches, JSON, tables,
and sizes, counts and times in words.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime
from typing import Any

from .progress import NO_PROGRESS, Progress

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "fmt_count",
    "fmt_size",
    "fmt_steps",
    "fmt_when",
    "print_json",
    "print_table",
    "progress_for",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Bar:
    """A tqdm bar on stderr per phase; ``advance`` may come from any I/O thread."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()

    def start(self, total_bytes: int, description: str) -> None:
        from tqdm import tqdm

        with self._lock:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(
                total=total_bytes,
                desc=description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
            )

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(nbytes)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class _Quiet:
    def __enter__(self) -> Progress:
        return NO_PROGRESS

    def __exit__(self, *exc: object) -> None:
        pass


def progress_for() -> _Bar | _Quiet:
    """A progress bar only where someone watches: stderr is a terminal."""
    return _Bar() if sys.stderr.isatty() else _Quiet()


def print_json(obj: Any) -> int:
    """``obj`` as indented JSON on stdout; returns ``EXIT_OK``."""
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def print_table(
    header: list[str], rows: list[list[Any]], right: AbstractSet[int] = frozenset()
) -> None:
    """``rows`` under ``header`` in aligned columns, those in ``right`` right-aligned."""
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print(
            "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )


def fmt_size(n: int) -> str:
    """Decimal units, as ``max_shard_size="5GB"`` counts them."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def fmt_count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def fmt_when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts is not None else "-"


def fmt_steps(steps: Sequence[int]) -> str:
    return ", ".join(f"step_{s}" for s in steps) if steps else "none"
