"""The record a save keeps of itself while it runs, so that an interrupted save can be finished.

While a save is under way its folder holds, under ``.hf_dcp_staging/``:

* ``save.json``: written by the coordinator after planning, before any rank writes: the save's
  id, how the bytes travel (``direct`` positioned writes, ``staged`` objects, ``s3`` multipart
  uploads, ``gcs`` composed part objects, ``azure`` committed blocks), the world size, every
  output file's name and encoded header, and on S3 the ids of the multipart uploads;
* ``rank{r:05d}.json``: written by rank ``r`` once every byte it owes is durable (or uploaded):
  what it wrote, item by item (key, chunk, where its staged bytes sit, its CRC32 share, S3
  part ETags).
* ``complete.json`` (S3, GCS, Azure): written by the coordinator just before it has the server
  assemble the files: every file's parts and their ETags (GCS: generations, Azure: block ids),
  so that a save that died while completing gathers nothing again when finished, and (S3) can
  tell a file it completed (the object's ETag is the one those parts make) from one whose
  upload was lost.

With both, the coordinator's ``finish`` (merge or complete the uploads, write the index) can be
run later by another process (``hf-dcp consolidate``). The folder is deleted once the index is
written. Encoding and decoding only: no I/O here.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

__all__ = [
    "COMPLETION_RECORD",
    "FORMAT",
    "MODES",
    "SAVE_RECORD",
    "CompletionRecord",
    "ItemRecord",
    "RankRecord",
    "RecordError",
    "SaveRecord",
    "rank_record",
    "rank_record_name",
]

FORMAT = 1
SAVE_RECORD = "save.json"
COMPLETION_RECORD = "complete.json"
MODES = ("direct", "staged", "s3", "gcs", "azure")


def rank_record_name(rank: int) -> str:
    return f"rank{rank:05d}.json"


class RecordError(ValueError):
    """A staging record that cannot be read: damaged, or from another version."""


@dataclass(frozen=True)
class SaveRecord:
    """The coordinator's plan of one save (``save.json``)."""

    save_id: str
    mode: str
    world_size: int
    files: tuple[tuple[str, bytes], ...]  # (name, encoded header), by file index
    uploads: Mapping[int, str]  # S3: file index -> multipart upload id
    # Part stores: what the parts were planned with (the store's ``PartRules`` and the ranks a
    # node), so that finishing the save plans the same parts whatever the finishing process's
    # library version or environment; empty in records that predate it.
    part_plan: Mapping[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        return _json(
            {
                "format": FORMAT,
                "save_id": self.save_id,
                "mode": self.mode,
                "world_size": self.world_size,
                "files": [
                    {"name": name, "header": base64.b64encode(header).decode("ascii")}
                    for name, header in self.files
                ],
                "uploads": {str(f): u for f, u in sorted(self.uploads.items())},
                "part_plan": dict(sorted(self.part_plan.items())),
            }
        )

    @classmethod
    def decode(cls, raw: bytes, where: str) -> SaveRecord:
        obj = _load(raw, where)
        try:
            files = tuple(
                (str(f["name"]), base64.b64decode(f["header"], validate=True)) for f in obj["files"]
            )
            record = cls(
                str(obj["save_id"]),
                obj["mode"],
                int(obj["world_size"]),
                files,
                {int(f): str(u) for f, u in obj["uploads"].items()},
                {str(k): int(v) for k, v in obj.get("part_plan", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(
                f"{where}: not a valid save record ({type(exc).__name__}: {exc})"
            ) from None
        if record.mode not in MODES or record.world_size < 1:
            raise RecordError(
                f"{where}: not a valid save record (mode {record.mode!r}, world size "
                f"{record.world_size})"
            )
        return record


@dataclass(frozen=True)
class ItemRecord:
    """One write item as its rank wrote it (a ``WriteResult`` plus the chunk's sizes)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    file: int
    staged_offset: int | None
    crc: int
    parts: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class RankRecord:
    """What one rank wrote (``rank{r:05d}.json``): its items, and where it gathered parts over
    the ranks' network (written after that), the parts it uploaded, by file."""

    save_id: str
    rank: int
    items: tuple[ItemRecord, ...]
    gathered: Mapping[int, tuple[dict[str, Any], ...]] = field(default_factory=dict)

    def encode(self) -> bytes:
        items = [
            [
                i.key,
                list(i.offsets),
                list(i.sizes),
                i.nbytes,
                i.file,
                i.staged_offset,
                f"{i.crc:08x}",
                list(i.parts),
            ]
            for i in self.items
        ]
        obj: dict[str, Any] = {
            "format": FORMAT,
            "save_id": self.save_id,
            "rank": self.rank,
            "items": items,
        }
        if self.gathered:
            obj["gathered"] = {str(f): list(ps) for f, ps in sorted(self.gathered.items())}
        return _json(obj)

    @classmethod
    def decode(cls, raw: bytes, where: str) -> RankRecord:
        obj = _load(raw, where)
        try:
            items = tuple(
                ItemRecord(
                    str(k),
                    tuple(map(int, o)),
                    tuple(map(int, s)),
                    int(n),
                    int(f),
                    None if so is None else int(so),
                    int(c, 16),
                    tuple(p),
                )
                for k, o, s, n, f, so, c, p in obj["items"]
            )
            gathered = {int(f): tuple(ps) for f, ps in obj.get("gathered", {}).items()}
            return cls(str(obj["save_id"]), int(obj["rank"]), items, gathered)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(
                f"{where}: not a valid rank record ({type(exc).__name__}: {exc})"
            ) from None


@dataclass(frozen=True)
class CompletionRecord:
    """The parts the coordinator completed each file's upload with (``complete.json``)."""

    save_id: str
    parts: Mapping[
        str, tuple[dict[str, Any], ...]
    ]  # file name -> ({"PartNumber", "ETag"[, "CRC32C"]}, ...)

    def encode(self) -> bytes:
        return _json(
            {
                "format": FORMAT,
                "save_id": self.save_id,
                "parts": {n: list(p) for n, p in sorted(self.parts.items())},
            }
        )

    @classmethod
    def decode(cls, raw: bytes, where: str) -> CompletionRecord:
        obj = _load(raw, where)
        try:
            parts = {str(n): tuple(_part_entry(e) for e in p) for n, p in obj["parts"].items()}
            return cls(str(obj["save_id"]), parts)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(
                f"{where}: not a valid completion record ({type(exc).__name__}: {exc})"
            ) from None


def _part_entry(e: Mapping[str, Any]) -> dict[str, Any]:
    """A part's entry as recorded: its number and ETag, and (GCS) the CRC32C its upload got."""
    entry: dict[str, Any] = {"PartNumber": int(e["PartNumber"]), "ETag": str(e["ETag"])}
    if "CRC32C" in e:
        entry["CRC32C"] = str(e["CRC32C"])
    return entry


def rank_record(
    save_id: str,
    rank: int,
    items: list[WriteItem],
    results: list[WriteResult],
    gathered: Mapping[int, tuple[dict[str, Any], ...]] | None = None,
) -> RankRecord:
    """What a rank wrote, for ``rank{r}.json``: each item's result (``storage_data`` a
    ``plan/rankplan.Written``) and its chunk's sizes; ``gathered``: the parts it gathered and
    uploaded, by file, where it records after gathering."""
    sizes = {
        item.index: tuple(item.tensor_data.chunk.sizes)
        for item in items
        if item.tensor_data is not None
    }
    records = []
    for r in results:
        w = r.storage_data
        records.append(
            ItemRecord(
                r.index.fqn,
                tuple(r.index.offset or ()),
                sizes[r.index],
                r.size_in_bytes,
                w.file,
                w.staged_offset,
                w.crc,
                w.parts,
            )
        )
    return RankRecord(save_id, rank, tuple(records), dict(gathered or {}))


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def _load(raw: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else None
        raise RecordError(f"{where}: record format {found!r}; this version reads format {FORMAT}")
    return obj
