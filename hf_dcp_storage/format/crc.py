"""Per-tensor CRC32 computed while the bytes stream out, by ranks that each see part of a tensor.

The value is the standard ``zlib.crc32`` of the tensor's bytes as laid out in the safetensors
file. No rank sees the whole tensor and there is no extra read pass, so each rank folds the CRCs
of its own byte runs into a *contribution* and the coordinator XORs the contributions.

The math: with ``Z_n`` the GF(2)-linear operator "append ``n`` zero bytes" acting on a CRC value
(the one zlib's ``crc32_combine`` uses), ``crc32(A + B) == Z_len(B)(crc32(A)) ^ crc32(B)``.
Unrolled over runs ``[s_k, e_k)`` that tile ``[0, L)``::

    crc32(tensor) == XOR_k Z_{L - e_k}(crc32(run_k))

Each term needs only its own run and ``L``, so a rank's contribution is the XOR of its terms and
the XOR of all ranks' contributions is the tensor's CRC (``crc32(b"") == 0``; an empty tensor's
CRC is 0).

Call sequence: (every rank, per tensor) one :class:`CrcAccumulator` per writing thread, fed with
``add``/``update`` as runs are written, merged with ``merge`` (or their contributions XORed);
``contribution(L)`` travels to the coordinator, which calls :func:`combine_contributions`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

try:
    # zlib-ng's CRC-32 (carry-less multiply: PCLMULQDQ/VPCLMULQDQ, PMULL) gives zlib's value
    # at ~30 GB/s on this VM's cores, where the stdlib's zlib 1.2.13 gives ~6 GB/s: a save
    # checksums every byte it writes, and at 6 GB/s that alone took a fifth of a direct save.
    from zlib_ng.zlib_ng import crc32 as _crc32

    CRC32_BACKEND = "zlib-ng"
except ImportError:  # a platform without zlib-ng's wheel: the same values, slower
    from zlib import crc32 as _crc32

    CRC32_BACKEND = "zlib"

__all__ = [
    "CRC32_BACKEND",
    "CrcAccumulator",
    "combine_contributions",
    "crc32_combine",
    "crc32_of",
    "crc32_shift",
]

# zlib's CRC-32 polynomial, bit-reflected: bit 31 of a CRC value is the coefficient of x^0.
_POLY = 0xEDB88320
# ``x^8`` in that representation: the operator "append one zero byte" is "multiply by x^8 mod P".
_X8 = 1 << 23


def crc32_of(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """``zlib.crc32(data, value)``: the CRC32 of a C-contiguous buffer (continuing from the CRC
    ``value`` of the bytes before it), as an unsigned 32-bit int, computed by ``CRC32_BACKEND``.

    Both backends release the GIL for buffers over 5 KiB and take any length, so callers need
    not chunk: one call per slab already being written is both the fastest and the simplest.

    Raises:
        BufferError: ``data`` is not C-contiguous (make it so, e.g. ``tensor.contiguous()``).
    """
    return _crc32(data, value)


def crc32_shift(crc: int, nbytes: int) -> int:
    """``Z_nbytes(crc)``, i.e. ``crc32(A + bytes(nbytes)) ^ crc32(bytes(nbytes))`` when
    ``crc == crc32(A)``.

    Any ``nbytes >= 0`` works, including beyond 4 GiB. Cost: one operator application (4 table
    lookups, ~0.5 us) per set bit of ``nbytes`` the first time a length is seen; a length seen
    again gets its own table, so from then on a shift by it is one application whatever its size.

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"crc32_shift(nbytes={nbytes}) needs nbytes >= 0 (zero bytes appended)")
    if nbytes == 0:
        return crc
    op = _operator(nbytes)
    # Build a length's own table only on its second use: for a one-off shift (the final
    # ``Z_{L - e}`` of a tensor) building it (~100 us) costs 10-100x the direct path.
    if op.table is None and not op.seen:
        op.seen = True
        return _shift_direct(crc, nbytes)
    return _apply(_table_for(nbytes), crc)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``crc32(A + B)`` from ``crc1 == crc32(A)``, ``crc2 == crc32(B)`` and ``len2 == len(B)``,
    as zlib's."""
    return crc32_shift(crc1, len2) ^ crc2


def combine_contributions(values: Iterable[int]) -> int:
    """A tensor's CRC32 from every rank's :meth:`CrcAccumulator.contribution` (their XOR; 0 if
    none)."""
    out = 0
    for v in values:
        out ^= v
    return out


class CrcAccumulator:
    """One writer's share of one tensor's CRC32, from the byte runs it wrote, in any order.

    Feed every run this writer wrote, with ``add(start, end, crc32(run))`` or
    ``update(start, run_bytes)``; offsets are bytes within the tensor. Runs fed to one
    accumulator must not overlap each other (nor those of any other writer of the tensor), but
    they may come in any order; runs in increasing order are cheapest (one cached shift each).

    Not thread-safe: give each thread its own accumulator and ``merge`` them, or XOR their
    contributions; both equal the contribution of the union of their runs.

    State is ``(acc, end)``: the contribution is ``Z_{L - end}(acc)`` for a tensor of ``L`` bytes,
    with ``end`` the largest run end seen, so nothing about ``L`` or other ranks is needed early.

    Attributes:
        nbytes: total bytes of the runs fed so far. Over all writers of a tensor these sum to its
            length exactly when the runs tile it (given no overlaps), a cheap coverage check for
            the coordinator.
    """

    __slots__ = ("_acc", "_end", "_gap", "_table", "nbytes")

    def __init__(self) -> None:
        self._acc = 0
        self._end = 0
        self.nbytes = 0
        # The last in-order gap and, once it repeats, its operator table.
        self._gap = -1
        self._table: list[int] | None = None

    def add(self, start: int, end: int, crc: int) -> None:
        """Fold in the run ``[start, end)`` whose bytes have ``zlib.crc32`` value ``crc``.

        Raises:
            ValueError: not ``0 <= start <= end``, or ``crc`` is not an unsigned 32-bit value.
        """
        if not 0 <= start <= end:
            raise ValueError(f"byte run [{start}, {end}) is not a run: need 0 <= start <= end")
        if not 0 <= crc <= 0xFFFFFFFF:
            raise ValueError(f"crc={crc} is not a zlib.crc32 value: need 0 <= crc < 2**32")
        self._fold(end, crc)
        self.nbytes += end - start

    def update(self, start: int, data: bytes | bytearray | memoryview) -> None:
        """Fold in the run of ``data`` at byte ``start``, computing its CRC (one zlib pass).

        In increasing order the gap since the previous run is folded into zlib's starting value
        (``zlib.crc32(data, v) == Z_len(data)(v) ^ crc32(data)``), so each run costs one zlib
        call plus one shift by the gap.

        Raises:
            ValueError: ``start`` is negative.
            BufferError: ``data`` is not C-contiguous.
        """
        if start < 0:
            raise ValueError(f"byte run at start={start} is not a run: need start >= 0")
        n = memoryview(data).nbytes
        if start >= self._end:
            self._fold(start, 0)  # shift over the gap; zlib then appends the run
            self._acc = _crc32(data, self._acc)
            self._end = start + n
        else:
            self._fold(start + n, _crc32(data))
        self.nbytes += n

    def merge(self, other: CrcAccumulator) -> None:
        """Fold in all runs of ``other`` (disjoint from this one's); ``other`` is left unchanged."""
        self._fold(other._end, other._acc)
        self.nbytes += other.nbytes

    def contribution(self, length: int) -> int:
        """This writer's term of the CRC32 of a tensor of ``length`` bytes; XOR all writers' terms.

        Raises:
            ValueError: a run ended past ``length``.
        """
        if length < self._end:
            raise ValueError(
                f"tensor length {length} is shorter than a byte run fed to it (ending at "
                f"{self._end}); pass the whole tensor's byte length, not this writer's"
            )
        return crc32_shift(self._acc, length - self._end)

    def _fold(self, end: int, crc: int) -> None:
        # Both states stand for "Z_{L - end}(value)"; bring the one that ends earlier forward.
        gap = end - self._end
        if gap < 0:
            self._acc ^= crc32_shift(crc, -gap)
            return
        if gap == self._gap and gap:
            # Same stride as the last run (every row of a column shard): skip the cache lookup.
            if self._table is None:
                self._table = _table_for(gap)
            self._acc = _apply(self._table, self._acc) ^ crc
        else:
            self._acc = crc32_shift(self._acc, gap) ^ crc
            self._gap, self._table = gap, None
        self._end = end


# --- GF(2) operators --------------------------------------------------------------------------
# An operator "multiply by a mod P" is linear in the CRC value, so it is fully described by its
# values on the 32 unit vectors; we store it as 4 byte tables (1024 ints, flat): applying it is 4
# lookups and 3 XORs, ~0.3-0.5 us in CPython against ~5 us for zlib's bit-serial gf2 product.

_ONE = 1 << 31  # the polynomial 1: ``Z_n(_ONE)`` is the multiplier ``x^(8n) mod P`` itself


class _Operator:
    """Per-length cache entry: whether the length was seen, and its table once built."""

    __slots__ = ("seen", "table")

    def __init__(self) -> None:
        self.seen = False
        self.table: list[int] | None = None


@functools.lru_cache(maxsize=64)
def _operator(nbytes: int) -> _Operator:
    # Bounded: a table is ~40 KiB (1024 ints) and only lengths used twice get one; an accumulator
    # also holds its current stride's table itself, so eviction never slows a tensor in progress.
    return _Operator()


@functools.cache
def _pow2_table(k: int) -> list[int]:
    """Table of ``Z_{2^k}`` for ``0 <= k < 32``; built once per ``k`` from the previous one.

    ``x^(2^32) == x mod P`` for zlib's polynomial (zlib's ``x2nmodp`` relies on it too), so
    ``Z_{2^k} == Z_{2^(k mod 32)}`` and these 32 tables serve every length.
    """
    if k == 0:
        return _byte_tables(_X8)
    prev = _pow2_table(k - 1)
    mult = _apply(prev, _apply(prev, _ONE))  # x^(8 * 2^k) == (x^(8 * 2^(k-1)))^2
    return _byte_tables(mult)


def _shift_direct(crc: int, nbytes: int) -> int:
    """``Z_nbytes(crc)`` as one power-of-two table per set bit of ``nbytes``."""
    while nbytes:
        low = nbytes & -nbytes
        crc = _apply(_pow2_table((low.bit_length() - 1) & 31), crc)
        nbytes ^= low
    return crc


def _table_for(nbytes: int) -> list[int]:
    """The table of ``Z_nbytes`` for ``nbytes > 0``, built now if it was not yet."""
    if nbytes & (nbytes - 1) == 0:
        return _pow2_table((nbytes.bit_length() - 1) & 31)
    op = _operator(nbytes)
    if op.table is None:
        # Races between threads are benign: both build the same table, one assignment wins.
        op.table = _byte_tables(_shift_direct(_ONE, nbytes))
    return op.table


def _byte_tables(mult: int) -> list[int]:
    """Flat 4x256 tables of "multiply by ``mult`` mod P": entry ``256*i + b`` maps byte ``i`` =
    ``b``."""
    # Column j is the image of the unit vector 1 << j, i.e. mult * x^(31 - j): walk down from j=31.
    cols = [0] * 32
    v = mult
    for j in range(31, -1, -1):
        cols[j] = v
        v = (v >> 1) ^ _POLY if v & 1 else v >> 1  # times x, mod P
    flat: list[int] = []
    for i in range(4):
        table = [0]
        for bit in range(8):  # doubling: entries with this bit set = entries without it ^ column
            col = cols[8 * i + bit]
            table += [t ^ col for t in table]
        flat += table
    return flat


def _apply(table: list[int], crc: int) -> int:
    """The operator of ``table`` applied to ``crc``: one lookup per byte of ``crc``."""
    return (
        table[crc & 255]
        ^ table[256 | (crc >> 8 & 255)]
        ^ table[512 | (crc >> 16 & 255)]
        ^ table[768 | crc >> 24]
    )
