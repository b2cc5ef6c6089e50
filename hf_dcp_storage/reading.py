"""A rank's reads of a load, batched across tensors: what ``HFStorageReader.read_data`` does on
every rank (but with ``verify``, where a tensor is read whole to be checksummed).

Every read item is cut into slabs (parts of its destination region of at most a slab's bytes,
``io/slabs.py``). A slab's bytes go straight into its destination where it takes them raw (a
contiguous CPU tensor of the stored dtype); else into host memory, to be copied into the
destination (converted on its device) once read. The slabs, in file order, go to the store's
``Reads`` in batches (``Reads.read_batch``, which joins near byte runs of a file across tensors
into few large requests); a batch closes where the host memory its slabs take would pass half
the reader's ``buffer_size``, the other half bounding the requests in flight. A slab read into
host memory is finished (copied, converted) on a pool of the load's as soon as its bytes are in,
while the rest of its batch is still on its way. An item is committed once its last slab is in.
A quantized weight's slab (``decoders``) is read as stored, only the blocks or groups its region
touches, into host memory, and dequantized into its destination (``io/dequantizing.py``) from
the scales read once before (``read_scales``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from .format.crc import crc32_of
from .format.geometry import chunk_runs, element_size
from .io.dequantizing import Dequantizer
from .io.hostbuf import HostBuffers
from .io.parallel import parallel_map
from .io.slabs import SLAB_BYTES, as_bytes, slab_bounds, sub_chunk
from .plan.layout import parse_size
from .plan.reads import REQUEST_BYTES
from .stores.reads import Reads, SlabRead

__all__ = [
    "CheckedTensor",
    "LoadStats",
    "check_buffer_size",
    "read_items",
    "read_scales",
    "read_verified",
    "request_budget",
]

# Slabs packed into one host buffer start at multiples of this, so each views as any dtype.
_ALIGN = 64


class StoredTensor(Protocol):
    """Where one whole tensor's bytes are (the reader's ``storage_data`` values)."""

    @property
    def file(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


S = TypeVar("S", bound=StoredTensor)


class CheckedTensor(StoredTensor, Protocol):
    """A stored tensor with its name and the CRC32 the index records for its bytes."""

    @property
    def key(self) -> str: ...
    @property
    def crc(self) -> int | None: ...


C = TypeVar("C", bound=CheckedTensor)


def read_verified(
    items: Sequence[ReadItem],
    stored: C,
    planner: LoadPlanner,
    fill: Callable[[C, list[tuple[int, int, int]], memoryview], None],
    url: str,
    decoder: Dequantizer | None = None,
) -> None:
    """(each rank, with ``verify``) Read one whole tensor slab by slab (``fill(stored, runs,
    view)``), check its CRC32, and fill every region ``items`` ask for; the regions are committed
    only after the check passes. A quantized tensor (``decoder``) is held whole until then, and
    its regions dequantized from it.

    Raises:
        ValueError: the bytes read fail the checksum, naming ``url`` (the tensor's file) and key.
    """
    targets = [(item, planner.resolve_tensor(item).detach()) for item in items]
    itemsize = element_size(stored.dtype)
    row_bytes = math.prod(stored.shape[1:]) * itemsize
    crc = 0
    whole = torch.empty(stored.shape, dtype=stored.dtype) if decoder is not None else None
    for r0, r1 in slab_bounds(stored.shape, itemsize):
        rows = stored.shape and (r1 - r0,)
        buf = (
            torch.empty((*rows, *stored.shape[1:]), dtype=stored.dtype)
            if whole is None
            else whole[r0:r1]
        )
        view = buf.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        fill(
            stored,
            [(r0 * row_bytes, 0, len(view))] if stored.shape else [(0, 0, itemsize)],
            view,
        )
        crc = crc32_of(view, crc)
        for item, target in targets if whole is None else ():
            if not stored.shape:
                target.copy_(buf)
                continue
            o0, l0 = item.storage_offsets[0], item.lengths[0]
            a, b = max(r0, o0), min(r1, o0 + l0)
            if a < b:
                src = buf[a - r0 : b - r0]
                for d in range(1, len(stored.shape)):
                    src = src.narrow(d, item.storage_offsets[d], item.lengths[d])
                target[a - o0 : b - o0].copy_(src)
    _check_crc(stored, crc, url)
    for item, target in targets:
        if decoder is not None and whole is not None:
            offsets, sizes = decoder.stored_region(item.storage_offsets, item.lengths)
            region = whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
            decoder.finish(region, item.storage_offsets, item.lengths, target)
        planner.commit_tensor(item, target)


@dataclass
class LoadStats:
    """What one rank's load read (``HFStorageReader.load_stats``; each load starts it anew):
    ``requests`` sent and the bytes they read (``bytes_read``, gaps included) for the
    ``bytes_wanted``, in ``batches``; ``bytes_kept``: bytes of those wanted served from what the
    header reads brought (``io/files.read_head``), with no request; ``host_bytes_peak``: the most
    host memory a batch's slabs took; ``in_flight_bytes``: the bound on the bytes of requests in
    flight; ``bytes_sent``, ``bytes_received``: bytes of shared reads passed to and from other
    ranks (``sharedreads.py``), in ``shared_groups`` groups."""

    requests: int = 0
    bytes_read: int = 0
    bytes_wanted: int = 0
    batches: int = 0
    bytes_kept: int = 0
    host_bytes_peak: int = 0
    in_flight_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    shared_groups: int = 0


@dataclass
class _Slab:
    item: int
    path: str
    start: int
    runs: list[tuple[int, int, int]]
    dest: torch.Tensor
    dtype: torch.dtype  # as stored
    nbytes: int
    raw: bool  # the destination takes the stored bytes as they are
    # A quantized tensor's slab: the decoder, and the slab's region of the dequantized tensor
    # (offsets, sizes); the view holds the stored region it comes from.
    decode: tuple[Dequantizer, list[int], list[int]] | None = None


def request_budget(buffer_size: int) -> tuple[int, int, int]:
    """``(host bytes for slabs, requests in flight, bytes per request)`` of a load holding at
    most ``buffer_size`` bytes on their way: half for the slabs of a batch, half for requests."""
    half = buffer_size // 2
    request_bytes = min(REQUEST_BYTES, half)
    return half, max(1, half // request_bytes), request_bytes


def read_items(
    items: Sequence[ReadItem],
    planner: LoadPlanner,
    stored_of: Callable[[ReadItem], S],
    path_of: Callable[[str], str],
    slab_bytes: Callable[[S, ReadItem], int],
    reads: Reads,
    host: Callable[[torch.Tensor], HostBuffers],
    *,
    threads: int,
    buffer_size: int,
    stats: LoadStats,
    decoders: Mapping[str, Dequantizer] | None = None,
) -> None:
    """(each rank) Read every item into ``planner``'s tensors and commit it.

    ``stored_of(item)``: where its tensor's bytes are; ``path_of(file)``: that file's path;
    ``slab_bytes``: bytes of destination per slab; ``host(dest)``: the pool of host buffers for
    slabs that do not take raw bytes (``count x nbytes`` is the most a batch takes of it);
    ``decoders``: the quantized tensors by key, whose slabs are read as stored into host memory
    and dequantized into their destinations.

    Raises:
        ValueError: a destination region whose shape is not the one requested; a file shorter
            than its header says (``Reads.read_batch``).
    """
    budget, in_flight, request_bytes = request_budget(buffer_size)
    stats.in_flight_bytes = in_flight * request_bytes
    targets: dict[int, torch.Tensor] = {}
    left: dict[int, int] = {}
    batch: list[tuple[_Slab, memoryview]] = []
    buffers: list[torch.Tensor] = []
    pool: HostBuffers | None = None
    used = 0  # bytes taken of the last host buffer

    def release(done: Any = None) -> None:
        nonlocal used
        for buf in buffers:
            assert pool is not None
            pool.release(buf, done)  # also on failure: the reader keeps its pool across loads
        buffers.clear()
        used = 0

    finishing: list[ThreadPoolExecutor] = []  # made at the first slab to finish, for the load

    def flush() -> None:
        if not batch:
            return
        done = None
        pending: dict[int, Future[None]] = {}
        try:
            slabs: list[SlabRead] = [(s.path, s.start, s.runs, view) for s, view in batch]
            if not finishing and not all(s.raw for s, _ in batch):
                finishing.append(ThreadPoolExecutor(threads, thread_name_prefix="hf-dcp-finish"))

            def arrived(i: int) -> None:
                # A slab whose bytes are in is converted (or dequantized) while the rest of the
                # batch is still on its way; this may run on an event loop: hand it on, no more.
                if not batch[i][0].raw:
                    pending[i] = finishing[0].submit(_finish, batch[i])

            requests, nbytes = reads.read_batch(
                slabs,
                threads=threads,
                in_flight=in_flight,
                request_bytes=request_bytes,
                done=arrived if finishing else None,
            )
            stats.requests += requests
            stats.bytes_read += nbytes
            stats.batches += 1
            stats.host_bytes_peak = max(stats.host_bytes_peak, sum(b.numel() for b in buffers))
            late = [batch[i] for i, (s, _) in enumerate(batch) if not s.raw and i not in pending]
            parallel_map(_finish, late, threads)
            for finished in list(pending.values()):
                finished.result()
            device = next((s.dest.device for s, _ in batch if s.dest.device.type == "cuda"), None)
            if device is not None:
                done = torch.cuda.Event()  # the buffers are refilled only after their copies
                done.record(torch.cuda.current_stream(device))
        finally:
            futures.wait(list(pending.values()))  # no buffer goes back while a slab reads it
            release(done)
        for s, _ in batch:
            left[s.item] -= 1
            if left[s.item] == 0:
                planner.commit_tensor(items[s.item], targets.pop(s.item))
        batch.clear()

    try:
        slabs = _slabs(
            items, planner, stored_of, path_of, slab_bytes, targets, left, decoders or {}
        )
        for slab in slabs:
            stats.bytes_wanted += sum(n for _, _, n in slab.runs)
            if slab.raw:
                view = slab.dest.reshape(-1).view(torch.uint8).numpy().data.cast("B")
                batch.append((slab, view))
                continue
            pool = pool or host(slab.dest)
            need = -(-slab.nbytes // _ALIGN) * _ALIGN
            if not buffers or used + need > buffers[-1].numel():
                if len(buffers) >= max(1, min(pool.count, budget // pool.nbytes)):
                    flush()
                buffers.append(pool.acquire(need))
                used = 0
            batch.append((slab, buffers[-1][used : used + slab.nbytes].numpy().data.cast("B")))
            used += need
        flush()
    finally:
        release()  # what a failure left acquired (nothing, after a clean last flush)
        for executor in finishing:
            executor.shutdown(wait=True)


def _slabs(
    items: Sequence[ReadItem],
    planner: LoadPlanner,
    stored_of: Callable[[ReadItem], S],
    path_of: Callable[[str], str],
    slab_bytes: Callable[[S, ReadItem], int],
    targets: dict[int, torch.Tensor],
    left: dict[int, int],
    decoders: Mapping[str, Dequantizer],
) -> Iterator[_Slab]:
    """Every item's slabs, items in file order (by file, then where the tensor and its region
    start), each item's destination resolved as its first slab is made."""
    stored = [stored_of(item) for item in items]
    order = sorted(
        range(len(items)),
        key=lambda i: (stored[i].file, stored[i].start, tuple(items[i].storage_offsets)),
    )
    for i in order:
        item, where = items[i], stored[i]
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            raise ValueError(
                f"{item.dest_index.fqn!r}: destination region {list(target.shape)} does not match "
                f"requested {list(item.lengths)}"
            )
        itemsize = element_size(where.dtype)
        bounds = list(slab_bounds(item.lengths, itemsize, slab_bytes(where, item)))
        targets[i], left[i] = target, len(bounds)
        decoder = decoders.get(item.storage_index.fqn)
        for r0, r1 in bounds:
            offsets, sizes = sub_chunk(item.storage_offsets, item.lengths, r0, r1)
            dest = target[r0:r1] if item.lengths else target
            if decoder is None:
                at, size = offsets, sizes
                raw = dest.dtype == where.dtype and dest.is_contiguous() and dest.is_cpu
            else:  # read the stored region the slab dequantizes from
                (at, size), raw = decoder.stored_region(offsets, sizes), False
            yield _Slab(
                i,
                path_of(where.file),
                where.start,
                list(chunk_runs(where.shape, at, size, itemsize)),
                dest,
                where.dtype,
                math.prod(size) * itemsize,
                raw,
                None if decoder is None else (decoder, offsets, sizes),
            )


def _finish(slab_view: tuple[_Slab, memoryview]) -> None:
    """Copy a slab read into host memory into its destination, converting it on the
    destination's device (queued on CUDA: the host buffer is pinned)."""
    slab, view = slab_view
    if not slab.nbytes:
        return  # an empty region: nothing to copy (and no buffer to view)
    if slab.decode is not None:
        decoder, offsets, sizes = slab.decode
        stored = torch.frombuffer(view, dtype=slab.dtype)
        decoder.finish(
            stored.view(decoder.stored_region(offsets, sizes)[1]), offsets, sizes, slab.dest
        )
        return
    host = torch.frombuffer(view, dtype=slab.dtype).view(slab.dest.shape)
    if slab.dest.device.type == "cuda":
        if slab.dest.dtype == slab.dtype:
            slab.dest.copy_(host, non_blocking=True)
        else:
            slab.dest.copy_(host.to(slab.dest.device, non_blocking=True))
    else:
        slab.dest.copy_(host)


def read_scales(
    keys: Iterable[str],
    stored_of: Callable[[str], C],
    path_of: Callable[[str], str],
    reads: Reads,
    *,
    threads: int,
    buffer_size: int,
    stats: LoadStats,
    url_of: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """(each rank) Read the scales of a load's quantized weights, whole, in one batch before the
    weights: ``keys`` are the scale tensors' keys, ``stored_of(key)`` says where a tensor's bytes
    are. Returns ``{scale key: tensor}``. With ``url_of`` (``verify``), each is
    checked against its CRC32.

    Raises:
        ValueError: (with ``url_of``) a scale tensor fails its checksum, naming its file and key.
    """
    _, in_flight, request_bytes = request_budget(buffer_size)
    scales: dict[str, torch.Tensor] = {}
    slabs: list[SlabRead] = []
    for key in sorted(set(keys)):
        where = stored_of(key)
        scales[key] = tensor = torch.empty(where.shape, dtype=where.dtype)
        view = as_bytes(tensor)  # contiguous and on the CPU: a view, no copy
        if len(view):
            slabs.append((path_of(where.file), where.start, [(0, 0, len(view))], view))
    if slabs:
        requests, nbytes = reads.read_batch(
            slabs, threads=threads, in_flight=in_flight, request_bytes=request_bytes
        )
        stats.requests, stats.bytes_read = stats.requests + requests, stats.bytes_read + nbytes
    for key, tensor in scales.items():
        if url_of is not None:
            where = stored_of(key)
            crc = crc32_of(as_bytes(tensor))
            _check_crc(where, crc, url_of(where.file))
    return scales


def _check_crc(stored: CheckedTensor, crc: int, url: str) -> None:
    if crc != stored.crc:
        raise ValueError(
            f"{url}: tensor {stored.key!r} fails its checksum (crc32 of the bytes read "
            f"{crc:08x}, the index records {stored.crc:08x}); the file is corrupt: restore it "
            "from a copy or re-save"
        )


def check_buffer_size(buffer_size: int | str) -> int:
    """The ``buffer_size`` option in bytes: at least four slabs (two in host memory, two
    requests' worth in flight)."""
    size = parse_size(buffer_size, "buffer_size")
    if size < 4 * SLAB_BYTES:
        raise ValueError(
            f"buffer_size={buffer_size!r} is {size} bytes; a load needs at least "
            f"{4 * SLAB_BYTES >> 20}MiB (two {SLAB_BYTES >> 20} MiB slabs and two requests on "
            'their way): give a larger one (the default is "512MB")'
        )
    return size
