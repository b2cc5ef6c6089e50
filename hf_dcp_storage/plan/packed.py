"""Values that every rank's plan carries, pickled as one compressed blob made once.

The coordinator pickles each rank's plan on its own (``scatter_object_list``), so a value that
every plan holds is pickled once per rank: the save's file names, at 8,192 ranks and 191 files,
are 1.6 M small strings to pickle, and the files and offsets of a key table that every FSDP
rank shares 13 KiB a plan. A :class:`PackedTuple` reads as the plain tuple, a
:class:`PackedArray` as the array; pickled, each is one ``bytes`` made with the value (zlib),
the same object in every plan, which pickle copies in one step (545 bytes a plan instead of
6.7 KiB of names).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["PackedArray", "PackedTuple", "packed_array"]


def _pack(value: Any) -> bytes:
    return zlib.compress(json.dumps(value, separators=(",", ":")).encode("utf-8"), 1)


def _unpack(blob: bytes) -> Any:
    return json.loads(zlib.decompress(blob))


class PackedTuple(tuple):  # type: ignore[type-arg]  # noqa: SLOT001 - a tuple subtype takes no non-empty __slots__, and _blob needs a place
    """A tuple of strings (or other JSON values), pickled as one blob."""

    _blob: bytes

    def __new__(cls, items: Iterable[Any]) -> PackedTuple:
        out = super().__new__(cls, items)
        out._blob = _pack(list(out))
        return out

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _tuple_from, (self._blob,)


def _tuple_from(blob: bytes) -> PackedTuple:
    out = tuple.__new__(PackedTuple, _unpack(blob))
    out._blob = blob  # as received: not packed again
    return out


class PackedArray(np.ndarray):
    """A read-only array pickled as its dtype, shape and zlib-compressed bytes, packed when made
    (:func:`packed_array`); unpickled as a plain ndarray. For arrays that many ranks' plans
    share: a key table's files and offsets, the same for every FSDP rank."""

    _blob: bytes

    def __reduce__(self) -> str | tuple[Any, ...]:
        blob = getattr(self, "_blob", None)  # a slice or view of one has none
        if blob is None:
            return np.asarray(self).__reduce__()
        return _array_from, (self.dtype.str, self.shape, blob)


def packed_array(a: np.ndarray) -> PackedArray:
    """``a``'s values as a :class:`PackedArray`."""
    out = np.array(a, order="C").view(PackedArray)
    out._blob = zlib.compress(out.tobytes(), 1)
    out.flags.writeable = False
    return out


def _array_from(dtype: str, shape: tuple[int, ...], blob: bytes) -> np.ndarray:
    return np.frombuffer(zlib.decompress(blob), dtype=np.dtype(dtype)).reshape(shape)
