"""JSON decoded strictly: a name given twice in one object is refused, and every failure of the
decoder (or of Python building what it decoded) becomes the caller's own error."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["loads_strict"]


class _Duplicate(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def loads_strict(
    raw: bytes | str,
    *,
    duplicate: Callable[[str], BaseException],
    invalid: Callable[[Exception], BaseException],
) -> Any:
    """``json.loads(raw)`` with every object's names unique.

    Raises:
        ``duplicate(name)``: a name given twice in one object (``json`` keeps the last silently,
            another reader the first).
        ``invalid(exc)``: not UTF-8 or not JSON, or JSON Python will not build: an int of more
            than ``sys.get_int_max_str_digits()`` digits (``ValueError``), nesting too deep to
            decode (``RecursionError``).
    """

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in pairs:
            if name in out:
                raise _Duplicate(name)
            out[name] = value
        return out

    try:
        return json.loads(raw, object_pairs_hook=unique)
    except _Duplicate as d:
        raise duplicate(d.name) from None
    except (
        ValueError,
        RecursionError,
    ) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise invalid(exc) from None
