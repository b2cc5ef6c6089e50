"""CRC32C (Castagnoli) values as GCS reports them, and the CRC32C of a concatenation from its
pieces'.

GCS gives every object's CRC32C (the only checksum a composed object has), base64 of the value's
4 big-endian bytes, in the metadata each upload and each compose returns. The CRC32C of the
bytes ``A + B`` follows from ``crc(A)``, ``crc(B)`` and ``len(B)`` alone, as zlib's
``crc32_combine`` does for CRC32: ``crc(A + B) == x^(8 len(B)) * crc(A) mod P  ^  crc(B)``, so the
CRC32C a composed file must have is known from its parts' without reading a byte of them.

Pure: no I/O. Values are the standard CRC32C (``google_crc32c.value``) as unsigned 32-bit ints.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterable

__all__ = ["crc32c_combine", "crc32c_from_gcs", "crc32c_of_pieces"]

# The Castagnoli polynomial, bit-reflected (bit 31 is the coefficient of x^0).
_POLY = 0x82F63B78
_ONE = 1 << 31  # the polynomial 1
_X8 = 1 << 23  # x^8: "append one zero byte"


def crc32c_from_gcs(value: str) -> int:
    """The CRC32C an object's metadata gives (``"crc32c"``: base64 of 4 big-endian bytes).

    Raises:
        ValueError: not such a value.
    """
    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"crc32c={value!r} is not base64 of a 4-byte CRC32C ({exc})") from None
    if len(raw) != 4:
        raise ValueError(f"crc32c={value!r} is not base64 of a 4-byte CRC32C ({len(raw)} bytes)")
    return int.from_bytes(raw, "big")


def _multiply(a: int, b: int) -> int:
    """``a * b mod P`` in the reflected representation."""
    product, mask = 0, _ONE
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=256)
def _zeros_operator(nbytes: int) -> int:
    """``x^(8 nbytes) mod P``: multiplying a CRC by it appends ``nbytes`` zero bytes (cached:
    a file's parts are mostly of one size)."""
    out, power = _ONE, _X8
    while nbytes:
        if nbytes & 1:
            out = _multiply(out, power)
        power = _multiply(power, power)
        nbytes >>= 1
    return out


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """``crc32c(A + B)`` from ``crc1 == crc32c(A)``, ``crc2 == crc32c(B)`` and ``len2 == len(B)``.

    Raises:
        ValueError: ``len2`` is negative.
    """
    if len2 < 0:
        raise ValueError(f"crc32c_combine(len2={len2}) needs len2 >= 0")
    return (_multiply(_zeros_operator(len2), crc1) if len2 else crc1) ^ crc2


def crc32c_of_pieces(pieces: Iterable[tuple[int, int]]) -> int:
    """The CRC32C of pieces ``(crc32c, nbytes)`` laid end to end, in order (0 for none)."""
    out = 0
    for crc, nbytes in pieces:
        out = crc32c_combine(out, crc, nbytes)
    return out
