"""How save and load *planning* scale with ranks and tensors: Llama 8B-405B over up to 8,192 ranks,
simulated in one process from shapes alone (no tensors, no process group, no storage I/O).

    python -m benchmarks.bench_scale --cases 8B:64,8B:1024,70B:1024,405B:8192 --tp 1,8 --mode
    local,s3 \\
        --md-out benchmarks/results/scale-cpu-2core.md

Each case (model, ranks N, tensor-parallel degree) runs in a fresh process, phase by phase, as
``dcp.save`` and ``dcp.load`` would run them with ``HFStorageWriter``/``HFStorageReader``, with
the object plans DCP gathers by default. Local-disk saves no longer use them: they send compact
plans (``plan/compact.py``), measured by ``bench_compact.py``; here ``local`` is the object path's
direct-write planning, kept for comparison, and ``s3`` is what S3 saves run:

1. ranks (simulated one after another; not coordinator time): each builds the ``SavePlan``
   ``DefaultSavePlanner`` makes from its DTensor shards (``_synthetic_plans``), calls the writer's
   ``prepare_local_plan``, and pickles the plan, as ``gather_object`` does.
2. coordinator, DCP's part: unpickle the N plans (the gather), ``dedup_save_plans``,
   ``create_default_global_save_plan`` with the planner-data merge, and the global-plan validation
   (quadratic in N for row-sharded tensors wider than tall: above ``--max-comparisons`` chunk
   pairs it is not run, and its time is estimated from a calibration, a lower bound).
3. coordinator, ours: the pure steps of ``HFStorageWriter.prepare_global_plan``
   (``collect_tensor_specs``, ``plan_layout``, ``place_items``, the store's ``plan``: S3's parts
   and the gathering tasks, each given to a rank) and each
   rank's ``RankPlan``, built exactly as ``prepare_global_plan`` builds it (S3 with fake upload
   ids); then the save record, and the pickling of every rank's final plan (DCP's scatter).
4. load: the index and headers the save would write (sparse files),
   ``HFStorageReader.read_metadata`` on them, and ``HFLoadPlanner.create_local_plan`` for a few
   ranks of a resharded destination (the same model over N/2 ranks), timed per rank: every rank
   plans its own load.

Reported per case: wall time per phase, the coordinator's peak RSS (growth over the imports), the
pickled size of what each rank sends and receives, index and header bytes, bytes written per rank
(max/mean) and, on S3, the bytes gathered, by the busiest rank and by the coordinator, the bytes
each rank moves (max/mean) and the requests per rank; and per phase
the time spent in Python's cyclic garbage collector. S3 planning is skipped above ``--max-runs``
byte runs (column shards make one per row). A case that runs past ``--timeout`` seconds of
coordinator work (``--sim-timeout`` for simulating the ranks), or past ``--mem-cap-gib`` of RSS,
is stopped and reported with the phase it reached. ``--profile MODEL:N:TP`` runs one case's
coordinator under cProfile; ``--from-json`` reprints the tables of earlier ``--json-out`` files.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import cProfile
import dataclasses
import gc
import hashlib
import io
import json
import math
import pickle
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import default_planner as _dcp_planner
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from benchmarks._synthetic_plans import (
    DEEPSEEK,
    LLAMA,
    ExpertParallel,
    LlamaConfig,
    Mesh,
    count_runs,
    llama_shapes,
    rank_load_state_dict,
    rank_save_plan,
)
from hf_dcp_storage import HFLoadPlanner, HFStorageReader, HFStorageWriter
from hf_dcp_storage.format.geometry import element_size
from hf_dcp_storage.format.index import INDEX_NAME, recorded_headers
from hf_dcp_storage.io.fsio import STREAM_PART_BYTES
from hf_dcp_storage.plan.layout import Layout, collect_tensor_specs, place_items, plan_layout
from hf_dcp_storage.plan.layout import index_bytes as _index_bytes
from hf_dcp_storage.plan.parts import MAX_PARTS, MIN_PART_BYTES, GatherPart, RankPart
from hf_dcp_storage.plan.placed import place_items as place_written
from hf_dcp_storage.plan.rankplan import rank_plans as writer_rank_plans
from hf_dcp_storage.session.records import SaveRecord
from hf_dcp_storage.stores import store_for_mode

__all__ = [
    "OurPlan",
    "bytes_per_rank",
    "calibrate_validate",
    "dcp_global_plan",
    "dcp_validate",
    "main",
    "plan_ours",
    "s3_requests",
    "validate_comparisons",
]

MiB, GiB = 1 << 20, 1 << 30


def _fake_upload_id(file: int) -> str:
    """A distinct opaque id per file, as long as AWS's (about 100 characters) and as random
    (URL-safe base64 of a hash), so that pickling and compression sizes are real."""
    return base64.urlsafe_b64encode(
        hashlib.sha512(f"upload {file}".encode()).digest()
        + hashlib.sha256(f"upload {file}".encode()).digest()[:11]
    ).decode()[:100]


# The coordinator's phases that are DCP's own (the same for every mode).
DCP_PHASES = ("gather", "dedup", "global_plan", "validate")


# -- the coordinator's planning (importable: tests/test_scale.py uses it) ------------------------


@dataclass
class OurPlan:
    """What ``prepare_global_plan``'s pure steps produce for one save."""

    layout: Layout
    placements: list[dict[Any, Any]]
    s3_parts: Sequence[Sequence[RankPart | GatherPart]] | None
    uploads: dict[int, str]
    rank_plans: list[SavePlan]
    timings: dict[str, float] = field(default_factory=dict)


# Called at the end of each timed phase with its name and seconds (the benchmark prints a line).
PhaseDone = Callable[[str, float], None]


@contextmanager
def _timed(timings: dict[str, float], name: str, done: PhaseDone | None = None) -> Iterator[None]:
    t = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - t
    if done is not None:
        done(name, timings[name])


def dcp_global_plan(
    plans: list[SavePlan], timings: dict[str, float], done: PhaseDone | None = None
) -> tuple[list[SavePlan], Metadata]:
    """DCP's part of the coordinator's save planning (``DefaultSavePlanner._create_global_plan``)
    before its validation: dedup, then the global plan with the merged flattening maps."""
    with _timed(timings, "dedup", done):
        deduped = dedup_save_plans(plans, False)
    with _timed(timings, "global_plan", done):
        global_plan, metadata = create_default_global_save_plan(deduped)
        merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
        metadata = dataclasses.replace(metadata, planner_data=merged)
    return global_plan, metadata


def dcp_validate(
    global_plan: list[SavePlan],
    metadata: Metadata,
    timings: dict[str, float],
    done: PhaseDone | None = None,
) -> None:
    """DCP's validation of the global plan (bounds, overlaps, coverage), as ``create_global_plan``
    runs it."""
    with _timed(timings, "validate", done):
        errors = _dcp_planner._validate_global_plan(global_plan, metadata)  # private; torch 2.13
    if errors:
        raise RuntimeError(f"DCP rejects the synthetic global plan: {errors[:3]}")


def validate_comparisons(global_plan: Sequence[SavePlan]) -> int:
    """How many chunk pairs DCP's global-plan validation compares for overlap: its sweep over
    each tensor's largest dimension, replayed with counts only. Chunks that all span the sweep
    dimension (a row-sharded tensor wider than tall) stay active together: N(N-1)/2 pairs."""
    chunks: dict[str, list[Any]] = {}
    sizes: dict[str, torch.Size] = {}
    for plan in global_plan:
        for item in plan.items:
            chunks.setdefault(item.index.fqn, []).append(item.tensor_data.chunk)
            sizes[item.index.fqn] = item.tensor_data.size
    total = 0
    for key, cs in chunks.items():
        size = sizes[key]
        if len(size) == 0 or len(cs) < 2:
            continue
        d = max(range(len(size)), key=lambda i: size[i])
        active: list[int] = []
        for c in sorted(cs, key=lambda c: (c.offsets[d], *c.offsets)):
            start = c.offsets[d]
            del active[: bisect.bisect_right(active, start)]
            total += len(active)
            bisect.insort(active, start + c.sizes[d])
    return total


def calibrate_validate() -> float:
    """Seconds per chunk pair of DCP's validation: two wide row-sharded tensors over 1,024 ranks,
    the plans unpickled one by one as a gather leaves them (scattered over the heap)."""
    shapes = [(f"w{i}", (1024, 4096)) for i in range(2)]
    plans = [pickle.loads(pickle.dumps(rank_save_plan(shapes, Mesh(1024), r))) for r in range(1024)]
    global_plan, metadata = create_default_global_save_plan(plans)
    t = time.perf_counter()
    _dcp_planner._validate_global_plan(global_plan, metadata)
    return (time.perf_counter() - t) / validate_comparisons(global_plan)


def object_local_plan(plan: SavePlan) -> SavePlan:
    """A rank's plan as DCP gathers it by default: its write items, with its keys in order as
    storage data (what ``prepare_local_plan`` sent before compact plans). Saves now send compact
    plans (``bench_compact.py``); finishing an interrupted save (``consolidate``) still plans
    from items, rebuilt from the rank records."""
    return dataclasses.replace(
        plan, storage_data=tuple(dict.fromkeys(item.index.fqn for item in plan.items))
    )


def plan_ours(
    writer: HFStorageWriter,
    plans: list[SavePlan],
    mode: str,
    timings: dict[str, float] | None = None,
    done: PhaseDone | None = None,
) -> OurPlan:
    """The pure steps of ``HFStorageWriter.prepare_global_plan`` on DCP's global plan, for
    ``mode`` ``"local"`` (direct positioned writes), ``"s3"`` or ``"staged"`` (other object stores:
    a merge task per file): layout, placements, S3 parts or merge tasks, and
    each rank's ``_RankPlan``, built as ``prepare_global_plan`` builds them; no I/O (the upload
    ids are fake). Steps mirror ``_adopt``; each is timed into ``timings``."""
    t: dict[str, float] = timings if timings is not None else {}
    with _timed(t, "specs", done):
        specs = collect_tensor_specs(plans, key_order=[p.storage_data or () for p in plans])
    with _timed(t, "layout", done):
        layout = plan_layout(
            specs,
            max_shard_bytes=writer.max_shard_bytes,
            fqn_to_index_mapping=writer.fqn_to_index_mapping,
        )
    with _timed(t, "place", done):
        placements = place_items(layout, plans)
        _items = {
            item.index: item for plan in plans for item in plan.items
        }  # _adopt keeps this map for finish
    s3_parts, uploads, tasks = None, {}, None
    store = store_for_mode(
        "direct" if mode == "local" else mode, writer.fs, writer.root, retry=writer.retry, threads=1
    )
    if mode in ("s3", "staged"):
        with _timed(t, "tasks", done):  # parts (S3) and each rank's finishing tasks
            tasks = store.plan(layout, place_written(layout, plans), len(plans))
        if mode == "s3":
            s3_parts = store.parts
            uploads = store.uploads = {
                f: _fake_upload_id(f) for f, parts in enumerate(s3_parts) if len(parts) > 1
            }
    with _timed(t, "rank_plans", done):
        rank_plans = writer_rank_plans(
            plans,
            layout,
            "0" * 32,
            mode == "local",
            placements,
            None,
            tasks,
            store.rank_data(len(plans)),
        )
    with _timed(t, "record", done):
        SaveRecord(
            "0" * 32,
            "direct" if mode == "local" else mode,
            len(plans),
            tuple((f.name, f.header) for f in layout.files),
            uploads,
        ).encode()
    return OurPlan(layout, placements, s3_parts, uploads, rank_plans, t)


# -- what the plans imply: balance, requests, sizes -------------------------------------------


def bytes_per_rank(plans: Sequence[SavePlan]) -> list[int]:
    """Bytes each rank writes, from the deduplicated plans."""
    return [
        sum(
            math.prod(it.tensor_data.chunk.sizes) * element_size(it.tensor_data.properties.dtype)
            for it in p.items
        )
        for p in plans
    ]


def s3_requests(ours: OurPlan, written: Sequence[int]) -> dict[str, Any]:
    """Requests each rank and the coordinator send on S3, and who gathers the staged bytes.

    A rank sends its own parts (UploadPart), one staged object per file where it has bytes outside
    its parts (one PUT, or create + 8 MiB parts + complete), and its record (PUT); then, for each
    gathered part it was given, one ranged GET per rank it holds pieces of (a lower bound:
    ``get_ranges`` joins near ranges of one object) and one UploadPart. The coordinator also
    creates the uploads and completes each file. ``moved``: bytes a rank uploads of its own, plus
    twice the bytes of the parts it gathers (downloaded, then uploaded).
    """
    assert ours.s3_parts is not None
    world = len(written)
    own = [0] * world
    requests = [1] * world  # the rank record
    own_in_file: dict[tuple[int, int], int] = {}
    coordinator = len(ours.uploads) + len(ours.layout.files)
    for f, parts in enumerate(ours.s3_parts):
        for p in parts:
            if isinstance(p, RankPart):
                own[p.rank] += p.nbytes
                requests[p.rank] += 1
                own_in_file[(p.rank, f)] = own_in_file.get((p.rank, f), 0) + p.nbytes
    gathered = [0] * world
    for rank, plan in enumerate(ours.rank_plans):
        in_file: dict[int, int] = {}
        for it in plan.items:
            f = ours.placements[rank][it.index].file
            in_file[f] = in_file.get(f, 0) + math.prod(it.tensor_data.chunk.sizes) * element_size(
                it.tensor_data.properties.dtype
            )
        for f, n in in_file.items():
            staged = n - own_in_file.get((rank, f), 0)
            part = max(STREAM_PART_BYTES, MIN_PART_BYTES, -(-staged // MAX_PARTS))
            requests[rank] += 0 if staged == 0 else 1 if staged < part else 2 + -(-staged // part)
        for task in plan.storage_data.tasks:
            gathered[rank] += task.nbytes - len(task.head)
            requests[rank] += 1 + len(task_ranks(task))  # a rank's runs in a part are one GET
    total = sum(written)
    moved = [w + 2 * g for w, g in zip(written, gathered, strict=True)]
    return {
        "rank_part_bytes": sum(own),
        "gathered_bytes": sum(gathered),
        "gathered_share": sum(gathered) / total if total else 0.0,
        "gathered_per_rank_max": max(gathered),
        "gathered_by_coordinator": gathered[0],
        "moved_max_over_mean": max(moved) / (sum(moved) / world) if total else 1.0,
        "gather_parts": sum(isinstance(p, GatherPart) for parts in ours.s3_parts for p in parts),
        "rank_parts": sum(isinstance(p, RankPart) for parts in ours.s3_parts for p in parts),
        "requests_per_rank_max": max(requests),
        "requests_per_rank_mean": sum(requests) / world,
        "coordinator_requests_min": coordinator + requests[0],
    }


def task_ranks(task: Any) -> set[int]:
    """The ranks whose staged objects a gathering task reads."""
    ranks: set[int] = set()
    if task.pieces:
        ranks.update(np.frombuffer(task.pieces, dtype=np.int64)[0::4].tolist())
    if task.strided:
        ranks.update(np.frombuffer(task.strided, dtype=np.int64)[0 :: 3 + 2 * task.width].tolist())
    return ranks


def _sizes(values: Sequence[int]) -> dict[str, float]:
    return {"max": max(values), "mean": sum(values) / len(values), "total": sum(values)}


# -- one case, in a fresh process -------------------------------------------------------------


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


class _Reporter:
    """Prints one JSON line per finished phase (so a stopped case still shows how far it got)."""

    def __init__(self) -> None:
        self.base_kib = _status_kib("VmRSS")
        self.timings: dict[str, float] = {}
        self.gc_s = 0.0  # time in the cyclic garbage collector since the last line
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: Mapping[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start

    def emit(self, kind: str, **data: Any) -> None:
        data.update(
            kind=kind,
            gc_s=self.gc_s,
            rss_mib=(_status_kib("VmRSS") - self.base_kib) / 1024,
            peak_mib=(_status_kib("VmHWM") - self.base_kib) / 1024,
        )
        self.gc_s = 0.0
        print(json.dumps(data), flush=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with _timed(self.timings, name):
            yield
        self.emit("phase", phase=name, s=self.timings[name])


def _simulate_ranks(
    shapes: list[tuple[str, tuple[int, ...]]], mesh: Mesh, writer: HFStorageWriter
) -> tuple[list[bytes], dict[str, float]]:
    """Each rank's local step, one after another: DCP's local plan, our ``prepare_local_plan``,
    and the pickle ``gather_object`` sends. Returns the pickles and the per-rank costs."""
    blobs, ours = [], 0.0
    t0 = time.perf_counter()
    for rank in range(mesh.size):
        plan = rank_save_plan(shapes, mesh, rank)
        t = time.perf_counter()
        plan = object_local_plan(plan)
        ours += time.perf_counter() - t
        blobs.append(pickle.dumps(plan))
    sizes = [len(b) for b in blobs]
    return blobs, {
        "rank_s": (time.perf_counter() - t0) / mesh.size,
        "prepare_local_plan_s": ours / mesh.size,
        "local_plan_bytes_max": max(sizes),
        "local_plan_bytes_mean": sum(sizes) / len(sizes),
        # gather_object pads every object to the largest and receives all N at once.
        "gather_buffer_bytes": max(sizes) * len(sizes),
        # What our prepare_local_plan adds to the plan a rank sends (its keys, in order; the
        # strings are the items' own, so the pickle refers back to them).
        "key_order_bytes": len(blobs[-1])
        - len(pickle.dumps(dataclasses.replace(plan, storage_data=None))),
    }


def _scatter_sizes(rank_plans: list[SavePlan], plan_sizes: list[int]) -> dict[str, float]:
    """Sizes of what DCP scatters (each rank's final plan, pickled: ``plan_sizes``) and of the
    ``storage_data`` in it, alone; not timed."""
    data_sizes = [len(pickle.dumps(p.storage_data)) for p in rank_plans]
    bare = [
        len(pickle.dumps(dataclasses.replace(p, storage_data=None)))
        for p in rank_plans[:: max(1, len(rank_plans) // 16)]
    ]
    return {
        "plan_bytes_max": max(plan_sizes),
        "plan_bytes_mean": sum(plan_sizes) / len(plan_sizes),
        "scatter_buffer_bytes": max(plan_sizes) * len(plan_sizes),
        "storage_data_bytes_max": max(data_sizes),
        "storage_data_bytes_mean": sum(data_sizes) / len(data_sizes),
        "plan_without_storage_data_bytes_max": max(bare),
    }


def _write_sparse_checkpoint(layout: Layout, folder: Path) -> dict[str, int]:
    """The files the save would leave: each header at the start of a sparse file of the planned
    size, and the index as ``finish`` writes it (checksums all zero: same length)."""
    for f in layout.files:
        with open(folder / f.name, "wb") as out:
            out.write(f.header)
            out.truncate(f.size)
    raw = _index_bytes(layout, dict.fromkeys(layout.weight_map, 0))
    (folder / INDEX_NAME).write_bytes(raw)
    return {
        "index_bytes": len(raw),
        "headers_bytes": sum(len(f.header) for f in layout.files),
        "files": len(layout.files),
    }


def _simulate_load(
    shapes: list[tuple[str, tuple[int, ...]]],
    layout: Layout,
    load_mesh: Mesh,
    rep: _Reporter,
    ep: ExpertParallel | None = None,
) -> dict[str, Any]:
    """Every rank's load planning: ``read_metadata`` (the index, which records the headers) and
    its local load plan (``ep``: experts on their group's ranks only)."""
    folder = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    try:
        out: dict[str, Any] = _write_sparse_checkpoint(layout, folder)
        with rep.phase("read_metadata"):
            metadata = HFStorageReader(str(folder)).read_metadata()
        out["metadata_pickle_bytes"] = len(pickle.dumps(metadata))
        # Objects each loading rank reads for it: the index, and the headers it does not record.
        recorded = (
            recorded_headers(
                json.loads((folder / INDEX_NAME).read_bytes())["metadata"], layout.names, INDEX_NAME
            )
            or {}
        )
        out["metadata_reads_per_rank"] = 1 + len(layout.files) - len(recorded)
        samples = sorted({0, load_mesh.size // 2, load_mesh.size - 1})
        times, sizes, sent = [], [], []
        reader = HFStorageReader(str(folder))
        for rank in samples:
            planner = HFLoadPlanner()
            # set_up_planner would materialise the destination (meta DTensors need a process
            # group); for a flat state dict it only sets these two.
            planner.state_dict, planner.metadata = (
                rank_load_state_dict(shapes, load_mesh, rank, ep),
                metadata,
            )
            t = time.perf_counter()
            plan = planner.create_local_plan()
            times.append(time.perf_counter() - t)
            sizes.append(len(pickle.dumps(plan)))
            sent.append(
                len(pickle.dumps(reader.prepare_local_plan(plan)))
            )  # what DCP gathers: the items stay on the rank
        out.update(
            load_world=load_mesh.size, load_plan_s=max(times),
            load_plan_cpu_s=max(times) * load_mesh.size, load_plan_bytes_max=max(sizes),
            load_plan_sent_bytes_max=max(sent), load_read_items=len(plan.items),
        )  # fmt: skip
        rep.emit("phase", phase="load_plan", s=max(times))
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _coordinator(
    blobs: list[bytes],
    writer: HFStorageWriter,
    spec: Mapping[str, Any],
    rep: _Reporter,
    result: dict[str, Any],
) -> tuple[list[SavePlan], OurPlan]:
    """The coordinator's phases: DCP's gather, global plan and validation, then ours per mode."""
    with rep.phase("gather"):
        plans = [pickle.loads(b) for b in blobs]
    blobs.clear()
    timings: dict[str, float] = {}
    global_plan, metadata = dcp_global_plan(
        plans, timings, lambda name, s: rep.emit("phase", phase=name, s=s)
    )
    del plans
    comparisons = validate_comparisons(global_plan)
    result["validate_comparisons"] = comparisons
    if comparisons <= spec["max_comparisons"]:
        dcp_validate(
            global_plan, metadata, timings, lambda name, s: rep.emit("phase", phase=name, s=s)
        )
    else:
        result["validate_estimate_s"] = comparisons * calibrate_validate()
    del metadata
    written = bytes_per_rank(global_plan)
    result["dcp_peak_mib"] = (_status_kib("VmHWM") - rep.base_kib) / 1024
    result.update(
        items_after_dedup=sum(len(p.items) for p in global_plan),
        written_max_over_mean=max(written) / (sum(written) / len(written)),
    )
    ours = None
    for mode in spec["modes"]:
        ours = None
        gc.collect()  # the previous mode's garbage, outside the timed phases
        rep.gc_s = 0.0
        _reset_peak()
        t: dict[str, float] = {}
        ours = plan_ours(
            writer,
            global_plan,
            mode,
            t,
            lambda name, s, mode=mode: rep.emit("phase", phase=f"{mode}.{name}", s=s),
        )
        with rep.phase(f"{mode}.scatter"):  # scatter_object_list pickles every rank's plan
            plan_sizes = [len(pickle.dumps(p)) for p in ours.rank_plans]
        result[mode] = _scatter_sizes(ours.rank_plans, plan_sizes)
        result[mode].update(
            timings=t, ours_s=sum(t.values()), peak_mib=(_status_kib("VmHWM") - rep.base_kib) / 1024
        )
        if mode == "s3":
            result[mode].update(s3_requests(ours, written))
        rep.emit("mode", mode=mode, **{k: v for k, v in result[mode].items() if k != "timings"})
    if (
        ours is None
    ):  # every mode skipped (too many byte runs for S3): the layout alone, for the load
        ours = plan_ours(writer, global_plan, "local")
    return global_plan, ours


def run_case(spec: dict[str, Any]) -> None:
    """One case in this process; JSON lines on stdout (``kind``: phase, mode, result)."""
    cfg = LLAMA[spec["model"]] if spec["model"] in LLAMA else LlamaConfig(**spec["config"])
    shapes = llama_shapes(cfg)
    mesh = Mesh.of(spec["world"], spec["tp"])
    writer = HFStorageWriter(tempfile.gettempdir(), max_shard_size=spec["max_shard_size"])
    runs = count_runs(shapes, mesh)
    modes = [m for m in spec["modes"] if m != "s3" or runs <= spec["max_runs"]]
    rep = _Reporter()
    result: dict[str, Any] = {
        "tensors": len(shapes),
        "items": len(shapes) * mesh.size,
        "runs": runs,
        "skipped_modes": [m for m in spec["modes"] if m not in modes],
    }
    with rep.phase("ranks"):
        blobs, rank_stats = _simulate_ranks(shapes, mesh, writer)
    result.update(rank_stats)
    rep.emit("coordinator_start")
    _reset_peak()
    profiler = cProfile.Profile() if spec.get("profile") else None
    if profiler is not None:
        profiler.enable()
    global_plan, ours = _coordinator(blobs, writer, {**spec, "modes": modes}, rep, result)
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        rep.emit("profile", text=text.getvalue())
    result["coordinator_peak_mib"] = (_status_kib("VmHWM") - rep.base_kib) / 1024
    del global_plan
    load_world = max(spec["tp"], spec["world"] // 2)
    result.update(_simulate_load(shapes, ours.layout, Mesh.of(load_world, spec["tp"]), rep))
    rep.emit("result", **result)


# -- the parent: fresh process per case, limits, tables ---------------------------------------


def _run_child(
    spec: dict[str, Any], timeout: float, sim_timeout: float, mem_cap: float
) -> dict[str, Any]:
    """Run one case; stop it past ``timeout`` s of coordinator work (``sim_timeout`` for the
    simulated ranks) or ``mem_cap`` GiB RSS. Returns the phases, the result or why it stopped."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_scale", "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: list[dict[str, Any]] = []
    stop: list[str] = []
    started = [time.monotonic(), None]

    def watch() -> None:
        while proc.poll() is None:
            limit = sim_timeout if started[1] is None else timeout
            since = started[1] if started[1] is not None else started[0]
            rss = _proc_rss_gib(proc.pid)
            if rss > mem_cap or time.monotonic() - since > limit:
                stop.append(
                    f"stopped at {rss:.1f} GiB RSS"
                    if rss > mem_cap
                    else f"stopped after {limit:.0f} s at {rss:.1f} GiB RSS"
                )
                proc.kill()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        obj = json.loads(line)
        lines.append(obj)
        if obj["kind"] == "coordinator_start":
            started[1] = time.monotonic()
        print(f"  {spec['model']}:{spec['world']} tp{spec['tp']}: {_short(obj)}", flush=True)
    proc.wait()
    watcher.join()
    out: dict[str, Any] = {"spec": spec, "lines": lines}
    results = [o for o in lines if o["kind"] == "result"]
    if results:
        out["result"] = results[0]
    else:
        reached = [o["phase"] for o in lines if o["kind"] == "phase"]
        where = (
            f"{'simulating the ranks' if started[1] is None else 'coordinator'}, after phase "
            f"{reached[-1]}"
            if reached
            else "before any phase"
        )
        out["stopped"] = f"{stop[0] if stop else f'failed (exit {proc.returncode})'} ({where})"
    return out


def _proc_rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def _short(obj: Mapping[str, Any]) -> str:
    if obj["kind"] == "phase":
        return (
            f"{obj['phase']} {obj['s']:.2f} s (rss +{obj['rss_mib']:.0f} MiB, peak "
            f"+{obj['peak_mib']:.0f})"
        )
    if obj["kind"] == "profile":
        return "profile:\n" + obj["text"]
    return json.dumps({k: v for k, v in obj.items() if k != "text"})[:400]


def _phase_times(run: Mapping[str, Any]) -> dict[str, float]:
    return {o["phase"]: o["s"] for o in run["lines"] if o["kind"] == "phase"}


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _case_name(spec: Mapping[str, Any]) -> str:
    mesh = f"{spec['world'] // spec['tp']}x{spec['tp']}" if spec["tp"] > 1 else str(spec["world"])
    if spec.get("ep", 1) > 1:
        mesh = f"{spec['world']} (EP {spec['ep']} x FSDP {spec['world'] // spec['ep']})"
    return f"{spec['model']} / {mesh}"


def save_tables(runs: Sequence[Mapping[str, Any]], modes: Sequence[str]) -> list[str]:
    """Markdown: the coordinator's time per phase, DCP's and ours, and its peak memory."""
    lines = [
        (
            "| case | write items (after dedup) | mode | DCP: gather | dedup | global plan | "
            "validate | ours: specs | layout | place | S3 parts | gather / merge tasks | rank "
            "plans | ours total | ours µs/item | DCP: scatter pickling | GC share | coordinator "
            "peak RSS |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        spec, res = run["spec"], run.get("result")
        for mode in modes:
            items = spec["world"] * len(llama_shapes(LLAMA[spec["model"]]))
            head = f"| {_case_name(spec)} | {items:,} | {mode} | "
            if res is None:
                lines.append(head + f"{run['stopped']} |" + " |" * 14)
            elif mode in res["skipped_modes"]:
                lines.append(head + f"not run: {res['runs']:,} byte runs to route |" + " |" * 14)
            else:
                lines.append(f"| {_case_name(spec)} | " + " | ".join(_save_cells(run, mode)) + " |")
    return lines


def _save_cells(run: Mapping[str, Any], mode: str) -> list[str]:
    phases = {o["phase"]: o for o in run["lines"] if o["kind"] == "phase"}
    res = run["result"]
    sec = lambda name: phases[name]["s"] if name in phases else 0.0  # noqa: E731
    validate = (
        f"{sec('validate'):.2f} s"
        if "validate" in phases
        else f"≥ {res['validate_estimate_s']:.0f} s (est.)"
    )
    ours = res[mode]["ours_s"]
    coordinator = [n for n in phases if n in DCP_PHASES or n.startswith(mode + ".")]
    total = sum(phases[n]["s"] for n in coordinator) + res.get("validate_estimate_s", 0.0)
    gc_share = sum(phases[n]["gc_s"] for n in coordinator) / total if total else 0.0
    return [
        f"{res['items']:,} ({res['items_after_dedup']:,})",
        mode,
        *(f"{sec(n):.2f} s" for n in ("gather", "dedup", "global_plan")),
        validate,
        *(f"{sec(f'{mode}.{n}'):.2f} s" for n in ("specs", "layout", "place")),
        f"{sec(f'{mode}.s3_parts'):.2f} s" if mode == "s3" else "-",
        f"{sec(f'{mode}.tasks'):.2f} s" if mode in ("s3", "staged") else "-",
        f"{sec(f'{mode}.rank_plans') + sec(f'{mode}.record'):.2f} s",
        f"**{ours:.2f} s**",
        f"{ours / res['items_after_dedup'] * 1e6:.1f}",
        f"{sec(f'{mode}.scatter'):.2f} s",
        f"{gc_share:.0%}",
        _fmt_bytes(max(res[mode]["peak_mib"], res["dcp_peak_mib"]) * MiB),
    ]


def size_tables(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        (
            "| case | files | index + headers | local plan sent per rank (max) | gather buffer "
            "(DCP) | our key order, added to each plan sent | storage_data per rank, local (max / "
            "mean) | storage_data per rank, S3 (max / mean) | storage_data per rank, staged (max "
            "/ mean) | final plan per rank (max) | scatter buffer (DCP) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        res = run.get("result")
        if res is None:
            continue
        loc, s3, staged = res.get("local"), res.get("s3"), res.get("staged")
        sd = lambda m: (  # noqa: E731 - a one-line formatter
            f"{_fmt_bytes(m['storage_data_bytes_max'])} / "
            f"{_fmt_bytes(m['storage_data_bytes_mean'])}"
            if m
            else "-"
        )
        final = max((m["plan_bytes_max"] for m in (loc, s3, staged) if m), default=0)
        scatter = max((m["scatter_buffer_bytes"] for m in (loc, s3, staged) if m), default=0)
        lines.append(
            f"| {_case_name(run['spec'])} | {res['files']} | {_fmt_bytes(res['index_bytes'])} + "
            f"{_fmt_bytes(res['headers_bytes'])} | {_fmt_bytes(res['local_plan_bytes_max'])} | "
            f"{_fmt_bytes(res['gather_buffer_bytes'])} | {_fmt_bytes(res['key_order_bytes'])} | "
            f"{sd(loc)} | {sd(s3)} | {sd(staged)} | {_fmt_bytes(final)} | {_fmt_bytes(scatter)} |"
        )
    return lines


def balance_tables(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        (
            "| case | bytes written per rank, max / mean | S3: byte runs | S3: bytes in ranks' "
            "own parts | S3: gathered (share) / busiest gatherer / coordinator | S3: bytes moved "
            "per rank, max / mean (own + 2 × gathered) | S3: requests per rank (max / mean) | S3: "
            "coordinator requests (≥) | load: read_metadata per rank | load: plan per rank (N/2 "
            "ranks) | load plan sent per rank |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        res = run.get("result")
        if res is None:
            continue
        t = _phase_times(run)
        s3 = res.get("s3")
        s3_cells = (
            [
                f"{res['runs']:,}",
                _fmt_bytes(s3["rank_part_bytes"]),
                (
                    f"{_fmt_bytes(s3['gathered_bytes'])} ({s3['gathered_share']:.0%}) / "
                    f"{_fmt_bytes(s3['gathered_per_rank_max'])} / "
                    f"{_fmt_bytes(s3['gathered_by_coordinator'])}"
                ),
                f"{s3['moved_max_over_mean']:.3f}",
                f"{s3['requests_per_rank_max']:,} / {s3['requests_per_rank_mean']:,.0f}",
                f"{s3['coordinator_requests_min']:,}",
            ]
            if s3
            else [f"{res['runs']:,}", "-", "-", "-", "-", "-"]
        )
        cells = [
            f"{res['written_max_over_mean']:.3f}",
            *s3_cells,
            f"{t.get('read_metadata', 0) * 1000:.0f} ms",
            f"{res['load_plan_s'] * 1000:.0f} ms",
            _fmt_bytes(res["load_plan_bytes_max"])
            + (
                f" ({_fmt_bytes(res['load_plan_sent_bytes_max'])} sent)"
                if "load_plan_sent_bytes_max" in res
                else ""
            ),
        ]
        lines.append(f"| {_case_name(run['spec'])} | " + " | ".join(cells) + " |")
    return lines


def _parse_cases(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        model, _, world = item.partition(":")
        if model not in {*LLAMA, *DEEPSEEK} or not world.isdigit():
            raise SystemExit(
                f"--cases item {item!r} must be MODEL:RANKS with MODEL one of "
                f"{sorted({*LLAMA, *DEEPSEEK})}"
            )
        out.append((model, int(world)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cases",
        default="8B:64,8B:1024,70B:1024,405B:8192",
        help="MODEL:RANKS,... (models: 8B, 70B, 405B)",
    )
    ap.add_argument("--tp", default="1,8", help="tensor-parallel degrees; 1 is plain FSDP")
    ap.add_argument(
        "--mode",
        default="local,s3",
        help="local (direct writes), s3 (multipart parts), staged (other object stores: merge "
        "tasks)",
    )
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument(
        "--timeout", type=float, default=300.0, help="seconds of coordinator work per case"
    )
    ap.add_argument(
        "--sim-timeout",
        type=float,
        default=900.0,
        help="seconds for simulating the ranks' local plans",
    )
    ap.add_argument("--mem-cap-gib", type=float, default=14.0, help="stop a case above this RSS")
    ap.add_argument(
        "--max-runs",
        type=int,
        default=20_000_000,
        help="skip S3 planning above this many byte runs",
    )
    ap.add_argument(
        "--max-comparisons",
        type=float,
        default=3e7,
        help="skip DCP's validation above this many chunk pairs (estimated instead)",
    )
    ap.add_argument(
        "--profile", help="MODEL:RANKS:TP: run that case under cProfile (top functions by own time)"
    )
    ap.add_argument("--json-out", help="write every case's JSON lines here")
    ap.add_argument("--md-out", help="write the tables here (markdown)")
    ap.add_argument(
        "--from-json", nargs="+", help="only print the tables of earlier --json-out files"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_case(json.loads(args.child))
        return
    modes = [m for m in args.mode.split(",") if m]
    runs = [
        json.loads(line)
        for path in args.from_json or ()
        for line in Path(path).read_text().splitlines()
        if line
    ]
    for model, world in _parse_cases(args.cases) if not runs else ():
        for tp in (int(x) for x in args.tp.split(",")):
            spec = {
                "model": model,
                "world": world,
                "tp": tp,
                "modes": modes,
                "max_shard_size": args.max_shard_size,
                "max_runs": args.max_runs,
                "max_comparisons": args.max_comparisons,
                "profile": args.profile == f"{model}:{world}:{tp}",
            }
            print(f"{_case_name(spec)}:", flush=True)
            run = _run_child(spec, args.timeout, args.sim_timeout, args.mem_cap_gib)
            runs.append(run)
    lines = [
        "## Coordinator time and memory",
        "",
        *save_tables(runs, modes),
        "",
        "## Sizes",
        "",
        *size_tables(runs),
        "",
        "## Balance, S3 requests, load planning",
        "",
        *balance_tables(runs),
    ]
    report(lines, runs, args.json_out, args.md_out)


def report(
    lines: Sequence[str],
    runs: Sequence[Mapping[str, Any]],
    json_out: str | None,
    md_out: str | None,
) -> None:
    """Print the tables; write them (``md_out``) and every case's JSON line (``json_out``) if
    asked."""
    text = "\n".join(lines) + "\n"
    print(text)
    if json_out:
        Path(json_out).write_text("\n".join(json.dumps(r) for r in runs) + "\n")
    if md_out:
        Path(md_out).write_text(text)


if __name__ == "__main__":
    main()
