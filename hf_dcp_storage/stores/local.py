"""Local disk (and NFS): every rank writes its bytes straight into the final files with positioned
writes, so nothing is left to consolidate.

The coordinator creates every file at its final size with its header (``prepare``); each rank
``pwrite``s its byte runs where they belong, starts their writeback slab by slab, and fsyncs
before it reports; the coordinator's ``complete`` only makes the folder's entries durable.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..format.crc import CrcAccumulator
from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.layout import Layout
from ..plan.rankplan import Finished, RankPlan, Written
from .base import Slabs, Store, tensor_bytes

__all__ = ["LocalStore"]


class LocalStore(Store):
    """Positioned writes into the final files (``direct`` saves). Also finishes an interrupted
    direct save copied elsewhere, where ``complete`` has nothing to do but the index."""

    mode = "direct"
    needs_placement = False

    def _make_files(self, layout: Layout) -> None:
        for f in layout.files:
            _create_with_header(fsio.join(self.root, f.name), f.header, f.size)

    def write(self, items: list[WriteItem], rank_plan: RankPlan, slabs: Slabs) -> list[WriteResult]:
        fds: dict[int, int] = {}
        lock = threading.Lock()

        def fd_for(file: int) -> int:
            with lock:
                if file not in fds:
                    fds[file] = fsio.open_rw(fsio.join(self.root, rank_plan.files[file]), create=False)
                return fds[file]

        def write_item(item: WriteItem) -> WriteResult:
            place = rank_plan.placements[item.index]
            fd = fd_for(place.file)
            nbytes = 0
            crc = CrcAccumulator()
            for runs, data in slabs(item):
                first = last = None
                for tensor_off, chunk_off, n in runs:
                    run = data[chunk_off : chunk_off + n]
                    fsio.pwrite_all(fd, run, place.tensor_start + tensor_off)
                    crc.update(tensor_off, run)  # while the run is still in cache
                    first = tensor_off if first is None else first
                    last = tensor_off + n
                if first is not None:
                    fsio.start_writeback(fd, place.tensor_start + first, last - first)
                nbytes += len(data)
            return WriteResult(item.index, nbytes, Written(place.file, None, crc.contribution(tensor_bytes(item))))

        try:
            results = parallel_map(write_item, items, self.threads)
            # Durable before we report success: the coordinator commits on our word.
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return results

    def complete(self, layout: Layout, results: list[list[WriteResult]], finished: Mapping[int, Finished]) -> None:
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
