"""Wait, inside ``write_data``, until every rank of a save has staged its bytes.

A rank assembling other ranks' staged bytes (``_spread.py``) may start only when they are all
staged. DCP does not hand the storage writer its process group, and a collective issued on
another group from ``dcp.async_save``'s background thread could interleave with the training
loop's own collectives. So the ranks meet on the job's key-value store instead (the one
``init_process_group`` set up; the same pattern as torch's store-based barrier): no process group,
no device, safe from any thread. Every rank arrives, failed or not, so a rank that failed its
own writes does not leave the others waiting: they all learn which ranks failed and stop.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["arrive", "arrive_and_wait", "forget"]

_PREFIX = "hf_dcp_storage/arrival"


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "HFStorageWriter: a save on several ranks needs torch.distributed initialised (its key-value store "
            "is where ranks meet before gathering each other's staged bytes); call init_process_group first"
        )
    # The default group's store: every rank of any group of the job can reach it.
    return dist.distributed_c10d._get_default_store()


def arrive(save_id: str, world: int, *, failed_rank: int | None = None) -> None:
    """(every rank of the save, once) Report that this rank is done with its own bytes, or with
    ``failed_rank`` that it failed them; does not wait."""
    store = _store()
    key = f"{_PREFIX}/{save_id}"
    if failed_rank is not None:
        # Before arriving: whoever sees everyone arrived also sees every failure.
        store.append(f"{key}/failed", f"{failed_rank},")
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", b"1")


def arrive_and_wait(save_id: str, world: int) -> list[int]:
    """(every rank of the save that succeeded, once) Arrive, wait for all ``world`` ranks, and
    return the ranks that arrived failed (sorted; empty when all succeeded).

    Waits up to the store's timeout (the process group's, 30 min by default): a rank that died
    without arriving fails the others then, as a collective would.
    """
    arrive(save_id, world)
    store = _store()
    key = f"{_PREFIX}/{save_id}"
    store.wait([f"{key}/all"])
    if not store.check([f"{key}/failed"]):
        return []
    return sorted(int(r) for r in store.get(f"{key}/failed").decode().split(",") if r)


def forget(save_id: str) -> None:
    """(coordinator, after every rank has passed ``arrive_and_wait``) Drop the save's keys."""
    store = _store()
    for name in ("arrived", "all", "failed"):
        try:
            store.delete_key(f"{_PREFIX}/{save_id}/{name}")
        except Exception:  # noqa: BLE001 - a store without deletes keeps a few bytes; nothing to fail
            pass
