"""``HFStorageReader``: load HF safetensors checkpoints into any DCP sharding, over fsspec."""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .format.geometry import element_size
from .format.index import FileHeader
from .format.quantscheme import block_size_of
from .io import fsio
from .io.dequantizing import Dequantizer
from .io.direct import check_direct_io
from .io.files import Head, check_recorded, load_weight_map, read_config, read_head, read_header
from .io.gcpause import paused_gc
from .io.hostbuf import KeptHostBuffers
from .io.parallel import check_thread_count, parallel_map
from .io.slabs import SLAB_BYTES
from .plan.loadmeta import Stored, dequantize, load_metadata
from .plan.reads import READ_GAP_BYTES
from .reading import (
    LoadStats,
    check_buffer_size,
    read_items,
    read_scales,
    read_verified,
    request_budget,
)
from .session.claim import Claim, released_on_error
from .sharedreads import LoadRanks, read_sharing
from .stores import ranges_for
from .stores.reads import KeptReads, Ranges, Reads
from .stores.retry import RetryPolicy, policy_or_default

__all__ = ["HFStorageReader"]


class HFStorageReader(StorageReader):
    """Load a Hugging Face safetensors checkpoint with DCP, resharding onto any layout.

    Reads checkpoints written by :class:`HFStorageWriter` and any HF model folder: an index json
    plus shards, or a single ``model.safetensors`` (as ``save_pretrained`` writes). Only the
    header bytes and the byte ranges each rank needs are read.

    Call sequence (DCP drives it): (all ranks) ``read_metadata`` parses the index and every
    file's header and validates them; (all ranks) ``read_data`` reads each requested region
    into the destination tensors, converting dtype where the destination differs. A reader
    holds one load at a time: ``reset`` (or ``set_up_storage_reader``) takes it for a load and
    ``read_data`` gives it back, done or failed (``session/claim.py``); a load from another thread
    meanwhile is refused before it changes anything.

    Args:
        path: the checkpoint folder, local or any fsspec URL; may be given later as
            ``dcp.load(..., checkpoint_id=...)``.
        storage_options: passed to the fsspec filesystem.
        thread_count: I/O threads per rank.
        retry: how transient failures of remote reads are retried; default ``RetryPolicy()``.
        verify: check every tensor a rank loads against the CRC32 the index recorded at save
            time. The rank then reads each such tensor whole (once, filling its regions from
            the same bytes), so a resharded load reads more than without it. Each rank also
            reads every file's own header and checks that, where it decodes, it equals the
            copy the index records (``metadata.headers``): a CRC32 covers a tensor's bytes but
            not the dtype, shape or offsets they are read with.
        direct_io: on local disk, read each run's aligned superset with ``O_DIRECT`` (no page
            cache): ``None`` as ``stores/local.READ_DIRECT_BY_DEFAULT`` decides, ``True`` (an error
            where the filesystem refuses it), ``False`` never.
        buffer_size: the most host memory a rank's load holds for bytes on their way (an int,
            or a string such as ``"512MB"``): half for slabs read into host memory (destinations
            on an accelerator or of another dtype), half for ranged requests in flight
            (``reading.py``). What one load read is in ``load_stats`` afterwards.
        dequantize: a dtype (``torch.bfloat16``) to load quantized weights into, dequantized:
            FP8 block-wise (``X.weight`` with ``X.weight_scale_inv``, DeepSeek-V3) and MXFP4
            (``X_blocks`` with ``X_scales``, gpt-oss; ``[..., G, B]`` becomes ``[..., G * 2 * B]``
            under the same key), as ``QuantizedHuggingFaceStorageReader(target_dtype=...)`` gives
            them, bit for bit, from any store and into any sharding: each rank reads the blocks
            its slices touch and every scale tensor once (``format/quantscheme.py``). The scales
            stay loadable as stored. ``None`` (the default): every tensor loads as stored.
        block_size: FP8 rows x columns per scale (an int: square): by default the folder's
            ``config.json`` ``quantization_config.weight_block_size``, else 128.
        share_reads: bytes that several ranks need (a DTensor's ``Replicate`` dimensions: HSDP
            replicas, TP-replicated norms; plain tensors every rank loads) are read from the
            store by one rank and passed to the others over a gloo group of the load's own
            (``sharedreads.py``), so the store serves each byte once. Off with ``verify`` (each
            rank checks what it read), and where the load's ranks are not the job's, in order.

    Raises (from ``read_metadata``, wrapped by DCP):
        FileNotFoundError: no index and no ``model.safetensors``, or a file the index names is
        missing. ValueError: malformed index, a file name escaping the folder, corrupt or truncated
        files; with ``verify=True``, an index without checksums, or a file whose header differs
        from the index's copy of it.

    Raises (from ``read_data``, with ``verify=True``):
        ValueError: a tensor whose bytes fail their checksum, naming its file and key.
    """

    # Pickled as its settings and path (DCP's process-based async machinery, or a user's own
    # process pool): the ranged reader, host buffers and locks are made anew where it lands.
    _SETTINGS = (
        "storage_options",
        "thread_count",
        "retry",
        "verify",
        "direct_io",
        "buffer_size",
        "dequantize",
        "block_size",
        "share_reads",
    )

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.checkpoint_id, **{k: getattr(self, k) for k in self._SETTINGS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("path"), **state)  # type: ignore[misc]

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 4,
        retry: RetryPolicy | None = None,
        verify: bool = False,
        direct_io: bool | None = None,
        buffer_size: int | str = "512MB",
        dequantize: torch.dtype | None = None,
        block_size: int | tuple[int, int] | None = None,
        share_reads: bool = True,
    ) -> None:
        super().__init__()
        if dequantize not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"dequantize={dequantize!r}: give the dtype to dequantize into (torch.bfloat16, "
                "torch.float16 or torch.float32), or None to load tensors as stored"
            )
        if block_size is not None:
            block_size_of(None, block_size)  # a bad one refused here, not at the load
        self.dequantize, self.block_size = dequantize, block_size
        self.share_reads = share_reads
        self.storage_options = storage_options
        self.thread_count = check_thread_count(thread_count)
        self.retry = policy_or_default(retry)
        self.verify = verify
        self.direct_io = check_direct_io(direct_io)
        self._ranges: Ranges | None = None  # how this store's byte ranges are read
        self.checkpoint_id: str | os.PathLike[str] | None = None
        self.storage_data: dict[str, Stored] = {}  # tensor name -> where its bytes are
        # This rank's read items, between prepare_local_plan and read_data.
        self._kept: list[ReadItem] = []
        self._heads: dict[str, tuple[int, bytes]] = {}  # bytes after headers read (read_head)
        self.buffer_size = check_buffer_size(buffer_size)
        self.load_stats = LoadStats()
        self._host = KeptHostBuffers(
            thread_count, request_budget(self.buffer_size)[0] // SLAB_BYTES
        )
        # The load using this reader (session/claim.py): a reader holds one load's state at a time.
        self.claim = Claim("HFStorageReader", "load", "loading", "a dcp.load in another thread")
        if path is not None:
            self._start(path)  # not a load yet: the constructing thread takes no claim

    # -- DCP protocol -------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, taking this reader for it; ``checkpoint_id`` (when given) replaces the
        path.

        Raises:
            RuntimeError: this reader's previous load is still running in another thread, before
                anything changes.
        """
        self.claim.take(
            lambda: str(checkpoint_id if checkpoint_id is not None else self.checkpoint_id)
        )
        with self.claim.released_on_error():
            self._start(checkpoint_id)

    def _start(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.fs, self.root = fsio.resolve(checkpoint_id, self.storage_options)
            self._ranges = ranges_for(self.fs, self.retry)
        self.storage_data, self._heads = {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        return fsio.resolvable(cls, checkpoint_id)

    def read_metadata(self) -> Metadata:
        """(all ranks) Index plus headers -> DCP metadata: one whole-tensor chunk per key. The
        headers are the index's copies where it records them (checkpoints ``HFStorageWriter``
        saved: one read per rank), else read from the files.

        Takes no ``rank`` keyword on purpose: DCP then does not retry with rank-local
        metadata (which HF checkpoints do not have) and reports our error as it is.

        Runs with the garbage collector paused (``io/gcpause.py``): it builds some ten objects
        per tensor, and the S3 client its first request makes some fifty thousand.
        """
        with paused_gc():
            return self._read_metadata()

    def _read_metadata(self) -> Metadata:
        if self.checkpoint_id is None:
            raise ValueError(
                "HFStorageReader has no path: pass HFStorageReader(path) or dcp.load(..., "
                "checkpoint_id=path)"
            )
        weight_map, checksums, recorded = self._weight_map()
        if self.verify and checksums is None:
            raise ValueError(
                f"{fsio.url_of(self.fs, self.root)}: verify=True, but the checkpoint records no "
                "checksums (only checkpoints saved by HFStorageWriter have them); load it with "
                "verify=False"
            )
        files = sorted(set(weight_map.values()))
        # The index's copies where it has them: no request per file (every rank reads this).
        recorded = recorded or {}
        if self.verify:
            check_recorded(recorded, self._read_header, self._url, self.thread_count)
        unrecorded = [f for f in files if f not in recorded]
        read = parallel_map(
            lambda f: self._read_header(f, keep=True), unrecorded, self.thread_count
        )
        found = {**recorded, **dict(zip(unrecorded, read, strict=True))}
        headers = {f: (h.by_name, h.data_start) for f, h in found.items()}
        # The bytes past the headers just read (``io/files.read_head``), for read_data to use.
        self._heads = {
            fsio.join(self.root, f): (h.data_start, h.kept)
            for f, h in found.items()
            if isinstance(h, Head)
        }
        state, storage = load_metadata(
            weight_map, headers, checksums, verify=self.verify, url_of=self._url
        )
        if self.dequantize is not None:
            assert self._ranges is not None
            config = self._ranges.retried(
                lambda: read_config(self.fs, self.root),
                operation="read config.json of",
                url=fsio.url_of(self.fs, self.root),
            )
            dequantize(state, storage, self.dequantize, block_size_of(config, self.block_size))
        self.storage_data = storage
        return Metadata(state_dict_metadata=state, storage_data=storage)  # type: ignore[arg-type]

    @released_on_error
    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """(all ranks) The load goes on (or, with no ``reset``, starts): this reader is taken for
        it.

        Raises:
            RuntimeError: another thread's load is still using this reader, naming its path.
        """
        self.claim.join(lambda: str(self.checkpoint_id))
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator

    @released_on_error
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """(all ranks) Keep this rank's read items here and send DCP's global step none of them.

        Every rank reads on its own: DCP's default and HF load planners do nothing with the
        gathered plans, which at thousands of ranks would be millions of ``ReadItem`` objects
        unpickled on the coordinator (~190 KiB a rank for Llama 405B). ``read_data`` takes the
        items back; a planner that puts items into a rank's plan in its global step is obeyed.
        """
        self._kept = list(plan.items)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        return dataclasses.replace(plan, items=[], storage_data=LoadRanks(rank))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(coordinator) Tell each rank the load's id and its number in it, for shared reads:
        only where the load's ranks are the job's ranks in order (DTensor meshes name global
        ranks), else no id and every rank reads alone."""
        ranks = [p.storage_data for p in plans]
        job = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        share = self.share_reads and not self.verify and len(plans) == job > 1
        share = share and all(
            isinstance(r, LoadRanks) and r.global_rank == i for i, r in enumerate(ranks)
        )
        load_id = uuid.uuid4().hex if share else ""
        return [
            dataclasses.replace(p, storage_data=LoadRanks(r.global_rank, load_id, i, len(plans)))
            if isinstance(r, LoadRanks)
            else p
            for i, (p, r) in enumerate(zip(plans, ranks, strict=True))
        ]

    @released_on_error
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(all ranks) Read every item of ``plan`` into ``planner``'s tensors, slab by slab, with
        the garbage collector paused (``io/gcpause.py``): a few objects per item, none of them
        cycles."""
        with paused_gc():
            self._read_items(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        ranks = plan.storage_data if isinstance(plan.storage_data, LoadRanks) else None
        items = self._kept if ranks is not None and not plan.items else plan.items
        assert self._ranges is not None
        reads = KeptReads(self._ranges.open_reads(self.direct_io), self._heads)

        def fill(stored: Stored, runs: Iterable[tuple[int, int, int]], view: memoryview) -> None:
            reads.read_runs(fsio.join(self.root, stored.file), stored.start, list(runs), view)

        try:
            self.load_stats = LoadStats()
            decoders = self._decoders(items, reads)
            if self.verify:
                by_tensor: dict[MetadataIndex, list[ReadItem]] = {}
                for item in items:
                    by_tensor.setdefault(item.storage_index, []).append(item)

                def verified(items: list[ReadItem]) -> None:
                    stored = self.storage_data[items[0].storage_index.fqn]
                    decoder = decoders.get(stored.key)
                    read_verified(items, stored, planner, fill, self._url(stored.file), decoder)

                parallel_map(verified, list(by_tensor.values()), self.thread_count)
            else:

                def read(items: Sequence[ReadItem], planner: LoadPlanner) -> None:
                    read_items(
                        items,
                        planner,
                        lambda item: self.storage_data[item.storage_index.fqn],
                        lambda file: fsio.join(self.root, file),
                        self._slab_bytes,
                        reads,
                        self._host,
                        threads=self.thread_count,
                        buffer_size=self.buffer_size,
                        stats=self.load_stats,
                        decoders=decoders,
                    )

                if ranks is not None and ranks.load_id:
                    read_sharing(items, planner, ranks, read, self.load_stats)
                else:
                    read(items, planner)
                self.load_stats.bytes_kept = reads.served
        finally:
            self._heads = {}  # at most HEADER_PREFIX bytes a file, held until the load's end
            reads.close()  # every read done: descriptors closed, buffers the next load's or save's
            if self._host.pool is not None:
                self._host.pool.drain()  # the destinations hold every byte before DCP returns them
            self.claim.release()  # this rank's last step of the load, done or failed

    # -- helpers ------------------------------------------------------------------------------

    def _decoders(self, items: Sequence[ReadItem], reads: Reads) -> dict[str, Dequantizer]:
        """(``dequantize``) A decoder for each quantized weight ``items`` read, with its scales,
        all read in one batch (``reading.read_scales``)."""
        quant = {
            key: stored.quant
            for item in items
            if (stored := self.storage_data[key := item.storage_index.fqn]).quant is not None
        }
        if not quant:
            return {}
        assert self.dequantize is not None
        scales = read_scales(
            (q.scale_key for q in quant.values()),
            self.storage_data.__getitem__,
            lambda file: fsio.join(self.root, file),
            reads,
            threads=self.thread_count,
            buffer_size=self.buffer_size,
            stats=self.load_stats,
            url_of=self._url if self.verify else None,
        )
        return {k: Dequantizer(q, scales[q.scale_key], self.dequantize) for k, q in quant.items()}

    def _slab_bytes(self, stored: Stored, item: ReadItem) -> int:
        """Bytes of destination per slab: ``SLAB_BYTES``, less where a remote read fetches whole
        rows for a part of each (a column shard whose gaps ``coalesce`` reads), so that what one
        slab fetches, and holds in memory, stays about ``SLAB_BYTES`` whatever the world size."""
        assert self._ranges is not None
        shape = stored.shape if stored.quant is None else stored.quant.shape  # item.lengths' frame
        if not self._ranges.coalesces or len(shape) < 2:
            return SLAB_BYTES
        wanted, full = math.prod(item.lengths[1:]), math.prod(shape[1:])
        if wanted == full or (full - wanted) * element_size(stored.dtype) > READ_GAP_BYTES:
            return SLAB_BYTES
        return max(1, SLAB_BYTES * wanted // max(full, 1))

    def _url(self, name: str) -> str:
        return fsio.url_of(self.fs, fsio.join(self.root, name))

    def _weight_map(
        self,
    ) -> tuple[dict[str, str], dict[str, int] | None, Mapping[str, FileHeader | Head] | None]:
        """``key -> file``, the recorded checksums and headers (``io/files.py``:
        ``load_weight_map``; a single file's header read as ``_read_header`` reads with ``keep``).

        Retried as a whole: the index (and a folder's listing) is read through fsspec, and s3fs
        retries neither a 500 nor a connection reset. A permanent failure keeps its own error.
        """
        assert self._ranges is not None
        keep = self._ranges.coalesces
        return self._ranges.retried(
            lambda: load_weight_map(self.fs, self.root, self._read_range, keep=keep),
            operation="read the index of",
            url=fsio.url_of(self.fs, self.root),
        )

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        assert self._ranges is not None
        return self._ranges.get_range(path, start, end)

    def _read_header(self, file: str, keep: bool = False) -> Head | FileHeader:
        # Retried as a whole, as the index is: the file's size comes through fsspec (a HEAD that
        # s3fs does not retry on a 500); a permanent failure (a corrupt header) keeps its error.
        # ``keep`` (a load's headers, where requests cost round trips): one request, which also
        # brings the first tensors (a ``Head``: io/files.read_head), and no size asked.
        assert self._ranges is not None
        read = read_head if keep and self._ranges.coalesces else read_header
        return self._ranges.retried(
            lambda: read(self.fs, self.root, file, self._read_range),
            operation="read the header of",
            url=self._url(file),
        )
