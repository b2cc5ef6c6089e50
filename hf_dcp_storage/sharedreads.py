"""A load's shared reads: bytes that several ranks need, read from the store by one of them and
passed to the others over the load's own process group (``HFStorageReader(share_reads=True)``).

Which ranks need the same region of a tensor is read off the destination state dict, with no
message: a DTensor's region is the same on the ranks at its coordinate on every mesh dimension
but those it is ``Replicate`` on (HSDP's replicas, TP-replicated norms); a plain tensor's, on
every rank that loads it (``plan/sharing.py`` has the rules). The ranks then check, with one
all-gather of a digest per group, that every member of each group holds the same items; a group
that does not agree is read by each member on its own, as without sharing.

A group's pieces (whole rows of its regions, dealt over its members) go in rounds of at most
``plan/sharing.ROUND_BYTES``: each member reads its pieces of the round through the load's
usual reads (``reading.read_items``, into a buffer of the destination dtype), sends them to
every other member and receives theirs (gloo, CPU: one message each way per member; where the
group is every rank of the load, plain tensors, one all-gather, a ring), then copies every
piece into its destination. The groups go in one order on every rank (sorted by their
ranks), so two groups that share ranks never wait on each other. What a rank holds at once:
one round's bytes.

The process group is made straight on the job's key-value store (``session/group.py``), as a
save's exchange is: no ``new_group`` (which every rank of the job must call alike, from the
thread that owns the groups) and nothing sent on the trainer's groups. Beyond
``session/group.EAGER_GROUP_WORLD`` ranks it connects lazily: a rank opens connections to the
ranks it exchanges with (its groups' members, its ring neighbours for the tables), not to all of
them, so a load of 16,384 ranks opens a handful of sockets a rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from .format.geometry import element_size
from .plan.sharing import (
    GroupReads,
    Piece,
    SharedItem,
    agreed,
    group_digest,
    plan_group,
    replica_group,
)
from .reading import LoadStats
from .session.group import forget_group, save_group
from .session.meeting import DEFAULT_RANK_TIMEOUT

__all__ = ["LoadRanks", "ReadFn", "read_sharing"]

# Each piece starts at a multiple of this in a member's buffer (any dtype views it).
_ALIGN = 64
# A member's buffer starts with its status: nonzero where its reads of the round failed.
_HEAD = _ALIGN

# ``read(items, planner)``: the load's own reads of ``items`` into ``planner``'s tensors.
ReadFn = Callable[[Sequence[ReadItem], LoadPlanner], None]


@dataclass(frozen=True)
class LoadRanks:
    """What the load's coordinator told each rank (``HFStorageReader.prepare_global_plan``):
    the load's id, this rank's number and the number of ranks. ``load_id`` is empty where the
    load does not share (turned off, or its ranks are not the job's ranks in order)."""

    global_rank: int
    load_id: str = ""
    rank: int = -1
    world: int = 0


def read_sharing(
    items: Sequence[ReadItem],
    planner: LoadPlanner,
    ranks: LoadRanks,
    read: ReadFn,
    stats: LoadStats,
) -> None:
    """(every rank of the load, in ``read_data``) Read ``items`` into ``planner``'s tensors and
    commit them: the regions other ranks need too through the group exchange, the rest with
    ``read``.

    A rank whose read of its pieces fails still takes part in that round's exchange, flagged
    failed, and raises its error after it; the other members of the group then fail naming it.
    The ranks' own reads come last, so that a failure there keeps no other rank waiting.

    Raises:
        RuntimeError: a member of a group failed its reads, or stopped taking part (after
            ``DEFAULT_RANK_TIMEOUT``), naming it.
    """
    groups = _groups(items, planner, ranks.world)
    # Every rank joins, groups or not: whether any other rank shares with it is known only
    # from the tables.
    group = save_group(
        f"load-{ranks.load_id}",
        ranks.rank,
        ranks.world,
        DEFAULT_RANK_TIMEOUT,
    )
    try:
        digests = {g: group_digest(g, shared) for g, shared in groups.items()}
        sharing = agreed({g: d for g, (_, d) in digests.items()}, _tables(group, digests))
        for g in sorted(sharing):
            _exchange(group, ranks.rank, plan_group(g, groups[g]), items, planner, read, stats)
            stats.shared_groups += 1
        shared = {i.index for g in sharing for i in groups[g]}
        read([item for i, item in enumerate(items) if i not in shared], planner)
    finally:
        forget_group(f"load-{ranks.load_id}", ranks.rank)


def _groups(
    items: Sequence[ReadItem], planner: LoadPlanner, world: int
) -> dict[tuple[int, ...], list[SharedItem]]:
    """This rank's items that other ranks need too, by group (its load ranks, sorted)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    state = getattr(planner, "state_dict", None)
    if not isinstance(state, dict):
        return {}  # a planner of another kind: nothing known of the destinations
    groups: dict[tuple[int, ...], list[SharedItem]] = {}
    for i, item in enumerate(items):
        dest = state.get(item.dest_index.fqn)
        if isinstance(dest, DTensor):
            mesh, coordinate = dest.device_mesh, dest.device_mesh.get_coordinate()
            kinds = [isinstance(p, Replicate) for p in dest.placements]
            if coordinate is None or not any(kinds):
                continue
            if not all(isinstance(p, (Shard, Replicate)) for p in dest.placements):
                continue  # Partial: each rank's values are its own
            g = replica_group(mesh.mesh.cpu().numpy(), coordinate, kinds)
        elif isinstance(dest, torch.Tensor):
            g = tuple(range(world))
        else:
            continue
        lengths = list(item.lengths)
        size = element_size(dest.dtype)
        rows, row_bytes = (lengths[0], math.prod(lengths[1:]) * size) if lengths else (1, size)
        if len(g) > 1 and rows * row_bytes:
            key: tuple[object, ...] = (item.dest_index.fqn, item.storage_index.fqn)
            key += (tuple(item.storage_offsets), tuple(lengths), str(dest.dtype))
            groups.setdefault(g, []).append(SharedItem(i, key, rows, row_bytes))
    return groups


def _tables(group: Any, digests: dict[tuple[int, ...], tuple[int, int]]) -> list[dict[int, int]]:
    """Every rank's ``{group id: digest}``, gathered (two all-gathers: the sizes, the tables)."""
    mine = torch.tensor([list(d) for d in digests.values()], dtype=torch.int64).reshape(-1, 2)
    world = group.size()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    group.allgather([counts], [torch.tensor([len(mine)], dtype=torch.int64)]).wait()
    most = int(max(c.item() for c in counts))
    padded = torch.full((most, 2), -1, dtype=torch.int64)
    padded[: len(mine)] = mine
    tables = [torch.empty((most, 2), dtype=torch.int64) for _ in range(world)]
    group.allgather([tables], [padded]).wait()
    return [{int(a): int(b) for a, b in t.tolist() if a >= 0} for t in tables]


class _Staging:
    """The planner a member's reads of its pieces go through: each piece's rows land in that
    member's round buffer, nothing is committed."""

    def __init__(self, targets: dict[int, torch.Tensor]) -> None:
        self.targets = targets

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.targets[id(item)]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _layout(pieces: Sequence[Piece], ranks: Sequence[int]) -> dict[int, tuple[int, list[int]]]:
    """``member -> (buffer bytes, each of its pieces' offset)``, as every member computes it: a
    member's buffer is its status (``_HEAD`` bytes) and then its pieces of the round."""
    out: dict[int, tuple[int, list[int]]] = {r: (_HEAD, []) for r in ranks}
    for piece in pieces:
        size, offsets = out[piece.reader]
        offsets.append(size)
        out[piece.reader] = (size + -(-piece.nbytes // _ALIGN) * _ALIGN, offsets)
    return out


def _exchange(
    group: Any,
    rank: int,
    plan: GroupReads,
    items: Sequence[ReadItem],
    planner: LoadPlanner,
    read: ReadFn,
    stats: LoadStats,
) -> None:
    """One group's rounds: read this rank's pieces, swap them with every other member (the
    whole load's group: one all-gather a round; a smaller one: a message to and from each
    member), copy every piece into its destination; commit each item once its last piece is
    in."""
    targets: dict[int, torch.Tensor] = {}
    left: dict[int, int] = {}
    for round_ in plan.rounds:
        for piece in round_:
            left[piece.index] = left.get(piece.index, 0) + 1
    whole = len(plan.ranks) == group.size()  # ranks 0 .. world-1, sorted
    for number, round_ in enumerate(plan.rounds):
        layout = _layout(round_, plan.ranks)
        # An all-gather takes buffers of one size: each member's padded to the largest.
        most = max(size for size, _ in layout.values())
        buffers = {
            r: torch.empty(most if whole else size, dtype=torch.uint8)
            for r, (size, _) in layout.items()
        }
        placed = {r: iter(offsets) for r, (_, offsets) in layout.items()}
        views: list[tuple[Piece, torch.Tensor]] = []
        mine: list[ReadItem] = []
        staged: dict[int, torch.Tensor] = {}
        for piece in round_:
            item = items[piece.index]
            if piece.index not in targets:
                targets[piece.index] = planner.resolve_tensor(item).detach()
            dest = targets[piece.index]
            at = next(placed[piece.reader])
            shape = (piece.r1 - piece.r0, *dest.shape[1:]) if dest.dim() else ()
            view = buffers[piece.reader][at : at + piece.nbytes].view(dest.dtype).view(shape)
            views.append((piece, view))
            if piece.reader == rank:
                sub = _rows(item, piece)
                mine.append(sub)
                staged[id(sub)] = view
        failure: Exception | None = None
        try:
            if mine:
                read(mine, cast(LoadPlanner, _Staging(staged)))
        except Exception as exc:  # noqa: BLE001 - raised after this round's exchange, below
            failure = exc
        buffers[rank][:_HEAD].view(torch.int64)[0] = failure is not None
        _swap(group, rank, plan.ranks, buffers, whole, number, stats)
        if failure is not None:
            raise failure
        failed = [r for r in plan.ranks if r != rank and buffers[r][:_HEAD].view(torch.int64)[0]]
        if failed:
            raise RuntimeError(
                f"load rank(s) {failed} failed to read their share of the bytes that ranks "
                f"{_ranks(plan.ranks)} load alike (their own errors say why); load with "
                "HFStorageReader(share_reads=False) to have each rank read alone"
            )
        for piece, view in views:
            dest = targets[piece.index]
            (dest[piece.r0 : piece.r1] if dest.dim() else dest).copy_(view)
            left[piece.index] -= 1
            if not left[piece.index]:
                planner.commit_tensor(items[piece.index], targets.pop(piece.index))


def _swap(
    group: Any,
    rank: int,
    ranks: Sequence[int],
    buffers: dict[int, torch.Tensor],
    whole: bool,
    number: int,
    stats: LoadStats,
) -> None:
    """Send this rank's buffer to every other member and fill theirs: for the whole load, one
    all-gather (a ring: two neighbours, however many ranks); else one message each way per
    member (tag: the round)."""
    others = [r for r in ranks if r != rank]
    try:
        if whole:
            # This rank's own slot gets a copy of its input: never the input itself.
            out = [buffers[r] if r != rank else torch.empty_like(buffers[r]) for r in ranks]
            group.allgather([out], [buffers[rank]]).wait()
        else:
            tag = number % (1 << 30)
            works = [group.send([buffers[rank]], other, tag) for other in others]
            works += [group.recv([buffers[other]], other, tag) for other in others]
            for work in works:
                work.wait()
    except RuntimeError as exc:
        raise RuntimeError(
            f"the shared reads of load ranks {_ranks(ranks)}: a member stopped taking part "
            f"({exc}); load with HFStorageReader(share_reads=False) to have each rank read alone"
        ) from exc
    stats.bytes_sent += len(buffers[rank]) * len(others)
    stats.bytes_received += sum(len(buffers[r]) for r in others)


def _ranks(ranks: Sequence[int]) -> str:
    return str(list(ranks)) if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}]"


def _rows(item: ReadItem, piece: Piece) -> ReadItem:
    """The read item of rows ``[r0, r1)`` of ``item``'s region (a 0-d item: itself)."""
    if not len(item.lengths):
        return item
    offsets, dest, lengths = (
        list(v) for v in (item.storage_offsets, item.dest_offsets, item.lengths)
    )
    offsets[0] += piece.r0
    dest[0] += piece.r0
    lengths[0] = piece.r1 - piece.r0
    return dataclasses.replace(
        item,
        storage_offsets=torch.Size(offsets),
        dest_offsets=torch.Size(dest),
        lengths=torch.Size(lengths),
    )
