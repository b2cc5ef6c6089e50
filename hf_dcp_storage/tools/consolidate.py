"""Finish a save that stopped after its ranks wrote their bytes but before the index was written.

Every save by ``HFStorageWriter`` keeps a record of itself in ``.hf_dcp_staging/``
(``session/records.py``): the coordinator's plan, and one record per rank written once that rank's
bytes are durable. If the coordinator dies, or its ``finish`` fails, before the index is written,
those records are all it takes to do ``finish`` again later, from any machine: merge the staged
objects, complete the S3 multipart uploads, or (local disk, where the bytes are already in
place) just write the index. The work is the writer's own ``finish``, run from the records.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..format.index import INDEX_NAME
from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.layout import Layout, layout_from_files
from ..plan.rankplan import FINISHED, Finished, Written
from ..session.records import (
    COMPLETION_RECORD,
    SAVE_RECORD,
    CompletionRecord,
    RankRecord,
    SaveRecord,
    rank_record_name,
)
from ..stores import coordinator
from ..stores.base import STAGING_DIR
from ..stores.registry import store_class
from ..stores.retry import RetryPolicy
from ..writer import HFStorageWriter
from .progress import NO_PROGRESS, Progress

__all__ = ["ConsolidateReport", "consolidate_checkpoint"]

# Bytes per read/write when copying finished files to another destination.
_COPY_BYTES = 8 << 20


@dataclass(frozen=True)
class ConsolidateReport:
    """What ``consolidate_checkpoint`` did.

    ``mode``: how the interrupted save had moved its bytes (``direct``, ``staged``, ``s3``, ``gcs``,
    ``azure``); ``moved_bytes``: bytes this process copied or merged (0 where only the index was
    missing); ``already_complete``: the source had its index already (only leftovers were cleared).
    """

    url: str
    mode: str
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    moved_bytes: int
    already_complete: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, files=list(self.files))


def consolidate_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    thread_count: int = 4,
    retry: RetryPolicy | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConsolidateReport:
    """Produce the consolidated HF checkpoint of an interrupted save at ``src``.

    One process does it, with ``thread_count`` files at a time and bounded memory (the merge
    copies 8 MiB blocks). With ``dst`` omitted the checkpoint is completed in place and the
    staging folder removed; with ``dst`` the source is left as it is and the checkpoint is
    written to ``dst`` (not possible for a save to S3, GCS or Azure, whose parts the server
    assembles where they are: complete it in place, then copy).

    Raises:
        FileNotFoundError: ``src`` holds no record of a save (nothing to consolidate).
        ValueError: the save cannot be finished (a rank never finished writing, records of
            different saves, S3 uploads gone, ``dst`` on an S3, GCS or Azure save), naming what and
            why.
        FileExistsError: ``dst`` holds a complete checkpoint and ``overwrite`` is off.
    """
    started = time.monotonic()
    progress = progress or NO_PROGRESS
    fs, root = fsio.resolve(src, storage_options)
    url = fsio.url_of(fs, root)
    staging = fsio.join(root, STAGING_DIR)
    names = fsio.list_tree(fs, staging)
    committed = fsio.exists(fs, fsio.join(root, INDEX_NAME))
    in_place = dst is None or _same_place(fs, root, *fsio.resolve(dst, storage_options))
    if committed:
        if not in_place:
            raise ValueError(
                f"{url} is already a complete checkpoint (it has {INDEX_NAME}); nothing to "
                f"consolidate: copy it to {dst} with your usual tools"
            )
        # The index exists: the save was committed and died while clearing its staging folder.
        fsio.remove_tree(fs, staging)
        return ConsolidateReport(url, "none", (), 0, 0, 0, True, time.monotonic() - started)
    if SAVE_RECORD not in names:
        raise FileNotFoundError(
            f"{url}: nothing to consolidate: no {INDEX_NAME} and no save record "
            f"({STAGING_DIR}/{SAVE_RECORD}). Either this is not a checkpoint folder, or the save "
            "stopped before it had planned its files; save again"
        )
    record, ranks = _read_records(fs, staging, names, url)
    layout = layout_from_files(record.files, f"{url}/{STAGING_DIR}/{SAVE_RECORD}")
    plans, results = _rebuild(layout, ranks, url)
    kind = store_class(record.mode)
    if kind.bound_to_place is not None and not in_place:
        raise ValueError(
            f"{url} was being saved to {kind.bound_to_place}, so it can only be completed in "
            f"place; run consolidate without a destination, then copy the checkpoint to {dst}"
        )

    if kind.files_in_place:
        _check_files(fs, root, layout, url)

    writer = HFStorageWriter(
        dst if dst is not None else src,
        storage_options=storage_options,
        thread_count=thread_count,
        retry=retry,
        overwrite=overwrite,
    )
    # The store that finishes what the save began: the record's kind, at the destination.
    store = coordinator.adopt(
        record.mode,
        writer.fs,
        writer.root,
        (layout, plans, record.uploads, record.save_id, record.part_plan),
        retry=writer.retry,
        threads=thread_count,
        source=None if in_place else (fs, root),
        on_bytes=progress.advance,
    )
    writer.adopt(store, layout, record.save_id)
    moved = 0
    if in_place and kind.bound_to_place is not None:
        completion = _read_completion(fs, staging, names, record, url)
        store.reconcile(layout, completion)
        if completion is not None:
            results = _with_gathered_parts(results, layout, completion)
    elif not in_place:
        store.prepare(layout, overwrite, make_files=False)
        if kind.files_in_place:
            # The files are complete where they are: copy them, then commit at the destination.
            progress.start(sum(f.size for f in layout.files), "copying")
            parallel_map(
                lambda f: _copy(
                    fs,
                    fsio.join(root, f.name),
                    writer.fs,
                    fsio.join(writer.root, f.name),
                    f.size,
                    progress,
                ),
                layout.files,
                thread_count,
            )
            moved = sum(f.size for f in layout.files)
    if kind.merges_files:
        progress.start(sum(f.size for f in layout.files), "merging")
    writer.finish(None, results)  # finish does not read the metadata
    moved += writer.merge_stats.coordinator_bytes
    return ConsolidateReport(
        fsio.url_of(writer.fs, writer.root),
        record.mode,
        layout.names,
        len(layout.specs),
        layout.total_size,
        moved,
        False,
        time.monotonic() - started,
    )


def _read_records(
    fs: Any, staging: str, names: set[str], url: str
) -> tuple[SaveRecord, list[RankRecord]]:
    """The save record and every rank's record; refuses a save a rank did not finish."""
    where = f"{url}/{STAGING_DIR}"
    record = SaveRecord.decode(
        fsio.read_all(fs, fsio.join(staging, SAVE_RECORD)), f"{where}/{SAVE_RECORD}"
    )
    missing = [r for r in range(record.world_size) if rank_record_name(r) not in names]
    if missing:
        shown = missing if len(missing) <= 16 else [*missing[:16], "..."]
        raise ValueError(
            f"{url}: ranks {shown} of {record.world_size} never finished writing (no "
            f"{STAGING_DIR}/rankNNNNN.json), so the save's data is incomplete and cannot be "
            "consolidated; save the checkpoint again"
        )
    raws = parallel_map(
        lambda r: fsio.read_all(fs, fsio.join(staging, rank_record_name(r))),
        range(record.world_size),
        8,
    )
    ranks = [RankRecord.decode(raw, f"{where}/{rank_record_name(r)}") for r, raw in enumerate(raws)]
    for r, rank in enumerate(ranks):
        if rank.save_id != record.save_id or rank.rank != r:
            raise ValueError(
                f"{where}/{rank_record_name(r)} belongs to another save (save id {rank.save_id}, "
                f"rank {rank.rank}) than {SAVE_RECORD} (save id {record.save_id}); the records "
                "are inconsistent, save the checkpoint again"
            )
    return record, ranks


def _rebuild(
    layout: Layout, ranks: list[RankRecord], url: str
) -> tuple[list[SavePlan], list[list[WriteResult]]]:
    """Each rank's write items and results, as the coordinator's ``finish`` would have received
    them.

    Raises:
        ValueError: a key no rank wrote in full (elements written vs the tensor's size).
    """
    plans, results = [], []
    written: dict[str, int] = dict.fromkeys(layout.specs, 0)
    for rank in ranks:
        items, rank_results = [], []
        for i in rank.items:
            spec = layout.specs.get(i.key)
            if spec is None:
                raise ValueError(
                    f"{url}: rank {rank.rank} recorded key {i.key!r}, which the save's plan does "
                    "not have; the records are inconsistent"
                )
            index = MetadataIndex(i.key, torch.Size(i.offsets))
            chunk = ChunkStorageMetadata(torch.Size(i.offsets), torch.Size(i.sizes))
            items.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk, TensorProperties(dtype=spec.dtype), torch.Size(spec.shape)
                    ),
                )
            )
            rank_results.append(
                WriteResult(index, i.nbytes, Written(i.file, i.staged_offset, i.crc, i.parts))
            )
            written[i.key] += _numel(i.sizes)
        if rank.gathered:  # the parts it gathered over the ranks' network: not gathered again
            rank_results.append(WriteResult(FINISHED, 0, Finished(dict(rank.gathered), (), 0)))
        plans.append(SavePlan(items))
        results.append(rank_results)
    short = [k for k, n in written.items() if n != _numel(layout.specs[k].shape)]
    if short:
        k = short[0]
        raise ValueError(
            f"{url}: the ranks' records cover {written[k]} of the {_numel(layout.specs[k].shape)} "
            f"elements of {k!r} ({len(short)} tensors incomplete); the save's data is incomplete, "
            "save the checkpoint again"
        )
    return plans, results


def _read_completion(
    fs: Any, staging: str, names: set[str], record: SaveRecord, url: str
) -> CompletionRecord | None:
    """The coordinator's completion record (part stores), if it got as far as writing it for this
    save."""
    if COMPLETION_RECORD not in names:
        return None
    where = f"{url}/{STAGING_DIR}/{COMPLETION_RECORD}"
    completion = CompletionRecord.decode(
        fsio.read_all(fs, fsio.join(staging, COMPLETION_RECORD)), where
    )
    return completion if completion.save_id == record.save_id else None


def _with_gathered_parts(
    results: list[list[WriteResult]], layout: Layout, completion: CompletionRecord
) -> list[list[WriteResult]]:
    """``results`` plus the gathered parts the ranks had uploaded (from the completion record),
    as ``finish`` would have received them: those are not gathered again."""
    own = {
        (r.storage_data.file, e["PartNumber"])
        for rs in results
        for r in rs
        if r.index != FINISHED  # a rank's gathered parts (``_rebuild``) are among the extra
        for e in r.storage_data.parts
    }
    file_of = {plan.name: f for f, plan in enumerate(layout.files)}
    gathered = {
        file_of[name]: tuple(e for e in parts if (file_of[name], e["PartNumber"]) not in own)
        for name, parts in completion.parts.items()
        if name in file_of
    }
    extra = WriteResult(FINISHED, 0, Finished({f: p for f, p in gathered.items() if p}, (), 0))
    return [*results[:-1], [*results[-1], extra]] if results else [[extra]]


def _copy(src_fs: Any, src: str, dst_fs: Any, dst: str, size: int, progress: Progress) -> None:
    """Stream one file to another store, 8 MiB at a time; the destination appears only when
    whole."""
    with fsio.open_read(src_fs, src, _COPY_BYTES) as f, fsio.write_stream(dst_fs, dst, size) as out:
        while block := f.read(_COPY_BYTES):
            out.write(block)
            progress.advance(len(block))


def _same_place(fs: Any, root: str, other_fs: Any, other_root: str) -> bool:
    return type(fs) is type(other_fs) and root.rstrip("/") == other_root.rstrip("/")


def _check_files(fs: Any, root: str, layout: Layout, url: str) -> None:
    """Refuse to commit files written in place that are missing or of the wrong size."""
    for f in layout.files:
        try:
            size = fsio.size(fs, fsio.join(root, f.name))
        except FileNotFoundError:
            size = None
        if size != f.size:
            found = "missing" if size is None else f"{size} bytes"
            raise ValueError(
                f"{url}/{f.name}: the save wrote it in place at {f.size} bytes, but it is {found} "
                "now; save the checkpoint again"
            )


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
