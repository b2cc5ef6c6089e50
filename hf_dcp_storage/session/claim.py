"""One save (or load) at a time on a storage writer (or reader).

A writer holds one save's state: its path, store, layout and plans. Two saves sharing one writer
(two ``dcp.async_save`` calls, each on a thread of its own) would swap the path and the store
under each other, and one save's bytes could land in the other's folder. So each save takes the
writer with a ``Claim`` at its first call into it and gives it back at its last; a save that
finds the writer taken is refused at once, before it changes anything.

Call sequence, as the writer and the reader use it (all in the thread that runs the save, which
is the thread DCP calls every step of a save from):

1. ``take`` in ``reset`` (DCP calls ``reset(checkpoint_id)`` first, when a save names a path):
   a new save. It replaces a claim that this thread holds (a save of this thread that ended
   without telling the writer: DCP ends a save that failed in the planner or on another rank
   without a further call) or whose thread has ended.
2. ``join`` in the writer's ``storage_meta`` (DCP's first call of a save) and
   ``set_up_storage_writer``, the reader's ``set_up_storage_reader``: the save ``reset`` took goes
   on, or, where DCP called no ``reset`` (the path was given to the constructor), starts here.
3. ``release`` after the save's last call on this rank (``finish`` on the coordinator,
   ``write_data`` elsewhere; ``read_data`` for a load) and on every error path of the writer's
   own steps, so a failed save frees the writer for the next one.

What the writer cannot see: DCP ends a save that fails in the planner or on another rank
without another call into it. Such a claim is freed by the next save of the same thread (a
synchronous ``dcp.save`` cannot overlap one of its own thread) or once its thread has ended
(each ``dcp.async_save`` runs on a thread of its own, which ends with the save).

The claim is a token per save (``_Holder``): ``release`` frees only the claim the calling
thread took, so a late error path of one save never frees the next save's claim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["Claim", "released_on_error"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class _Holder:
    """The save holding a claim: the thread running it, and the path it saves (for the refusal)."""

    thread: threading.Thread
    where: str


class Claim:
    """Who is saving (or loading) with one writer (or reader), if anyone.

    Args:
        what: how a refusal names the object (``"HFStorageWriter"``).
        job: what it does, for the refusal (``"save"``, ``"load"``).
        doing: the same as a verb (``"saving"``, ``"loading"``).
        how: how a second one comes to run meanwhile (``"a dcp.async_save in flight"``).
    """

    def __init__(self, what: str, job: str, doing: str, how: str) -> None:
        self._what, self._job, self._doing, self._how = what, job, doing, how
        self._lock = threading.Lock()
        self._holder: _Holder | None = None

    def take(self, where: Callable[[], str]) -> None:
        """A save starts in this thread (``reset``); ``where()`` is the path it will save.

        Raises:
            RuntimeError: another live thread's save holds the claim, naming its path.
        """
        with self._lock:
            self._refuse_if_other()
            self._holder = _Holder(threading.current_thread(), where())

    def join(self, where: Callable[[], str]) -> None:
        """The save of this thread goes on (its ``reset`` took the claim), or starts here.

        Raises:
            RuntimeError: another live thread's save holds the claim, naming its path.
        """
        with self._lock:
            self._refuse_if_other()
            holder = self._holder
            if holder is None or holder.thread is not threading.current_thread():
                self._holder = _Holder(threading.current_thread(), where())

    def release(self) -> None:
        """This thread's save is over on this rank (done or failed): the next save may start.
        A no-op where this thread holds no claim."""
        with self._lock:
            holder = self._holder
            if holder is not None and holder.thread is threading.current_thread():
                self._holder = None

    @contextlib.contextmanager
    def released_on_error(self) -> Iterator[None]:
        """Run a step of the save; if it raises, the save is over: release, then re-raise."""
        try:
            yield
        except BaseException:
            self.release()
            raise

    def _refuse_if_other(self) -> None:
        holder = self._holder
        if (
            holder is not None
            and holder.thread is not threading.current_thread()
            and holder.thread.is_alive()
        ):
            raise RuntimeError(
                f"this {self._what} is still {self._doing} {holder.where} in thread "
                f"{holder.thread.name!r} ({self._how}); a {self._what} holds one {self._job}'s "
                f"state at a time: pass a new {self._what} to each {self._job}, or wait for the "
                "previous one to end"
            )


def released_on_error(method: Callable[..., T]) -> Callable[..., T]:
    """Decorate a step of a writer's (reader's) save: if it raises, the save is over, so the
    object's ``claim`` (a ``Claim``) is released before the error goes on to DCP."""

    @functools.wraps(method)
    def step(self: Any, *args: Any, **kwargs: Any) -> T:
        with self.claim.released_on_error():
            return method(self, *args, **kwargs)

    return step
