"""Per-tensor CRC32 from disjoint byte runs, checked against ``zlib.crc32`` of the whole buffer."""

from __future__ import annotations

import itertools
import random
import zlib

import pytest

from hf_dcp_storage.format.crc import (
    CrcAccumulator,
    combine_contributions,
    crc32_combine,
    crc32_of,
    crc32_shift,
)


def _zeros_shift(crc: int, n: int) -> int:
    """``Z_n(crc)`` straight from zlib: ``zlib.crc32(data, v) == Z_len(data)(v) ^
    zlib.crc32(data)``."""
    zeros = bytes(n)
    return zlib.crc32(zeros, crc) ^ zlib.crc32(zeros)


def _cuts(rng: random.Random, n: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` pieces of ``range(n)`` in order, some possibly empty."""
    points = [0, *sorted(rng.randint(0, n) for _ in range(parts - 1)), n]
    return list(itertools.pairwise(points))


def _grid_runs(
    rng: random.Random, rows: int, cols: int, itemsize: int, grid: tuple[int, int]
) -> list[list[tuple[int, int]]]:
    """Byte runs per rank for a ``rows x cols`` tensor split over a ``grid`` of ranks.

    ``(world, 1)`` is a row shard (one run per rank), ``(1, world)`` a column shard (one run per
    row per rank, interleaved across ranks), anything else 2-D blocks. Splits are uneven and
    may be empty; empty runs are kept, as a writer may well report them.
    """
    per_rank = []
    for r0, r1 in _cuts(rng, rows, grid[0]):
        for c0, c1 in _cuts(rng, cols, grid[1]):
            if c0 == 0 and c1 == cols:
                runs = [(r0 * cols * itemsize, r1 * cols * itemsize)]
            else:
                runs = [
                    ((r * cols + c0) * itemsize, (r * cols + c1) * itemsize) for r in range(r0, r1)
                ]
            per_rank.append(runs)
    return per_rank


def _rank_contribution(
    rng: random.Random, data: bytes, runs: list[tuple[int, int]], mode: str
) -> tuple[int, int]:
    """One rank's contribution and byte count, fed the way ``mode`` says."""
    if mode == "in_order_add":
        acc = CrcAccumulator()
        for s, e in runs:
            acc.add(s, e, zlib.crc32(data[s:e]))
        return acc.contribution(len(data)), acc.nbytes
    if mode == "in_order_update":
        acc = CrcAccumulator()
        for s, e in runs:
            acc.update(s, memoryview(data)[s:e])
        return acc.contribution(len(data)), acc.nbytes
    # Out of order over several per-thread accumulators, folded by merge or by XOR of contributions.
    runs = list(runs)
    rng.shuffle(runs)
    threads = [CrcAccumulator() for _ in range(rng.randint(1, 4))]
    for s, e in runs:
        acc = rng.choice(threads)
        if rng.random() < 0.5:
            acc.add(s, e, zlib.crc32(data[s:e]))
        else:
            acc.update(s, data[s:e])
    if mode == "shuffled_merge":
        merged = CrcAccumulator()
        for acc in threads:
            merged.merge(acc)
        return merged.contribution(len(data)), merged.nbytes
    assert mode == "shuffled_xor"
    return (
        combine_contributions(acc.contribution(len(data)) for acc in threads),
        sum(acc.nbytes for acc in threads),
    )


@pytest.mark.parametrize(
    "mode", ["in_order_add", "in_order_update", "shuffled_merge", "shuffled_xor"]
)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["rows", "cols", "blocks"])
def test_contributions_combine_to_the_whole_tensor_crc(kind: str, world: int, mode: str) -> None:
    rng = random.Random(f"{kind}-{world}-{mode}")
    for _ in range(8):
        rows, cols, itemsize = rng.randint(0, 24), rng.randint(0, 24), rng.choice([1, 2, 4, 8])
        if kind == "rows":
            grid = (world, 1)
        elif kind == "cols":
            grid = (1, world)
        else:
            a = rng.choice([d for d in range(1, world + 1) if world % d == 0])
            grid = (a, world // a)
        data = rng.randbytes(rows * cols * itemsize)
        per_rank = _grid_runs(rng, rows, cols, itemsize, grid)
        results = [_rank_contribution(rng, data, runs, mode) for runs in per_rank]
        assert combine_contributions(c for c, _ in results) == zlib.crc32(data)
        assert sum(n for _, n in results) == len(data)


def test_random_tilings_in_random_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        data = rng.randbytes(rng.randint(0, 3000))
        runs = _cuts(rng, len(data), rng.randint(1, 40))
        ranks = [CrcAccumulator() for _ in range(rng.randint(1, 8))]
        rng.shuffle(runs)
        for s, e in runs:
            rng.choice(ranks).add(s, e, zlib.crc32(data[s:e]))
        assert combine_contributions(r.contribution(len(data)) for r in ranks) == zlib.crc32(data)


def test_empty_and_single_byte_tensors() -> None:
    assert CrcAccumulator().contribution(0) == 0 == zlib.crc32(b"")
    assert combine_contributions([]) == 0
    acc = CrcAccumulator()
    acc.add(0, 0, 0)
    assert acc.contribution(0) == 0 and acc.nbytes == 0
    # A rank that wrote nothing of a non-empty tensor contributes 0.
    assert CrcAccumulator().contribution(10) == 0
    acc = CrcAccumulator()
    acc.update(0, b"\x7f")
    assert acc.contribution(1) == zlib.crc32(b"\x7f")


def test_empty_runs_change_nothing() -> None:
    data = random.Random(3).randbytes(100)
    acc = CrcAccumulator()
    acc.add(50, 50, 0)
    acc.add(0, 40, zlib.crc32(data[:40]))
    acc.update(40, b"")
    acc.add(40, 100, zlib.crc32(data[40:]))
    acc.add(100, 100, 0)
    assert acc.contribution(100) == zlib.crc32(data)


def test_shift_matches_zlib_on_zero_buffers() -> None:
    rng = random.Random(11)
    lengths = [*range(70), 255, 256, 257, 4095, 4096, 8192, 65537, 1 << 20, 3 * (1 << 20) + 17]
    lengths += [rng.randint(1, 4 << 20) for _ in range(6)]
    for n in lengths:
        crc = rng.getrandbits(32)
        expected = _zeros_shift(crc, n)
        # Three calls: first use, table build on the second, table path on the third.
        for _ in range(3):
            assert crc32_shift(crc, n) == expected, n


def test_shift_composes_beyond_4gib() -> None:
    rng = random.Random(5)
    pairs = [(2**31, 2**31), (2**32, 2**32), (5 << 30, 123), (2**32 - 1, 1), (2**40, 2**40 + 7)]
    pairs += [(rng.getrandbits(40), rng.getrandbits(36)) for _ in range(20)]
    for a, b in pairs:
        crc = rng.getrandbits(32)
        assert crc32_shift(crc, a + b) == crc32_shift(crc32_shift(crc, a), b), (a, b)


def test_combine_matches_zlib() -> None:
    rng = random.Random(13)
    for _ in range(300):
        data = rng.randbytes(rng.randint(0, 2000))
        cut = rng.choice([0, len(data), rng.randint(0, len(data))])
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def test_crc32_of_is_zlib_on_views() -> None:
    data = bytearray(random.Random(1).randbytes(10_000))
    assert crc32_of(memoryview(data)[100:9000]) == zlib.crc32(bytes(data[100:9000]))
    assert crc32_of(memoryview(data).cast("I")) == zlib.crc32(data)
    with pytest.raises(BufferError):
        crc32_of(memoryview(data)[::2])


def test_errors_name_the_value_and_the_rule() -> None:
    acc = CrcAccumulator()
    with pytest.raises(ValueError, match=r"byte run \[5, 3\) is not a run: need 0 <= start <= end"):
        acc.add(5, 3, 0)
    with pytest.raises(ValueError, match=r"byte run \[-1, 3\) is not a run"):
        acc.add(-1, 3, 0)
    with pytest.raises(ValueError, match=r"crc=4294967296 is not a zlib.crc32 value"):
        acc.add(0, 3, 1 << 32)
    with pytest.raises(ValueError, match=r"byte run at start=-2 is not a run"):
        acc.update(-2, b"x")
    acc.add(0, 10, 0)
    with pytest.raises(
        ValueError, match=r"tensor length 9 is shorter than a byte run fed to it \(ending at 10\)"
    ):
        acc.contribution(9)
    with pytest.raises(ValueError, match=r"crc32_shift\(nbytes=-1\) needs nbytes >= 0"):
        crc32_shift(0, -1)


def test_crc32c_of_pieces_is_the_crc32c_of_their_concatenation() -> None:
    # GCS reports every object's CRC32C; a composed file's must be its parts' laid end to end.
    import base64

    google_crc32c = pytest.importorskip("google_crc32c")
    from hf_dcp_storage.format.crc32c import crc32c_combine, crc32c_from_gcs, crc32c_of_pieces

    rng = random.Random(7)
    pieces = [rng.randbytes(n) for n in (0, 1, 112, 6 << 20, 4095, 0, 65536)]
    want = google_crc32c.value(b"".join(pieces))
    assert crc32c_of_pieces((google_crc32c.value(p), len(p)) for p in pieces) == want
    assert (
        crc32c_of_pieces((google_crc32c.value(p), len(p)) for p in reversed(pieces)) != want
    )  # order matters
    assert crc32c_combine(
        google_crc32c.value(b"ab"), google_crc32c.value(b""), 0
    ) == google_crc32c.value(b"ab")
    assert crc32c_from_gcs(base64.b64encode(want.to_bytes(4, "big")).decode()) == want
    with pytest.raises(ValueError, match=r"crc32c='AAA=' is not base64 of a 4-byte CRC32C"):
        crc32c_from_gcs("AAA=")


def test_the_fast_backend_is_installed_and_gives_zlib_s_values() -> None:
    """The dev set installs zlib-ng (setup.cfg asks for it): its CRC-32 is zlib's, on any length,
    continued from any value, on memoryviews of tensor bytes as the writer passes them."""
    from hf_dcp_storage.format.crc import CRC32_BACKEND

    assert CRC32_BACKEND == "zlib-ng"
    rng = random.Random(11)
    data = rng.randbytes(3 << 20)
    for n in (0, 1, 7, 4096, 5 * 1024 + 3, len(data)):
        start = rng.getrandbits(32)
        assert crc32_of(memoryview(data)[:n], start) == zlib.crc32(data[:n], start), n
    with pytest.raises(BufferError):
        crc32_of(memoryview(data)[::2])
