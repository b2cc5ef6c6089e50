"""The compact form of a save plan (``plan/compact.py`` says why): each rank's chunks as one
integer array and a key table (:class:`LocalChunks`, :func:`encode_local`), and every rank's
joined on the coordinator (:class:`GlobalChunks`, :func:`gather`). Pure.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.planner import WriteItem

from ..format.header import NAME_TO_DTYPE, dtype_name
from .layout import TensorSpec

__all__ = ["GlobalChunks", "LocalChunks", "chunk_bytes", "describe_row", "encode_local", "gather"]


@dataclass(frozen=True)
class LocalChunks:
    """``SavePlan.storage_data`` of a rank's local plan: its chunks, one row per write item in
    plan order, instead of the items themselves.

    ``table`` is zlib-compressed JSON ``[[key, dtype name, shape], ...]`` in the order the rank
    first meets each key; ranks holding the same keys send byte-identical tables, so the
    coordinator decodes each distinct table once. ``rows`` is ``int64 [items, 1 + 2 * ndim]``:
    table row, then the chunk's offsets and sizes, zero-padded to the rank's largest ``ndim``
    (``int32`` when every value fits).
    """

    table: bytes
    rows: np.ndarray


def encode_local(items: Sequence[WriteItem]) -> LocalChunks:
    """(each rank) The compact form of this rank's tensor write items, in their order.

    Raises:
        ValueError: an item without tensor data, an unsupported dtype, or one key with two
            dtypes or shapes on this rank.
    """
    index: dict[str, int] = {}
    table: list[tuple[str, str, tuple[int, ...]]] = []
    ndim = max(
        (len(item.tensor_data.size) for item in items if item.tensor_data is not None), default=0
    )
    pad = [0] * ndim
    flat: list[int] = []  # rows built as one Python list: numpy element writes cost ~1 µs each
    for item in items:
        td = item.tensor_data
        if td is None:
            raise ValueError(
                f"{item.index.fqn!r} is not a tensor; only tensors can be planned as chunks"
            )
        key, shape = item.index.fqn, tuple(td.size)
        row = index.get(key)
        if row is None:
            row = index[key] = len(table)
            table.append((key, dtype_name(td.properties.dtype, key=key), shape))
        elif table[row][2] != shape or NAME_TO_DTYPE[table[row][1]] != td.properties.dtype:
            raise ValueError(
                f"key {key!r} is planned as {table[row][1:]} and as "
                f"{(td.properties.dtype, shape)} on one rank"
            )
        gap = pad[len(shape) :]
        flat.append(row)
        flat.extend(td.chunk.offsets)
        flat.extend(gap)
        flat.extend(td.chunk.sizes)
        flat.extend(gap)
    rows = np.array(flat, dtype=np.int64).reshape(len(items), 1 + 2 * ndim)
    raw = json.dumps([[k, d, list(s)] for k, d, s in table], separators=(",", ":")).encode()
    if not len(rows) or (rows.max() < 2**31 and rows.min() >= -(2**31)):
        rows = rows.astype(np.int32)  # half the bytes gathered; dims beyond 2**31 stay int64
    return LocalChunks(zlib.compress(raw, 1), rows)


@dataclass
class GlobalChunks:
    """Every rank's chunks on the coordinator, one row per chunk, ranks in order.

    ``key`` indexes ``specs``; ``offsets``/``sizes`` are padded with zeros past each key's ndim.
    Rank ``r``'s chunks are rows ``rank_start[r]:rank_start[r + 1]``, in its plan's order.
    ``rank`` and ``key`` are int32, and so are ``offsets``/``sizes`` when every chunk ends
    below 2**31 (ten million rows at 405B over 8,192 ranks: half the coordinator's memory);
    arithmetic that can exceed that (products, byte offsets) is done in int64.
    ``table_keys[t]`` maps the rows of distinct table ``t`` to keys; rank ``r`` sent table
    ``table_of_rank[r]``.
    """

    specs: list[TensorSpec]
    table_keys: list[np.ndarray]
    table_of_rank: np.ndarray
    rank_start: np.ndarray
    rank: np.ndarray
    key: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    @property
    def ndim(self) -> np.ndarray:
        """Each key's number of dimensions."""
        return np.array([len(s.shape) for s in self.specs], dtype=np.int64)

    def shapes(self) -> np.ndarray:
        """Each key's shape, zero-padded to the widest: ``int64 [keys, width]``."""
        shapes = np.zeros((len(self.specs), self.offsets.shape[1]), dtype=np.int64)
        for i, spec in enumerate(self.specs):
            shapes[i, : len(spec.shape)] = spec.shape
        return shapes


def gather(locals_: Sequence[LocalChunks]) -> GlobalChunks:
    """(coordinator) Join every rank's chunks; keys ordered as rank 0 lists them, then keys
    first seen on rank 1, and so on.

    Raises:
        ValueError: a key with a different dtype or global shape on two ranks.
    """
    distinct: dict[bytes, int] = {}
    tables: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = []
    table_of_rank = np.empty(len(locals_), dtype=np.int64)
    for r, local in enumerate(locals_):
        t = distinct.get(local.table)
        if t is None:
            t = distinct[local.table] = len(tables)
            tables.append(
                [
                    (k, NAME_TO_DTYPE[d], tuple(s))
                    for k, d, s in json.loads(zlib.decompress(local.table))
                ]
            )
        table_of_rank[r] = t
    specs: dict[str, TensorSpec] = {}
    for table in tables:
        for name, dtype, shape in table:
            spec = TensorSpec(name, dtype, shape)
            prev = specs.setdefault(name, spec)
            if prev != spec:
                raise ValueError(
                    f"key {name!r} is {prev.dtype}{list(prev.shape)} on one rank and "
                    f"{dtype}{list(shape)} on another; every rank must hold the same global tensor"
                )
    position = {key: i for i, key in enumerate(specs)}
    table_keys = [np.array([position[k] for k, _, _ in table], dtype=np.int64) for table in tables]
    counts = np.array([len(local.rows) for local in locals_], dtype=np.int64)
    rank_start = np.concatenate(([0], np.cumsum(counts)))
    total, width = int(rank_start[-1]), max((len(s.shape) for s in specs.values()), default=0)
    small = all(local.rows.dtype == np.int32 for local in locals_)
    key = np.empty(total, dtype=np.int32)
    offsets = np.zeros((total, width), dtype=np.int32 if small else np.int64)
    sizes = np.zeros((total, width), dtype=np.int32 if small else np.int64)
    for r, local in enumerate(locals_):
        a, b = rank_start[r], rank_start[r + 1]
        if a == b:
            continue
        nd = (local.rows.shape[1] - 1) // 2
        key[a:b] = table_keys[table_of_rank[r]][local.rows[:, 0]]
        offsets[a:b, :nd] = local.rows[:, 1 : 1 + nd]
        sizes[a:b, :nd] = local.rows[:, 1 + nd :]
    # An end past 2**31 (checked after a cheap bound): sums of int32 offsets and sizes would wrap.
    if (
        small
        and total
        and int(offsets.max()) + int(sizes.max()) >= 2**31
        and any(
            int((offsets[:, d].astype(np.int64) + sizes[:, d]).max()) >= 2**31 for d in range(width)
        )
    ):
        offsets, sizes = offsets.astype(np.int64), sizes.astype(np.int64)
    rank = np.repeat(np.arange(len(locals_), dtype=np.int32), counts)
    return GlobalChunks(
        list(specs.values()), table_keys, table_of_rank, rank_start, rank, key, offsets, sizes
    )


def describe_row(g: GlobalChunks, row: int) -> str:
    """Global row ``row`` in words: its rank, key, shape, offsets and sizes (for errors)."""
    spec = g.specs[int(g.key[row])]
    nd = len(spec.shape)
    return (
        f"rank {int(g.rank[row])}'s chunk of {spec.key!r} {list(spec.shape)} at offsets "
        f"{g.offsets[row, :nd].tolist()} with sizes {g.sizes[row, :nd].tolist()}"
    )


def chunk_bytes(g: GlobalChunks, key: np.ndarray, nd: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The bytes of chunks (rows of keys ``key``, their keys' ndim ``nd``, sizes ``sizes``):
    their key's itemsize times the size of each of its real dimensions, a column at a time, in
    int64 (sizes may be int32)."""
    ndim, width = g.ndim, sizes.shape[1]
    itemsize = np.array([spec.dtype.itemsize for spec in g.specs], dtype=np.int64)
    nbytes = itemsize[key]  # a new array: multiplied in place
    for d in range(width):
        nbytes *= sizes[:, d] if d < ndim.min(initial=width) else np.where(nd > d, sizes[:, d], 1)
    return nbytes
