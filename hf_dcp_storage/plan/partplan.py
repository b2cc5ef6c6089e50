"""A part store's save (S3, GCS, Azure): every file's parts and the gathering tasks of its
mixed parts, from its placed chunks.

The coordinator plans every file's parts from the byte runs the chunks make in it
(``plan/parts.plan_file_parts``) and, for each gathered part, where its bytes sit in the ranks'
staged objects, given out to the ranks by bytes, each rank's share one ``plan/spread.py``
``GatherTasks`` (``plan/gather.py``). A column-sharded tensor makes one run per row per rank
(161 M runs at 405B over 1,024 x 8 ranks): such a tensor is one run of mixed ranks here, always
gathered, and its chunks are named whole in the tasks, so nothing is ever done per row on the
coordinator. Everything else is numpy over the chunks, an object per part and a Python step per
rank where shares are made.

What the ranks do agrees by construction: a rank routes each byte run it writes into one of its own
parts or into its staged object of the file (``plan/parts.route_run``), chunk after chunk in output
order (``io/items.py``'s ``in_write_order``), so its staged bytes of a file are, in that order,
the bytes of its chunks not in its parts: a column-sharded chunk whole, a row-sharded one in the
pieces the parts leave. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .exchange import Sends
from .fileparts import FileParts, Part, RankPart
from .gather import Runs, file_order, gather_tasks
from .layout import Layout
from .parts import S3_RULES, PartRules, gather_part_bytes, plan_file_parts
from .placed import PlacedChunks
from .spread import GatherTasks

__all__ = ["PartPlan", "PartsRankPlan", "parts_rank_plans", "plan_parts"]


@dataclass(frozen=True)
class PartPlan:
    """Every file's parts (``parts[f]``, numbered from 1 in file order) and each rank's share of
    the gathered ones (``tasks[rank]``, in file order)."""

    parts: list[FileParts]
    tasks: list[GatherTasks]


@dataclass(frozen=True)
class PartsRankPlan:
    """What a rank of a part store's save is told besides its place in the layout: the parts it
    uploads of its own, (S3) the multipart uploads it sends parts to (of its own or gathered),
    and where the save's gathered parts travel over the ranks' network (``exchange``), what it
    sends the gathering ranks (``plan/exchange.py``)."""

    # file index -> upload id, of the files this rank sends parts to (a failing rank aborts the
    # rest from the save record)
    uploads: Mapping[int, str]
    parts: Mapping[int, tuple[RankPart, ...]]  # file index -> this rank's parts, by start
    headers: Mapping[int, bytes]  # file index -> header, where this rank's part carries it
    exchange: bool = False
    sends: Sends | None = None


def parts_rank_plans(
    layout: Layout,
    parts: Sequence[Sequence[Part]],
    uploads: Mapping[int, str],
    tasks: Sequence[GatherTasks],
    sends: Sequence[Sends] | None = None,
) -> list[PartsRankPlan]:
    """(coordinator) Each rank's ``PartsRankPlan``: its own parts by file (one pass over all parts,
    not one per rank), the headers its parts carry, only the uploads it sends parts to (all
    of them in every plan were a quarter of what the coordinator sent at 8,192 ranks), and
    where the save exchanges (``sends`` given), what it sends. Pure."""
    own: dict[int, dict[int, list[RankPart]]] = {}
    for f, file_parts in enumerate(parts):
        for p in FileParts.of(file_parts).own():
            own.setdefault(p.rank, {}).setdefault(f, []).append(p)
    out = []
    for rank, mine in enumerate(tasks):
        by_file = {f: tuple(ps) for f, ps in own.get(rank, {}).items()}
        headers = {
            f: layout.files[f].header for f, ps in by_file.items() if any(p.header for p in ps)
        }
        files = set(by_file) | set(mine.parts[:, 0].tolist())
        out.append(
            PartsRankPlan(
                {f: uploads[f] for f in sorted(files) if f in uploads},
                by_file,
                headers,
                sends is not None,
                sends[rank] if sends is not None else None,
            )
        )
    return out


def plan_parts(
    placed: PlacedChunks,
    layout: Layout,
    world: int,
    rules: PartRules = S3_RULES,
    per_node: int = 1,
) -> PartPlan:
    """(coordinator) Plan a part store's save: its parts and gathering tasks, spread over ``world``
    ranks by bytes (``plan/balance.py``, counting the bytes each rank uploads of its own). Pure.
    ``rules``: the store's part rules (GCS and Azure plan their parts here too, with theirs);
    ``per_node``: ranks a node, consecutive (a gathered part goes to the node holding most of it
    where the load allows: ``plan/gather.py``).

    Raises:
        ValueError: a file needs more than ``rules.max_parts`` parts (S3's 10,000).
    """
    strided = _strided(placed)
    file_base = np.concatenate(([0], np.cumsum([f.size for f in layout.files], dtype=np.int64)))
    position = (
        file_base[placed.file] + placed.start
    )  # of each chunk's first byte, in all files' bytes
    # Byte runs: a row-sharded chunk is one; a column-sharded tensor one, of rank -1.
    row = np.flatnonzero(~strided & (placed.nbytes > 0))
    mixed_keys = np.flatnonzero(np.bincount(placed.key[strided], minlength=len(placed.key_names)))
    key_bytes = (
        np.array(
            [
                np.prod(s[:n])
                for s, n in zip(
                    placed.shape[mixed_keys].tolist(), placed.ndim[mixed_keys].tolist(), strict=True
                )
            ],
            dtype=np.int64,
        )
        * placed.itemsize[mixed_keys]
    )
    # A run's chunk in ``placed``; a column-sharded tensor's ``-1 - m``, ``m`` its place in
    # ``mixed_keys``.
    run_chunk = np.concatenate((row, -1 - np.arange(len(mixed_keys))))
    order, start = file_order(
        np.concatenate(
            (
                position[row],
                file_base[placed.key_file[mixed_keys]] + placed.tensor_start[mixed_keys],
            )
        ),
        np.concatenate((placed.key[row], mixed_keys)),
        placed,
        file_base,
    )
    chunk = run_chunk[order]
    del order, run_chunk, row
    # The rest of each run from its chunk (a gather per column: chunks listed rank after rank
    # come here key after key), then a mixed tensor's (where ``chunk`` counts from the end).
    runs = Runs(start, placed.nbytes[chunk], placed.rank[chunk], (placed.staged - position)[chunk])
    mixed = np.flatnonzero(chunk < 0)
    runs.nbytes[mixed], runs.rank[mixed] = key_bytes[-1 - chunk[mixed]], -1
    del chunk, mixed
    bounds = np.searchsorted(runs.start, file_base)
    gather_part = gather_part_bytes(int(placed.nbytes.sum()), world, rules.min_part)
    parts = []
    for f, plan in enumerate(layout.files):
        a, b = bounds[f], bounds[f + 1]
        start, nbytes, rank = _joined(
            runs.start[a:b] - file_base[f], runs.nbytes[a:b], runs.rank[a:b]
        )
        parts.append(
            plan_file_parts(
                len(plan.header),
                plan.size,
                start,
                nbytes,
                rank,
                min_part=rules.min_part,
                rank_part=rules.rank_part,
                gather_part=gather_part,
                max_parts=rules.max_parts,
                own_part=rules.own_part,
                run_nodes=np.where(rank >= 0, rank // per_node, -1) if per_node > 1 else None,
                node_part=rules.node_part,
            )
        )
    return PartPlan(
        parts,
        gather_tasks(placed, layout, parts, strided, runs, position, file_base, world, per_node),
    )


def _joined(
    start: np.ndarray, nbytes: np.ndarray, rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One file's runs with neighbouring runs of one rank joined (a rank's small tensors side by
    side, a one-rank save), as ``plan_file_parts`` takes them."""
    new = np.ones(len(start), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (rank[1:] < 0)
    heads = np.flatnonzero(new)
    if len(heads) == len(start):
        return start, nbytes, rank
    return start[heads], np.add.reduceat(nbytes, heads), rank[heads]


def _strided(placed: PlacedChunks) -> np.ndarray:
    """Per chunk: whether its tensor has a chunk of several runs (a column shard), so the whole
    tensor is gathered. A chunk is several runs when it is cut in some dimension and holds more
    than one index of an earlier one; a column at a time, from the last dimension."""
    several = np.zeros(len(placed.key), dtype=bool)
    cut_after = np.zeros(len(placed.key), dtype=bool)  # not whole in some later dimension
    for d in range(placed.offsets.shape[1] - 1, -1, -1):
        size = placed.sizes[:, d]
        several |= cut_after & (size != 1)
        cut_after |= size != placed.shape[:, d][placed.key]  # padded dims: 0 == 0, whole
    several &= placed.nbytes > 0
    mixed = np.zeros(len(placed.shape), dtype=bool)
    mixed[placed.key[several]] = True
    return mixed[placed.key]
