"""The file names every rank's plan carries pickle as one blob."""

from __future__ import annotations

import pickle

from hf_dcp_storage._packed import PackedTuple


def test_a_packed_tuple_reads_and_round_trips_as_the_tuple() -> None:
    names = tuple(f"model-{i:05d}-of-00191.safetensors" for i in range(1, 192))
    packed = PackedTuple(names)
    assert packed == names and packed[3] == names[3] and len(packed) == 191
    back = pickle.loads(pickle.dumps(packed))
    assert back == names and isinstance(back, PackedTuple)
    assert pickle.loads(pickle.dumps(back)) == names  # sent on again: the blob as received
    # One blob, not 191 strings: far smaller than the plain tuple pickled.
    assert len(pickle.dumps(packed)) < len(pickle.dumps(names)) / 5


def test_a_packed_value_pickles_as_the_blob_made_with_it() -> None:
    packed = PackedTuple(str(i) for i in range(1000))
    blob = packed._blob  # made when the value is made, not at each pickling
    for data in (pickle.dumps(packed), pickle.dumps(packed)):
        assert blob in data and len(data) < len(blob) + 100
    assert pickle.loads(pickle.dumps([packed] * 3)) == [packed] * 3
