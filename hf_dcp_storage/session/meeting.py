"""Wait, inside ``write_data``, until every rank of a save has staged its bytes.

A rank assembling other ranks' staged bytes (``plan/spread.py``) may start only when they are all
staged. DCP does not hand the storage writer its process group, and a collective issued on
another group from ``dcp.async_save``'s background thread could interleave with the training
loop's own collectives. So the ranks meet on the job's key-value store instead (the one
``init_process_group`` set up; the same pattern as torch's store-based barrier): no process group,
no device, safe from any thread. Every rank arrives, failed or not, so a rank that failed its
own writes does not leave the others waiting: they all learn which ranks failed and stop.

A rank that dies (killed, out of memory) never arrives. So that the others do not wait for the
store's timeout (30 minutes by default), every rank of a save beats while it writes and waits
(``Meeting``: a counter of its own on the store, bumped every ``rank_timeout / 10`` seconds),
and the waiting ranks give up on a rank whose beat stopped for ``rank_timeout`` seconds: the
save's rank 0 watches every rank that has not arrived, the others watch rank 0. They fail with
a message naming the silent ranks. A slow rank keeps beating, so a large save is never cut off.

Keys: per save ``{prefix}/{save_id}/...`` (removed by ``forget`` once every rank is past the
meeting: a fixed handful, whatever the world size), plus one beat counter per process of the
job, ``{prefix}/beat/{global rank}``, reused by every save.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from typing import Any

import torch.distributed as dist

__all__ = ["DEFAULT_RANK_TIMEOUT", "Meeting", "check_rank_timeout", "forget", "job_store"]

logger = logging.getLogger(__name__)

_PREFIX = "hf_dcp_storage/arrival"
# How long a rank of an object-store save may go silent before the others stop waiting for it.
DEFAULT_RANK_TIMEOUT = 120.0
_PER_SAVE_KEYS = ("arrived", "all", "failed", "ranks", "who")


def check_rank_timeout(value: object) -> float:
    """``value`` as seconds, or ``ValueError`` naming it (the writer's and manager's option)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"rank_timeout={value!r} must be a number of seconds > 0 (how long a silent rank is "
            "waited for)"
        )
    return float(value)


def job_store() -> Any:
    """The job's key-value store (the default group's, which every rank of any group reaches).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "HFStorageWriter: a save on several ranks needs torch.distributed initialised (its "
            "key-value store is where ranks meet before gathering each other's staged bytes); "
            "call init_process_group first"
        )
    # The default group's store: every rank of any group of the job can reach it.
    return dist.distributed_c10d._get_default_store()


class Meeting:
    """One rank's part in the meeting of one save (every rank of the save makes one).

    Call sequence, on every rank of the save: ``start()`` before its own writes (it begins to
    beat); then exactly one of ``arrive_failed()`` (its writes failed; does not wait) or
    ``arrive_and_wait()`` (they succeeded); ``stop()`` in a ``finally`` (the beating ends; safe
    to call twice).

    Args:
        save_id: the save's id (the same on every rank).
        rank, world: this rank's number in the save and the save's number of ranks.
        rank_timeout: seconds a rank may be silent before the others give up on it.
    """

    def __init__(self, save_id: str, rank: int, world: int, rank_timeout: float) -> None:
        self.store = job_store()
        self.key = f"{_PREFIX}/{save_id}"
        self.rank, self.world, self.rank_timeout = rank, world, rank_timeout
        self.every = min(5.0, max(0.05, rank_timeout / 10))
        self._beat_key = f"{_PREFIX}/beat/{dist.get_rank()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Say which process this rank is (for the watchers) and begin to beat."""
        self.store.add(self._beat_key, 1)
        self.store.append(f"{self.key}/ranks", f"{self.rank}:{dist.get_rank()},")
        self._thread = threading.Thread(
            target=self._beat, name=f"hf-dcp-beat-{self.rank}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.store.add(self._beat_key, 1)
            except Exception:  # noqa: BLE001 - the store is gone (its host died): the waits fail and say so
                return

    def stop(self) -> None:
        """End the beating (joined: no thread of the save outlives it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def arrive_failed(self) -> None:
        """Report that this rank failed its own bytes; does not wait."""
        # Before arriving: whoever sees everyone arrived also sees every failure.
        self.store.append(f"{self.key}/failed", f"{self.rank},")
        self._arrive()

    def _arrive(self) -> None:
        self.store.append(f"{self.key}/who", f"{self.rank},")
        if self.store.add(f"{self.key}/arrived", 1) == self.world:
            self.store.set(f"{self.key}/all", b"1")

    def arrive_and_wait(self) -> list[int]:
        """Arrive, then wait for every rank; returns the ranks that arrived failed (sorted; empty
        when all succeeded).

        Raises:
            RuntimeError: ranks that stayed silent for ``rank_timeout`` seconds without arriving
                (dead or hung), naming them, or a key-value store that stopped answering.
        """
        self._arrive()
        watch = _Watch(self.store, self.key, self.rank, self.world, self.rank_timeout)
        while True:
            try:
                self.store.wait([f"{self.key}/all"], datetime.timedelta(seconds=self.every))
                break
            except RuntimeError as exc:  # TCPStore: DistStoreError; FileStore: a plain RuntimeError
                if "timeout" not in str(exc).lower():
                    raise RuntimeError(
                        f"rank {self.rank} of {self.world} lost the job's key-value store while "
                        f"waiting for the other ranks to stage their bytes ({exc}); the process "
                        "hosting it (usually rank 0) has probably died"
                    ) from exc
            silent = watch.silent()
            if silent:
                shown = silent if len(silent) <= 16 else [*silent[:16], "..."]
                message = (
                    f"ranks {shown} of {self.world} stopped answering for {self.rank_timeout:g} s "
                    f"before they had staged their bytes (dead or hung), so rank {self.rank} "
                    "stops waiting for them and the save fails; raise "
                    "HFStorageWriter(rank_timeout=...) if ranks can stall that long while alive"
                )
                # Logged too: DCP next gathers every rank's result, and with a rank dead that
                # collective fails with the transport's own error, which would hide this one.
                logger.error(message)
                raise RuntimeError(message)
        if not self.store.check([f"{self.key}/failed"]):
            return []
        return sorted(int(r) for r in self.store.get(f"{self.key}/failed").decode().split(",") if r)


class _Watch:
    """What a waiting rank knows of the others' beats: the save's rank 0 watches every rank that
    has not arrived, any other rank watches rank 0 only (one key per poll, whatever the world)."""

    def __init__(self, store: Any, key: str, rank: int, world: int, timeout: float) -> None:
        self.store, self.key, self.rank, self.world, self.timeout = store, key, rank, world, timeout
        self.started = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {}  # save rank -> (beat, when it last changed)

    def silent(self) -> list[int]:
        """The watched ranks that have not arrived and whose beat has not moved for ``timeout``."""
        now = time.monotonic()
        processes = _parse_pairs(self._get("ranks"))
        arrived = {int(r) for r in self._get("who").split(",") if r}
        watched = [r for r in range(self.world) if r not in arrived] if self.rank == 0 else [0]
        out = []
        for r in watched:
            if r == self.rank or r in arrived:
                continue
            g = processes.get(r)
            beat = self.store.add(f"{_PREFIX}/beat/{g}", 0) if g is not None else -1
            last = self.seen.get(r)
            if last is None or last[0] != beat:
                self.seen[r] = (beat, now if last is not None else self.started)
            elif now - last[1] > self.timeout:
                out.append(r)
        return out

    def _get(self, name: str) -> str:
        k = f"{self.key}/{name}"
        return self.store.get(k).decode() if self.store.check([k]) else ""


def _parse_pairs(text: str) -> dict[int, int]:
    """``{save rank: global rank}`` from ``"0:4,1:5,"``."""
    out = {}
    for pair in text.split(","):
        if pair:
            r, _, g = pair.partition(":")
            out[int(r)] = int(g)
    return out


def forget(save_id: str) -> None:
    """(coordinator, after every rank has passed the meeting) Drop the save's keys."""
    store = job_store()
    for name in _PER_SAVE_KEYS:
        # Any error: a store without deletes keeps a few bytes; nothing to fail for.
        with contextlib.suppress(Exception):
            store.delete_key(f"{_PREFIX}/{save_id}/{name}")
