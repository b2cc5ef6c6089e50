"""FP8 block-wise export during a save, planned: which tensors are quantized, the
``weight_scale_inv`` items each rank writes, and the amax agreement of blocks that shards cut.

Each rank quantizes its own shard of a weight. A 128 x 128 block wholly inside the shard has its
amax there; a block cut by a shard boundary has a part on each of the ranks holding it. Those
parts travel in the local plans DCP gathers anyway (``SavePlan.planner_data``: a few floats per
cut block, the blocks along the shard edges), the coordinator keeps each block's largest
(``agree``) and hands every rank back the blocks it sent, so every rank quantizes with the
whole block's amax and the files hold the bits of one process quantizing the whole tensor
(``format/quantized.fp8_block_quantize``). The scales of a block are written by the rank whose
shard holds its first element (``scale_item``): the scales' chunks tile ``weight_scale_inv``.
Pure: plans in, plans out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..format.quantized import fp8_block_amax, fp8_block_quantize_with, fp8_scale_inv

__all__ = [
    "CONFIG_KEY",
    "EXPORT_KEYS",
    "PARTS_KEY",
    "Fp8Export",
    "QuantizeFilter",
    "agree",
    "as_fp8",
    "cut_blocks",
    "default_filter",
    "export_config",
    "quantization_config",
    "scale_item",
    "scale_region",
]

# ``SavePlan.planner_data`` keys of the export: each rank's cut blocks' parts going up (agreed
# amaxes coming back down), and the ``quantization_config`` the coordinator's writer puts into
# ``config.json``.
PARTS_KEY = "hf_dcp_storage.fp8_parts"
CONFIG_KEY = "hf_dcp_storage.quantization_config"
EXPORT_KEYS = frozenset((PARTS_KEY, CONFIG_KEY))

QuantizeFilter = Callable[[str, Sequence[int]], bool]
# What DeepSeek-V3's FP8 checkpoints keep in bf16: embeddings, norms, the MoE router (``gate``),
# the output head.
_KEEP = re.compile(r"(embed|norm|lm_head|router|(^|\.)gate\.weight$)")


def default_filter(key: str, shape: Sequence[int]) -> bool:
    """Quantize 2-D ``*.weight`` tensors (the linear layers), not embeddings, norms, the router
    (``gate``) or ``lm_head``."""
    return key.endswith(".weight") and len(shape) == 2 and not _KEEP.search(key)


def quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    """The ``quantization_config`` DeepSeek-V3's ``config.json`` has, and transformers' and
    vLLM's FP8 loaders read."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


def export_config(plans: Sequence[Any]) -> dict[str, Any] | None:
    """(coordinator's writer) The ``quantization_config`` the planner put into the global plans
    (``HFSavePlanner(quantize=...)``), or ``None``."""
    for plan in plans:
        data = plan.planner_data
        if isinstance(data, dict) and data.get(CONFIG_KEY) is not None:
            return dict(data[CONFIG_KEY])
    return None


def scale_region(
    offsets: Sequence[int], sizes: Sequence[int], block: tuple[int, int]
) -> tuple[list[int], list[int]]:
    """The blocks whose first element lies in the chunk at ``offsets`` of ``sizes``, as a region
    of ``weight_scale_inv`` (``(offsets, sizes)``; empty where it holds no block's first
    element). Chunks that tile the weight give regions that tile its scales."""
    first = [-(-o // b) for o, b in zip(offsets, block, strict=True)]
    end = [-(-(o + n) // b) for o, n, b in zip(offsets, sizes, block, strict=True)]
    return first, [max(0, e - f) for f, e in zip(first, end, strict=True)]


def scale_item(item: WriteItem, key: str, block: tuple[int, int]) -> WriteItem | None:
    """The ``weight_scale_inv`` write item (float32, named ``key``) for the weight chunk of
    ``item``, or ``None`` where the chunk holds no block's first element."""
    td = item.tensor_data
    assert td is not None
    offsets, sizes = scale_region(td.chunk.offsets, td.chunk.sizes, block)
    if not math.prod(sizes):
        return None
    size = torch.Size(-(-n // b) for n, b in zip(td.size, block, strict=True))
    return WriteItem(
        index=MetadataIndex(key, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=torch.float32),
            size=size,
        ),
    )


def as_fp8(item: WriteItem) -> WriteItem:
    """``item`` saved as ``float8_e4m3fn``."""
    td = item.tensor_data
    assert td is not None
    props = dataclasses.replace(td.properties, dtype=torch.float8_e4m3fn)
    return dataclasses.replace(item, tensor_data=dataclasses.replace(td, properties=props))


def cut_blocks(
    offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int], block: tuple[int, int]
) -> list[tuple[int, int]]:
    """The blocks (global block row, column) the chunk touches but does not wholly hold."""
    per_dim = []
    for o, n, full, b in zip(offsets, sizes, shape, block, strict=True):
        first, last = o // b, (o + max(n, 1) - 1) // b
        inside = {
            i for i in range(first, last + 1) if i * b >= o and min((i + 1) * b, full) <= o + n
        }
        per_dim.append((range(first, last + 1), inside))
    (rows, rows_in), (cols, cols_in) = per_dim
    return [(i, j) for i in rows for j in cols if i not in rows_in or j not in cols_in]


Parts = dict[str, list[tuple[int, int, float]]]  # key -> (block row, block column, amax)


def agree(parts: Sequence[Parts | None]) -> list[Parts]:
    """(coordinator) Each rank's ``parts`` with every block's amax replaced by the largest any
    rank sent for it."""
    best: dict[tuple[str, int, int], float] = {}
    for rank_parts in parts:
        for key, blocks in (rank_parts or {}).items():
            for i, j, value in blocks:
                at = (key, i, j)
                # NaN wins (max() would keep whichever came first): a NaN weight is not hidden.
                if at not in best or value > best[at] or math.isnan(value):
                    best[at] = value
    return [
        {key: [(i, j, best[(key, i, j)]) for i, j, _ in blocks] for key, blocks in p.items()}
        if p
        else {}
        for p in parts
    ]


class Fp8Export:
    """One rank's side of an FP8 block-wise export (``HFSavePlanner(quantize="fp8_block")``):
    in ``local`` (``create_local_plan``) the rank picks the weights to quantize, computes their
    blocks' amax over its shards, and plans the FP8 weights and their scales; ``agreed``
    (``finish_plan``) takes the coordinator's amax of the blocks its shards cut; ``resolve``
    (``resolve_data``) gives an item's bytes: the shard quantized, or its scales."""

    def __init__(self, block: tuple[int, int], keep: QuantizeFilter) -> None:
        self.block, self.keep = block, keep
        # (weight key, chunk offsets) -> its blocks' amax (those its chunk touches), and where
        # the first of them is (global block row, column).
        self._amax: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, int]]] = {}
        self._chunks: dict[str, list[tuple[torch.Tensor, tuple[int, int]]]] = {}  # by key
        self._scales: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]] = {}

    def local(
        self, items: Sequence[WriteItem], chunk_of: Callable[[WriteItem], Any]
    ) -> tuple[list[WriteItem], Parts]:
        """The plan's items with the chosen weights as FP8 and their scales added, and the
        parts of the blocks this rank's chunks cut (for ``agree``). ``chunk_of(item)``: the
        item's tensor data as the state dict holds it.

        Raises:
            ValueError: a weight to quantize whose scales' key the state dict already has.
        """
        keys = {item.index.fqn for item in items}
        out: list[WriteItem] = []
        parts: Parts = {}
        for item in items:
            td = item.tensor_data
            key = item.index.fqn
            if td is None or not self._quantizes(key, td):
                out.append(item)
                continue
            scale_key = key + "_scale_inv"
            if scale_key in keys:
                raise ValueError(
                    f"quantize='fp8_block' would write {scale_key!r} for {key!r}, but the state "
                    "dict has that key already: drop it, or keep the weight out with "
                    "quantize_filter"
                )
            offsets, sizes = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
            amax = fp8_block_amax(chunk_of(item), offsets, self.block)
            first = (offsets[0] // self.block[0], offsets[1] // self.block[1])
            self._amax[(key, offsets)] = (amax, first)
            self._chunks.setdefault(key, []).append((amax, first))
            for i, j in cut_blocks(offsets, sizes, td.size, self.block):
                value = float(amax[i - first[0], j - first[1]])
                parts.setdefault(key, []).append((i, j, value))
            out.append(as_fp8(item))
            scales = scale_item(item, scale_key, self.block)
            if scales is not None:
                out.append(scales)
                self._scales[(scale_key, tuple(scales.index.offset or ()))] = (key, offsets)
        return out, parts

    def _quantizes(self, key: str, td: TensorWriteData) -> bool:
        dtype = td.properties.dtype
        floating = dtype.is_floating_point and dtype.itemsize > 1  # not FP8 already
        return floating and len(td.size) == 2 and self.keep(key, tuple(td.size))

    def agreed(self, parts: Parts | None) -> None:
        """Take each cut block's agreed amax (the coordinator's ``agree``)."""
        for key, blocks in (parts or {}).items():
            for i, j, value in blocks:
                for amax, (f0, f1) in self._chunks.get(key, ()):
                    if 0 <= i - f0 < amax.shape[0] and 0 <= j - f1 < amax.shape[1]:
                        amax[i - f0, j - f1] = value

    def resolve(self, item: WriteItem, chunk_of: Callable[[WriteItem], Any]) -> torch.Tensor | None:
        """The bytes of ``item`` where the export makes them (an FP8 shard, or scales), else
        ``None``."""
        td = item.tensor_data
        if td is None:
            return None
        at = (item.index.fqn, tuple(td.chunk.offsets))
        if at in self._amax:
            amax, _ = self._amax[at]
            return fp8_block_quantize_with(chunk_of(item), amax, at[1], self.block)
        if at in self._scales:
            amax, first = self._amax[self._scales[at]]
            (s0, s1), (n0, n1) = td.chunk.offsets, td.chunk.sizes
            rows, cols = (
                slice(s0 - first[0], s0 - first[0] + n0),
                slice(s1 - first[1], s1 - first[1] + n1),
            )
            return fp8_scale_inv(amax[rows, cols])
        return None
