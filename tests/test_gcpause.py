"""The garbage collector is paused while a load builds its many objects (``io/gcpause.py``), and
the process's own setting is what it finds afterwards."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.io.gcpause import paused_gc


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of every automatic collection that starts while the test runs."""
    seen: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start" and len(seen) < 1000:
            seen.append(info["generation"])

    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)
        if not was:
            gc.disable()


def test_a_pause_restores_the_setting_it_found_nested_and_on_error() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with paused_gc():
            assert not gc.isenabled()
            with paused_gc():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer pause still runs
        assert gc.isenabled()
        with pytest.raises(KeyError), paused_gc():
            raise KeyError("x")
        assert gc.isenabled()
        gc.disable()  # a process that manages its collector itself (torchtitan's gc_freq)
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_overlapping_pauses_on_two_threads_reenable_only_after_the_last() -> None:
    was = gc.isenabled()
    gc.enable()
    first_in, second_out, release = threading.Event(), threading.Event(), threading.Event()
    states: list[bool] = []

    def first() -> None:
        with paused_gc():
            first_in.set()
            release.wait(10)

    def second() -> None:
        first_in.wait(10)
        with paused_gc():
            pass
        states.append(gc.isenabled())  # the first thread's pause still runs
        second_out.set()

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        second_out.wait(10)
        release.set()
        for t in threads:
            t.join(10)
        assert states == [False] and gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_a_load_of_thousands_of_tensors_triggers_no_collection_in_its_own_steps(
    tmp_path: Path, collections: list[int]
) -> None:
    """Without the pause, read_metadata alone of 3,000 tensors runs some sixty young collections
    and five of the middle generation (and every tenth of those, a full one over the whole
    process heap). Paused, what it built is scanned once, by the young collection that the next
    allocation after it runs."""
    sd = {f"layers.{i}.w": torch.full((4, 2), float(i)) for i in range(3000)}
    dcp.save(sd, storage_writer=HFStorageWriter(tmp_path), no_dist=True)
    reader = HFStorageReader(tmp_path)
    gc.collect()
    collections.clear()
    metadata = reader.read_metadata()
    assert gc.isenabled()
    assert len(metadata.state_dict_metadata) == 3000
    assert collections in ([], [0]), str(collections)

    out = {k: torch.zeros(4, 2) for k in sd}
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner(out, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    collections.clear()
    reader.read_data(plan, planner).wait()
    assert gc.isenabled()
    assert collections in ([], [0]), str(collections)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
