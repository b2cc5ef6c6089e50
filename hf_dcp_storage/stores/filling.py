"""What the part stores (S3, GCS, Azure) do alike on each rank: fill the parts that hold only this
rank's bytes while staging the rest (``fill_file``), and gather a mixed part from the ranks'
staged runs (``gather_bytes``).

Each store brings its own requests: where a filled part goes (an S3 ``UploadPart``, a GCS part
object, an Azure block), the staged object's writer, and the client whose ``get_spans`` reads
ranges of staged objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..format.crc import CrcAccumulator
from ..io.items import chunk_bytes, in_write_order, tensor_bytes
from ..io.parallel import parallel_map
from ..plan.parts import GatherPart, RankPart, route_run
from ..plan.rankplan import RankPlan, Written
from ..plan.spread import GatherTasks, Source
from .base import Slabs
from .exchange import Held

__all__ = [
    "FileShare",
    "GatheredSources",
    "PartAssembler",
    "fill_file",
    "gather_bytes",
    "with_parts",
    "write_by_file",
]


def write_by_file(
    items: list[WriteItem],
    rank_plan: RankPlan,
    write_file: Callable[[int, list[WriteItem]], list[WriteResult]],
    threads: int,
) -> list[WriteResult]:
    """(each rank) ``write_file(file, its items)`` for every file this rank has items of, up to
    ``threads`` files at a time; the results of all, in file order."""
    by_file: dict[int, list[WriteItem]] = {}
    for item in items:
        by_file.setdefault(rank_plan.placements[item.index].file, []).append(item)
    return [
        r
        for rs in parallel_map(lambda f: write_file(f, by_file[f]), sorted(by_file), threads)
        for r in rs
    ]


@dataclasses.dataclass(frozen=True)
class FileShare:
    """What one rank writes of one file: its items in write order, its own parts, and the bytes
    it stages (everything of its items outside those parts)."""

    name: str
    items: list[WriteItem]
    parts: tuple[RankPart, ...]
    staged_size: int

    @classmethod
    def of(cls, file: int, items: list[WriteItem], rank_plan: RankPlan) -> FileShare:
        parts = tuple(rank_plan.store.parts.get(file, ()))
        ordered = in_write_order(items, lambda it: rank_plan.placements[it.index].tensor_start)
        return cls(
            rank_plan.files[file],
            ordered,
            parts,
            sum(chunk_bytes(it) for it in ordered) - sum(p.nbytes for p in parts),
        )


def with_parts(results: list[WriteResult], parts: tuple[dict[str, Any], ...]) -> list[WriteResult]:
    """``results`` of one file with the entries of the parts the rank uploaded (``ETag``, ...) on
    its last result, where the coordinator collects them."""
    last = results[-1]
    return [
        *results[:-1],
        dataclasses.replace(last, storage_data=dataclasses.replace(last.storage_data, parts=parts)),
    ]


class PartAssembler:
    """Fills a rank's own parts of one file from the pieces it writes, in any order, and hands
    each part to ``send`` as soon as its last byte arrives (the buffer itself, not a copy).

    A part that carries the header gets it in front (the header is file bytes ``[0, start)``).
    """

    def __init__(self, header: bytes, send: Callable[[RankPart, bytearray], None]) -> None:
        self.header, self.send = header, send
        self._open: dict[
            int, tuple[bytearray, list[int]]
        ] = {}  # part number -> (buffer, [bytes missing])

    def add(self, part: RankPart, at: int, piece: memoryview) -> None:
        """Copy ``piece``, file bytes from ``at``, into ``part``."""
        lead = part.start if part.header else 0
        entry = self._open.get(part.number)
        if entry is None:
            buf = bytearray(lead + part.nbytes)
            buf[:lead] = self.header[:lead]
            entry = self._open[part.number] = (buf, [part.nbytes])
        buf, missing = entry
        offset = lead + at - part.start
        buf[offset : offset + len(piece)] = piece
        missing[0] -= len(piece)
        if missing[0] == 0:
            del self._open[part.number]
            self.send(part, buf)

    def check_filled(self, name: str, rank: int) -> None:
        """Raise unless every part of ``name`` this rank began was filled (a plan that does not
        add up: a bug, never a user error)."""
        if self._open:
            raise RuntimeError(
                f"{name}: parts {sorted(self._open)} were planned for rank {rank} but not filled"
            )


def fill_file(
    file: int,
    file_items: list[WriteItem],
    rank_plan: RankPlan,
    slabs: Slabs,
    parts: Sequence[RankPart],
    staged: Any,
    assembler: PartAssembler,
) -> list[WriteResult]:
    """(each rank) Route every byte of ``file_items`` (one file's, in write order): into this
    rank's own parts through ``assembler``, or appended to ``staged`` (the rank's staged object
    of the file; ``None`` when nothing is staged). Each result records the item's CRC32
    contribution; where its bytes sit in the staged object is not recorded, since the
    coordinator's plan (``placed.staged``) already says, for the gathering and for ``hf-dcp
    consolidate`` alike."""
    starts = [p.start for p in parts]
    results: list[WriteResult] = []
    for item in file_items:
        start = rank_plan.placements[item.index].tensor_start
        crc, nbytes = CrcAccumulator(), 0
        item_slabs = slabs(item)
        write = _staged_write(staged, item_slabs)
        for runs, data in item_slabs:
            nbytes += len(data)
            for tensor_off, chunk_off, n in runs:
                run = data[chunk_off : chunk_off + n]
                crc.update(tensor_off, run)
                run_start = start + tensor_off
                for at, take, part in route_run(run_start, n, starts, parts):
                    piece = run[at - run_start : at - run_start + take]
                    if part is None:
                        write(piece)
                    else:
                        assembler.add(part, at, piece)
        results.append(
            WriteResult(
                item.index, nbytes, Written(file, None, crc.contribution(tensor_bytes(item)))
            )
        )
    return results


def _staged_write(staged: Any, item_slabs: object) -> Callable[[memoryview], object]:
    """How ``fill_file`` appends an item's staged pieces to ``staged``: pieces of a tensor read
    in place (``io/items.ItemSlabs.in_place``), which outlives the exchange, are held as views
    (``Held.keep``: no copy); any other piece is copied, its slab's buffer being reused."""
    if isinstance(staged, Held) and getattr(item_slabs, "in_place", False):
        return staged.keep
    if staged is None:
        return _nothing_staged
    return staged.write


def _nothing_staged(piece: memoryview) -> object:
    raise RuntimeError(
        f"a {len(piece)}-byte piece is to be staged where the plan stages nothing; the plan is "
        "inconsistent"
    )


def gather_bytes(
    client: Any,
    sources: Sequence[Source],
    staged_path: Callable[[int], str],
    *,
    url: Callable[[str], str] = str,
) -> bytearray:
    """A gathered part's bytes: literal pieces (the header's) and ranges of the ranks' staged
    objects (``staged_path(rank)``), read with ``client.get_spans``. Ranges that follow each other
    in one staged object (a rank's runs in a part, which it staged back to back) are one read;
    all reads run in parallel. ``url`` spells a path for messages.

    Raises:
        RuntimeError: a staged object is shorter than the save recorded (an inconsistent save).
    """
    spans: list[list[Any]] = []  # [path, start, end], joined while ranges follow each other
    last: dict[str, int] = {}  # path -> index of its latest span
    plan: list[bytes | tuple[int, int, int]] = []  # literal bytes, or (span, offset in it, nbytes)
    for s in sources:
        if isinstance(s, bytes):
            plan.append(s)
            continue
        path = staged_path(s[0])
        i = last.get(path)
        if i is None or spans[i][2] != s[1]:
            i = last[path] = len(spans)
            spans.append([path, s[1], s[1]])
        plan.append((i, spans[i][2] - spans[i][1], s[2]))
        spans[i][2] += s[2]
    fetched = client.get_spans([(p, a, b) for p, a, b in spans])
    out = bytearray()
    for step in plan:
        if isinstance(step, bytes):
            out += step
            continue
        i, offset, n = step
        data = fetched[i]
        if len(data) < offset + n:
            raise RuntimeError(
                f"{url(spans[i][0])}: staged object ends early at byte {spans[i][1] + len(data)}"
            )
        out += memoryview(data)[offset : offset + n]
    return out


class GatheredSources:
    """Where each gathered part's bytes sit, for the parts no rank gathered (an interrupted
    save being finished, by the coordinator): looked up in the ranks' shares, indexed on first
    need."""

    def __init__(self, gathers: list[GatherTasks]) -> None:
        self.gathers = gathers
        self.where: dict[
            tuple[int, int], tuple[int, int]
        ] = {}  # (file, part number) -> (share, index)

    def of(self, f: int, part: GatherPart) -> list[Any]:
        if not self.where:
            self.where.update(
                ((fp[0], fp[1]), (b, i))
                for b, batch in enumerate(self.gathers)
                for i, fp in enumerate(batch.parts[:, :2].tolist())
            )
        b, i = self.where[(f, part.number)]
        return self.gathers[b].task(i).sources()
