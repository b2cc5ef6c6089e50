"""Pages and ``O_DIRECT``, what every direct read and write shares: the alignment (``ALIGN``),
the smallest run worth a direct system call (``MIN_DIRECT``), the aligned pages inside a run
(:func:`interior`), and opening a file for direct I/O where its filesystem takes it
(:func:`open_direct`). ``io/direct.py`` says how they are used.
"""

from __future__ import annotations

import errno
import os

__all__ = ["ALIGN", "MIN_DIRECT", "check_direct_io", "interior", "open_direct", "round_up"]

# A direct write or read must start at a file offset, cover a length and use a buffer address
# that are all multiples of the device's logical block size; a page is a multiple of every one
# in use.
ALIGN = 4096
# Smaller runs (column shards of narrow rows, norms) go through the page cache whole.
MIN_DIRECT = 256 << 10
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def check_direct_io(value: object) -> bool | None:
    """``value`` as the writer's and reader's ``direct_io`` option, or ``ValueError`` naming it."""
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(
        f"direct_io={value!r} must be None (O_DIRECT where the filesystem takes it), True (or an "
        "error) or False (never)"
    )


def open_direct(path: str, *, write: bool) -> int | None:
    """A descriptor of ``path`` opened with ``O_DIRECT``, or ``None`` where the filesystem (or
    the platform) has no direct I/O. Other errors (a missing file, no permission) raise."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | _O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


def interior(offset: int, n: int) -> tuple[int, int]:
    """``(start, end)`` of the aligned pages inside the run ``[offset, offset + n)`` that a direct
    write takes (``(offset, offset)``: none, under ``MIN_DIRECT``). Pure."""
    start, end = round_up(offset), (offset + n) // ALIGN * ALIGN
    return (start, end) if end - start >= MIN_DIRECT else (offset, offset)


def round_up(n: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return -(-n // ALIGN) * ALIGN
