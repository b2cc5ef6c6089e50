"""A write item's bytes, slab by slab, in the dtype it is saved in: what every store writes; how
many they are, and a rank's items of a file in output order.

A CPU tensor already in that dtype is read in place; any other (on an accelerator, or cast) goes
through reusable host buffers (``io/hostbuf.py``), copied a slab ahead on CUDA, or, where the
store says where a slab's bytes go (``place``: a direct write's aligned buffer), straight there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from ..format.geometry import chunk_runs, element_size
from .hostbuf import HostBuffers, copy_into, to_host
from .slabs import as_bytes, slab_bounds, sub_chunk

__all__ = ["ItemSlabs", "Place", "chunk_bytes", "in_write_order", "item_slabs", "tensor_bytes"]

# ``place(tensor byte offset, nbytes)``: where a slab that is one run of the tensor's bytes is to
# be copied (host memory of exactly ``nbytes``), or ``None``: into a host buffer of the writer's.
Place = Callable[[int, int], "memoryview | None"]


class ItemSlabs:
    """An iterator of a write item's ``(runs, bytes)`` slabs (``item_slabs``) that tells how long
    they stay valid: with ``in_place``, each is a view of the tensor itself (a contiguous CPU
    tensor already in the saved dtype), valid as long as the tensor is unchanged, which DCP
    guarantees until the save's ``write_data`` returns; else each is a copy in a reusable
    buffer, valid until the next slab is asked for."""

    def __init__(
        self, in_place: bool, slabs: Iterator[tuple[Iterable[tuple[int, int, int]], memoryview]]
    ) -> None:
        self.in_place = in_place
        self._slabs = slabs

    def __iter__(self) -> ItemSlabs:
        return self

    def __next__(self) -> tuple[Iterable[tuple[int, int, int]], memoryview]:
        return next(self._slabs)


def item_slabs(
    item: WriteItem,
    planner: SavePlanner,
    host: Callable[[torch.Tensor], HostBuffers],
    place: Place | None = None,
) -> ItemSlabs:
    """``(runs, bytes)`` per slab of a write item, cast to the planned dtype (bounded memory).

    A CPU tensor already in the planned dtype is read in place (``ItemSlabs.in_place``); any
    other (on an accelerator, or cast) is copied into ``place``'s memory where it gives some
    (the slab one run), else through ``host(tensor)``'s reusable buffers, copied a slab ahead on
    CUDA. Each slab's bytes are valid until the next slab is asked for (placed ones: until the
    store wrote them; in place ones: as long as the tensor)."""
    tensor = planner.resolve_data(item)
    dtype = item.tensor_data.properties.dtype if item.tensor_data is not None else None
    in_place = (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and tensor.dtype == dtype
        and tensor.is_contiguous()
    )
    return ItemSlabs(in_place, _slabs(item, tensor, in_place, host, place))


def _slabs(
    item: WriteItem,
    tensor: object,
    in_place: bool,
    host: Callable[[torch.Tensor], HostBuffers],
    place: Place | None,
) -> Iterator[tuple[Iterable[tuple[int, int, int]], memoryview]]:
    """``item_slabs``' slabs of ``tensor`` (what the planner resolved ``item`` to; ``in_place``:
    read as it is)."""
    td = item.tensor_data
    assert td is not None
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"planner resolved {item.index.fqn!r} to {type(tensor).__name__}, expected a tensor"
        )
    sizes = tuple(td.chunk.sizes)
    if tuple(tensor.shape) != sizes:
        raise RuntimeError(
            f"{item.index.fqn!r}: planned chunk {list(sizes)} "
            f"but the data has shape {list(tensor.shape)}"
        )
    dtype = td.properties.dtype
    itemsize = element_size(dtype)
    bounds = list(slab_bounds(sizes, max(itemsize, tensor.element_size())))
    runs = [
        chunk_runs(td.size, *sub_chunk(td.chunk.offsets, sizes, r0, r1), itemsize)
        for r0, r1 in bounds
    ]
    if in_place:
        for (r0, r1), slab_runs in zip(bounds, runs, strict=True):
            yield slab_runs, as_bytes(tensor[r0:r1] if sizes else tensor)
        return
    parts = [tensor[r0:r1] if sizes else tensor for r0, r1 in bounds]  # views, no copy
    if place is not None:
        yield from _placed_slabs(tensor, parts, runs, dtype, host, place)
        return
    depth = (
        2 if tensor.device.type == "cuda" else 1
    )  # CPU copies are synchronous: nothing to overlap
    for slab_runs, data in zip(runs, to_host(parts, dtype, host(tensor), depth), strict=True):
        yield slab_runs, as_bytes(data)


def _placed_slabs(
    tensor: torch.Tensor,
    parts: list[torch.Tensor],
    runs: Sequence[Iterable[tuple[int, int, int]]],
    dtype: torch.dtype,
    host: Callable[[torch.Tensor], HostBuffers],
    place: Place,
) -> Iterable[tuple[Iterable[tuple[int, int, int]], memoryview]]:
    """Each slab (``parts``, of ``tensor``) copied where ``place`` says (one copy, not two), or,
    where it gives nothing, through a host buffer (asked of ``host`` only then). A slab at a
    time: the store writes one before the next is placed."""
    for part, planned in zip(parts, runs, strict=True):
        slab_runs = list(planned)
        dest = place(slab_runs[0][0], slab_runs[0][2]) if len(slab_runs) == 1 else None
        if dest is not None:
            copy_into(part, dtype, dest)
            yield slab_runs, dest
            continue
        for data in to_host([part], dtype, host(tensor), 1):
            yield slab_runs, as_bytes(data)


def in_write_order(
    items: Iterable[WriteItem], tensor_start: Callable[[WriteItem], int]
) -> list[WriteItem]:
    """A rank's items of one file in output order (by the chunk's first byte: for chunks of one
    tensor, the order of their offsets), the order it stages them in; ``plan/placed.py`` sorts
    alike."""
    return sorted(items, key=lambda it: (tensor_start(it), tuple(it.tensor_data.chunk.offsets)))  # type: ignore[union-attr]


def tensor_bytes(item: WriteItem) -> int:
    """Bytes of the whole tensor (not the chunk) in the saved dtype."""
    td = item.tensor_data
    assert td is not None
    return math.prod(td.size) * element_size(td.properties.dtype)


def chunk_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    return math.prod(td.chunk.sizes) * element_size(td.properties.dtype)
