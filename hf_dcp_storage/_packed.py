"""Values that every rank's plan carries, pickled as one compressed blob made once.

The coordinator pickles each rank's plan on its own (``scatter_object_list``), so a value that
every plan holds is pickled once per rank. The save's file names and multipart upload ids are
such values: at 8,192 ranks and 191 files that is 3 M small strings to pickle, about a third of
the bytes the coordinator sends. A :class:`PackedTuple` or :class:`PackedMap` reads as the
plain tuple or mapping; pickled, it is one ``bytes`` (zlib over JSON, made when the value is
made, the same object in every plan), which pickle copies in one step.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["PackedTuple", "PackedMap"]


def _pack(value: Any) -> bytes:
    return zlib.compress(json.dumps(value, separators=(",", ":")).encode("utf-8"), 1)


def _unpack(blob: bytes) -> Any:
    return json.loads(zlib.decompress(blob))


class PackedTuple(tuple):  # type: ignore[type-arg]
    """A tuple of strings (or other JSON values), pickled as one blob."""

    _blob: bytes

    def __new__(cls, items: Iterable[Any]) -> PackedTuple:
        out = super().__new__(cls, items)
        out._blob = _pack(list(out))
        return out

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _tuple_from, (self._blob,)


class PackedMap(Mapping[int, Any]):
    """A read-only mapping of int keys to strings (or other JSON values), pickled as one blob."""

    def __init__(self, items: Mapping[int, Any]) -> None:
        self._items = {int(k): v for k, v in items.items()}
        self._blob = _pack(list(self._items.items()))

    def __getitem__(self, key: int) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"PackedMap({self._items!r})"

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _map_from, (self._blob,)


def _tuple_from(blob: bytes) -> PackedTuple:
    out = tuple.__new__(PackedTuple, _unpack(blob))
    out._blob = blob  # as received: not packed again
    return out


def _map_from(blob: bytes) -> PackedMap:
    out = PackedMap.__new__(PackedMap)
    out._items, out._blob = {int(k): v for k, v in _unpack(blob)}, blob
    return out

