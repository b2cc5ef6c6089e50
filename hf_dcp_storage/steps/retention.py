"""Pure rules for step checkpoints: folder names, and which steps retention keeps.

A run folder holds one folder per checkpoint, ``step_{N}``. A step counts only once its commit
marker exists (written last, after the model and the training state); anything else named like a
step is an incomplete leftover. Names are parsed strictly, so ``step_01``, ``step_-1`` or
``step_5.tmp`` are not steps and are never touched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["COMMIT_MARKER", "STEP_RE", "RetentionPolicy", "parse_step", "step_name", "to_remove"]

# [0-9], not \d: \d also matches other scripts' digits, and int() reads them, so "step_1\u0662"
# would parse as step 12 (a folder that step_name(12) does not name).
STEP_RE = re.compile(r"step_(0|[1-9][0-9]*)")
# Written last into a step folder; its presence is what makes the step complete.
COMMIT_MARKER = "COMMITTED"


def step_name(step: int) -> str:
    """``step_{N}`` for a step number.

    Raises:
        ValueError: ``step`` is not a non-negative int.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0 (the training step to save)")
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    """The step of a folder name ``step_{N}``; ``None`` for any other name."""
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RetentionPolicy:
    """Which complete steps to keep: the newest ``keep_last_n``, plus every multiple of
    ``keep_every`` (kept forever) when given.

    Raises:
        ValueError: ``keep_last_n`` not an int >= 1 (the newest complete step is always kept)
            or ``keep_every`` not ``None`` or an int >= 1; a bool is no count (``True`` would
            pass as 1).
    """

    keep_last_n: int = 3
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.keep_last_n, int)
            or isinstance(self.keep_last_n, bool)
            or self.keep_last_n < 1
        ):
            raise ValueError(
                f"keep_last_n={self.keep_last_n!r} must be an int >= 1: the newest complete step "
                "is always kept"
            )
        if self.keep_every is not None and (
            not isinstance(self.keep_every, int)
            or isinstance(self.keep_every, bool)
            or self.keep_every < 1
        ):
            raise ValueError(
                f"keep_every={self.keep_every!r} must be None or an int >= 1 (keep steps that are "
                "multiples of it)"
            )


def to_remove(
    steps: Mapping[int, bool], policy: RetentionPolicy, in_flight: Iterable[int] = ()
) -> list[int]:
    """Steps to delete, ascending, from ``steps`` (step -> complete?).

    Kept: the newest ``keep_last_n`` complete steps, complete multiples of ``keep_every``, and
    anything in ``in_flight`` (a save still running, complete or not). Removed: other complete
    steps, and incomplete ones (leftovers of crashed saves). Pure.
    """
    busy = set(in_flight)
    complete = sorted(s for s, done in steps.items() if done)
    keep = set(complete[-policy.keep_last_n :]) | busy
    if policy.keep_every is not None:
        keep |= {s for s in complete if s % policy.keep_every == 0}
    return sorted(s for s in steps if s not in keep)
