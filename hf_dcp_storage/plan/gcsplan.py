"""Pure planning of GCS consolidated files: parts the ranks upload as objects, composed by the
server.

A consolidated file on GCS is composed server-side from objects: its parts, cut as S3's are
(``plan/parts.py``, ``plan/partplan.py``) but with GCS's rules (``GCS_RULES``: no minimum part size,
so a rank sends every run of 1 MiB or more of its own, a node every run of its ranks of 64 KiB or
more; smaller runs, and column-sharded tensors, are gathered into parts by the ranks). Each part
is an object under the save's staging folder, in a folder of the save's own (``part_name``:
named by the save id, so no other save's object, nor a stale compose of a killed one, can ever
pass for it); a compose takes at most 32
sources, so a file of more parts is composed as a tree (``compose_tree``): groups of up to 32
consecutive parts into intermediate objects, those again, until one compose writes the file. The
header travels as the first bytes of the first part (a rank's own, or a gathered one), as on S3: no
object of its own. Pure: no I/O.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from .parts import NODE_PART_BYTES, RANK_PART_BYTES, PartRules

__all__ = [
    "GCS_RULES",
    "MAX_COMPOSE_SOURCES",
    "Compose",
    "compose_tree",
    "intermediate_name",
    "part_name",
]

# GCS's compose takes at most 32 source objects per request.
MAX_COMPOSE_SOURCES = 32
# Compose has no minimum part size: a rank sends each of its runs of 1 MiB or more as a part of
# its own (S3 needs 5 MiB), and the ranks of a node gather each run of theirs of
# ``NODE_PART_BYTES`` or more (side by side) into a part of its own, so at scale (8,192 ranks, 8
# a node: a node's runs of a 405B model's tensors are ~0.5-1.7 MiB) its bytes cross between hosts
# once; smaller runs (norms, KV projections) are gathered. Parts of at most 16 MiB, at most
# ``32 ** 4`` per file (a compose tree of at most 4 levels).
GCS_RULES = PartRules(
    min_part=1,
    max_parts=MAX_COMPOSE_SOURCES**4,
    rank_part=RANK_PART_BYTES,
    own_part=1 << 20,
    node_part=NODE_PART_BYTES,
)


def _save_folder(save_id: str) -> str:
    if not save_id or "/" in save_id:
        raise ValueError(
            f"save_id={save_id!r}: a part's folder is named by its save's id, which must be "
            "non-empty and hold no '/'"
        )
    return save_id[:32]


def part_name(staging: str, save_id: str, file_name: str, number: int) -> str:
    """The object holding part ``number`` of ``file_name`` in save ``save_id``, under the save's
    staging folder."""
    return posixpath.join(staging, "parts", _save_folder(save_id), f"{file_name}.part{number:05d}")


def intermediate_name(staging: str, save_id: str, file_name: str, level: int, index: int) -> str:
    """The intermediate object of compose ``index`` at tree level ``level`` (from 1) in save
    ``save_id``."""
    return posixpath.join(
        staging, "compose", _save_folder(save_id), f"{file_name}.l{level}.{index:05d}"
    )


@dataclass(frozen=True)
class Compose:
    """One compose request: ``sources`` (in order) into ``target``; ``level`` 1 composes parts,
    the last level writes the file."""

    level: int
    target: str
    sources: tuple[str, ...]


def compose_tree(
    file_name: str,
    final: str,
    parts: list[str],
    staging: str,
    save_id: str,
    fan_in: int = MAX_COMPOSE_SOURCES,
) -> list[list[Compose]]:
    """The composes that make ``final`` from ``parts`` (object names, in file order), level by
    level: every compose of a level may run at once, once the level before is done.

    ``len(parts) <= fan_in``: one compose. Otherwise groups of ``fan_in`` consecutive sources
    become intermediate objects (``intermediate_name``), the last group of a level holding the
    rest, until one level has at most ``fan_in`` sources left. A file of ``n`` parts takes
    ``ceil(log_fan_in(n))`` levels and about ``n / (fan_in - 1)`` composes.

    Raises:
        ValueError: no parts, or a fan-in under 2.
    """
    if fan_in < 2:
        raise ValueError(
            f"fan_in={fan_in} must be at least 2 (GCS composes up to {MAX_COMPOSE_SOURCES} sources)"
        )
    if not parts:
        raise ValueError(f"{file_name}: a file is composed from at least one part")
    levels: list[list[Compose]] = []
    sources = list(parts)
    level = 1
    while len(sources) > fan_in:
        groups = [tuple(sources[i : i + fan_in]) for i in range(0, len(sources), fan_in)]
        composes = [
            Compose(level, intermediate_name(staging, save_id, file_name, level, i), g)
            for i, g in enumerate(groups)
        ]
        levels.append(composes)
        sources = [c.target for c in composes]
        level += 1
    levels.append([Compose(level, final, tuple(sources))])
    return levels
