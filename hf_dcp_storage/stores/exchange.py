"""A part store's gathered parts over the ranks' own network, every byte uploaded once.

Where a save would stage its runs too small to be parts (``stores/parts.py``), each rank holds
them in host memory instead (``Held``: the staged object's bytes, in the same order). Once every
rank has written its own parts (``session/meeting.py``), the ranks join a group of the save's own
(``session/group.py``) and ``exchange``: each sends every gathering rank its pieces of each of
that rank's parts, one message per (part, sender), in tag order (``plan/exchange.py``); each
gathering rank receives its parts' pieces, a few parts at a time, puts them in order behind the
header and uploads the part. Nothing is staged in the store and read back.

Memory: a rank holds its runs (``held``, reported) until the exchange ends, at most ``window``
messages in flight out, and ``threads`` parts being gathered, each at most a part plus its
pieces as received.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..plan.exchange import Sends, part_tag
from ..plan.spread import GatherTask, GatherTasks
from ..session.group import PointToPoint

__all__ = ["Held", "exchange"]

# Messages a rank has in flight to the gathering ranks (each a part's worth at most).
_WINDOW = 4


class Held:
    """One rank's staged bytes of one file, held in host memory for the gathering ranks: written
    in order, as a staged object's stream is, as pieces (``view`` reads any range of the
    stream); a context manager, like the store's staged writers.

    A piece of a tensor read in place is held as a view of it (``keep``: no copy; the tensor
    outlives the exchange, which ends inside the save's ``write_data``); any other piece is
    copied (``write``: its slab's buffer is reused for the next slab).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.pieces: list[memoryview] = []
        self.starts: list[int] = []  # each piece's first byte in the stream
        self.at = 0

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keep(self, data: memoryview) -> None:
        self._add(data.cast("B") if data.format != "B" else data)

    def write(self, data: memoryview | bytes | bytearray) -> None:
        self._add(memoryview(bytearray(data)))

    def _add(self, piece: memoryview) -> None:
        if not len(piece):
            return  # an empty tensor's: nothing to read, and ``view`` never stops on one
        self.pieces.append(piece)
        self.starts.append(self.at)
        self.at += len(piece)

    def view(self, start: int, n: int) -> memoryview:
        """Stream bytes ``[start, start + n)``: a view where they lie in one piece, else a copy."""
        if not n:
            return memoryview(b"")
        i = bisect.bisect_right(self.starts, start) - 1
        offset = start - self.starts[i]
        piece = self.pieces[i]
        if offset + n <= len(piece):
            return piece[offset : offset + n]
        out = bytearray(n)
        at = 0
        while at < n:
            piece = self.pieces[i]
            take = min(n - at, len(piece) - offset)
            out[at : at + take] = piece[offset : offset + take]
            at, offset, i = at + take, 0, i + 1
        return memoryview(out)


def exchange(
    group: PointToPoint,
    rank: int,
    held: Mapping[int, Held],
    sends: Sends,
    tasks: GatherTasks,
    upload: Callable[[GatherTask, bytearray], dict[str, Any]],
    *,
    threads: int,
    window: int = _WINDOW,
) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """(every rank of the save, after every rank wrote its own bytes) Send this rank's pieces of
    the parts others gather (``sends``), while gathering and uploading its own (``tasks``) with
    ``upload(task, data)``, ``threads`` at a time. Returns each gathered part's ``(file, ETag
    entry)`` and the bytes received from other ranks.

    Raises:
        RuntimeError: a rank stopped taking part (the group's timeout), a message of the wrong
            size (an inconsistent plan), or an upload's own error.
    """
    stop = threading.Event()
    failure: list[BaseException] = []

    def send_all() -> None:
        pending: deque[Any] = deque()
        try:
            for i in range(len(sends)):
                if stop.is_set():
                    return
                task = sends.tasks.task(i)
                message = torch.frombuffer(
                    _message(held[task.file], task.ranges()), dtype=torch.uint8
                )
                pending.append(
                    (
                        group.send([message], int(sends.to[i]), part_tag(task.file, task.number)),
                        message,
                    )
                )
                while len(pending) > window:
                    pending.popleft()[0].wait()
            while pending:
                pending.popleft()[0].wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, raised there
            failure.append(exc)

    def gather(task: GatherTask) -> tuple[tuple[int, dict[str, Any]] | None, int]:
        data, received = _gather(group, rank, held, task)
        if failed:
            return None, received  # draining: see below
        try:
            return (task.file, upload(task, data)), received
        except BaseException as exc:  # noqa: BLE001 - raised once the exchange has drained
            failed.append(exc)
            return None, received

    # After a failed upload the rank goes on receiving (and sending) without uploading, so that
    # no other rank is left waiting on it for the group's timeout: each fails its own way soon
    # after (this rank's abort ends the save's uploads) or learns of it when DCP gathers results.
    failed: list[BaseException] = []
    order = sorted(range(len(tasks)), key=lambda i: part_tag(*tasks.parts[i, :2].tolist()))
    sender = threading.Thread(target=send_all, name=f"hf-dcp-send-{rank}", daemon=True)
    sender.start()
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="hf-dcp-gather") as pool:
            done = list(pool.map(gather, [tasks.task(i) for i in order]))
    except BaseException:
        stop.set()  # the group failed: the sender stops at its next message
        raise
    sender.join()
    if failed or failure:
        raise (failed or failure)[0]
    return [entry for entry, _ in done if entry is not None], sum(n for _, n in done)


def _message(held: Held, ranges: np.ndarray) -> memoryview:
    """A sender's pieces of one part, in file order: a view of the held bytes where they lie
    back to back in one held piece (a rank holds its runs in file order, so they often do),
    else a copy."""
    starts, sizes = ranges[:, 2], ranges[:, 3]
    if len(ranges) and (starts[1:] == starts[:-1] + sizes[:-1]).all():
        return held.view(int(starts[0]), int(starts[-1] + sizes[-1] - starts[0]))
    out = bytearray(int(sizes.sum()))
    at = 0
    for s, n in zip(starts.tolist(), sizes.tolist(), strict=True):
        out[at : at + n] = held.view(s, n)
        at += n
    return memoryview(out)


def _gather(
    group: PointToPoint, rank: int, held: Mapping[int, Held], task: GatherTask
) -> tuple[bytearray, int]:
    """Part ``task``'s bytes: its header's, then its pieces in file order, this rank's from
    ``held`` and each other rank's from its one message; and the bytes received."""
    ranges = task.checked_ranges()
    tag = part_tag(task.file, task.number)
    sources = ranges[:, 1]
    received: dict[int, torch.Tensor] = {}
    works = []
    for src in np.unique(sources).tolist():
        if src == rank:
            continue
        buf = torch.empty(int(ranges[sources == src, 3].sum()), dtype=torch.uint8)
        works.append(group.recv([buf], src, tag))
        received[src] = buf
    for work in works:
        work.wait()
    out = bytearray(task.nbytes)
    out[: len(task.head)] = task.head
    views = {src: buf.numpy().data for src, buf in received.items()}
    read = dict.fromkeys(views, 0)
    own = held.get(task.file) if rank in sources else None
    at = len(task.head)
    for src, staged, n in ranges[:, 1:].tolist():
        if src == rank:
            assert own is not None
            out[at : at + n] = own.view(staged, n)
        else:
            out[at : at + n] = views[src][read[src] : read[src] + n]
            read[src] += n
        at += n
    return out, sum(len(v) for v in views.values())
