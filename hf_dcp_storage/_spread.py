"""Who assembles what once every rank has staged: the finishing work of a save, spread by bytes.

Where the store has no positioned writes, some bytes of the consolidated files can only be put
in place after every rank has staged its own: on S3 the multipart parts that mix several ranks'
small runs (``GatherPart``), on other stores whole files merged from the ranks' staged objects.
With a thousand FSDP ranks every run is small, so that is nearly every byte of the checkpoint;
left to the coordinator it is the failure seen elsewhere, one process moving the whole
checkpoint while the others idle. Here the coordinator hands each piece of that work (a task)
to one rank: largest task first, to the rank with the fewest bytes so far, counting the bytes
each rank already uploads of its own. Every rank does its tasks at the end of ``write_data``,
after all ranks have staged (``_arrival.py``). Pure planning: no I/O.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ._layout import Layout, element_size
from ._merge import StagedPiece
from ._placed import PlacedChunks
from ._s3parts import GatherPart, RankPart

__all__ = ["GatherTask", "MergeTask", "Source", "assign", "encode_chunk_rows", "merge_tasks", "gather_tasks", "gather_sources"]

# One piece of a gathered part, in file order: literal bytes (the file's header, which the
# coordinator knows), or ``(rank, offset, nbytes)``: a range of that rank's staged object.
Source = bytes | tuple[int, int, int]


@dataclass(frozen=True)
class GatherTask:
    """(S3) Assemble part ``number`` of file ``file`` and upload it (``nbytes`` bytes).

    The part holds, in order, ``head`` (the header's bytes in it, if any), then the byte runs
    the ranks staged, in file order: ``runs``, zlib-compressed int64 pairs ``(rank, nbytes)``
    (a column shard makes one run per row, in a pattern that compresses to almost nothing). A
    rank stages its bytes of a file in file order, so its runs in one part lie back to back in
    its staged object, from offset ``base[rank]``: one offset per rank, not one per run.
    ``explicit``, when not empty, replaces all that with the part's sources as they are (a rank
    holding several chunks of one tensor stages them chunk after chunk, not in file order).
    """

    file: int
    number: int
    nbytes: int
    head: bytes = b""
    runs: bytes = b""
    base: tuple[tuple[int, int], ...] = ()
    explicit: tuple[Source, ...] = ()

    def sources(self) -> list[Source]:
        """The part's bytes in order: literal bytes, or ``(rank, offset, nbytes)`` staged ranges."""
        if self.explicit:
            return list(self.explicit)
        out: list[Source] = [self.head] if self.head else []
        at = dict(self.base)
        for rank, n in _decode_runs(self.runs).tolist():
            out.append((rank, at[rank], n))
            at[rank] += n
        return out


def _encode_runs(runs: np.ndarray) -> bytes:
    return zlib.compress(np.ascontiguousarray(runs, dtype=np.int64).tobytes(), 1)


def _decode_runs(data: bytes) -> np.ndarray:
    return np.frombuffer(zlib.decompress(data), dtype=np.int64).reshape(-1, 2) if data else np.empty((0, 2), dtype=np.int64)


@dataclass(frozen=True)
class MergeTask:
    """(other stores) Write file ``file`` whole (``nbytes``): ``header``, then every rank's
    staged chunks of it in output order. ``tensors``: ``(tensor_start, shape, itemsize)`` of each
    key in the file; ``chunks``: zlib-compressed int64 rows ``(rank, tensor, staged_offset,
    offsets, sizes)``, offsets and sizes zero-padded to ``width`` dims, one row per chunk (a file
    of a thousand ranks' shards holds tens of thousands; their regular numbers compress
    several-fold)."""

    file: int
    header: bytes
    nbytes: int
    tensors: tuple[tuple[int, tuple[int, ...], int], ...]
    chunks: bytes
    width: int

    def pieces(self, staged_path: Callable[[int], str]) -> list[StagedPiece]:
        """The chunks as ``StagedPiece``s of the ranks' staged objects (``staged_path(rank)``)."""
        rows = np.frombuffer(zlib.decompress(self.chunks), dtype=np.int64).reshape(-1, 3 + 2 * self.width)
        out = []
        for rank, t, staged_offset, *dims in rows.tolist():
            start, shape, itemsize = self.tensors[t]
            nd = len(shape)
            offsets, sizes = tuple(dims[:nd]), tuple(dims[self.width : self.width + nd])
            out.append(StagedPiece(staged_path(rank), start, staged_offset, shape, offsets, sizes, itemsize))
        return out


def encode_chunk_rows(rank: np.ndarray, tensor: np.ndarray, staged: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bytes:
    """``MergeTask.chunks`` from one array per column (``offsets``/``sizes``: ``[n, width]``)."""
    rows = np.concatenate((np.stack((rank, tensor, staged), axis=1), offsets, sizes), axis=1)
    return zlib.compress(np.ascontiguousarray(rows, dtype=np.int64).tobytes(), 1)


def merge_tasks(placed: PlacedChunks, layout: Layout) -> list[MergeTask]:
    """(coordinator, stores without positioned writes) One task per file of ``layout``: its
    chunks, each fully staged by its rank (``placed.staged``). Pure; numpy over the chunks."""
    by_file = np.argsort(placed.file.astype(np.int16 if len(layout.files) < 2**15 else np.int64), kind="stable")
    bounds = np.searchsorted(placed.file[by_file], np.arange(len(layout.files) + 1))
    # Each key's position among its file's tensors (the MergeTask's ``tensors``).
    keys = list(layout.specs)
    key_index = {k: i for i, k in enumerate(keys)}
    in_file = np.zeros(len(keys), dtype=np.int64)
    tasks = []
    for f, plan in enumerate(layout.files):
        tensors = []
        for t, entry in enumerate(plan.entries):
            spec = layout.specs[entry.name]
            in_file[key_index[entry.name]] = t
            tensors.append((layout.tensor_start[entry.name], tuple(spec.shape), element_size(spec.dtype)))
        rows = by_file[bounds[f] : bounds[f + 1]]
        key = placed.key[rows]
        chunks = encode_chunk_rows(placed.rank[rows], in_file[key], placed.staged[rows], placed.offsets[rows], placed.sizes[rows])
        tasks.append(MergeTask(f, plan.header, plan.size, tuple(tensors), chunks, placed.offsets.shape[1]))
    return tasks


def assign(sizes: Sequence[int], load: Sequence[int]) -> list[int]:
    """The rank that does each task of ``sizes`` bytes, given the bytes ``load[r]`` rank ``r``
    already moves: largest task first, to the least-loaded rank (ties to the lower rank); a task
    counts twice its size (read, then written again). Deterministic; O(T log T + T log N).

    Greedy largest-first keeps the busiest rank within one task of the mean, and tasks are
    small (a gathered part is ~5 MiB; a merged file at most ``max_shard_size``).
    """
    heap = [(int(b), r) for r, b in enumerate(load)]
    heapq.heapify(heap)
    out = [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: -sizes[t]):
        bytes_so_far, rank = heapq.heappop(heap)
        out[t] = rank
        heapq.heappush(heap, (bytes_so_far + 2 * sizes[t], rank))
    return out


def gather_tasks(parts: Sequence[Sequence[RankPart | GatherPart]], headers: Sequence[bytes]) -> list[GatherTask]:
    """A task for each gathered part of every file (``parts[f]``, in file order), given that every
    rank stages its bytes of a file in file order (one chunk per tensor per rank: every DTensor
    save). Pure."""
    tasks = []
    for f, file_parts in enumerate(parts):
        staged: dict[int, int] = {}  # rank -> its bytes staged before the current part
        for p in file_parts:
            if not isinstance(p, GatherPart):
                continue  # a rank's own part: none of its bytes are staged
            pieces = p.pieces
            head = b""
            if pieces and pieces[0][0] is None:  # the header comes first, if at all
                head, pieces = headers[f][pieces[0][1] : pieces[0][2]], pieces[1:]
            arr = np.array(pieces, dtype=np.int64).reshape(-1, 3)
            runs = np.stack([arr[:, 0], arr[:, 2] - arr[:, 1]], axis=1)
            ranks, first, inverse = np.unique(runs[:, 0], return_index=True, return_inverse=True)
            per_rank = np.bincount(inverse, weights=runs[:, 1], minlength=len(ranks)).astype(np.int64)
            order = np.argsort(first)  # ranks in the order they first appear in the part
            base = []
            for rank, n in zip(ranks[order].tolist(), per_rank[order].tolist(), strict=True):
                base.append((rank, staged.get(rank, 0)))
                staged[rank] = staged.get(rank, 0) + n
            tasks.append(GatherTask(f, p.number, p.nbytes, head, _encode_runs(runs), tuple(base)))
    return tasks


def gather_sources(part: GatherPart, header: bytes, locate: Callable[[int, int, int], list[tuple[int, int]]]) -> tuple[Source, ...]:
    """Where the bytes of ``part`` sit, for stagings not in file order: header slices, and
    ``(rank, offset, nbytes)`` ranges of the ranks' staged objects, from ``locate(rank, start,
    end)`` (a ``StagedIndex`` lookup)."""
    out: list[Source] = []
    for rank, start, end in part.pieces:
        if rank is None:
            out.append(header[start:end])
        else:
            out.extend((rank, offset, n) for offset, n in locate(rank, start, end))
    return tuple(out)
