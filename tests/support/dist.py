"""Run a function on several gloo ranks, each in its own spawned process.

    run_ranks(fn, world_size, *args)

spawns ``world_size`` processes (start method ``spawn``); each joins a gloo process group whose
rendezvous is a fresh ``file://`` in a temporary folder (no TCP ports), calls
``fn(rank, world_size, *args)`` and destroys the group. ``fn`` must be a module-level function
(spawned children import it by name). A failure on any rank fails the caller with that rank's
traceback; the other ranks are terminated instead of being left waiting in a collective, and
a run that hangs is killed after ``RUN_TIMEOUT_S``.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailed", "run_ranks"]

# A rank stuck in a collective (its peer died or diverged) fails after this instead of hanging.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=180)
# The whole run (all ranks) is killed after this: catches hangs outside collectives too.
RUN_TIMEOUT_S = 300.0


class RankFailed(RuntimeError):
    """Raised in a child for any failure; its message carries the full traceback(s)."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank
    fails."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    with tempfile.TemporaryDirectory(prefix="hf_dcp_rdzv_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _child,
            args=(world_size, init_file, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # join() returns when a rank exits (or at the timeout); on the first failure it
        # terminates the other ranks and raises ProcessRaisedException with that rank's traceback.
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                alive = [p for p in ctx.processes if p.is_alive()]
                for p in alive:
                    p.kill()
                for p in alive:
                    p.join()
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks did not finish within {RUN_TIMEOUT_S}s; "
                    f"killed ranks {[ctx.processes.index(p) for p in alive]}"
                )


def _child(
    rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
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
    except BaseException:  # noqa: BLE001 - CheckpointException derives from BaseException
        # mp.spawn forwards only Exception subclasses with their traceback; a BaseException
        # (such as DCP's CheckpointException) would only show up as "exit code 1". Re-raise
        # everything as an Exception whose message holds the complete text, including the
        # per-rank traces DCP collected.
        raise RankFailed(f"rank {rank}/{world_size} failed:\n{traceback.format_exc()}") from None
    # Success: leave without interpreter teardown. Process groups a DeviceMesh still holds are
    # destroyed during finalization, where gloo has aborted a finished rank once in CI
    # ("terminate called without an active exception", SIGABRT) after its results were written.
    # Everything the rank owes is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
