"""The small collectives of a checkpoint's bookkeeping: rank 0 decides, every rank hears it.

``CheckpointManager`` and the trainer integrations make their decisions (which steps exist, what
was refused, when a folder is clear) on rank 0 and broadcast them. Those are a few hundred bytes
of Python objects: they run on a gloo-capable group, never on the tensors' NCCL group. Without
``torch.distributed`` initialized every call is the identity for one process.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist

__all__ = ["Control"]


class Control:
    """Rank, world size and object collectives on a gloo-capable group (every rank makes one).

    The group is the default one when it can carry CPU tensors (gloo, ``cpu:gloo,cuda:nccl``),
    else a gloo group of the same ranks, made on first use. Under plain NCCL an object
    collective would stage through ``torch.cuda.current_device()``, which is GPU 0 on every rank
    that never called ``torch.cuda.set_device``; a few hundred bytes of decisions need no GPU.
    """

    def __init__(self) -> None:
        self._group: Any = None

    @property
    def active(self) -> bool:
        """Whether ``torch.distributed`` is initialized (else: one process)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.active else 0

    @property
    def world(self) -> int:
        return dist.get_world_size() if self.active else 1

    @property
    def has_group(self) -> bool:
        """Whether the group has been picked (or made) since construction or ``close``."""
        return self._group is not None

    def group(self) -> Any:
        """(all ranks) The group the collectives run on, made once."""
        if self._group is None:
            backend = str(dist.get_backend())
            self._group = dist.group.WORLD if "gloo" in backend else dist.new_group(backend="gloo")
        return self._group

    def broadcast(self, value: Any) -> Any:
        """(all ranks) Rank 0's ``value``, on every rank."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group())
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """(all ranks) Every rank's ``value``, by rank."""
        if not self.active:
            return [value]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value, group=self.group())
        return out

    def barrier(self) -> None:
        """(all ranks) Wait for every rank."""
        if self.active:
            dist.barrier(group=self.group())

    def close(self) -> None:
        """Destroy the group made (if any); a later collective makes it again."""
        group, self._group = self._group, None
        if group is not None and group is not dist.group.WORLD and self.active:
            with contextlib.suppress(ValueError, RuntimeError):  # already destroyed with its job
                dist.destroy_process_group(group)
