"""Synthetic DCP plans of Llama models over large meshes, built from shapes alone. Pure.

No tensor is materialised and no process group exists: each rank's ``SavePlan`` is built the way
``DefaultSavePlanner`` builds it from DTensor local shards (one ``WriteItem`` per state-dict key,
``WriteItemType.SHARD``, the chunk of the rank's local shard, fresh objects per item as DCP makes
them), so that the coordinator's planning can be measured for 8,192 ranks on one machine.
``tests/test_scale.py`` checks the plans against ``DefaultSavePlanner`` on real DTensors.

Sharding follows DTensor (``Shard.local_shard_size_and_offset``, torch 2.13): a dimension of
``n`` elements over ``k`` shards gives every shard ``ceil(n / k)`` elements, the last non-empty
one the remainder, and the trailing shards none; an empty shard reports its offset as ``n``
(so DCP's dedup keeps one of the identical empty chunks and drops the rest).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

__all__ = [
    "DEEPSEEK",
    "LLAMA",
    "DeepSeekConfig",
    "ExpertParallel",
    "LlamaConfig",
    "Mesh",
    "ShapeOnlyShard",
    "count_runs",
    "deepseek_shapes",
    "llama_shapes",
    "local_chunk",
    "placements_for",
    "rank_load_state_dict",
    "rank_save_plan",
    "shard_range",
]

Shape = tuple[int, ...]
# Per mesh dimension: the tensor dimension it shards (``Shard(d)``), or ``None`` (``Replicate()``).
Placements = tuple[int | None, ...]


@dataclass(frozen=True)
class LlamaConfig:
    """The widths that fix a Llama checkpoint's tensor shapes (GQA: ``kv_dim`` = kv heads x head
    dim)."""

    layers: int
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape in llama_shapes(self))


# Llama 3.1 8B / 70B / 405B (8 kv heads of 128), and an uneven toy for tests.
LLAMA: dict[str, LlamaConfig] = {
    "8B": LlamaConfig(layers=32, hidden=4096, intermediate=14336, kv_dim=8 * 128, vocab=128256),
    "70B": LlamaConfig(layers=80, hidden=8192, intermediate=28672, kv_dim=8 * 128, vocab=128256),
    "405B": LlamaConfig(layers=126, hidden=16384, intermediate=53248, kv_dim=8 * 128, vocab=128256),
}


def llama_shapes(cfg: LlamaConfig) -> list[tuple[str, Shape]]:
    """``(HF key, global shape)`` in ``LlamaForCausalLM.state_dict()`` order."""
    h, i, kv = cfg.hidden, cfg.intermediate, cfg.kv_dim
    shapes: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (cfg.vocab, h))]
    for layer in range(cfg.layers):
        p = f"model.layers.{layer}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab, h))]
    return shapes


@dataclass(frozen=True)
class DeepSeekConfig:
    """The widths of a DeepSeek-V3-like checkpoint in HF keys: MLA attention, ``dense`` leading
    layers with a plain MLP, the rest MoE (``experts`` routed experts, one shared)."""

    layers: int = 61
    dense: int = 3
    hidden: int = 7168
    intermediate: int = 18432
    moe_intermediate: int = 2048
    experts: int = 256
    vocab: int = 129280
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape in deepseek_shapes(self))


# DeepSeek-V3 / R1's shapes (671B parameters; 45,459 tensors unquantized).
DEEPSEEK: dict[str, DeepSeekConfig] = {"DSV3": DeepSeekConfig()}


def deepseek_shapes(cfg: DeepSeekConfig) -> list[tuple[str, Shape]]:
    """``(HF key, global shape)`` of a DeepSeek-V3-like model, in ``state_dict()`` order."""
    h, qk = cfg.hidden, cfg.qk_nope + cfg.qk_rope
    shapes: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (cfg.vocab, h))]

    def mlp(prefix: str, width: int) -> list[tuple[str, Shape]]:
        return [
            (prefix + "gate_proj.weight", (width, h)),
            (prefix + "up_proj.weight", (width, h)),
            (prefix + "down_proj.weight", (h, width)),
        ]

    for layer in range(cfg.layers):
        p = f"model.layers.{layer}."
        shapes += [
            (p + "self_attn.q_a_proj.weight", (cfg.q_lora, h)),
            (p + "self_attn.q_a_layernorm.weight", (cfg.q_lora,)),
            (p + "self_attn.q_b_proj.weight", (cfg.heads * qk, cfg.q_lora)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_lora + cfg.qk_rope, h)),
            (p + "self_attn.kv_a_layernorm.weight", (cfg.kv_lora,)),
            (
                p + "self_attn.kv_b_proj.weight",
                (cfg.heads * (cfg.qk_nope + cfg.v_head), cfg.kv_lora),
            ),
            (p + "self_attn.o_proj.weight", (h, cfg.heads * cfg.v_head)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if layer < cfg.dense:
            shapes += mlp(p + "mlp.", cfg.intermediate)
            continue
        shapes += [
            (p + "mlp.gate.weight", (cfg.experts, h)),
            (p + "mlp.gate.e_score_correction_bias", (cfg.experts,)),
        ]
        for e in range(cfg.experts):
            shapes += mlp(f"{p}mlp.experts.{e}.", cfg.moe_intermediate)
        shapes += mlp(p + "mlp.shared_experts.", cfg.moe_intermediate)
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab, h))]
    return shapes


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism over ``world`` ranks in ``ep`` contiguous groups: routed expert ``e``'s
    tensors (keys ``...mlp.experts.{e}.``) live on group ``e // (experts // ep)`` alone,
    ``Shard(0)`` over its ranks (FSDP within the group); every other key is ``Shard(0)`` over
    all ranks. What a rank outside the group holds of an expert: nothing (no item)."""

    world: int
    ep: int
    experts: int

    def holders(self, key: str) -> tuple[int, int] | None:
        """``(first rank, ranks)`` of the group holding expert key ``key``; ``None`` for a key
        that is no routed expert's."""
        marker = ".mlp.experts."
        at = key.find(marker)
        if at < 0:
            return None
        expert = int(key[at + len(marker) :].split(".", 1)[0])
        size = self.world // self.ep
        return expert // (self.experts // self.ep) * size, size


def _chunk(
    key: str, shape: Shape, mesh: Mesh, rank: int, ep: ExpertParallel | None
) -> tuple[Shape, Shape] | None:
    """``(offsets, sizes)`` of ``rank``'s local shard of ``key``, or ``None`` where it holds none
    (an expert of another group)."""
    group = ep.holders(key) if ep is not None else None
    if group is None:
        return local_chunk(shape, mesh, placements_for(shape, mesh), rank)
    first, size = group
    if not first <= rank < first + size:
        return None
    return local_chunk(shape, Mesh(size), (0,), rank - first)


@dataclass(frozen=True)
class Mesh:
    """A row-major device mesh ``(dp, tp)``: rank ``r`` sits at ``(r // tp, r % tp)``.

    ``tp == 1`` is plain FSDP: a 1-D mesh of ``dp`` ranks.
    """

    dp: int
    tp: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(
                f"mesh ({self.dp}, {self.tp}) must have at least one rank on each dimension"
            )

    @property
    def size(self) -> int:
        return self.dp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.dp,) if self.tp == 1 else (self.dp, self.tp)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return (rank,) if self.tp == 1 else (rank // self.tp, rank % self.tp)

    @classmethod
    def of(cls, world: int, tp: int) -> Mesh:
        """The mesh of ``world`` ranks with ``tp``-way tensor parallelism."""
        if world % tp:
            raise ValueError(
                f"{world} ranks do not split into tensor-parallel groups of {tp}; pick a multiple "
                f"of {tp}"
            )
        return cls(world // tp, tp)


def shard_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of shard ``index`` of a dimension of ``size`` over ``num_chunks``,
    as DTensor ``Shard`` computes it: ``torch.chunk`` sizes, an empty shard at offset ``size``."""
    step = -(-size // num_chunks)
    start = step * index
    length = max(0, min(size, start + step) - start)
    return (start, length) if length else (size, 0)


def placements_for(shape: Shape, mesh: Mesh) -> Placements:
    """FSDP (``Shard(0)``), or FSDP x TP: matrices ``(Shard(0), Shard(1))``, vectors
    ``(Shard(0), Replicate())`` (replicated across the TP group, so DCP dedups them)."""
    if mesh.tp == 1:
        return (0,)
    return (0, 1) if len(shape) >= 2 else (0, None)


def local_chunk(shape: Shape, mesh: Mesh, placements: Placements, rank: int) -> tuple[Shape, Shape]:
    """``(offsets, sizes)`` of ``rank``'s local shard of a tensor of global ``shape``.

    Raises:
        ValueError: two mesh dimensions shard one tensor dimension (``_StridedShard``, not
        modelled).
    """
    sharded = [d for d in placements if d is not None]
    if len(set(sharded)) != len(sharded):
        raise ValueError(
            f"placements {placements} shard one tensor dimension twice; only distinct dimensions "
            "are modelled"
        )
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, coord in enumerate(mesh.coordinate(rank)):
        d = placements[mesh_dim]
        if d is not None:
            offsets[d], sizes[d] = shard_range(shape[d], mesh.shape[mesh_dim], coord)
    return tuple(offsets), tuple(sizes)


# torch 2.15 added ``strides`` to TensorProperties; DCP fills it from the rank's local tensor
# (``DTensor.to_local()``: a contiguous shard), so a synthetic plan does too where the field exists.
_HAS_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}


def _contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """``torch.empty(sizes).stride()`` without a tensor (an empty dimension counts as 1)."""
    out, step = [], 1
    for n in reversed(sizes):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _properties(dtype: torch.dtype, sizes: Sequence[int]) -> TensorProperties:
    return (
        TensorProperties(dtype=dtype, strides=_contiguous_strides(sizes))
        if _HAS_STRIDES
        else TensorProperties(dtype=dtype)
    )


def rank_save_plan(
    shapes: Sequence[tuple[str, Shape]],
    mesh: Mesh,
    rank: int,
    dtype: torch.dtype = torch.bfloat16,
    ep: ExpertParallel | None = None,
) -> SavePlan:
    """The ``SavePlan`` ``DefaultSavePlanner.create_local_plan`` makes on ``rank`` for a flat
    state dict of DTensors of these shapes: one SHARD item per key it holds (``ep``: experts on
    their group's ranks only), and ``planner_data`` the flattening map ``{key: (key,)}``. Every
    item gets its own objects, as DCP builds them, so that a pickled plan has the size of a real
    one."""
    items = []
    held = []
    for key, shape in shapes:
        chunk = _chunk(key, shape, mesh, rank, ep)
        if chunk is None:
            continue
        offsets, sizes = chunk
        held.append(key)
        items.append(
            WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(offsets), sizes=torch.Size(sizes)
                    ),
                    properties=_properties(dtype, sizes),
                    size=torch.Size(shape),
                ),
            )
        )
    return SavePlan(items, planner_data={key: (key,) for key in held})


def count_runs(shapes: Sequence[tuple[str, Shape]], mesh: Mesh) -> int:
    """Contiguous byte runs of all distinct non-empty chunks in their files, as
    ``format.geometry.chunk_runs`` cuts them (a row shard is one run, a column shard one run
    per row); replicated and empty chunks count once, as DCP's dedup keeps one copy. Closed form,
    no plans."""
    total = 0
    for _, shape in shapes:
        pieces = _pieces_per_dim(shape, mesh)  # non-empty shard lengths of each tensor dimension
        if not shape:
            total += 1
            continue
        k = len(shape) - 1
        while k > 0 and pieces[k] == [shape[k]]:
            k -= 1
        total += math.prod(sum(p) for p in pieces[:k]) * math.prod(len(p) for p in pieces[k:])
    return total


def _pieces_per_dim(shape: Shape, mesh: Mesh) -> list[list[int]]:
    pieces = [[n] for n in shape]
    for mesh_dim, d in enumerate(placements_for(shape, mesh)):
        if d is not None:
            k = mesh.shape[mesh_dim]
            pieces[d] = [n for n in (shard_range(shape[d], k, c)[1] for c in range(k)) if n]
    return pieces


class ShapeOnlyShard:
    """A destination tensor for DCP's load planning without data: its global ``size()`` and its
    local chunk through ``__create_chunk_list__``, the hook DTensor implements for DCP."""

    def __init__(self, shape: Shape, offsets: Shape, sizes: Shape) -> None:
        self._shape = torch.Size(shape)
        self._chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def size(self) -> torch.Size:
        return self._shape

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]


def rank_load_state_dict(
    shapes: Sequence[tuple[str, Shape]], mesh: Mesh, rank: int, ep: ExpertParallel | None = None
) -> dict[str, ShapeOnlyShard]:
    """``rank``'s destination state dict for a load onto ``mesh``: one shape-only shard per key
    it holds (``ep``: experts on their group's ranks only)."""
    out = {}
    for key, shape in shapes:
        chunk = _chunk(key, shape, mesh, rank, ep)
        if chunk is not None:
            out[key] = ShapeOnlyShard(shape, *chunk)
    return out
