"""The steps of ``plan/gather.gather_tasks``, each on small hand-built inputs whose outputs are
worked out by hand: the parts as arrays, who gathers which, the row-sharded pieces and the
column-sharded chunks of each gathered part, the shift by a rank's own parts, each rank's share."""

from __future__ import annotations

import numpy as np

from hf_dcp_storage.plan.gather import (
    Runs,
    _best_nodes,
    _column_chunks,
    _narrowed,
    _part_table,
    _reaching,
    _row_pieces,
    _Rows,
    _shares,
    _Slots,
    _slots,
    _unstage_own_parts,
)
from hf_dcp_storage.plan.parts import GatherPart, RankPart
from hf_dcp_storage.plan.placed import PlacedChunks


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _same(got: np.ndarray, want: list[list[int]] | list[int], dtype: type = np.int64) -> None:
    """``got`` holds ``want`` exactly, as ``dtype``."""
    assert got.dtype == dtype, got.dtype
    assert got.tolist() == want


# Two files of 30 and 20 bytes (all files' bytes: file 0 at 0, file 1 at 30).
TWO_FILES = [
    [GatherPart(1, 0, 10), RankPart(2, 1, 10, 30)],
    [RankPart(1, 0, 0, 8, header=True), GatherPart(2, 8, 20)],
]
TWO_FILES_BASE = _i64(0, 30, 50)


def test_step1_the_parts_are_arrays_in_file_order_with_their_absolute_bytes() -> None:
    t = _part_table(TWO_FILES, TWO_FILES_BASE)
    _same(t.file, [0, 0, 1, 1])
    _same(t.number, [1, 2, 1, 2])
    _same(t.start, [0, 10, 0, 8])
    _same(t.end, [10, 30, 8, 20])
    _same(t.lo, [0, 10, 30, 38])
    _same(t.hi, [10, 30, 38, 50])
    _same(t.rank, [-1, 1, 0, -1])  # -1: gathered


def test_step2_the_gathered_parts_go_largest_first_to_the_least_loaded_rank() -> None:
    # Gathered parts 0, 2, 3 of 10, 40, 20 bytes; part 1 is rank 1's own. Ranks already upload
    # 50, 0 and 1,000 bytes: 40 B goes to rank 1 (now 80), 20 B to rank 0 (50 < 80; now 90),
    # 10 B to rank 1 (80 < 90). Rank 0 gathers part 3; rank 1 parts 0 and 2; rank 2 none.
    parts = [[GatherPart(1, 0, 10), RankPart(2, 1, 10, 15), GatherPart(3, 15, 55)]]
    parts.append([GatherPart(1, 0, 20)])
    got = _slots(_part_table(parts, _i64(0, 55, 75)), _i64(50, 0, 1000), 3)
    _same(got.order, [3, 0, 2])
    _same(got.rank_at, [0, 1, 3, 3])


def _runs() -> Runs:
    """File 0 (bytes 0-100, a 10-byte header): rank 0's run 10-40, rank 1's 40-70, a
    column-sharded tensor 70-100; file 1 (100-200, a 10-byte header): rank 1's run 110-150,
    rank 0's 150-200. Each rank stages each file's runs from offset 0 (``staged``: offset less
    start)."""
    return Runs(
        start=_i64(10, 40, 70, 110, 150),
        nbytes=_i64(30, 30, 30, 40, 50),
        rank=np.array([0, 1, -1, 1, 0], dtype=np.int32),
        staged=_i64(-10, -40, 0, -110, -150),
    )


def test_step3_a_gathered_part_takes_the_runs_it_spans_cut_to_its_bytes() -> None:
    # Slots (not in file order): file 0's 30-60 (across ranks 0 and 1), file 1's 0-30 (its
    # header and rank 1's first 20 bytes), file 0's 70-100 (the column-sharded tensor alone: no
    # piece), file 0's 60-70 (rank 1's last 10 bytes).
    pieces = _row_pieces(_runs(), _i64(30, 100, 70, 60), _i64(60, 130, 100, 70), _i64(0, 100, 0, 0))
    assert pieces.rows.flags.f_contiguous
    # (rank, file offset, staged offset, bytes)
    _same(pieces.rows, [[0, 30, 20, 10], [1, 40, 0, 20], [1, 10, 0, 20], [1, 60, 20, 10]])
    _same(pieces.at, [0, 2, 3, 3, 4])


def test_step3_without_column_sharded_runs_every_run_counts() -> None:
    runs = Runs(_i64(0, 10), _i64(10, 10), np.array([2, 3], dtype=np.int32), _i64(5, -10))
    pieces = _row_pieces(runs, _i64(5), _i64(15), _i64(0))
    _same(pieces.rows, [[2, 5, 10, 5], [3, 10, 0, 5]])
    _same(pieces.at, [0, 2])


def test_reaching_drops_what_ends_before_a_part_when_the_ends_are_not_sorted() -> None:
    # [0, 100) reaches past [10, 20), which ends before the part [25, 35): only 0 and 2 reach it.
    take, counts = _reaching(_i64(0, 10, 30), _i64(100, 20, 40), _i64(25, 0), _i64(35, 5))
    assert take.tolist() == [0, 2, 0] and counts.tolist() == [2, 1]


def _placed() -> PlacedChunks:
    """File 1 of a save (file 0 is 100 bytes; file 1 has an 8-byte header): ``w`` [4, 4] uint8
    at 8-24 and ``v`` [2, 6] of 2-byte items at 24-48, each column-sharded over ranks 0 and 1
    (columns 0-1 | 2-3 and 0-2 | 3-5), and rank 0's ``n`` [4] uint8 at 48-52, row-sharded.
    Sorted by (rank, file, start); staged offsets as each rank stages its chunks whole."""
    return PlacedChunks(
        key_names=("w", "v", "n"),
        rank=np.array([0, 0, 0, 1, 1], dtype=np.int32),
        key=np.array([0, 1, 2, 0, 1], dtype=np.int32),
        file=np.ones(5, dtype=np.int32),
        start=_i64(8, 24, 48, 10, 30),
        nbytes=_i64(8, 12, 4, 8, 12),
        offsets=np.array([[0, 0], [0, 0], [0, 0], [0, 2], [0, 3]], dtype=np.int32),
        sizes=np.array([[4, 2], [2, 3], [4, 0], [4, 2], [2, 3]], dtype=np.int32),
        staged=_i64(0, 8, 20, 0, 8),
        shape=np.array([[4, 4], [2, 6], [4, 0]], dtype=np.int64),
        itemsize=_i64(1, 2, 1),
        tensor_start=_i64(8, 24, 48),
        key_file=_i64(1, 1, 1),
        ndim=_i64(2, 2, 1),
    )


def test_step4_a_column_sharded_chunk_is_named_in_every_part_between_its_first_and_last_byte() -> (
    None
):
    placed = _placed()
    strided = np.array([True, True, False, True, True])
    file_base = _i64(0, 100, 152)
    # Slots: file 1's bytes 21-52, then 0-21. Its chunks of w end at bytes 21 (rank 0: the last
    # row's first two bytes are 20 and 21) and 23, of v at 41 and 47; the file lists v before w.
    columns = _column_chunks(
        placed,
        strided,
        file_base[placed.file] + placed.start,
        file_base,
        _i64(1, 0, 2),
        _i64(121, 100),
        _i64(152, 121),
    )
    assert columns.rows.flags.f_contiguous
    w0, w1 = [0, 1, 0, 0, 0, 4, 2], [1, 1, 0, 0, 2, 4, 2]  # (rank, tensor, staged, offsets, sizes)
    v0, v1 = [0, 0, 8, 0, 0, 2, 3], [1, 0, 8, 0, 3, 2, 3]
    _same(columns.rows, [w0, w1, v0, v1, w0, w1])  # in output order: by first byte
    _same(columns.at, [0, 4, 6])


def test_step5_a_ranks_own_parts_move_its_later_staged_offsets_in_that_file_down() -> None:
    table = _part_table(
        [
            [
                RankPart(1, 0, 8, 20, header=True),
                GatherPart(2, 20, 30),
                RankPart(3, 1, 30, 50),
                RankPart(4, 0, 50, 60),
                GatherPart(5, 60, 80),
            ],
            [RankPart(1, 0, 0, 40, header=True), GatherPart(2, 40, 50)],
        ],
        _i64(0, 80, 130),
    )
    order = _i64(4, 1, 6)  # slots: file 0's part 5, its part 2, file 1's part 2
    # (rank, _, staged offset as if every byte were staged, _) per slot: ranks 0 and 1, 0, 0 and 1
    rows = [[0, 0, 100, 1], [1, 0, 100, 1], [0, 0, 100, 1], [0, 0, 100, 1], [1, 0, 100, 1]]
    pieces = _Rows(np.array(rows, dtype=np.int64, order="F"), _i64(0, 2, 3, 5))
    columns = _Rows(np.array([[1, 0, 7], [0, 0, 45]], dtype=np.int64, order="F"), _i64(0, 0, 1, 2))
    _unstage_own_parts(table, order, pieces, columns)
    # File 0's part 5: rank 0 sent 12 + 10 bytes before it, rank 1 20; its part 2: rank 0 12.
    # File 1's part 2: rank 0 sent 40 bytes of file 1 before it (file 0's do not count).
    assert pieces.rows[:, 2].tolist() == [78, 80, 88, 60, 100]
    assert columns.rows[:, 2].tolist() == [7, 5]  # rank 1's own part comes after file 0's part 2


def test_step5_without_own_parts_nothing_moves() -> None:
    table = _part_table([[GatherPart(1, 0, 10)]], _i64(0, 10))
    rows = _Rows(np.array([[3, 0, 9, 1]], dtype=np.int64), _i64(0, 1))
    _unstage_own_parts(table, _i64(0), rows)
    assert rows.rows.tolist() == [[3, 0, 9, 1]]


def test_column_rows_are_int32_in_c_order_where_every_value_fits() -> None:
    rows = np.array([[1, 2, 3], [4, 5, 2**31 - 1]], dtype=np.int64, order="F")
    small = _narrowed(rows)
    assert small.dtype == np.int32 and small.flags.c_contiguous and small.tolist() == rows.tolist()
    rows[1, 2] = 2**31  # a staged offset past 2 GiB
    assert _narrowed(rows) is rows
    empty = np.empty((0, 5), dtype=np.int64, order="F")
    assert _narrowed(empty) is empty


def test_step6_each_rank_gets_a_slice_of_the_slots_with_its_headers_and_tensors() -> None:
    table = _part_table(
        [
            [GatherPart(1, 0, 10), RankPart(2, 0, 10, 20), GatherPart(3, 20, 30)],
            [GatherPart(1, 0, 12), GatherPart(2, 12, 30)],  # a 16-byte header: in both
        ],
        _i64(0, 30, 60),
    )
    # Rank 0 gathers nothing, rank 1 file 0's part 3 and file 1's part 1, rank 2 file 0's part 1
    # and file 1's part 2.
    slots = _Slots(_i64(2, 3, 0, 4), _i64(0, 0, 2, 4))
    pieces = _Rows(np.arange(20, dtype=np.int64).reshape(5, 4), _i64(0, 1, 2, 4, 5))
    columns = _Rows(np.arange(15, dtype=np.int32).reshape(3, 5), _i64(0, 0, 2, 2, 3))
    headers = [b"H0H0", b"HEADER01HEADER02"]
    tensors = [((4, (26,), 1),), ((16, (14,), 1),)]
    zero, one, two = _shares(table, slots, pieces, columns, headers, tensors, 1)
    assert len(zero) == 0 and zero.heads == {} and zero.tensors == {}
    _same(zero.piece_at, [0])
    _same(zero.strided_at, [0])
    _same(one.parts, [[0, 3, 20, 30], [1, 1, 0, 12]])  # (file, number, start, end)
    _same(one.piece_at, [0, 1, 2])
    _same(one.pieces, pieces.rows[0:2].tolist())
    _same(one.strided_at, [0, 0, 2])
    _same(one.strided, columns.rows[0:2].tolist(), np.int32)
    assert one.heads == {1: b"HEADER01HEAD"} and one.tensors == {1: tensors[1]} and one.width == 1
    _same(two.parts, [[0, 1, 0, 10], [1, 2, 12, 30]])
    _same(two.piece_at, [0, 2, 3])
    _same(two.pieces, pieces.rows[2:5].tolist())
    _same(two.strided_at, [0, 0, 1])
    _same(two.strided, columns.rows[2:3].tolist(), np.int32)
    assert two.heads == {0: b"H0H0", 1: b"ER02"} and two.tensors == {1: tensors[1]}


def test_a_part_goes_to_the_node_holding_most_of_it_and_ties_spread_over_the_nodes() -> None:
    # 8 ranks, 2 a node. Part 0: rank 2 (node 1) holds 30 of its 40 bytes. Parts 1-4: 4 ranks
    # of 4 nodes hold 1 byte each of every one (a norm's parts): each goes to a different node.
    starts, ranks = [0, 10], [0, 2]
    for p in range(4):
        for r in (0, 2, 4, 6):
            starts.append(40 + 4 * p + r // 2)
            ranks.append(r)
    start = np.array(starts, dtype=np.int64)
    nbytes = np.diff(np.append(start, 56))
    runs = Runs(start, nbytes, np.array(ranks, dtype=np.int64), np.zeros(len(start), np.int64))
    lo, hi = np.array([0, 40, 44, 48, 52]), np.array([40, 44, 48, 52, 56])
    best = _best_nodes(runs, lo, hi, per_node=2)
    assert best[0] == 1
    assert sorted(best[1:].tolist()) == [0, 1, 2, 3]
