"""Pure planning of a load's shared reads: which ranks need the same bytes, and which of them
reads each piece (``sharedreads.py`` does the reads and the exchange).

Where several ranks of a load need the same region of a tensor (a DTensor replicated on a mesh
dimension: HSDP's replicas, TP-replicated norms, DDP's ``Replicate``), the region is read from
the store once: cut into pieces of whole rows, each read by one rank of the group and passed to
the others over the load's own process group. Every rank of a group computes the same plan from
the same inputs, with no message: the group comes from the DTensor's mesh and placements
(``replica_group``), the pieces and their readers from the group's items in key order
(``plan_group``). Before any byte moves the ranks check that they agree
(``group_digest``, compared by ``agreed``): a group whose members do not all report the same
items is read by each member on its own, as without sharing.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "PIECE_BYTES",
    "ROUND_BYTES",
    "GroupReads",
    "Piece",
    "SharedItem",
    "agreed",
    "group_digest",
    "plan_group",
    "replica_group",
]

# A piece's size: large enough that a message's and a request's overheads stay small, small
# enough that a group's members each read a share of a large tensor.
PIECE_BYTES = 16 << 20
# A tensor region smaller than this goes whole to one member (its pieces would be messages of a
# few bytes); the group's small regions are dealt out over its members in turn instead.
_SPLIT_BYTES = 1 << 20
# The bytes of one round of a group's exchange: what each member holds at once (its own pieces
# and those received), on top of the load's reads.
ROUND_BYTES = 256 << 20


@dataclass(frozen=True)
class SharedItem:
    """One read item of a shared group, as every member sees it: ``key`` orders and identifies
    it (the tensor's name, offsets and lengths), ``rows`` and ``row_bytes`` of its destination
    region (a 0-d region: one row)."""

    index: int  # in the rank's own list of read items
    key: tuple[object, ...]
    rows: int
    row_bytes: int


@dataclass(frozen=True)
class Piece:
    """Rows ``[r0, r1)`` of item ``index``'s region, read by load rank ``reader``."""

    index: int
    r0: int
    r1: int
    reader: int
    nbytes: int


@dataclass
class GroupReads:
    """A group's shared reads: its ranks (sorted), and its pieces in rounds."""

    ranks: tuple[int, ...]
    rounds: list[list[Piece]] = field(default_factory=list)

    def nbytes_of(self, round_: Sequence[Piece], reader: int) -> int:
        """Bytes of ``round_`` that ``reader`` reads (and sends to every other member)."""
        return sum(p.nbytes for p in round_ if p.reader == reader)


def replica_group(
    mesh: np.ndarray, coordinate: Sequence[int], replicated: Sequence[bool]
) -> tuple[int, ...]:
    """The ranks holding the same local region as the rank at ``coordinate`` of ``mesh`` (its
    global ranks): those at the same coordinate on every dimension but the replicated ones."""
    index = tuple(slice(None) if rep else c for c, rep in zip(coordinate, replicated, strict=True))
    return tuple(sorted(int(r) for r in np.asarray(mesh)[index].reshape(-1)))


def plan_group(
    ranks: tuple[int, ...],
    items: Sequence[SharedItem],
    *,
    piece_bytes: int = PIECE_BYTES,
    round_bytes: int = ROUND_BYTES,
) -> GroupReads:
    """Cut ``items`` (every member's same items, any order) into pieces of whole rows, dealt
    over the ``ranks``, and the pieces into rounds of about ``round_bytes``: a region
    of ``_SPLIT_BYTES`` or more is split into at least one piece per member, each of at most
    ``piece_bytes`` (a row larger is one piece); a smaller one is one piece. Each piece goes to
    the member that has the fewest bytes to read so far. The same on every member."""
    g = len(ranks)
    plan = GroupReads(ranks)
    # Each piece to the member with the fewest bytes so far (the first in ``ranks`` on a tie):
    # no member reads more than one piece beyond any other.
    loads = [(0, k) for k in range(g)]
    pieces: list[Piece] = []
    for item in sorted(items, key=lambda i: i.key):
        nbytes = item.rows * item.row_bytes
        if nbytes >= _SPLIT_BYTES and item.rows > 1:
            n = min(item.rows, max(g, math.ceil(nbytes / piece_bytes)))
        else:
            n = 1
        bounds = [item.rows * j // n for j in range(n + 1)]
        for j in range(n):
            r0, r1 = bounds[j], bounds[j + 1]
            load, k = heapq.heappop(loads)
            pieces.append(Piece(item.index, r0, r1, ranks[k], (r1 - r0) * item.row_bytes))
            heapq.heappush(loads, (load + (r1 - r0) * item.row_bytes, k))
    current: list[Piece] = []
    held = 0
    for piece in pieces:
        if current and held + piece.nbytes > round_bytes:
            plan.rounds.append(current)
            current, held = [], 0
        current.append(piece)
        held += piece.nbytes
    if current:
        plan.rounds.append(current)
    return plan


def group_digest(ranks: tuple[int, ...], items: Sequence[SharedItem]) -> tuple[int, int]:
    """``(group id, digest of its items)``: two 63-bit numbers every member of the group
    computes alike when they hold the same items (``agreed`` compares them)."""
    keys = sorted((i.key, i.rows, i.row_bytes) for i in items)
    return _hash63(repr(ranks)), _hash63(repr(keys))


def agreed(
    groups: Mapping[tuple[int, ...], int], tables: Sequence[Mapping[int, int]]
) -> set[tuple[int, ...]]:
    """The groups of ``groups`` (``ranks -> this rank's digest``) whose every member reported the
    same digest: ``tables[r]`` is rank ``r``'s ``{group id: digest}``. Every member of a group
    decides alike, from the same tables."""
    out = set()
    for ranks, digest in groups.items():
        gid = _hash63(repr(ranks))
        if all(tables[r].get(gid) == digest for r in ranks):
            out.add(ranks)
    return out


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
