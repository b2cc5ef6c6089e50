"""Run a function as a job of several gloo ranks that may be killed, and report how each rank ended.

    result = run_job(fn, world, *args, timeout=60.0)

Unlike ``dist.run_ranks``, a rank that dies (SIGKILL included) does not end the job: every rank
runs until it returns, raises, dies, or ``timeout`` passes (then it is SIGKILLed, as a scheduler
would), and ``JobResult`` says which. ``fn(rank, world, *args)`` runs after the process group is up
(gloo, ``file://`` rendezvous in the job's own folder); its return value comes back pickled.

Ranks fork from a forkserver that has already imported torch and the library, so a job of two
ranks starts in a fraction of a second instead of two interpreter starts and torch imports.

Inside a rank, ``kill_job()`` SIGKILLs every rank of the job at once (each rank wrote its pid
into the job folder before the rendezvous), and ``kill_self()`` only the calling rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["JobResult", "RankEnd", "kill_job", "kill_self", "run_job"]

_PRELOAD = ["torch", "torch.distributed.checkpoint", "hf_dcp_storage", "fsspec"]
_CTX: Any = None
_JOB_DIR_ENV = "HF_DCP_TEST_JOB_DIR"


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended: ``returned`` (with ``value``), ``raised`` (``error`` holds the
    traceback), ``killed`` (by a signal: ``signal``) or ``hung`` (killed at the timeout)."""

    rank: int
    how: str
    seconds: float
    value: Any = None
    error: str = ""
    signal: int | None = None
    log: str = ""  # what the rank logged at WARNING and above
    ended_at: float = 0.0  # wall-clock time it was seen ended (time.time())
    fired_at: float | None = None  # when a kill point fired in the job (``killpoints``), if one did


@dataclass(frozen=True)
class JobResult:
    ranks: tuple[RankEnd, ...]

    def how(self) -> list[str]:
        return [r.how for r in self.ranks]

    def check_returned(self) -> list[Any]:
        """Every rank's return value; raises with every failing rank's story otherwise."""
        bad = [r for r in self.ranks if r.how != "returned"]
        if bad:
            raise AssertionError(
                "\n".join(f"rank {r.rank} {r.how} (signal {r.signal}):\n{r.error}" for r in bad)
            )
        return [r.value for r in self.ranks]


def _context() -> Any:
    global _CTX  # noqa: PLW0603 - a per-process cache, set once
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def run_job(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; wait until all ended or ``timeout``."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="hf_dcp_job_") as job_dir:
        procs = [
            ctx.Process(target=_rank_main, args=(rank, world, job_dir, fn, args, env or {}))
            for rank in range(world)
        ]
        started = time.monotonic()
        for p in procs:
            p.start()
        ended: dict[int, float] = {}
        ended_at: dict[int, float] = {}
        while len(ended) < world and time.monotonic() - started < timeout:
            for rank, p in enumerate(procs):
                if rank not in ended and not p.is_alive():
                    ended[rank], ended_at[rank] = time.monotonic() - started, time.time()
            time.sleep(0.02)
        hung = [rank for rank in range(world) if rank not in ended]
        for rank in hung:
            procs[rank].kill()
        for p in procs:
            p.join()
        fired = os.path.join(job_dir, "fired")
        fired_at = float(open(fired).read() or "nan") if os.path.exists(fired) else None
        ends = [
            _ending(rank, procs[rank], job_dir, ended.get(rank, timeout), rank in hung)
            for rank in range(world)
        ]
        return JobResult(
            tuple(
                dataclasses.replace(
                    e, ended_at=ended_at.get(e.rank, time.time()), fired_at=fired_at
                )
                for e in ends
            )
        )


def _ending(rank: int, proc: Any, job_dir: str, seconds: float, hung: bool) -> RankEnd:
    log_path = os.path.join(job_dir, f"rank{rank}.log")
    log = open(log_path).read() if os.path.exists(log_path) else ""
    if hung:
        return RankEnd(rank, "hung", seconds, signal=signal.SIGKILL, log=log)
    out = os.path.join(job_dir, f"rank{rank}.out")
    if proc.exitcode is not None and proc.exitcode < 0:
        return RankEnd(rank, "killed", seconds, signal=-proc.exitcode, log=log)
    if not os.path.exists(out):
        return RankEnd(
            rank, "raised", seconds, error=f"exit code {proc.exitcode} and no result", log=log
        )
    with open(out, "rb") as f:
        ok, payload = pickle.load(f)
    if ok:
        return RankEnd(rank, "returned", seconds, value=payload, log=log)
    return RankEnd(rank, "raised", seconds, error=payload, log=log)


def _rank_main(
    rank: int,
    world: int,
    job_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    import logging

    import torch
    import torch.distributed as dist

    handler = logging.FileHandler(os.path.join(job_dir, f"rank{rank}.log"))
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    os.environ.update(env)
    os.environ[_JOB_DIR_ENV] = job_dir
    torch.set_num_threads(1)
    with open(os.path.join(job_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(job_dir, 'rendezvous')}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            result: tuple[bool, Any] = (True, fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        result = (False, traceback.format_exc())
    tmp = os.path.join(job_dir, f"rank{rank}.out.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(job_dir, f"rank{rank}.out"))


def kill_job() -> None:
    """(inside a rank) SIGKILL every rank of the job, this one last: the whole job dies at once."""
    job_dir = os.environ[_JOB_DIR_ENV]
    me = os.getpid()
    for name in os.listdir(job_dir):
        if name.endswith(".pid"):
            with open(os.path.join(job_dir, name)) as f:
                pid = int(f.read())
            if pid != me:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    kill_self()


def kill_self() -> None:
    """(inside a rank) SIGKILL this rank alone."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: SIGKILL is not deliverable late
