"""What every rank's plan carries (file names, a key table's files and offsets) pickles as one
blob."""

from __future__ import annotations

import pickle

import numpy as np

from hf_dcp_storage.plan.packed import PackedArray, PackedTuple, packed_array


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


def test_a_packed_array_round_trips_as_a_plain_array_from_one_blob() -> None:
    starts = np.cumsum(np.full(1137, 1 << 22, dtype=np.int64))  # a key table's offsets
    packed = packed_array(starts)
    assert (
        isinstance(packed, PackedArray)
        and np.array_equal(packed, starts)
        and not packed.flags.writeable
    )
    data = pickle.dumps(packed)
    assert packed._blob in data and len(data) < len(pickle.dumps(starts)) / 4
    back = pickle.loads(data)
    assert type(back) is np.ndarray and back.dtype == np.int64 and np.array_equal(back, starts)
    part = pickle.loads(pickle.dumps(packed[10:20]))  # a slice has no blob: pickled as numpy does
    assert np.array_equal(part, starts[10:20])
    empty = pickle.loads(pickle.dumps(packed_array(np.empty((0, 3), dtype=np.int32))))
    assert empty.shape == (0, 3) and empty.dtype == np.int32
