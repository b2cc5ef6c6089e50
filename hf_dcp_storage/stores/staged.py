"""Any other fsspec store (``memory://``, an fsspec backend without a store of its own here,
local disk with ``direct_write=False``): staged objects, each output file then merged by one
rank.

A store like that has no positioned writes and fsspec no API to assemble an object from pieces,
so a file has one writer. Each rank streams its chunks of an output file, in the file's byte
order, into one staged object of its own (``write``); once every rank has staged, the rank given
the file (``plan/spread.py``: spread by bytes; the coordinator when finishing an interrupted save)
walks the output file front to back and copies each byte run from the staged object that holds
it (``merge_file``), with bounded memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..format.crc import CrcAccumulator
from ..format.geometry import element_size
from ..io import fsio
from ..io.items import chunk_bytes, in_write_order, tensor_bytes
from ..io.parallel import parallel_map
from ..plan.layout import Layout
from ..plan.merge import StagedPiece, merge_segments
from ..plan.placed import PlacedChunks
from ..plan.rankplan import Finished, RankPlan, Written
from ..plan.spread import MergeTask, plan_merges
from .base import Slabs, Store

__all__ = ["COPY_BYTES", "StagedStore", "merge_file"]


class StagedStore(Store):
    """Staged objects merged per file (see the module docstring)."""

    mode = "staged"
    merges_files = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Finishing an interrupted save from its records (``adopt``): every rank's write items.
        self.items: dict[MetadataIndex, WriteItem] | None = None

    def plan(
        self, layout: Layout, placed: PlacedChunks | None, world: int
    ) -> list[list[MergeTask]]:
        """One task per file, spread over the ranks by bytes (``plan/spread.py``'s
        ``plan_merges``); the files' columns are packed on the writer's threads."""
        assert placed is not None
        return plan_merges(
            placed, layout, world, lambda fn, files: parallel_map(fn, files, self.threads)
        )

    def adopt(
        self,
        layout: Layout,
        plans: list[SavePlan],
        uploads: Mapping[int, str],
        part_plan: Mapping[str, int],
    ) -> None:
        """(``consolidate``) Finish a save from its records: merge from these write items."""
        self.items = {item.index: item for plan in plans for item in plan.items}

    def write(self, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs) -> list[WriteResult]:
        by_file: dict[int, list[WriteItem]] = {}
        for item in items:
            by_file.setdefault(rank_plan.placements[item.index].file, []).append(item)

        def write_file(file: int) -> list[WriteResult]:
            path = self.staged_path(rank_plan.files[file], rank_plan.rank)
            # Output order, so the merge reads each staged object front to back.
            file_items = in_write_order(
                by_file[file], lambda it: rank_plan.placements[it.index].tensor_start
            )
            results, pos = [], 0
            with fsio.write_stream(self.fs, path, sum(chunk_bytes(it) for it in file_items)) as out:
                for item in file_items:
                    start = pos
                    crc = CrcAccumulator()
                    for runs, data in slabs(item):
                        out.write(data)
                        for tensor_off, chunk_off, n in runs:
                            crc.update(tensor_off, data[chunk_off : chunk_off + n])
                        pos += len(data)
                    results.append(
                        WriteResult(
                            item.index,
                            pos - start,
                            Written(file, start, crc.contribution(tensor_bytes(item))),
                        )
                    )
                if fsio.is_local(self.fs):
                    out.flush()
                    os.fsync(out.fileno())
            return results

        return [r for rs in parallel_map(write_file, sorted(by_file), self.threads) for r in rs]

    def run_task(self, task: MergeTask, rank_plan: RankPlan) -> tuple[int, dict[str, Any] | None]:
        name = rank_plan.files[task.file]
        merge_file(
            self.fs,
            fsio.join(self.root, name),
            task.header,
            task.nbytes,
            task.pieces(lambda rank: self.staged_path(name, rank)),
        )
        return task.file, None

    def complete(
        self, layout: Layout, results: list[list[WriteResult]], finished: Mapping[int, Finished]
    ) -> None:
        """Every file was a rank's task, merged before that rank's results came back; finishing
        an interrupted save (``adopt``), the files no rank merged are merged here."""
        merged = {f for fin in finished.values() for f in fin.merged}
        if self.items is None:
            missing = [layout.files[f].name for f in range(len(layout.files)) if f not in merged]
            if missing:
                raise RuntimeError(
                    f"files {missing[:8]} were not merged by any rank; the checkpoint at "
                    f"{fsio.url_of(self.fs, self.root)} is not committed"
                )
            staged = []
        else:
            staged = [
                (r.index, rank, r.storage_data) for rank, rs in enumerate(results) for r in rs
            ]
        self._merge(layout, staged, merged)

    def _merge(
        self, layout: Layout, staged: list[tuple[MetadataIndex, int, Written]], merged: set[int]
    ) -> None:
        """(coordinator) Merge each file's staged objects into it, but ``merged`` (done by
        ranks)."""
        pieces: dict[int, list[StagedPiece]] = {}
        for index, rank, written in staged:
            assert self.items is not None
            td = self.items[index].tensor_data
            assert td is not None and written.staged_offset is not None
            path = self.staged_path(layout.files[written.file].name, rank, source=True)
            pieces.setdefault(written.file, []).append(
                StagedPiece(
                    path=path,
                    tensor_start=layout.tensor_start[index.fqn],
                    staged_offset=written.staged_offset,
                    shape=tuple(td.size),
                    offsets=tuple(td.chunk.offsets),
                    sizes=tuple(td.chunk.sizes),
                    itemsize=element_size(td.properties.dtype),
                )
            )
        source_fs = self.source[0] if self.source is not None else self.fs

        def merge_one(file: int) -> None:
            plan = layout.files[file]
            merge_file(
                self.fs,
                fsio.join(self.root, plan.name),
                plan.header,
                plan.size,
                pieces.get(file, []),
                source_fs=source_fs,
                on_bytes=self.on_bytes,
            )
            self.merge_stats.add(plan.size, plan.size, plan.size)

        for f in merged:
            self.merge_stats.add(layout.files[f].size, layout.files[f].size, 0)
        parallel_map(
            merge_one, [f for f in range(len(layout.files)) if f not in merged], self.threads
        )


# Bytes moved per read/write while copying: bounds the merge's memory per thread.
COPY_BYTES = 8 << 20
# Every staged object of a file stays open while it is merged (FSDP visits them round-robin, one
# piece each per tensor), and a remote fsspec file keeps one read block: with a thousand ranks,
# 8 MiB blocks would hold 8 GiB. Blocks shrink to keep their sum near this, but not below
# _MIN_BLOCK (consecutive pieces of one rank sit back to back in its staged object: a block
# still serves several).
_READ_BLOCKS_BUDGET = 256 << 20
_MIN_BLOCK = 256 << 10


def merge_file(
    fs: AbstractFileSystem,
    out_path: str,
    header: bytes,
    size: int,
    pieces: Iterable[StagedPiece],
    *,
    source_fs: AbstractFileSystem | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Write ``header`` then every staged run in order to ``out_path``; exactly ``size`` bytes.

    The staged objects are read from ``source_fs`` (default ``fs``), all open at once, with read
    blocks whose sum stays near 256 MiB whatever the number of ranks; ``on_bytes(n)`` is told
    of each block copied.

    Raises:
        RuntimeError: the staged runs leave a hole or overlap (an inconsistent save).
    """
    source_fs = source_fs or fs
    pieces = list(pieces)
    block = max(
        _MIN_BLOCK, min(COPY_BYTES, _READ_BLOCKS_BUDGET // max(1, len({p.path for p in pieces})))
    )
    readers: dict[str, Any] = {}
    # write_stream publishes nothing if the merge fails: no truncated shard is left behind.
    with contextlib.ExitStack() as stack, fsio.write_stream(fs, out_path, size) as out:
        out.write(header)
        pos = len(header)
        for off, path, soff, n in merge_segments(pieces):
            if off != pos:
                raise RuntimeError(
                    f"{out_path}: staged data jumps from byte {pos} to {off}; the save is "
                    "inconsistent"
                )
            src = readers.get(path)
            if src is None:
                src = readers[path] = stack.enter_context(fsio.open_read(source_fs, path, block))
            src.seek(soff)
            left = n
            while left:
                data = src.read(min(left, COPY_BYTES))
                if not data:
                    raise RuntimeError(
                        f"{path}: staged object ends early at byte {soff + n - left}"
                    )
                out.write(data)
                left -= len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
            pos += n
        if pos != size:
            raise RuntimeError(f"{out_path}: merged {pos} bytes but the layout has {size}")
        if fsio.is_local(fs):
            out.flush()
            os.fsync(out.fileno())
