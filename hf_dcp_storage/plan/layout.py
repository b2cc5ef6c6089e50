"""Pure layout planning: which file each key goes to, each file's header, where every byte lands.

Nothing here touches a filesystem or a process group; the coordinator calls these functions
from ``HFStorageWriter.prepare_global_plan`` and tests call them with hand-built plans.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from ..format.geometry import element_size
from ..format.header import TensorEntry, decode_header, dtype_name, encode_header
from ..format.index import FORMAT_METADATA, file_name_problem, index_json, json_bytes, shard_name

__all__ = [
    "DATA_ALIGN",
    "FilePlan",
    "Layout",
    "Placement",
    "TensorSpec",
    "collect_tensor_specs",
    "index_bytes",
    "layout_from_files",
    "parse_size",
    "place_items",
    "plan_layout",
    "whole_tensor_metadata",
]

# Where each file's tensor data starts: a page boundary (the header padded with spaces, at most
# 4 KiB more per file), so a tensor whose bytes are whole pages (most weights) lies on whole
# pages and goes to disk with O_DIRECT without a buffered edge (io/direct.py); every store and
# both write paths use the same layout, so the bytes do not depend on how they were written.
DATA_ALIGN = 4096

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(size: int | str, name: str = "max_shard_size") -> int:
    """Bytes in ``size`` (the option ``name``): an int, or a string like ``"5GB"`` (10**9) or
    ``"512MiB"`` (2**20).

    Raises:
        ValueError: not a positive size, with the accepted forms.
    """
    value: float | None = None
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
        if m and m.group(2).lower() in _UNITS:
            value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value is None or value < 1:
        raise ValueError(
            f"{name}={size!r} is not a positive size; pass bytes as an int or a string "
            "such as '5GB' (decimal) or '512MiB' (binary)"
        )
    return int(value)


@dataclass(frozen=True)
class TensorSpec:
    """A whole (global) tensor to be stored: its saved key, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


@dataclass(frozen=True)
class FilePlan:
    """One output file: its name, encoded header, and entries in data order."""

    name: str
    header: bytes
    entries: tuple[TensorEntry, ...]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def size(self) -> int:
        return self.data_start + (self.entries[-1].end if self.entries else 0)


@dataclass(frozen=True)
class Layout:
    """The complete consolidated layout of a checkpoint.

    ``tensor_start[key]`` is the absolute byte offset of the key's data in ``files[file_of[key]]``.
    """

    files: tuple[FilePlan, ...]
    file_of: Mapping[str, int]
    tensor_start: Mapping[str, int]
    specs: Mapping[str, TensorSpec]

    @property
    def names(self) -> tuple[str, ...]:
        """File names, by file index."""
        return tuple(f.name for f in self.files)

    @property
    def weight_map(self) -> dict[str, str]:
        return {key: self.files[f].name for key, f in self.file_of.items()}

    @property
    def total_size(self) -> int:
        """Bytes of tensor data, as ``metadata.total_size`` in the HF index counts them."""
        return sum(spec.nbytes for spec in self.specs.values())


@dataclass(frozen=True)
class Placement:
    """Where one write item goes: output file index and absolute offset of its tensor's data."""

    file: int
    tensor_start: int


def collect_tensor_specs(
    plans: Sequence[SavePlan], key_order: Sequence[Sequence[str]] | None = None
) -> list[TensorSpec]:
    """One spec per key over all ranks' plans, in state-dict order.

    ``key_order[r]`` is rank r's keys in its state-dict order, taken before deduplication
    removed replicated items from some plans. The result follows rank 0's order, then keys first
    seen on rank 1, and so on; keys absent from ``key_order`` come last, in plan order.

    Raises:
        ValueError: a key whose chunks disagree on dtype or global shape across ranks.
    """
    specs: dict[str, TensorSpec] = {}
    for plan in plans:
        for item in plan.items:
            td = item.tensor_data
            if td is None:
                continue
            spec = TensorSpec(item.index.fqn, td.properties.dtype, tuple(td.size))
            prev = specs.setdefault(spec.key, spec)
            if prev != spec:
                raise ValueError(
                    f"key {spec.key!r} is {prev.dtype}{list(prev.shape)} on one rank and "
                    f"{spec.dtype}{list(spec.shape)} on another; every rank must hold the same "
                    "global tensor"
                )
    order = dict.fromkeys(k for keys in (key_order or ()) for k in keys if k in specs)
    order.update(dict.fromkeys(specs))
    return [specs[k] for k in order]


def plan_layout(
    specs: Sequence[TensorSpec],
    *,
    max_shard_bytes: int,
    fqn_to_index_mapping: Mapping[str, int] | None = None,
    file_name: str | None = None,
) -> Layout:
    """Assign keys to files and encode every file's header.

    Without ``fqn_to_index_mapping`` keys fill files greedily in the given order so that no file
    holds more than ``max_shard_bytes`` of tensor data (a larger tensor gets a file of its own).
    With it, each key goes to its 1-based file index; indices must cover ``1..N``. With
    ``file_name`` every key goes to the one file of that name (``adapter_model.safetensors``).

    Raises:
        ValueError: unsupported dtype, or a mapping that misses keys, names unknown keys or
            leaves a file index empty.
    """
    for spec in specs:
        dtype_name(spec.dtype, key=spec.key)
    if file_name is not None:
        groups = [list(specs)]
    elif fqn_to_index_mapping is not None:
        groups = _groups_from_mapping(specs, fqn_to_index_mapping)
    else:
        groups = _greedy_groups(specs, max_shard_bytes)
    total = max(len(groups), 1)
    files: list[FilePlan] = []
    file_of: dict[str, int] = {}
    tensor_start: dict[str, int] = {}
    for i, group in enumerate(groups or [[]]):
        entries, pos = [], 0
        for spec in group:
            entries.append(TensorEntry(spec.key, spec.dtype, spec.shape, pos, pos + spec.nbytes))
            pos += spec.nbytes
        header = encode_header(entries, FORMAT_METADATA, align=DATA_ALIGN)
        name = file_name if file_name is not None else shard_name(i + 1, total)
        files.append(FilePlan(name, header, tuple(entries)))
        for e in entries:
            file_of[e.name] = i
            tensor_start[e.name] = len(header) + e.begin
    return Layout(tuple(files), file_of, tensor_start, {s.key: s for s in specs})


def _greedy_groups(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        groups.append(current)
    return groups


def _groups_from_mapping(
    specs: Sequence[TensorSpec], mapping: Mapping[str, int]
) -> list[list[TensorSpec]]:
    keys = {s.key for s in specs}
    missing = [s.key for s in specs if s.key not in mapping]
    if missing:
        raise ValueError(
            f"fqn_to_index_mapping has no file index for {_preview(missing)}; map every saved key "
            "(after key_mapping) to a 1-based file index"
        )
    unknown = sorted(k for k in mapping if k not in keys)
    if unknown:
        raise ValueError(f"fqn_to_index_mapping names keys that are not saved: {_preview(unknown)}")
    bad = {
        k: v for k, v in mapping.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1
    }
    if bad:
        raise ValueError(f"fqn_to_index_mapping values must be 1-based ints, got {_preview(bad)}")
    n = max(mapping.values(), default=0)
    groups: list[list[TensorSpec]] = [[] for _ in range(n)]
    for spec in specs:
        groups[mapping[spec.key] - 1].append(spec)
    empty = [i + 1 for i, g in enumerate(groups) if not g]
    if empty:
        raise ValueError(
            f"fqn_to_index_mapping uses file indices up to {n} but assigns no key to {empty}; "
            "number the files 1..N without gaps"
        )
    return groups


def place_items(layout: Layout, plans: Sequence[SavePlan]) -> list[dict[MetadataIndex, Placement]]:
    """For each rank's (deduplicated) plan, the placement of every tensor write item."""
    return [
        {
            item.index: Placement(
                layout.file_of[item.index.fqn], layout.tensor_start[item.index.fqn]
            )
            for item in plan.items
            if item.tensor_data is not None
        }
        for plan in plans
    ]


def _preview(values: object, limit: int = 8) -> str:
    items = (
        list(values.items()) if isinstance(values, Mapping) else list(cast(Iterable[Any], values))
    )
    shown = ", ".join(
        repr(v) if not isinstance(v, tuple) else f"{v[0]!r}: {v[1]!r}" for v in items[:limit]
    )
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return f"[{shown}]{more}"


def layout_from_files(files: tuple[tuple[str, bytes], ...], where: str) -> Layout:
    """The ``Layout`` a save planned, rebuilt from its files' names and headers. Pure.

    Raises:
        HeaderError: a header that does not decode.
    """
    plans, file_of, tensor_start, specs = [], {}, {}, {}
    for f, (name, header) in enumerate(files):
        entries, _, data_start = decode_header(header, where=f"{where} ({name})")
        plans.append(FilePlan(name, header, tuple(entries)))
        for e in entries:
            file_of[e.name] = f
            tensor_start[e.name] = data_start + e.begin
            specs[e.name] = TensorSpec(e.name, e.dtype, e.shape)
    return Layout(tuple(plans), file_of, tensor_start, specs)


def whole_tensor_metadata(layout: Layout) -> dict[str, TensorStorageMetadata]:
    """DCP metadata of the consolidated checkpoint: one whole-tensor chunk per key."""
    out = {}
    for key, spec in layout.specs.items():
        size = torch.Size(spec.shape)
        out[key] = TensorStorageMetadata(
            TensorProperties(dtype=spec.dtype),
            size,
            [ChunkStorageMetadata(torch.Size([0] * len(size)), size)],
        )
    return out


def index_bytes(layout: Layout, checksums: Mapping[str, int]) -> bytes:
    """The index file a save of ``layout`` commits (``format/index.py``'s ``index_json``)."""
    files = [(f.name, f.size, f.header) for f in layout.files]
    return json_bytes(index_json(layout.total_size, layout.weight_map, files, checksums))


def check_file_name(file_name: str | None, fqn_to_index_mapping: Any) -> str | None:
    """The writer's ``file_name`` option: ``None``, or a plain ``*.safetensors`` name in the
    folder other than the index's, with no ``fqn_to_index_mapping`` beside it.

    Raises:
        ValueError: any other value, naming it and the rule.
    """
    if file_name is None:
        return None
    if (
        not isinstance(file_name, str)
        or not file_name.endswith(".safetensors")
        or "/" in file_name
        or file_name_problem(file_name, "file_name") is not None
    ):
        raise ValueError(
            f"file_name={file_name!r} must be a plain file name ending in .safetensors, such as "
            "'adapter_model.safetensors'"
        )
    if fqn_to_index_mapping is not None:
        raise ValueError(
            "file_name puts every tensor in one file, fqn_to_index_mapping spreads them over "
            "several: give one of the two"
        )
    return file_name
