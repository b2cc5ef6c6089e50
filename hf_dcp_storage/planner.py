"""Planners mapping a trainer's state dict onto HF checkpoint keys and dtypes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem
from torch.distributed.tensor import DTensor

from .format.quantscheme import block_size_of
from .plan.fp8export import (
    CONFIG_KEY,
    EXPORT_KEYS,
    PARTS_KEY,
    Fp8Export,
    QuantizeFilter,
    agree,
    default_filter,
    quantization_config,
)

__all__ = ["TIED_EMBEDDINGS", "HFLoadPlanner", "HFSavePlanner", "KeyMapping"]

KeyMapping: TypeAlias = Mapping[str, str] | Callable[[str], str]


def _mapper(key_mapping: KeyMapping | None) -> Callable[[str], str]:
    """A callable FQN -> HF key; a dict renames the keys it lists and keeps the others."""
    if key_mapping is None:
        return lambda fqn: fqn
    if isinstance(key_mapping, Mapping):
        table = dict(key_mapping)
        return lambda fqn: table.get(fqn, fqn)
    if callable(key_mapping):
        return key_mapping
    raise ValueError(
        f"key_mapping must be a dict or a callable FQN -> HF key, got {type(key_mapping).__name__}"
    )


def _map_keys(fqns: list[str], key_mapping: KeyMapping | None) -> dict[str, str]:
    """FQN -> HF key for every FQN; two FQNs landing on one key is an error."""
    fn = _mapper(key_mapping)
    mapped: dict[str, str] = {}
    seen: dict[str, str] = {}
    for fqn in fqns:
        key = fn(fqn)
        if not isinstance(key, str) or not key:
            raise ValueError(f"key_mapping maps {fqn!r} to {key!r}; it must return a non-empty str")
        if key in seen:
            raise ValueError(
                f"key_mapping maps both {seen[key]!r} and {fqn!r} to {key!r}; each HF key must "
                "come from exactly one state-dict key. Fix the mapping (tied weights keep "
                "distinct names)."
            )
        seen[key] = fqn
        mapped[fqn] = key
    return mapped


# ``tied=`` of models whose output head is their input embedding (``tie_word_embeddings``).
TIED_EMBEDDINGS = {"lm_head.weight": "model.embed_tokens.weight"}


def _check_tied(tied: Mapping[str, str] | None) -> dict[str, str]:
    if tied is None:
        return {}
    if not isinstance(tied, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k != v for k, v in tied.items()
    ):
        raise ValueError(
            f"tied={tied!r} must map an HF key to the other HF key it is tied to, e.g. "
            f"{TIED_EMBEDDINGS}"
        )
    return dict(tied)


def _check_same(dropped: str, value: Any, kept: str, other: Any) -> None:
    """(each rank) ``dropped`` may be left out only where ``kept`` holds the same tensor."""
    local = [v._local_tensor if isinstance(v, DTensor) else v for v in (value, other)]
    a, b = local
    same = (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and (
            (a.untyped_storage().data_ptr(), a.storage_offset(), a.stride())
            == (b.untyped_storage().data_ptr(), b.storage_offset(), b.stride())
            or torch.equal(a, b)
        )
    )
    if not same:
        found = "missing" if other is None else "a different tensor"
        raise ValueError(
            f"tied: {dropped!r} is to be saved as {kept!r}, but {kept!r} is {found}; tie them "
            f"in the model, or leave {dropped!r} out of tied"
        )


class HFSavePlanner(DefaultSavePlanner):
    """Save planner that renames keys to HF names and picks the saved dtype.

    Use it with :class:`HFStorageWriter`. Every rank calls it with its own state dict.

    Args:
        key_mapping: a dict (listed keys renamed, others kept) or a callable FQN -> HF key,
            applied to the flattened FQNs. Two FQNs mapping to one key raise ``ValueError``.
        save_dtype: floating-point tensors are stored in this dtype (e.g. ``torch.bfloat16``);
            integer and bool tensors keep theirs. The writer casts slab by slab, so no full
            copy of a tensor is ever made.
        quantize: ``"fp8_block"``: save the chosen weights as DeepSeek-V3's FP8 checkpoints
            hold them (``float8_e4m3fn`` and a float32 ``<key>_scale_inv`` per block), each
            rank quantizing its own shard, the amax of a block that shards cut agreed between
            the ranks holding it: the files equal one process quantizing the whole tensors
            (``format/quantized.fp8_block_quantize``), bit for bit. The writer adds the
            ``quantization_config`` to a ``config.json`` companion (``plan/fp8export.py``).
        quantize_block: rows x columns per scale (an int: square); default 128.
        quantize_filter: ``(HF key, shape) -> bool``, which tensors to quantize; by default 2-D
            ``*.weight`` tensors but embeddings, norms, the router (``gate``) and ``lm_head``
            (``plan/fp8export.default_filter``). Tensors in FP8 already, or not floating, never.
        tied: tied weights saved once, as ``save_pretrained`` saves them: ``{HF key left out:
            HF key kept}`` (``TIED_EMBEDDINGS``: ``lm_head.weight`` is the embedding). A key left
            out must hold the same tensor as its kept key (the same storage, or equal values),
            else the save is refused naming both; load such a folder into both keys with
            ``HFLoadPlanner(tied=...)`` (``from_pretrained`` ties them itself).
        **kwargs: passed to :class:`DefaultSavePlanner`.
    """

    def __init__(
        self,
        key_mapping: KeyMapping | None = None,
        save_dtype: torch.dtype | None = None,
        *,
        quantize: str | None = None,
        quantize_block: int | tuple[int, int] = 128,
        quantize_filter: QuantizeFilter | None = None,
        tied: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _mapper(key_mapping)  # validate the type up front
        self.tied = _check_tied(tied)
        if save_dtype is not None and (
            not isinstance(save_dtype, torch.dtype) or not save_dtype.is_floating_point
        ):
            raise ValueError(
                f"save_dtype={save_dtype!r} must be a floating-point torch.dtype such as "
                "torch.bfloat16"
            )
        if quantize not in (None, "fp8_block"):
            raise ValueError(f"quantize={quantize!r}: the one export is 'fp8_block' (or None)")
        if quantize is not None and kwargs.get("enable_plan_caching"):
            raise ValueError(
                "quantize='fp8_block' agrees block amaxes through every save's plans: it cannot "
                "skip them with enable_plan_caching=True; drop one of the two"
            )
        self.key_mapping = key_mapping
        self.save_dtype = save_dtype
        self.quantize, self.quantize_block = quantize, block_size_of(None, quantize_block)
        self.quantize_filter = quantize_filter or default_filter
        self._export: Fp8Export | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # Renaming the flattened state dict keeps lookups (resolve_data) and plans consistent.
        mapped = _map_keys(list(self.state_dict), self.key_mapping)
        self.state_dict = {mapped[fqn]: value for fqn, value in self.state_dict.items()}
        self.mappings = {mapped[fqn]: self.mappings.get(fqn, (fqn,)) for fqn in mapped}
        for dropped, kept in self.tied.items():
            if dropped in self.state_dict:
                _check_same(dropped, self.state_dict[dropped], kept, self.state_dict.get(kept))
                del self.state_dict[dropped], self.mappings[dropped]

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [self._cast(item) for item in plan.items]
        if self.quantize is not None:
            # Quantized from the state dict's own values (not from a save_dtype cast).
            self._export = Fp8Export(self.quantize_block, self.quantize_filter)
            original = super().resolve_data
            items, parts = self._export.local(items, original)
            data = {**(plan.planner_data or {}), PARTS_KEY: parts}
            plan = dataclasses.replace(plan, planner_data=data)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _cast(self, item: WriteItem) -> WriteItem:
        td = item.tensor_data
        if (
            self.save_dtype is None
            or td is None
            or not td.properties.dtype.is_floating_point
            or td.properties.dtype == self.save_dtype
        ):
            return item
        props = dataclasses.replace(td.properties, dtype=self.save_dtype)
        return dataclasses.replace(item, tensor_data=dataclasses.replace(td, properties=props))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # A collision can also span ranks (fqn A on one rank, fqn B on another, same HF key).
        origin: dict[str, tuple[Any, ...]] = {}
        for plan in all_plans:
            for key, path in (plan.planner_data or {}).items():
                if key in EXPORT_KEYS:
                    continue
                if origin.setdefault(key, tuple(path)) != tuple(path):
                    raise ValueError(
                        f"key_mapping maps both {'.'.join(map(str, origin[key]))!r} and "
                        f"{'.'.join(map(str, path))!r} (on different ranks) to {key!r}; fix the "
                        "mapping"
                    )
        plans, metadata = super().create_global_plan(all_plans)
        if self.quantize is None:
            return plans, metadata
        # Every rank gets back the whole amax of each block it holds a part of, and the writer
        # the quantization_config for config.json.
        agreed = agree([(p.planner_data or {}).get(PARTS_KEY) for p in all_plans])
        config = quantization_config(self.quantize_block)
        plans = [
            dataclasses.replace(p, planner_data={PARTS_KEY: a, CONFIG_KEY: config})
            for p, a in zip(plans, agreed, strict=True)
        ]
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self._export is not None:
            self._export.agreed((new_plan.planner_data or {}).get(PARTS_KEY))
        return super().finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem) -> Any:
        made = (
            None if self._export is None else self._export.resolve(write_item, super().resolve_data)
        )
        return super().resolve_data(write_item) if made is None else made


class HFLoadPlanner(DefaultLoadPlanner):
    """Load planner that finds each state-dict key under its HF name.

    Give it the same forward mapping as at save time (FQN -> HF key). Data is converted to
    each destination tensor's dtype. Every rank calls it with its own state dict.

    ``tied``: ``{HF key: HF key it is tied to}`` (``TIED_EMBEDDINGS``): a destination whose key
    the checkpoint lacks loads from the key it is tied to, as ``from_pretrained`` ties a folder
    ``save_pretrained`` (or ``HFSavePlanner(tied=...)``) wrote with the weight once.

    Raises (wrapped by DCP):
        KeyError: keys missing from the checkpoint (unless ``allow_partial_load=True``), listed
            with the HF names looked up.
        ValueError: a destination whose global shape differs from the stored tensor.
    """

    def __init__(
        self,
        key_mapping: KeyMapping | None = None,
        *,
        tied: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _mapper(key_mapping)
        self.key_mapping = key_mapping
        self.tied = _check_tied(tied)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "DCP calls set_up_planner with metadata first"
        mapped = _map_keys(list(self.state_dict), self.key_mapping)
        stored = self.metadata.state_dict_metadata
        for fqn, key in mapped.items():
            if key not in stored and self.tied.get(key) in stored:
                mapped[fqn] = self.tied[key]  # two destinations, one stored tensor
        missing = {fqn: key for fqn, key in mapped.items() if key not in stored}
        if missing and not self.allow_partial_load:
            shown = ", ".join(
                f"{fqn!r}" + (f" (as {key!r})" if key != fqn else "")
                for fqn, key in list(missing.items())[:10]
            )
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise KeyError(
                f"checkpoint has no tensor for {shown}{more}; it holds {len(stored)} keys such as "
                f"{sorted(stored)[:5]}. Fix key_mapping, or pass allow_partial_load=True to skip "
                "them"
            )
        for fqn, key in mapped.items():
            md, obj = stored.get(key), self.state_dict[fqn]
            if (
                isinstance(md, TensorStorageMetadata)
                and isinstance(obj, torch.Tensor)
                and tuple(md.size) != tuple(obj.size())
            ):
                raise ValueError(
                    f"shape mismatch for {fqn!r}: the checkpoint stores {key!r} as {list(md.size)} "
                    f"but the destination is {list(obj.size())}; load into a tensor of the stored "
                    "shape"
                )
        # Plan against metadata re-keyed by FQN, then point each read back at the stored HF key.
        view = dataclasses.replace(
            self.metadata,
            state_dict_metadata={fqn: stored[key] for fqn, key in mapped.items() if key in stored},
        )
        local = {fqn: v for fqn, v in self.state_dict.items() if mapped[fqn] in stored}
        plan = create_default_local_load_plan(local, view, True)
        items = [
            dataclasses.replace(
                item,
                storage_index=dataclasses.replace(
                    item.storage_index, fqn=mapped[item.storage_index.fqn]
                ),
            )
            for item in plan.items
        ]
        return dataclasses.replace(plan, items=items)
