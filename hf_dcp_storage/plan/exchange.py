"""Which bytes each rank sends to the ranks that gather parts, when a save's runs too small to be
parts of their own travel over the ranks' own network instead of through the store as staged
objects (``stores/exchange.py`` sends them). Pure: no I/O.

Every gathered part has one gathering rank (``plan/spread.py``'s ``GatherTasks``); each other
rank holding bytes of it sends them in one message: its pieces of the part, in file order, from
its held runs (the bytes it would have staged, in the same order, ``plan/partplan.py``). A
message is named by its part's tag (``part_tag``), the same on both sides, so that a sender and
a receiver agree on it without being told.

Both sides go through the parts in tag order: a rank sends its messages in that order and its
gathering threads take their parts in that order, so the lowest part not yet done always has its
receiver and every one of its senders working on it, whatever the windows of either side hold:
the exchange cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .spread import GatherTasks

__all__ = ["MAX_TAG_FILES", "Sends", "part_tag", "plan_sends"]

# A tag is ``file << 16 | part number`` in a positive 32-bit int (gloo's tags are ints); part
# numbers stay under 2**16 on every store (S3: 10,000; Azure: 50,000 blocks).
_NUMBER_BITS = 16
MAX_TAG_FILES = 1 << (31 - _NUMBER_BITS)


def part_tag(file: int, number: int) -> int:
    """The tag of part ``number`` of file ``file``: unique in a save, ordered by (file, part)."""
    return (file << _NUMBER_BITS) | number


@dataclass(frozen=True)
class Sends:
    """What one rank sends: for each part another rank gathers and this one holds bytes of,
    ``tasks.task(i)`` (its rows only this rank's, no header), in tag order, and the gathering
    rank ``to[i]``."""

    tasks: GatherTasks
    to: np.ndarray  # int64 [k]

    def __len__(self) -> int:
        return len(self.to)


def plan_sends(tasks: Sequence[GatherTasks], world: int) -> list[Sends]:
    """(coordinator) Each rank's :class:`Sends`, from every rank's gathering tasks
    (``tasks[rank]``). Rows of the gathering rank's own bytes are not sent. Numpy over the rows,
    a sort and one step per rank.

    Raises:
        ValueError: more files than tags can name (``MAX_TAG_FILES``).
    """
    counts = [len(t) for t in tasks]
    parts = np.concatenate([t.parts for t in tasks]) if tasks else np.empty((0, 4), dtype=np.int64)
    if len(parts) and int(parts[:, 0].max()) >= MAX_TAG_FILES:
        raise ValueError(
            f"a save that gathers parts over the ranks' network names each part by a tag, which "
            f"allows {MAX_TAG_FILES} files; this one has {int(parts[:, 0].max()) + 1}: raise "
            "max_shard_size"
        )
    dst = np.repeat(np.arange(len(tasks), dtype=np.int64), counts)
    tag = (parts[:, 0] << _NUMBER_BITS) | parts[:, 1]
    width = max((t.width for t in tasks), default=0)
    tensors = {f: ts for t in tasks for f, ts in t.tensors.items()}
    base = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)

    def rows(at: str, table: str, cols: int) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's rows of ``table`` and the global part of each."""
        part = np.concatenate(
            [
                base[d] + np.repeat(np.arange(counts[d]), np.diff(getattr(t, at)))
                for d, t in enumerate(tasks)
            ]
            or [np.empty(0, dtype=np.int64)]
        ).astype(np.int64)
        data = np.concatenate(
            [getattr(t, table).astype(np.int64).reshape(-1, cols) for t in tasks]
            or [np.empty((0, cols), dtype=np.int64)]
        )
        keep = data[:, 0] != dst[part]  # the gathering rank's own bytes stay where they are
        part, data = part[keep], data[keep]
        order = np.lexsort((tag[part], data[:, 0]))
        return part[order], data[order]

    piece_part, pieces = rows("piece_at", "pieces", 4)
    strided_part, strided = rows("strided_at", "strided", 3 + 2 * width)
    piece_bounds = np.searchsorted(pieces[:, 0], np.arange(world + 1))
    strided_bounds = np.searchsorted(strided[:, 0], np.arange(world + 1))
    out = []
    for src in range(world):
        pa, pb = piece_bounds[src], piece_bounds[src + 1]
        sa, sb = strided_bounds[src], strided_bounds[src + 1]
        mine = np.unique(np.concatenate((piece_part[pa:pb], strided_part[sa:sb])))
        mine = mine[np.argsort(tag[mine], kind="stable")]
        mine_tags = tag[mine]
        piece_at = np.searchsorted(tag[piece_part[pa:pb]], mine_tags).astype(np.int64)
        strided_at = np.searchsorted(tag[strided_part[sa:sb]], mine_tags).astype(np.int64)
        files = set(parts[mine[np.isin(mine, strided_part[sa:sb])], 0].tolist())
        out.append(
            Sends(
                GatherTasks(
                    parts[mine],
                    np.append(piece_at, pb - pa),
                    pieces[pa:pb],
                    np.append(strided_at, sb - sa),
                    strided[sa:sb],
                    {},
                    {f: tensors[f] for f in sorted(files)},
                    width,
                ),
                dst[mine],
            )
        )
    return out
