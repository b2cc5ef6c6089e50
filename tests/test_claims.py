"""One save (load) at a time on a writer (reader), and on a ``CheckpointManager`` (issue 30).

A second save on a writer whose save is in flight must be refused before it changes anything
(else the first save's bytes can land in the second's folder), and a save that fails must free
the writer for the next. Every interleaving here is made with events, never sleeps: the first
save is held *before* ``set_up_storage_writer`` (in its planner's ``set_up_planner``, which DCP
calls right before it), and the test goes on only once the save's thread is there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from hf_dcp_storage import CheckpointManager, HFStorageReader, HFStorageWriter
from tests.support.checks import raises_in_checkpoint
from tests.support.data import assert_same, read_checkpoint

WAIT_S = 60.0  # upper bound on any wait: a broken claim fails the test instead of hanging it
REFUSED = r"still {doing} \S*{name}\S* in thread .* pass a new HFStorage{kind} to each {job}"


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
    }


def _refused(name: str, load: bool = False) -> str:
    if load:
        return REFUSED.format(doing="loading", name=name, kind="Reader", job="load")
    return REFUSED.format(doing="saving", name=name, kind="Writer", job="save")


class _Hold:
    """An event pair: the held thread says it is there (``arrived``), then waits for ``go``."""

    def __init__(self) -> None:
        self.arrived, self.go = threading.Event(), threading.Event()

    def wait_here(self) -> None:
        self.arrived.set()
        if not self.go.wait(WAIT_S):
            raise TimeoutError(f"the test did not release the held save within {WAIT_S} s")

    def until_arrived(self) -> None:
        assert self.arrived.wait(WAIT_S), "the held save never reached its hold"


class _HeldSavePlanner(DefaultSavePlanner):
    """Holds the save in ``set_up_planner``: after ``reset``/``storage_meta``, before
    ``set_up_storage_writer``."""

    def __init__(self, hold: _Hold) -> None:
        super().__init__()
        self.hold = hold

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.hold.wait_here()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


class _HeldLoadPlanner(DefaultLoadPlanner):
    """Holds the load in ``set_up_planner``: after ``reset``, before ``set_up_storage_reader``."""

    def __init__(self, hold: _Hold) -> None:
        super().__init__()
        self.hold = hold

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.hold.wait_here()
        super().set_up_planner(state_dict, metadata, is_coordinator)


class _FailingSavePlanner(DefaultSavePlanner):
    """Fails the save midway: inside the writer's ``write_data``, after planning, as a store error
    would."""

    def resolve_data(self, write_item: Any) -> Any:
        raise OSError("injected: the write failed")


@pytest.fixture
def held() -> Iterator[_Hold]:
    hold = _Hold()
    yield hold
    hold.go.set()  # never leave a save thread waiting, whatever the test did


def _same_files(got: str, expected: str) -> None:
    a, b = read_checkpoint(got)[0], read_checkpoint(expected)[0]
    assert sorted(a) == sorted(b)
    for key in b:
        assert_same(a[key], b[key], f"{got}: {key}")


# -- the writer --------------------------------------------------------------------------------


@pytest.mark.parametrize("named", [True, False], ids=["path-given-to-save", "path-given-to-writer"])
def test_a_second_save_is_refused_while_the_first_is_held_before_set_up(
    tmp_path, held: _Hold, named: bool
) -> None:
    """``named``: the first save passes ``checkpoint_id`` (DCP calls ``reset``); else the path was
    given to the constructor and ``storage_meta`` is the save's first call into the writer."""
    sd = _model(1)
    writer = HFStorageWriter() if named else HFStorageWriter(tmp_path / "one")
    first = dcp.async_save(
        sd,
        storage_writer=writer,
        planner=_HeldSavePlanner(held),
        checkpoint_id=tmp_path / "one" if named else None,
    )
    held.until_arrived()
    # A second save naming another path: refused by reset, before the path changes.
    with pytest.raises(RuntimeError, match=_refused("one")):
        dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / "two").result(
            timeout=WAIT_S
        )
    # The same path, named by no reset: refused at the save's first call (inside DCP's wrapping).
    with raises_in_checkpoint(RuntimeError, _refused("one")):
        dcp.async_save(sd, storage_writer=writer).result(timeout=WAIT_S)
    # A synchronous save from this thread is refused alike.
    with pytest.raises(RuntimeError, match=_refused("one")):
        dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "three")
    assert str(writer.checkpoint_id) == str(
        tmp_path / "one"
    )  # nothing changed under the first save
    held.go.set()
    first.result(timeout=WAIT_S)
    dcp.save(sd, storage_writer=HFStorageWriter(tmp_path / "sync"))
    _same_files(str(tmp_path / "one"), str(tmp_path / "sync"))
    assert not (tmp_path / "two").exists() and not (tmp_path / "three").exists()
    # Over: the writer takes the next save, from any thread.
    dcp.async_save(_model(2), storage_writer=writer, checkpoint_id=tmp_path / "four").result(
        timeout=WAIT_S
    )
    assert_same(
        read_checkpoint(tmp_path / "four")[0]["model.norm.weight"],
        _model(2)["model.norm.weight"],
        "four",
    )


def _in_a_live_thread(fn: Callable[[], None]) -> tuple[BaseException | None, threading.Event]:
    """Run ``fn`` in a thread that stays alive (until the returned event is set) after ``fn``
    ends: a claim the thread failed to give back is then still held, whatever the timing."""
    done, leave = threading.Event(), threading.Event()
    error: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            error.append(exc)
        done.set()
        leave.wait(WAIT_S)

    threading.Thread(target=run, name="failed-save", daemon=True).start()
    assert done.wait(WAIT_S)
    return (error[0] if error else None), leave


_FAILURES = {
    # where the save fails -> (writer options, state dict, planner)
    "reset": ({"direct_write": True}, lambda: _model(1), DefaultSavePlanner),
    "prepare_local_plan": ({}, lambda: {**_model(1), "note": "a string"}, DefaultSavePlanner),
    "write_data": ({}, lambda: _model(1), _FailingSavePlanner),
}


@pytest.mark.parametrize("step", sorted(_FAILURES))
def test_a_save_that_fails_midway_frees_the_writer(tmp_path, step: str) -> None:
    options, state, planner = _FAILURES[step]
    url = "memory://claims-reset/one" if step == "reset" else str(tmp_path / "one")
    writer = HFStorageWriter(**options)
    error, leave = _in_a_live_thread(
        lambda: dcp.save(state(), storage_writer=writer, planner=planner(), checkpoint_id=url)
    )
    try:
        assert error is not None, f"the save was to fail in {step}"
        writer.direct_write = None  # what made reset fail, mended; the claim alone decides now
        # The failed save's thread is alive: only a claim it gave back lets this save start.
        dcp.save(_model(2), storage_writer=writer, checkpoint_id=tmp_path / "next")
    finally:
        leave.set()
    assert_same(
        read_checkpoint(tmp_path / "next")[0]["model.norm.weight"],
        _model(2)["model.norm.weight"],
        "next",
    )


class _PlannerFailsAfterSetUp(DefaultSavePlanner):
    """Fails the save where DCP tells the writer nothing: in local planning, after set-up."""

    def create_local_plan(self) -> Any:
        raise RuntimeError("injected: the planner failed")


def test_a_save_that_failed_where_the_writer_cannot_see_is_over_for_its_own_thread(
    tmp_path,
) -> None:
    """A synchronous save failing in the planner leaves its claim with this thread: the next save
    of this thread starts (a thread's saves cannot overlap), as does another thread's once the
    failed save's thread has ended (each dcp.async_save runs on a thread of its own)."""
    writer = HFStorageWriter()
    with raises_in_checkpoint(RuntimeError, "injected: the planner failed"):
        dcp.save(
            _model(1),
            storage_writer=writer,
            planner=_PlannerFailsAfterSetUp(),
            checkpoint_id=tmp_path / "a",
        )
    dcp.save(_model(1), storage_writer=writer, checkpoint_id=tmp_path / "b")  # this thread: starts
    failed = dcp.async_save(
        _model(1),
        storage_writer=writer,
        planner=_PlannerFailsAfterSetUp(),
        checkpoint_id=tmp_path / "c",
    )
    with raises_in_checkpoint(RuntimeError, "injected: the planner failed"):
        failed.result(timeout=WAIT_S)
    holder = writer.claim._holder  # DCP never told the writer the save ended: still its thread's
    if holder is not None:
        holder.thread.join(WAIT_S)  # the async save's thread ends with its save
    dcp.save(_model(2), storage_writer=writer, checkpoint_id=tmp_path / "d")
    for name, seed in (("b", 1), ("d", 2)):
        assert_same(
            read_checkpoint(tmp_path / name)[0]["model.norm.weight"],
            _model(seed)["model.norm.weight"],
            name,
        )


# -- the reader --------------------------------------------------------------------------------


def test_a_second_load_is_refused_while_the_first_is_held_before_set_up(
    tmp_path, held: _Hold
) -> None:
    for name, seed in (("a", 1), ("b", 2)):
        dcp.save(_model(seed), storage_writer=HFStorageWriter(tmp_path / name))
    reader = HFStorageReader()
    first_out = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    error: list[BaseException] = []

    def first() -> None:
        try:
            dcp.load(
                first_out,
                storage_reader=reader,
                planner=_HeldLoadPlanner(held),
                checkpoint_id=tmp_path / "a",
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            error.append(exc)

    thread = threading.Thread(target=first, name="first-load")
    thread.start()
    held.until_arrived()
    out = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    with pytest.raises(RuntimeError, match=_refused("a", load=True)):
        dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path / "b")
    with raises_in_checkpoint(RuntimeError, _refused("a", load=True)):
        dcp.load(out, storage_reader=reader)
    held.go.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not error, error
    for key, value in _model(1).items():
        assert_same(first_out[key], value, key)  # the first load read its own checkpoint, whole
    dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path / "b")  # over: the next load runs
    for key, value in _model(2).items():
        assert_same(out[key], value, key)


def test_a_load_that_fails_frees_the_reader(tmp_path) -> None:
    dcp.save(_model(1), storage_writer=HFStorageWriter(tmp_path / "good"))
    dcp.save(_model(1), storage_writer=HFStorageWriter(tmp_path / "bad"))
    shard = next((tmp_path / "bad").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte: its CRC32 no longer matches
    shard.write_bytes(bytes(data))
    reader = HFStorageReader(verify=True)
    out = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    error, leave = _in_a_live_thread(
        lambda: dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path / "bad")
    )
    try:
        assert error is not None and "checksum" in str(error), error
        dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path / "good")
    finally:
        leave.set()
    for key, value in _model(1).items():
        assert_same(out[key], value, key)


# -- the manager -------------------------------------------------------------------------------


def _hold_saves(monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> None:
    """Every writer's save runs ``before`` first, in its own thread, at DCP's first call into it."""
    original = HFStorageWriter.storage_meta

    def storage_meta(self: HFStorageWriter) -> Any:
        before()
        return original(self)

    monkeypatch.setattr(HFStorageWriter, "storage_meta", storage_meta)


def test_a_manager_save_waits_for_the_async_save_in_flight(
    tmp_path, monkeypatch: pytest.MonkeyPatch, held: _Hold
) -> None:
    first_call = threading.Lock()
    _hold_saves(
        monkeypatch, lambda: held.wait_here() if first_call.acquire(blocking=False) else None
    )
    mgr = CheckpointManager(str(tmp_path / "run"), keep_last_n=5)
    fut = mgr.save(1, _model(1), async_save=True)
    held.until_arrived()
    assert mgr.all_checkpoints() == []  # held before the writer is set up: nothing committed
    errors: list[BaseException] = []

    def second() -> None:
        try:
            mgr.save(2, _model(2))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=second)
    thread.start()  # waits for step 1 (or, should it run first, must still leave step 1 whole)
    held.go.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors, errors
    assert fut.result(timeout=WAIT_S) == 1 and mgr.all_checkpoints() == [1, 2]
    for step in (1, 2):
        out = _model(0)
        mgr.load(out, step=step)
        for key, value in _model(step).items():
            assert_same(out[key], value, f"step {step}: {key}")


@pytest.mark.parametrize(
    "read_error", [True, False], ids=["error-read-from-the-future", "error-never-read"]
)
def test_a_failed_async_save_frees_the_manager(
    tmp_path, monkeypatch: pytest.MonkeyPatch, read_error: bool
) -> None:
    """The error of a failed async save is raised once: from its future, or (when nobody read
    it there) from the next save; the save after it, or that next save itself, succeeds."""
    first_call = threading.Lock()

    def fail_first() -> None:
        if first_call.acquire(blocking=False):
            raise OSError("injected: the store went away")

    _hold_saves(monkeypatch, fail_first)
    mgr = CheckpointManager(str(tmp_path / "run"), keep_last_n=5)
    fut = mgr.save(1, _model(1), async_save=True)
    if read_error:
        assert "injected" in repr(fut.exception(timeout=WAIT_S))
    else:
        with pytest.raises(BaseException, match="injected"):
            mgr.save(2, _model(2))
    mgr.save(2, _model(2))
    assert mgr.all_checkpoints() == [2]
    out = _model(0)
    mgr.load(out)
    for key, value in _model(2).items():
        assert_same(out[key], value, key)
