"""Who assembles what once every rank has staged: the finishing work of a save, spread by bytes.

Where the store has no positioned writes, some bytes of the consolidated files can only be put
in place after every rank has staged its own: on S3 the multipart parts that mix several ranks'
small runs (``GatherPart``), on other stores whole files merged from the ranks' staged objects.
With a thousand FSDP ranks every run is small, so that is nearly every byte of the checkpoint;
left to the coordinator it is the failure seen elsewhere, one process moving the whole
checkpoint while the others idle. Here the coordinator hands each piece of that work (a task)
to one rank by bytes, counting the bytes each rank already uploads of its own
(``plan/balance.assign``, re-exported here). Every rank does its tasks at the end of
``write_data``, after all ranks have staged (``session/meeting.py``). Pure planning: no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.geometry import chunk_runs_array, element_size
from .balance import assign
from .layout import Layout
from .merge import StagedPiece
from .placed import PlacedChunks

# ``map_fn(fn, items) -> [fn(x) for x in items]``, in any order of work (a thread pool, say).
MapFn = Callable[[Callable[[int], Any], list[int]], list[Any]]

__all__ = [
    "GatherTask",
    "GatherTasks",
    "MapFn",
    "MergeTask",
    "Source",
    "assign",  # re-exported from plan/balance.py
    "file_tensors",
    "merge_tasks",
    "pack_columns",
    "plan_merges",
    "unpack_columns",
]

# One piece of a gathered part, in file order: literal bytes (the file's header, which the
# coordinator knows), or ``(rank, offset, nbytes)``: a range of that rank's staged object.
Source = bytes | tuple[int, int, int]


@dataclass(frozen=True)
class GatherTask:
    """(S3) Assemble part ``number`` of file ``file``, its bytes ``[start, end)``, and upload it.

    ``head``: the header's bytes in it (the part starts at 0), which the coordinator knows.
    The rest the ranks staged: ``pieces``, int64 rows ``(rank, file_offset, staged_offset,
    nbytes)`` of row-sharded chunks, and ``strided``, int64 rows ``(rank, tensor,
    staged_offset, offsets, sizes)`` (zero-padded to ``width`` dims; ``tensor`` indexes
    ``tensors``, ``(tensor_start, shape, itemsize)`` of the file's keys) of column-sharded chunks,
    each staged whole, whose rows in the part the gathering rank works out itself: one row per
    chunk, not one per byte run. Raw bytes, not compressed: a part holds tens of rows, and the
    coordinator makes one task per 5-16 MiB of the checkpoint (48,000-109,000 at 405B).
    """

    file: int
    number: int
    start: int
    end: int
    head: bytes = b""
    pieces: bytes = b""
    strided: bytes = b""
    tensors: tuple[tuple[int, tuple[int, ...], int], ...] = ()
    width: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def sources(self) -> list[Source]:
        """The part's bytes in order: the header's, then ``(rank, offset, nbytes)`` staged ranges.

        Raises:
            RuntimeError: the staged ranges do not tile the part (an inconsistent plan).
        """
        out: list[Source] = [self.head] if self.head else []
        out.extend((r, s, n) for _, r, s, n in self.checked_ranges().tolist())
        return out

    def checked_ranges(self) -> np.ndarray:
        """``ranges()`` of a gathering rank's task, checked to tile the part after its header.

        Raises:
            RuntimeError: the staged ranges do not tile the part (an inconsistent plan).
        """
        lo, hi = self.start + len(self.head), self.end
        ranges = self.ranges()
        ends = ranges[:, 0] + ranges[:, 3]
        if (len(ranges) == 0 and lo != hi) or (
            len(ranges)
            and (ranges[0, 0] != lo or ends[-1] != hi or (ranges[1:, 0] != ends[:-1]).any())
        ):
            raise RuntimeError(
                f"part {self.number} of file {self.file}: the staged ranges do not cover bytes "
                f"{lo}..{hi} exactly; the plan is inconsistent"
            )
        return ranges

    def ranges(self) -> np.ndarray:
        """The staged ranges of the part's bytes after the header, int64 rows ``(file_offset,
        rank, staged_offset, nbytes)`` in file order; of the ranks whose rows the task holds
        (all of them in a gathering rank's task; one in a sender's, ``plan/exchange.py``)."""
        lo, hi = self.start + len(self.head), self.end
        cols: list[np.ndarray] = []  # (file_offset, rank, staged_offset, nbytes) blocks
        if self.pieces:
            p = np.frombuffer(self.pieces, dtype=np.int64).reshape(-1, 4)
            cols.append(np.stack((p[:, 1], p[:, 0], p[:, 2], p[:, 3]), axis=1))
        if self.strided:
            rows = np.frombuffer(self.strided, dtype=np.int64).reshape(-1, 3 + 2 * self.width)
            for rank, t, staged, *dims in rows.tolist():
                tensor_start, shape, itemsize = self.tensors[t]
                nd = len(shape)
                t_off, c_off, run = chunk_runs_array(
                    shape, dims[:nd], dims[self.width : self.width + nd], itemsize
                )
                at = tensor_start + t_off
                keep = (at < hi) & (at + run > lo)
                at, c_off = at[keep], c_off[keep]
                cut = np.maximum(lo - at, 0)  # a run that starts before the part
                n = np.minimum(at + run, hi) - at - cut
                cols.append(
                    np.stack((at + cut, np.full(len(at), rank), staged + c_off + cut, n), axis=1)
                )
        ranges = np.concatenate(cols) if cols else np.empty((0, 4), dtype=np.int64)
        ranges = ranges[ranges[:, 3] > 0]
        return ranges[np.argsort(ranges[:, 0], kind="stable")]


@dataclass(frozen=True)
class GatherTasks:
    """(S3) One rank's gathered parts, as arrays (``plan/partplan.py`` builds every rank's share at
    once). Iterating gives a :class:`GatherTask` per part, which the rank then carries out.

    Part ``i`` is ``parts[i] = (file, number, start, end)``; its staged pieces are rows
    ``piece_at[i]:piece_at[i + 1]`` of ``pieces`` and its column-sharded chunks rows
    ``strided_at[i]:strided_at[i + 1]`` of ``strided`` (the rows of :class:`GatherTask`);
    ``heads[i]``, the header's bytes in a part that starts at 0; ``tensors[file]``, the file's
    tensors where ``strided`` names any. One object per rank, a few arrays: at 405B over 8,192
    ranks there are 109,000 parts, which as objects cost the coordinator seconds to build and send.
    """

    parts: np.ndarray  # int64 [k, 4]
    piece_at: np.ndarray  # int64 [k + 1]
    pieces: np.ndarray  # int64 [p, 4]
    strided_at: np.ndarray  # int64 [k + 1]
    strided: np.ndarray  # int32 [q, 3 + 2 * width] where every value fits, else int64
    heads: Mapping[int, bytes]
    tensors: Mapping[int, tuple[tuple[int, tuple[int, ...], int], ...]]
    width: int

    def __len__(self) -> int:
        return len(self.parts)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Raw bytes for the arrays: numpy pickles each with its dtype object, about 10 µs an
        # array, and the coordinator sends thousands of these.
        arrays = tuple(
            (a.dtype.str, a.shape, a.tobytes())
            for a in (self.parts, self.piece_at, self.pieces, self.strided_at, self.strided)
        )
        return _tasks_from, (arrays, dict(self.heads), dict(self.tensors), self.width)

    def __iter__(self) -> Iterator[GatherTask]:
        return (self.task(i) for i in range(len(self.parts)))

    def task(self, i: int) -> GatherTask:
        """Part ``i`` as a :class:`GatherTask`."""
        f, number, start, end = self.parts[i].tolist()
        pa, pb, ca, cb = (
            int(self.piece_at[i]),
            int(self.piece_at[i + 1]),
            int(self.strided_at[i]),
            int(self.strided_at[i + 1]),
        )
        strided = (
            (self.strided[ca:cb].astype(np.int64).tobytes(), self.tensors[f], self.width)
            if cb > ca
            else (b"", (), 0)
        )
        return GatherTask(
            f, number, start, end, self.heads.get(i, b""), self.pieces[pa:pb].tobytes(), *strided
        )


def _tasks_from(
    arrays: tuple[tuple[str, tuple[int, ...], bytes], ...],
    heads: dict[int, bytes],
    tensors: dict[int, Any],
    width: int,
) -> GatherTasks:
    parts, piece_at, pieces, strided_at, strided = (
        np.frombuffer(data, dtype=np.dtype(dt)).reshape(shape) for dt, shape, data in arrays
    )
    return GatherTasks(parts, piece_at, pieces, strided_at, strided, heads, tensors, width)


@dataclass(frozen=True)
class MergeTask:
    """(other stores) Write file ``file`` whole (``nbytes``): ``header``, then every rank's
    staged chunks of it in output order. ``tensors``: ``(tensor_start, shape, itemsize)`` of each
    key in the file; ``chunks``: the columns ``(rank, tensor, staged_offset, offsets, sizes)``,
    offsets and sizes zero-padded to ``width`` dims, one row per chunk, packed by
    ``pack_columns`` (a 5 GB file of 8,192 ranks' shards holds 50,000 chunks: ≤ 75 KiB packed)."""

    file: int
    header: bytes
    nbytes: int
    tensors: tuple[tuple[int, tuple[int, ...], int], ...]
    chunks: bytes
    width: int

    def pieces(self, staged_path: Callable[[int], str]) -> list[StagedPiece]:
        """The chunks as ``StagedPiece``s of the ranks' staged objects (``staged_path(rank)``)."""
        rows = (
            np.stack(unpack_columns(self.chunks), axis=1)
            if self.chunks
            else np.empty((0, 3 + 2 * self.width), dtype=np.int64)
        )
        out = []
        for rank, t, staged_offset, *dims in rows.tolist():
            start, shape, itemsize = self.tensors[t]
            nd = len(shape)
            offsets, sizes = tuple(dims[:nd]), tuple(dims[self.width : self.width + nd])
            out.append(
                StagedPiece(
                    staged_path(rank), start, staged_offset, shape, offsets, sizes, itemsize
                )
            )
        return out


def pack_columns(columns: Sequence[np.ndarray]) -> bytes:
    """Integer columns of equal length, compressed: each stored column after column, as int32
    where its values fit (most do: ranks, dims), else int64; zlib over the whole. Column-major
    regular numbers compress several-fold."""
    codes, body = bytearray(), []
    for column in columns:
        c = np.asarray(column, dtype=np.int64)
        small = len(c) == 0 or (int(c.min()) >= -(2**31) and int(c.max()) < 2**31)
        codes.append(4 if small else 8)
        body.append(c.astype(np.int32 if small else np.int64).tobytes())
    return bytes([len(codes)]) + bytes(codes) + zlib.compress(b"".join(body), 1)


def unpack_columns(data: bytes) -> list[np.ndarray]:
    """The int64 columns ``pack_columns`` packed."""
    codes = data[1 : 1 + data[0]]
    payload = zlib.decompress(data[1 + data[0] :])
    rows = len(payload) // max(1, sum(codes))
    out, pos = [], 0
    for code in codes:
        out.append(
            np.frombuffer(
                payload, dtype=np.int32 if code == 4 else np.int64, count=rows, offset=pos
            ).astype(np.int64)
        )
        pos += rows * code
    return out


def merge_tasks(
    placed: PlacedChunks, layout: Layout, map_fn: MapFn | None = None
) -> list[MergeTask]:
    """(coordinator, stores without positioned writes) One task per file of ``layout``: its
    chunks, each fully staged by its rank (``placed.staged``). Pure; numpy over the chunks, and
    each file's columns packed through ``map_fn(fn, files)`` (default in order; the writer
    passes its thread pool: numpy's copies and zlib let go of the GIL, and at 405B over 8,192
    ranks the packing is 0.7 s of zlib)."""
    by_file = np.argsort(
        placed.file.astype(np.int16 if len(layout.files) < 2**15 else np.int64), kind="stable"
    )
    files = placed.file[by_file]
    bounds = np.searchsorted(
        files, np.arange(len(layout.files) + 1, dtype=files.dtype)
    )  # same dtype: no int64 copy
    in_file, tensors = file_tensors(layout, placed.key_names)

    def task(f: int) -> MergeTask:
        rows = by_file[bounds[f] : bounds[f + 1]]
        offsets, sizes = np.take(placed.offsets, rows, axis=0), np.take(placed.sizes, rows, axis=0)
        chunks = pack_columns(
            [
                placed.rank[rows],
                in_file[placed.key[rows]],
                placed.staged[rows],
                *offsets.T,
                *sizes.T,
            ]
        )
        plan = layout.files[f]
        return MergeTask(f, plan.header, plan.size, tensors[f], chunks, placed.offsets.shape[1])

    files_ = list(range(len(layout.files)))
    return map_fn(task, files_) if map_fn is not None else [task(f) for f in files_]


def plan_merges(
    placed: PlacedChunks, layout: Layout, world: int, map_fn: MapFn | None = None
) -> list[list[MergeTask]]:
    """(coordinator, stores without positioned writes) Each rank's files to merge: one task per
    file (``merge_tasks``), given to the rank with the fewest bytes so far, counting each rank's
    own bytes (``assign``). Pure."""
    merges = merge_tasks(placed, layout, map_fn)
    out: list[list[MergeTask]] = [[] for _ in range(world)]
    for task, rank in zip(
        merges,
        assign([t.nbytes for t in merges], placed.bytes_per_rank(world).tolist()),
        strict=True,
    ):
        out[rank].append(task)
    return out


def file_tensors(
    layout: Layout, key_names: Sequence[str]
) -> tuple[np.ndarray, list[tuple[tuple[int, tuple[int, ...], int], ...]]]:
    """Each key's index among its file's tensors (keys as ``key_names`` orders them), and each
    file's ``(tensor_start, shape, itemsize)`` per tensor: the ``tensors`` of its tasks."""
    index = {k: i for i, k in enumerate(key_names)}
    in_file = np.zeros(len(index), dtype=np.int64)
    tensors = []
    for plan in layout.files:
        entries = []
        for t, e in enumerate(plan.entries):
            spec = layout.specs[e.name]
            in_file[index[e.name]] = t
            entries.append(
                (layout.tensor_start[e.name], tuple(spec.shape), element_size(spec.dtype))
            )
        tensors.append(tuple(entries))
    return in_file, tensors
