"""``CheckpointManager``: step checkpoints on any store, keep-last-N retention, exact resume.

Layout of a run folder::

    root/step_{N}/model-0000k-of-0000M.safetensors  the weights: a consolidated HF checkpoint
    root/step_{N}/model.safetensors.index.json      (loadable by transformers as it is)
    root/step_{N}/training_state/                   optimizer tensors etc. (HF safetensors,
                                                    resharded on load) and one JSON per rank
                                                    (other values, RNG)
    root/step_{N}/COMMITTED                         written last: the step is complete

Call sequence: every rank constructs the manager with the same arguments and calls ``save`` /
``load`` / ``prune`` / ``latest`` / ``all_checkpoints`` at the same points (they use collectives
when ``torch.distributed`` is initialized). Rank 0 alone lists, prunes and commits; its decisions
are broadcast, so every rank sees the same answer.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Mapping, MutableMapping
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..io import fsio
from ..io.companions import Companions, check_companions
from ..io.direct import check_direct_io
from ..plan.layout import check_file_name
from ..session.meeting import DEFAULT_RANK_TIMEOUT, check_rank_timeout
from ..stores.retry import RetryPolicy
from ..writer import HFStorageWriter
from . import folder as step_folder
from .background import ASYNC_MODES, BackgroundSaves, Reported
from .control import Control
from .folder import TRAINING_STATE_DIR
from .retention import COMMIT_MARKER, RetentionPolicy, step_name, to_remove
from .runs import remove_step, step_status

__all__ = ["TRAINING_STATE_DIR", "CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Save every N steps, keep the last few, resume exactly from the newest complete one.

    Args:
        root: the run folder, a local path or any fsspec URL (``s3://bucket/run1``).
        keep_last_n: complete steps kept by retention (the newest is always kept).
        keep_every: also keep, forever, every complete step that is a multiple of this.
        storage_options: passed to fsspec.
        max_shard_size, thread_count, retry, direct_io: passed to ``HFStorageWriter`` /
            ``HFStorageReader``.
        rank_timeout: passed to ``HFStorageWriter``: how long the ranks of an object-store save
            wait for a silent (dead or hung) rank before the save fails.
        companions: the model's config and tokenizer files (a folder or a dict,
            ``HFStorageWriter(companions=...)``), written into every step's weights folder, so
            that each step loads with ``from_pretrained``.
        file_name: every step's weights in the one file of this name: with PEFT's
            ``"adapter_model.safetensors"`` and its ``adapter_config.json`` as a companion
            (``integrations.peft``), each step of adapter-only weights is an adapter folder
            that ``PeftModel.from_pretrained`` loads.
        overwrite: let ``save`` replace a complete step of the same number (else refused).
        reuse_staging: with ``save(..., async_save=True)``, keep the host copy of the tensors
            that an async save stages and copy into it again at the next save, instead of
            allocating a fresh copy each time (DCP's default): less time blocked from the
            second save on, at the price of holding that copy (pinned when CUDA is present)
            between saves. Free it with ``close()``, or use the manager in a ``with`` block.
        async_mode: where ``save(..., async_save=True)`` writes: ``"thread"`` (a thread of this
            process) or ``"process"`` (DCP's background process of each rank,
            ``AsyncCheckpointerType.PROCESS``: the training loop keeps the GIL; the tensors are
            staged into shared memory; ``steps/background.py``).

    Raises:
        ValueError: a bad retention setting, ``rank_timeout`` or ``async_mode``, naming it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last_n: int = 3,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        max_shard_size: int | str = "5GB",
        thread_count: int = 4,
        retry: RetryPolicy | None = None,
        overwrite: bool = False,
        reuse_staging: bool = False,
        rank_timeout: float = DEFAULT_RANK_TIMEOUT,
        async_mode: str = "thread",
        direct_io: bool | None = None,
        companions: Companions | None = None,
        file_name: str | None = None,
    ) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(
                f"async_mode={async_mode!r} must be 'thread' (a thread of this process) or "
                "'process' (DCP's background process of each rank)"
            )
        self.policy = RetentionPolicy(keep_last_n, keep_every)
        self.storage_options = storage_options
        self.fs, self.root = fsio.resolve(root, storage_options)
        self.url = fsio.url_of(self.fs, self.root)
        # What writers and readers alike take.
        self._io = {
            "storage_options": storage_options,
            "thread_count": thread_count,
            "retry": retry,
            "direct_io": check_direct_io(direct_io),
        }
        self.max_shard_size = max_shard_size
        check_companions(companions)
        self.companions = companions
        self.file_name = check_file_name(file_name, None)
        self.rank_timeout = check_rank_timeout(rank_timeout)
        self.overwrite = overwrite
        self._in_flight: tuple[int, Reported[int]] | None = None
        self._control = Control()
        self.reuse_staging, self.async_mode = reuse_staging, async_mode
        self._background = BackgroundSaves(async_mode, reuse_staging)
        _OPEN.add(self)

    def close(self) -> None:
        """(all ranks) Wait for an async save in flight, then free what the manager holds: the
        reused staging copies and the process groups it made. The manager can still save
        afterwards (it makes them again when needed).

        Also run at interpreter exit for a manager still open (``atexit``, before Python tears
        down its modules): the last async save commits and the groups are destroyed while the
        interpreter is whole, instead of a commit thread or a gloo group being torn down under
        finalization, which can abort the process after the step has committed.
        """
        try:
            self.wait()
        finally:
            self._background.close()
            self._control.close()
            _OPEN.discard(self)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- queries ------------------------------------------------------------------------------

    def all_checkpoints(self) -> list[int]:
        """(all ranks) Complete steps, ascending."""
        return self._broadcast(
            sorted(s for s, done in self._list_steps().items() if done) if self._rank == 0 else None
        )

    def latest(self) -> int | None:
        """(all ranks) The newest complete step, or ``None``."""
        steps = self.all_checkpoints()
        return steps[-1] if steps else None

    # -- save ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model_state_dict: Mapping[str, Any],
        training_state: Mapping[str, Any] | None = None,
        *,
        async_save: bool = False,
    ) -> Future[int] | None:
        """(all ranks) Save step ``step``: weights, training state and every rank's RNG states.

        The step becomes visible (``latest``) only once everything is written and rank 0 has
        written the commit marker; retention runs right after. With ``async_save`` the call
        returns once the tensors are staged (copied), and the returned future resolves to
        ``step`` after the commit; a later ``save``/``load`` waits for it first, and raises its
        error if it failed and the future's error was not read.

        Raises:
            ValueError: a bad step, or ranks disagreeing on it.
            TypeError: a training-state value that is neither a tensor nor JSON, before anything
                is written.
            FileExistsError: the step is already complete and ``overwrite`` is off.
        """
        folder = fsio.join(self.root, step_name(step))
        self.wait()
        tensors, payload = step_folder.prepare(self._ctl(), step, training_state)
        refusal = self._broadcast(self._clear_step(step) if self._rank == 0 else None)
        if refusal:
            raise FileExistsError(refusal)
        self._barrier()  # the folder is clear before anyone writes into it

        options = {
            "max_shard_size": self.max_shard_size,
            "rank_timeout": self.rank_timeout,
            **self._io,
        }
        model_writer, state_writer = step_folder.writers(
            self.fs,
            folder,
            bool(tensors),
            options,
            companions=self.companions,
            file_name=self.file_name,
        )
        if not async_save:
            # This rank's state goes up while the tensors are saved: its PUT (on an object store
            # often the rank's first request, the slowest) holds up no collective of the saves.
            with futures.ThreadPoolExecutor(1, thread_name_prefix="hf-dcp-rank-state") as pool:
                put = pool.submit(
                    step_folder.write_rank_state, self.fs, folder, self._rank, payload
                )
                dcp.save(dict(model_state_dict), storage_writer=model_writer)
                if state_writer is not None:
                    dcp.save(tensors, storage_writer=state_writer)
                put.result()
            self._barrier()
            if self._rank == 0:
                self._commit(step)
            self.prune()
            return None
        step_folder.write_rank_state(self.fs, folder, self._rank, payload)
        return self._save_async(step, model_state_dict, tensors, model_writer, state_writer)

    def wait(self) -> None:
        """Block until an async save in flight has ended. A failed save's error is raised here
        unless the caller has read it from the save's future already: raised once, never lost."""
        if self._in_flight is not None:
            _, fut = self._in_flight
            try:
                futures.wait([fut])
                if not fut.reported:
                    fut.result()
            finally:
                self._in_flight = None

    def _save_async(
        self,
        step: int,
        model_state_dict: Mapping[str, Any],
        tensors: dict[str, torch.Tensor],
        model_writer: HFStorageWriter,
        state_writer: HFStorageWriter | None,
    ) -> Future[int]:
        _OPEN.add(self)  # again, if it was closed: the exit hook must wait for this save

        def commit() -> None:
            if self._rank == 0:
                # Rank 0's saves return after their commit, i.e. after every rank's bytes.
                self._commit(step)
                self._prune_local(in_flight=())

        done = self._background.start(
            step, model_state_dict, tensors, model_writer, state_writer, commit
        )
        self._in_flight = (step, done)
        return done

    # -- load ---------------------------------------------------------------------------------

    def load(
        self,
        model_state_dict: MutableMapping[str, Any],
        training_state: MutableMapping[str, Any] | None = None,
        step: int | None = None,
    ) -> int:
        """(all ranks) Load a complete step (the newest when ``step`` is None) in place; returns it.

        Weights and training-state tensors reshard onto the current layout. ``Stateful`` entries
        get ``load_state_dict``; plain entries of ``training_state`` are replaced by the saved
        values; this rank's RNG states are restored last (with another world size, rank ``r``
        takes the saved rank ``r % saved_world_size``).

        Raises:
            FileNotFoundError: no complete step (or not ``step``) in the run folder.
            KeyError: a training-state entry the checkpoint does not hold.
        """
        self.wait()
        steps = self.all_checkpoints()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"{self.url}: no complete step checkpoint to load (step_N folders with "
                    f"{COMMIT_MARKER})"
                )
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(
                f"{self.url}: step {step} is not a complete checkpoint here; complete steps: "
                f"{steps}"
            )
        # Readers take the writers' I/O settings (storage options, threads, retry, direct I/O).
        step_folder.load(
            self.fs,
            fsio.join(self.root, step_name(step)),
            model_state_dict,
            training_state,
            rank=self._rank,
            reader_io=self._io,
        )
        self._barrier()
        return step

    # -- retention ------------------------------------------------------------------------------

    def prune(self) -> list[int]:
        """(all ranks) Apply retention; returns the removed steps (rank 0 removes, all agree)."""
        in_flight = [self._in_flight[0]] if self._in_flight is not None else []
        return self._broadcast(self._prune_local(in_flight) if self._rank == 0 else None)

    def _prune_local(self, in_flight: list[int] | tuple[int, ...]) -> list[int]:
        removed = to_remove(self._list_steps(), self.policy, in_flight)
        for s in removed:
            remove_step(self.fs, self.root, s)
        return removed

    # -- helpers --------------------------------------------------------------------------------

    def _list_steps(self) -> dict[int, bool]:
        """step -> complete?, for every ``step_N`` folder (rank 0); none before the first save."""
        return step_status(self.fs, self.root, missing_ok=True)

    def _clear_step(self, step: int) -> str | None:
        """(rank 0) Make the step's folder empty, or say why not (a complete step, no overwrite)."""
        fix = "pass CheckpointManager(..., overwrite=True) to replace it, or save another step"
        return step_folder.clear(
            self.fs, fsio.join(self.root, step_name(step)), overwrite=self.overwrite, fix=fix
        )

    def _commit(self, step: int) -> None:
        step_folder.commit(self.fs, fsio.join(self.root, step_name(step)), step, self._world)

    @property
    def _rank(self) -> int:
        return self._control.rank

    @property
    def _world(self) -> int:
        return self._control.world

    def _ctl(self) -> Control:
        """(all ranks) The manager's small collectives (``steps/control.py``). Registers the
        manager for the exit hook first when their group is about to be made, so that it is
        destroyed while the interpreter is whole."""
        if not self._control.has_group:
            _OPEN.add(self)
        return self._control

    def _broadcast(self, value: Any) -> Any:
        return self._ctl().broadcast(value)

    def _barrier(self) -> None:
        self._ctl().barrier()


# Managers not yet closed, for the exit hook (weakly: a manager dropped by its owner is not kept).
_OPEN: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


@atexit.register
def _close_open_managers() -> None:
    for manager in list(_OPEN):
        try:
            manager.close()
        except BaseException as exc:  # noqa: BLE001 - at exit: report, and close the others
            logger.error("closing a CheckpointManager at exit failed: %s", exc)
