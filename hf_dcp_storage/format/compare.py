"""How two descriptions of one safetensors file differ (a file's own header and the copy of it
that an index records), in words for an error message. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from .header import TensorEntry

__all__ = ["header_difference"]


def header_difference(
    copy: Mapping[str, TensorEntry],
    copy_start: int,
    actual: Mapping[str, TensorEntry],
    actual_start: int,
) -> str | None:
    """How a file's header (``actual``) differs from the index's copy of it, or ``None``."""
    if copy_start != actual_start:
        return f"the data starts at byte {copy_start} in the copy, {actual_start} in the file"
    for key in sorted(set(copy) | set(actual)):
        a, b = copy.get(key), actual.get(key)
        if a != b:
            described = [
                f"{e.dtype} {list(e.shape)} at [{e.begin}, {e.end}]" if e else "absent"
                for e in (a, b)
            ]
            return f"tensor {key!r} is {described[0]} in the copy, {described[1]} in the file"
    return None
