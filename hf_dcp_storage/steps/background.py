"""How ``CheckpointManager`` runs a step's saves in the background: DCP's ``async_save``, on a
thread of this process or in DCP's background process of this rank, on process groups of its own.

A step is two saves, the weights and the training state's tensors, then the commit. On threads
they run side by side, each on a gloo group of its own (collectives of two threads, or of a
thread and the training loop, must never share one). In a process (DCP's
``AsyncCheckpointerType.PROCESS``: one background process per rank, fed through one pipe, one
save at a time) they run one after the other: the training state is staged at the call, with
the weights, and its save is sent once the weights' save is done.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..writer import HFStorageWriter

__all__ = ["ASYNC_MODES", "BackgroundSaves", "Reported"]

ASYNC_MODES = ("thread", "process")
T = TypeVar("T")


class BackgroundSaves:
    """The async saves of one manager (every rank makes one, with the same arguments).

    Args:
        mode: ``"thread"`` or ``"process"`` (see the module docstring).
        reuse_staging: keep the host copies of the staged tensors between saves and refill them
            (two ``DefaultStager``s, one per state dict), instead of a fresh copy per save.
    """

    def __init__(self, mode: str, reuse_staging: bool) -> None:
        self.mode, self.reuse_staging = mode, reuse_staging
        self._groups: tuple[Any, Any] | None = None
        # (model, training state) stagers kept across saves (reuse_staging). A save waits for
        # the previous one (``CheckpointManager.save`` calls ``wait`` first), so a staged copy
        # is never refilled while being written.
        self._stagers: tuple[DefaultStager | None, DefaultStager | None] | None = None

    def start(
        self,
        step: int,
        model: Mapping[str, Any],
        tensors: dict[str, torch.Tensor],
        model_writer: HFStorageWriter,
        state_writer: HFStorageWriter | None,
        commit: Callable[[], None],
    ) -> Reported[int]:
        """(all ranks) Stage both state dicts now and save them in the background; ``commit``
        runs once both saves returned (on rank 0 that is after every rank's bytes). Returns a
        future of ``step``, done after the commit."""
        groups = self._process_groups()
        stagers, owned = self._stagers_for_this_save()
        kind = (
            AsyncCheckpointerType.PROCESS
            if self.mode == "process"
            else AsyncCheckpointerType.THREAD
        )
        first = _uploaded(
            dcp.async_save(
                dict(model),
                storage_writer=model_writer,
                process_group=groups[0],
                async_stager=stagers[0],
                async_checkpointer_type=kind,
            )
        )
        second = (
            None
            if state_writer is None
            else self._state_save(tensors, state_writer, groups[1], stagers[1], kind)
        )
        done: Reported[int] = Reported()

        def finish() -> None:
            try:
                first.result()
                if second is not None:
                    second().result()
                commit()
                done.set_result(step)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                done.set_exception(exc)
            finally:
                for stager in owned:
                    stager.close()

        # Not a daemon: a script that ends right after an async save still commits it (Python
        # joins such threads before it finalizes) instead of being cut off mid-commit.
        threading.Thread(target=finish, name=f"hf-dcp-commit-step-{step}").start()
        return done

    def _state_save(
        self,
        tensors: dict[str, torch.Tensor],
        writer: HFStorageWriter,
        group: Any,
        stager: DefaultStager | None,
        kind: AsyncCheckpointerType,
    ) -> Callable[[], Future[Any]]:
        """The training state's save, as a call that returns its future: in a process, the
        call starts it (``start``'s commit thread makes it once the model's save is done), from
        tensors staged now; with threads it is started now and the call hands it on."""
        if self.mode == "process":
            staged = (stager or _stager(shared=True)).stage(tensors)  # the snapshot, taken now
            assert isinstance(staged, dict)  # use_async_staging=False: staged in this thread

            def start() -> Future[Any]:
                return _uploaded(
                    dcp.async_save(
                        staged,
                        storage_writer=writer,
                        process_group=group,
                        async_stager=_Staged(),
                        async_checkpointer_type=kind,
                    )
                )

            return start
        started = _uploaded(
            dcp.async_save(tensors, storage_writer=writer, process_group=group, async_stager=stager)
        )
        return lambda: started

    def _stagers_for_this_save(
        self,
    ) -> tuple[tuple[DefaultStager | None, DefaultStager | None], list[DefaultStager]]:
        """The stagers of a save, and those to close after it. Threads: DCP's default (a fresh
        copy, ``None``) or the kept ones. A process: staging into shared memory, so the copy
        reaches the background process without another (kept ones, or fresh ones per save)."""
        if self.reuse_staging:
            if self._stagers is None:
                shared = self.mode == "process"
                self._stagers = (_stager(shared), _stager(shared))
            return self._stagers, []
        if self.mode == "process":
            fresh = (_stager(shared=True), _stager(shared=True))
            return fresh, list(fresh)
        return (None, None), []

    def _process_groups(self) -> tuple[Any, Any]:
        if self._groups is None:
            if dist.is_available() and dist.is_initialized():
                self._groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
            else:
                self._groups = (None, None)
        return self._groups

    def close(self) -> None:
        """Free the kept staging copies and destroy the process groups made (a later ``start``
        makes them again). Call with no save in flight."""
        stagers, self._stagers = self._stagers, None
        for stager in stagers or ():
            if stager is not None:
                stager.close()
        groups, self._groups = [g for g in self._groups or () if g is not None], None
        if dist.is_available() and dist.is_initialized():  # else the job destroyed them already
            for group in groups:
                with contextlib.suppress(ValueError, RuntimeError):
                    dist.destroy_process_group(group)


class Reported(Future[T]):
    """A step's future that remembers whether its outcome was read (``result``/``exception``
    after it was done): the manager raises a failed save's error once, from this future where
    the caller read it, else from the next ``save``, ``load`` or ``wait``."""

    reported = False

    def result(self, timeout: float | None = None) -> T:
        try:
            return super().result(timeout)
        finally:
            self.reported = self.reported or self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self.reported = self.reported or self.done()


def _stager(shared: bool) -> DefaultStager:
    """A stager that copies in the caller's thread: into pinned memory when CUDA is present,
    into shared memory when the save runs in another process."""
    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=shared,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


class _Staged(AsyncStager):
    """An ``AsyncStager`` for a state dict staged already: hands it on as it is."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _uploaded(response: Any) -> Future[Any]:
    """The future that resolves when an ``async_save`` has written everything."""
    return getattr(response, "upload_completion", response)
