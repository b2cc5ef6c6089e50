"""A process group of one save's ranks, of its own: where a part store's save sends the runs
too small to be parts to the ranks that gather them (``stores/exchange.py``).

Not the trainer's group: ``dcp.async_save`` runs the save on a background thread (or process)
while the training loop goes on issuing collectives on its groups, and two threads' collectives
on one group interleave. Not ``dist.new_group`` either: every process of the job must call it,
in the same order, from the thread that owns the groups. This group is a gloo backend made
straight on the job's key-value store under a prefix of the save's id (as torch makes a group's
backend), known to no one else: any thread may make it, only the save's ranks take part, and it
goes when the save drops it. Its timeout is the save's ``rank_timeout``: a rank that stops taking
part fails the others' sends and receives after that long, not after the store's 30 minutes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from .meeting import job_store

__all__ = ["EAGER_GROUP_WORLD", "PointToPoint", "forget_group", "save_group"]

_PREFIX = "hf_dcp_storage/group"


class PointToPoint(Protocol):
    """What the save's group is used for: a gloo backend's send and receive (torch's type stubs
    do not list them on the backend). Each returns a work whose ``wait()`` raises on failure."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any: ...


# Up to this many ranks a group connects every pair when it is made (a full mesh of at most 63
# sockets a rank: cheap); beyond, with gloo's lazy init, each pair when it first exchanges: at
# 8,192 ranks a full mesh is 8,191 sockets a rank, opened before the first byte moves, where a
# save's exchange talks mostly within a node. One run of the suite (torchtune's recipe, 2 ranks,
# lazy init) saw rank 0 abort at exit ("terminate called without an active exception") after a
# complete run, not reproduced since: lazy init stays where it is needed.
EAGER_GROUP_WORLD = 64


def save_group(
    save_id: str, rank: int, world: int, timeout: float, *, lazy: bool | None = None
) -> PointToPoint:
    """(every rank of save ``save_id``, at the same point of the save) A gloo group of the
    save's ``world`` ranks, this one ``rank``; send/recv and collectives. Eager (``lazy``
    false; the default up to ``EAGER_GROUP_WORLD`` ranks): returns once every rank has joined.
    Lazy (the default beyond): at once, each pair of ranks connecting when it first exchanges
    (gloo's lazy init: no full mesh of ``world`` sockets a rank).

    Raises:
        RuntimeError: torch.distributed is not initialised, or the ranks did not all join
            within ``timeout`` seconds.
    """
    if lazy is None:
        lazy = world > EAGER_GROUP_WORLD
    store = dist.PrefixStore(f"{_PREFIX}/{save_id}", job_store())
    with _lazy_init() if lazy else contextlib.nullcontext():
        group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout))
    return cast(PointToPoint, group)


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _lazy_init() -> Iterator[None]:
    """gloo reads ``TORCH_GLOO_LAZY_INIT`` when a group is made (torch's ProcessGroupGloo): set
    for this construction only, then put back as it was."""
    with _ENV_LOCK:
        before = os.environ.get(_LAZY)
        os.environ[_LAZY] = "1"
        try:
            yield
        finally:
            if before is None:
                del os.environ[_LAZY]
            else:
                os.environ[_LAZY] = before


_LAZY = "TORCH_GLOO_LAZY_INIT"


def forget_group(save_id: str, rank: int) -> None:
    """(each rank of the save, once its part in the exchange is over) Drop the address its
    rendezvous left on the job's store (gloo names it ``<device>/<rank>`` under the prefix; one
    device), so that a long job's saves leave nothing behind. Best effort: a key it cannot
    delete is a few bytes, no failure."""
    with contextlib.suppress(Exception):
        job_store().delete_key(f"{_PREFIX}/{save_id}/0/{rank}")
