"""Local disk (and NFS): every rank writes its bytes straight into the final files with positioned
writes, so nothing is left to consolidate; a load reads each byte run in place (``LocalRanges``).

The coordinator creates every file at its final size with its header (``prepare``); each rank
writes its byte runs where they belong and fsyncs before it reports; the coordinator's
``complete`` only makes the folder's entries durable. Where the filesystem takes ``O_DIRECT``
(``direct_io``), the whole pages of each rank's runs go to disk directly, from aligned buffers a
writer thread writes while the next slab is checksummed and copied, and only the partial pages
at their ends through the page cache (``io/direct.py``): the save's time no longer depends on
when writeback runs, and its bytes do not evict the page cache the training job uses.
Otherwise each slab's writeback is started as soon as it is written.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..format.crc import CrcAccumulator
from ..io import fsio
from ..io.direct import AlignedBuffers, Descriptors, DirectWriter, pread_run
from ..io.items import tensor_bytes
from ..io.parallel import parallel_map
from ..plan.layout import Layout
from ..plan.rankplan import Finished, RankPlan, Written
from .base import Slabs, Store
from .reads import Ranges, SlabDone, SlabRead
from .retry import RetryPolicy

__all__ = ["READ_DIRECT_BY_DEFAULT", "LocalRanges", "LocalStore"]

logger = logging.getLogger(__name__)

# Whether a load with direct_io=None reads local files with O_DIRECT (docs/direct-io.md has the
# measurement this rests on: the page cache wins warm and ties cold).
READ_DIRECT_BY_DEFAULT = False


class LocalRanges(Ranges):
    """Local files read in place: each byte run with ``pread`` (or ``O_DIRECT``), no request to
    save, so runs are never joined across gaps."""

    coalesces = False

    def open_reads(self, direct_io: bool | None) -> LocalReads:
        return LocalReads(
            READ_DIRECT_BY_DEFAULT if direct_io is None else direct_io, required=direct_io is True
        )


class LocalReads:
    """One rank's reads of a load from local files: each file opened once (``O_DIRECT`` too,
    where ``direct`` and the filesystem takes it), runs read with ``pread``. Thread-safe."""

    def __init__(self, direct: bool, *, required: bool) -> None:
        self.files = Descriptors(write=False, direct=direct, required=required)
        self.buffers = AlignedBuffers()

    def read_runs(
        self, path: str, start: int, runs: Sequence[tuple[int, int, int]], view: memoryview
    ) -> None:
        """Fill ``view`` with ``runs`` of ``path`` (``(offset from start, offset in view, bytes)``).

        Raises:
            ValueError: the file ends before a run does (truncated), naming it.
        """
        fd, direct_fd = self.files.open(path)
        for t, c, n in runs:
            if direct_fd is not None:
                pread_run(direct_fd, fd, view[c : c + n], start + t, self.buffers, where=path)
            else:
                fsio.pread_into(fd, view[c : c + n], start + t, where=path)

    def read_batch(
        self,
        slabs: Sequence[SlabRead],
        *,
        threads: int,
        in_flight: int,
        request_bytes: int,
        done: SlabDone | None = None,
    ) -> tuple[int, int]:
        """Each slab's runs read where they are, ``threads`` slabs at a time: a local read costs
        no round trip, so nothing is joined (``in_flight`` and ``request_bytes`` are for stores
        where one does)."""

        def read(i: int) -> None:
            self.read_runs(*slabs[i])
            if done is not None:
                done(i)

        parallel_map(read, range(len(slabs)), threads)
        return sum(len(runs) for _, _, runs, _ in slabs), sum(
            n for _, _, runs, _ in slabs for _, _, n in runs
        )

    def close(self) -> None:
        """Close the files; the aligned buffers go back to the pool (the next load's or save's)."""
        self.files.close()
        self.buffers.close()


class LocalStore(Store):
    """Positioned writes into the final files (``direct`` saves). Also finishes an interrupted
    direct save copied elsewhere, where ``complete`` has nothing to do but the index.

    Args:
        direct_io: ``None``: ``O_DIRECT`` where the filesystem takes it (tried once per save and
            rank, at the first file), else buffered; ``True``: ``O_DIRECT`` or an error;
            ``False``: buffered.
    """

    mode = "direct"
    files_in_place = True
    needs_placement = False

    @classmethod
    def ranges(cls, fs: AbstractFileSystem, retry: RetryPolicy) -> LocalRanges:
        return LocalRanges(fs, retry)

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        *,
        retry: RetryPolicy,
        threads: int,
        direct_io: bool | None = None,
    ) -> None:
        super().__init__(fs, root, retry=retry, threads=threads)
        self.direct_io = direct_io

    def _make_files(self, layout: Layout) -> None:
        for f in layout.files:
            _create_with_header(fsio.join(self.root, f.name), f.header, f.size)
        if self.direct_io and layout.files:
            # direct_io=True where the filesystem refuses it: refused before any rank writes a byte.
            probe = Descriptors(write=True, direct=True, required=True)
            try:
                probe.open(fsio.join(self.root, layout.files[0].name))
            finally:
                probe.close()

    def write(self, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs) -> list[WriteResult]:
        files = Descriptors(
            write=True, direct=self.direct_io is not False, required=self.direct_io is True
        )
        pipeline = DirectWriter()

        def write_item(item: WriteItem) -> WriteResult:
            place = rank_plan.placements[item.index]
            fd, direct_fd = files.open(fsio.join(self.root, rank_plan.files[place.file]))
            stream = pipeline.stream(direct_fd, fd) if direct_fd is not None else None
            nbytes = 0
            crc = CrcAccumulator()
            # A slab that needs a copy anyway (on CUDA, or cast) is copied straight into the
            # aligned buffer it is written from, at its place in its pages: one copy, not two.
            into = (
                (lambda tensor_off, n: stream.reserve(place.tensor_start + tensor_off, n))
                if stream is not None
                else None
            )
            for runs, data in slabs(item, into):
                first: int | None = None
                last = 0
                for tensor_off, chunk_off, n in runs:
                    run = data[chunk_off : chunk_off + n]
                    crc.update(tensor_off, run)  # while the run is still in cache
                    if stream is not None:
                        stream.write(run, place.tensor_start + tensor_off)
                        continue
                    fsio.pwrite_all(fd, run, place.tensor_start + tensor_off)
                    first = tensor_off if first is None else first
                    last = tensor_off + n
                if first is not None:
                    fsio.start_writeback(fd, place.tensor_start + first, last - first)
                nbytes += len(data)
            direct = 0
            if stream is not None:
                stream.flush()
                direct = stream.direct
            return WriteResult(
                item.index,
                nbytes,
                Written(
                    place.file, None, crc.contribution(tensor_bytes(item)), direct_io_bytes=direct
                ),
            )

        try:
            results = parallel_map(write_item, items, self.threads)
            pipeline.close()  # every queued direct write done (or its error raised)
            files.sync()  # durable before we report success: the coordinator commits on our word
        finally:
            pipeline.close(check=False)  # after a failure too: no write may outlive its descriptor
            files.close()
        return results

    def complete(
        self, layout: Layout, results: list[list[WriteResult]], finished: Mapping[int, Finished]
    ) -> None:
        for plan in layout.files:
            self.merge_stats.add(plan.size, 0, 0)
        self.merge_stats.direct_io_bytes = sum(
            r.storage_data.direct_io_bytes for rs in results for r in rs
        )
        if fsio.is_local(self.fs):
            fsio.fsync_dir(self.root)


def _create_with_header(path: str, header: bytes, size: int) -> None:
    """Create (or reuse) a file at exactly ``size`` bytes with ``header`` at its start, durably."""
    fd = fsio.open_rw(path, create=True)
    try:
        os.ftruncate(fd, size)
        fsio.pwrite_all(fd, memoryview(header), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
