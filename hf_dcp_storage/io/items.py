"""A write item's bytes, slab by slab, in the dtype it is saved in: what every store writes.

A CPU tensor already in that dtype is read in place; any other (on an accelerator, or cast) goes
through reusable host buffers (``io/hostbuf.py``), copied a slab ahead on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from ..plan.layout import chunk_runs, element_size
from .hostbuf import HostBuffers, to_host
from .slabs import as_bytes, slab_bounds, sub_chunk

__all__ = ["item_slabs"]


def item_slabs(item: WriteItem, planner: SavePlanner, host: Callable[[torch.Tensor], HostBuffers]) -> Iterable[tuple[Iterable[tuple[int, int, int]], memoryview]]:
    """``(runs, bytes)`` per slab of a write item, cast to the planned dtype (bounded memory).

    A CPU tensor already in the planned dtype is read in place; any other (on an accelerator,
    or cast) goes through ``host(tensor)``'s reusable buffers, copied a slab ahead on CUDA.
    Each slab's bytes are valid until the next slab is asked for."""
    td = item.tensor_data
    assert td is not None
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"planner resolved {item.index.fqn!r} to {type(tensor).__name__}, expected a tensor")
    sizes = tuple(td.chunk.sizes)
    if tuple(tensor.shape) != sizes:
        raise RuntimeError(f"{item.index.fqn!r}: planned chunk {list(sizes)} but the data has shape {list(tensor.shape)}")
    dtype = td.properties.dtype
    itemsize = element_size(dtype)
    bounds = list(slab_bounds(sizes, max(itemsize, tensor.element_size())))
    runs = [chunk_runs(td.size, *sub_chunk(td.chunk.offsets, sizes, r0, r1), itemsize) for r0, r1 in bounds]
    if tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous():
        for (r0, r1), slab_runs in zip(bounds, runs, strict=True):
            yield slab_runs, as_bytes(tensor[r0:r1] if sizes else tensor)
        return
    parts = (tensor[r0:r1] if sizes else tensor for r0, r1 in bounds)
    depth = 2 if tensor.device.type == "cuda" else 1  # CPU copies are synchronous: nothing to overlap
    for slab_runs, data in zip(runs, to_host(parts, dtype, host(tensor), depth), strict=True):
        yield slab_runs, as_bytes(data)
