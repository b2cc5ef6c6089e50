"""What both directions of ``tools/convert.py`` share: the ``dtype`` and ``key_mapping``
options, the report, and driving a storage writer's save sequence in this one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ..format.header import DTYPE_TO_NAME
from ..io import fsio
from ..io.parallel import parallel_map
from .keymap import KeyMapping, load_key_mapping

__all__ = ["ConvertReport", "as_key_mapping", "parse_dtype", "refuse_existing", "save_with"]


def as_key_mapping(
    key_mapping: str | os.PathLike[str] | Mapping[str, str | None] | KeyMapping | None,
) -> KeyMapping:
    """The ``key_mapping`` option as a :class:`KeyMapping` (``None``: keep every key)."""
    return KeyMapping({}) if key_mapping is None else load_key_mapping(key_mapping)


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating-point dtype to cast to: ``None``, a ``torch.dtype``, or a name like ``"bf16"``.

    Raises:
        ValueError: an unknown name (the message lists the accepted ones), or a dtype that is not
            floating point or that safetensors cannot hold.
    """
    if dtype is None:
        return None
    if isinstance(dtype, str):
        found = _DTYPE_NAMES.get(dtype.strip().lower().removeprefix("torch."))
        if found is None:
            raise ValueError(
                f"dtype={dtype!r} is not a known dtype; pass one of {', '.join(_DTYPE_NAMES)} (or "
                "a torch.dtype)"
            )
        return found
    if (
        not isinstance(dtype, torch.dtype)
        or not dtype.is_floating_point
        or dtype not in DTYPE_TO_NAME
    ):
        raise ValueError(
            f"dtype={dtype!r} must be a floating-point dtype that safetensors holds, such as "
            "torch.bfloat16; only floating-point tensors are cast, integer and bool tensors keep "
            "their dtype"
        )
    return dtype


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion did.

    ``tensors``: tensors written. ``bytes``: their bytes in the saved dtypes (the index's
    ``total_size`` for HF; DCP adds ``torch.save`` framing on top). ``files``: the output files'
    names inside ``dst``, data files then the commit marker. ``skipped``: source keys not
    converted (non-tensor DCP entries, keys mapped to null), in source order.
    ``unused_rules``: key-mapping rules that matched no tensor. ``seconds``: wall time.
    """

    tensors: int
    bytes: int
    files: tuple[str, ...]
    skipped: tuple[str, ...]
    seconds: float
    unused_rules: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def save_with(
    writer: StorageWriter,
    plans: list[list[WriteItem]],
    planner: object,
    metadata: Metadata,
    threads: int = 1,
) -> list[list[WriteResult]]:
    """Run ``writer``'s save sequence in this process, as DCP does for ``len(plans)`` ranks.

    Each list of items is one rank's plan; this process plays every rank (``write_data`` of up
    to ``threads`` plans at once) and the coordinator. ``planner`` needs only
    ``resolve_data(item) -> tensor``, all that ``write_data`` calls.
    """
    writer.set_up_storage_writer(True)
    local = [writer.prepare_local_plan(SavePlan(items)) for items in plans]
    global_plans = writer.prepare_global_plan(local)
    save_planner = cast(SavePlanner, planner)
    results = parallel_map(
        lambda plan: writer.write_data(plan, save_planner).wait(), global_plans, threads
    )
    writer.finish(metadata, results)
    return results


def refuse_existing(fs: AbstractFileSystem, root: str, markers: Sequence[str], what: str) -> None:
    """Raise if ``root`` holds a complete checkpoint (one of its commit ``markers``)."""
    found = [m for m in markers if fsio.exists(fs, fsio.join(root, m))]
    if found:
        raise FileExistsError(
            f"{fsio.url_of(fs, root)} already holds {what} ({', '.join(found)}); pass "
            "overwrite=True to replace it, or convert to a new path"
        )
