"""What travels between the coordinator and the ranks of a save, as ``SavePlan.storage_data`` and
``WriteResult.storage_data`` (pickled by DCP): the rank-plan types, and every rank's final plan
built from the coordinator's planning. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..format.header import dtype_name
from .compact import LocalChunks, TablePlan, xor_shares
from .layout import Layout, Placement
from .packed import PackedTuple
from .spread import GatherTasks, MergeTask

__all__ = [
    "FINISHED",
    "PACKED",
    "Finished",
    "RankPlan",
    "Written",
    "WrittenRows",
    "check_savable",
    "combine_checksums",
    "compact_plans",
    "meets",
    "pack_results",
    "rank_plans",
    "unpack_table",
]


@dataclass(frozen=True)
class RankPlan:
    """``SavePlan.storage_data`` the coordinator sends each rank: the part of the layout it
    writes."""

    rank: int
    save_id: str
    positioned: bool  # the store writes into the final files in place (local disk)
    files: tuple[str, ...]
    placements: Mapping[MetadataIndex, Placement]
    # What the save's store needs this rank to know besides (S3: its own parts and the uploads
    # it sends parts to, ``plan/partplan.py``'s ``PartsRankPlan``); ``None`` for the other stores.
    store: Any = None
    # Where each row of the rank's key table goes, which the rank turns into ``placements`` for
    # the write items it kept (``plan/compact.py``); set by every save.
    table: TablePlan | None = None
    # The save's finishing work this rank does once every rank has staged (``plan/spread.py``), and
    # whether the ranks meet before it (on a save of several ranks where any rank has tasks).
    tasks: GatherTasks | tuple[MergeTask, ...] = ()
    world: int = 1
    meet: bool = False


@dataclass(frozen=True)
class Written:
    """``WriteResult.storage_data``: the output file, the item's offset in its staged file, and
    the item's share of its tensor's CRC32 (XOR of all shares = the tensor's CRC32)."""

    file: int
    staged_offset: int | None
    crc: int
    parts: tuple[
        dict[str, Any], ...
    ] = ()  # S3: ETags of this rank's parts of the file (its last item)
    direct_io_bytes: int = 0  # local disk: bytes written with O_DIRECT


@dataclass(frozen=True)
class WrittenRows:
    """Compact plans: a rank's one ``WriteResult.storage_data`` for all its items: the key-table
    row and CRC32 share of each item it wrote (what ``finish`` needs; the rest stays in its
    record)."""

    rows: Any  # np.ndarray int64
    crcs: Any  # np.ndarray uint32
    parts: Mapping[int, tuple[dict[str, Any], ...]] = dataclasses.field(
        default_factory=dict
    )  # S3: file -> ETags of this rank's parts
    direct_io_bytes: int = 0  # local disk: bytes written with O_DIRECT


@dataclass(frozen=True)
class Finished:
    """``WriteResult.storage_data`` of a rank's finishing tasks: per file, the parts it gathered
    and uploaded (``{"PartNumber", "ETag"}``; no ETag for a one-part file's PUT), the files it
    merged, the bytes it assembled, and where the save's ranks exchanged bytes, what it received
    and held."""

    parts: Mapping[int, tuple[dict[str, Any], ...]]
    merged: tuple[int, ...]
    nbytes: int
    received: int = 0  # of those, bytes other ranks sent it over the save's group
    held: int = 0  # bytes it held in memory for the other ranks' gathered parts


# The ``WriteResult.index`` of a rank's packed results (compact plans), and of its finishing tasks.
PACKED = MetadataIndex("__hf_dcp_rank_results__")
FINISHED = MetadataIndex("__hf_dcp_finishing_tasks__")


def check_savable(items: Sequence[WriteItem]) -> None:
    """(each rank, before anything is written) Refuse what safetensors cannot hold.

    Raises:
        ValueError: values that are not tensors (all named), or a dtype safetensors has no name for.
    """
    not_tensors = [item.index.fqn for item in items if item.type == WriteItemType.BYTE_IO]
    if not_tensors:
        raise ValueError(
            "safetensors holds only tensors, but these state-dict values are not tensors: "
            f"{sorted(set(not_tensors))}. Save them separately (e.g. as JSON) or wrap numbers in "
            "torch.tensor()."
        )
    for item in items:
        assert item.tensor_data is not None  # every non-BYTE_IO item carries tensor data
        dtype_name(item.tensor_data.properties.dtype, key=item.index.fqn)


def compact_plans(plans: Sequence[SavePlan]) -> list[LocalChunks]:
    """(coordinator) Every rank's compact plan (``prepare_local_plan``'s ``LocalChunks``).

    Raises:
        ValueError: a plan DCP's plan caching reused (``usable=False``: the previous save's
            layout, save id and placements, which this save cannot reuse).
        RuntimeError: a rank sent no compact plan (a planner replaced ``storage_data``).
    """
    stale = [rank for rank, p in enumerate(plans) if not p.usable]
    if stale:
        raise ValueError(
            f"ranks {stale[:8]} sent a cached plan "
            "(DefaultSavePlanner(enable_plan_caching=True)); HFStorageWriter plans every save "
            "afresh. Use a planner without enable_plan_caching"
        )
    compact = [p.storage_data for p in plans if isinstance(p.storage_data, LocalChunks)]
    if len(compact) != len(plans):
        raise RuntimeError(
            f"{len(plans) - len(compact)} of {len(plans)} ranks sent no compact plan: "
            "HFStorageWriter.prepare_local_plan must be the last step of every rank's local "
            "planning (a planner that replaces SavePlan.storage_data breaks it)"
        )
    return compact


def rank_plans(
    plans: list[SavePlan],
    layout: Layout,
    save_id: str,
    positioned: bool,
    placements: list[dict[MetadataIndex, Placement]],
    tables: list[TablePlan] | None = None,
    tasks: Sequence[GatherTasks] | Sequence[Sequence[MergeTask]] | None = None,
    store_data: Sequence[Any] | None = None,
) -> list[SavePlan]:
    """(coordinator) Every rank's final plan: its ``RankPlan`` (placements or table plan, its
    finishing tasks, and what the store planned for it, ``store_data[rank]``)."""
    meet = meets(tasks)
    out, names = (
        [],
        PackedTuple(layout.names),
    )  # in every plan: pickled as one blob, not a string per file
    for rank, (plan, placed) in enumerate(zip(plans, placements, strict=True)):
        mine = tasks[rank] if tasks is not None else ()
        mine_tasks = mine if isinstance(mine, GatherTasks) else tuple(mine)
        table = tables[rank] if tables is not None else None
        data = store_data[rank] if store_data is not None else None
        rank_plan = RankPlan(
            rank, save_id, positioned, names, placed, data, table, mine_tasks, len(plans), meet
        )
        out.append(dataclasses.replace(plan, storage_data=rank_plan))
    return out


def meets(tasks: Sequence[Any] | None) -> bool:
    """Whether the ranks must wait for each other before their tasks: only if there are
    several ranks and any has a task (a task may read any rank's staged bytes)."""
    return tasks is not None and len(tasks) > 1 and any(tasks)


def unpack_table(
    all_items: list[WriteItem], local: LocalChunks, rank_plan: RankPlan
) -> tuple[list[WriteItem], RankPlan]:
    """(each rank) The write items this rank kept of ``all_items`` (its ``local`` chunks), and
    its plan with their placements, from the table plan the coordinator sent back."""
    table = rank_plan.table
    assert table is not None
    keep = np.ones(len(all_items), dtype=bool)
    keep[table.skip] = False
    rows = local.rows[:, 0]
    placements, items = {}, []
    for i in np.flatnonzero(keep).tolist():
        row = int(rows[i])
        items.append(all_items[i])
        placements[all_items[i].index] = Placement(int(table.file[row]), int(table.start[row]))
    return items, dataclasses.replace(rank_plan, placements=placements)


def pack_results(
    all_items: list[WriteItem], local: LocalChunks, results: list[WriteResult]
) -> WriteResult:
    """(each rank, compact plans) One result for all items: their table rows and CRC shares."""
    position = {item.index: i for i, item in enumerate(all_items)}
    rows = (
        local.rows[[position[r.index] for r in results], 0]
        if results
        else np.empty(0, dtype=np.int64)
    )
    crcs = np.array([r.storage_data.crc for r in results], dtype=np.uint32)
    parts = {r.storage_data.file: r.storage_data.parts for r in results if r.storage_data.parts}
    direct_io_bytes = sum(r.storage_data.direct_io_bytes for r in results)
    return WriteResult(
        PACKED,
        sum(r.size_in_bytes for r in results),
        WrittenRows(rows, crcs, parts, direct_io_bytes),
    )


def combine_checksums(
    layout: Layout, results: list[list[WriteResult]], tables: tuple[list[Any], Any] | None
) -> dict[str, int]:
    """(coordinator) Each key's CRC32: the XOR of the shares every rank reported for it
    (``tables``: the key tables of compact plans, ``None`` for results rebuilt from records)."""
    if results and results[0] and isinstance(results[0][0].storage_data, WrittenRows):
        assert tables is not None
        keys, table_of_rank = tables
        specs = list(layout.specs)  # in key-table order: the layout was planned from it
        shares = [(rs[0].storage_data.rows, rs[0].storage_data.crcs) for rs in results]
        return dict(
            zip(specs, xor_shares(keys, table_of_rank, shares, len(specs)).tolist(), strict=True)
        )
    checksums = dict.fromkeys(layout.weight_map, 0)
    for rank_results in results:
        for r in rank_results:
            checksums[r.index.fqn] ^= r.storage_data.crc
    return checksums
