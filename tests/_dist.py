"""Run a function on several gloo ranks, each in its own spawned process.

    run_ranks(fn, world_size, *args)

spawns ``world_size`` processes (start method ``spawn``); each joins a gloo process group whose
rendezvous is a fresh ``file://`` in a temporary folder (no TCP ports), calls
``fn(rank, world_size, *args)`` and destroys the group. ``fn`` must be a module-level function
(spawned children import it by name). A failure on any rank fails the caller with that rank's
traceback; the other ranks are terminated instead of being left waiting in a collective.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RankFailed"]

# A rank stuck in a collective (its peer died or diverged) fails after this instead of hanging.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=180)


class RankFailed(RuntimeError):
    """Raised in a child for any failure; its message carries the full traceback(s)."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank fails."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    with tempfile.TemporaryDirectory(prefix="hf_dcp_rdzv_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # join=True: waits for all ranks; on the first failure it terminates the others and
        # raises ProcessRaisedException carrying that rank's traceback.
        mp.spawn(
            _child,
            args=(world_size, init_file, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )


def _child(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        try:
            fn(rank, world_size, *args)
            # Nobody leaves (and tears down the group) while a peer still needs it.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        # mp.spawn forwards only Exception subclasses with their traceback; a BaseException
        # (such as DCP's CheckpointException) would only show up as "exit code 1". Re-raise
        # everything as an Exception whose message holds the complete text, including the
        # per-rank traces DCP collected.
        raise RankFailed(f"rank {rank}/{world_size} failed:\n{traceback.format_exc()}") from None
