"""Whether each key's chunks tile its tensor exactly once, on the coordinator, from the rows of
:class:`GlobalChunks` grouped by key: every chunk inside its tensor (:func:`check_inside`), and
no gap or overlap (:func:`check_tiling`), proven linearly band by band for DTensor layouts
(:func:`bands_tile`) and checked exactly for the keys that fail that (:func:`check_key`). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from .chunks import GlobalChunks, describe_row

__all__ = ["against_previous", "bands_tile", "check_inside", "check_key", "check_tiling"]


def check_inside(
    g: GlobalChunks, offsets: np.ndarray, sizes: np.ndarray, bounds: np.ndarray, shapes: np.ndarray
) -> None:
    """Every chunk lies inside its tensor. ``offsets``/``sizes`` are ``g``'s rows grouped by
    key, key ``k``'s rows ``bounds[k]:bounds[k + 1]``; ``shapes`` each key's, zero-padded.

    Checked on the smallest value and each key's largest end per dimension (a column at a time:
    these arrays have millions of rows); the chunk to name is looked for only when one is out.

    Raises:
        ValueError: naming a chunk outside its tensor.
    """
    n, width = offsets.shape
    present = np.flatnonzero(bounds[1:] > bounds[:-1])
    outside = n > 0 and (int(offsets.min()) < 0 or int(sizes.min()) < 0)
    for d in range(width if n else 0):
        ends = np.maximum.reduceat(offsets[:, d] + sizes[:, d], bounds[present])
        outside = outside or bool((ends > shapes[present, d]).any())
    if outside:
        bad = np.flatnonzero(
            ((g.offsets < 0) | (g.sizes < 0) | (g.offsets + g.sizes > shapes[g.key])).any(axis=1)
        )
        raise ValueError(
            f"{describe_row(g, int(bad[0]))} lies outside the tensor; every chunk must lie within "
            "its global shape"
        )


def check_tiling(
    g: GlobalChunks,
    key: np.ndarray,
    order: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    nd: np.ndarray,
    shapes: np.ndarray,
    distinct: np.ndarray,
) -> None:
    """Each key's distinct non-empty chunks cover its tensor exactly once. The rows (``g``'s
    rows ``order``, of keys ``key`` and ndim ``nd``) are grouped by key, each key's sorted by
    offsets then sizes; ``distinct`` marks the first of equal chunks, when not empty.

    Raises:
        ValueError: a key whose chunks leave a gap or overlap (:func:`check_key`).
    """
    covering = np.flatnonzero(distinct)  # one row per distinct chunk; empty ones cover nothing
    key_c = key[covering]
    suspect = bands_tile(key_c, offsets, sizes, covering, nd[covering], shapes)
    ndim, width = g.ndim, shapes.shape[1]
    # A key without a chunk is a gap, unless the tensor is empty.
    suspect |= (np.bincount(key_c, minlength=len(g.specs)) == 0) & (
        shapes.prod(axis=1, where=np.arange(width) < ndim[:, None]) > 0
    )
    by_key = np.searchsorted(key_c, np.arange(len(g.specs) + 1, dtype=key_c.dtype))
    for k in np.flatnonzero(suspect).tolist():
        rows = covering[by_key[k] : by_key[k + 1]]
        n = ndim[k]
        check_key(g, k, order[rows], offsets[rows, :n], sizes[rows, :n], shapes[k, :n])


def against_previous(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per row after the first: whether it is lexicographically after, or equal to, the row
    before it (``columns`` in order of precedence)."""
    n = len(columns[0]) if columns else 0
    later, equal = np.zeros(max(n - 1, 0), dtype=bool), np.ones(max(n - 1, 0), dtype=bool)
    for c in columns:
        later |= equal & (c[1:] > c[:-1])
        equal &= c[1:] == c[:-1]
    return later, equal


def bands_tile(
    key: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    rows: np.ndarray,
    nd: np.ndarray,
    shapes: np.ndarray,
) -> np.ndarray:
    """Per key, whether its distinct non-empty chunks, ``rows`` of ``offsets``/``sizes``
    (grouped by ``key``, each key's sorted by offsets then sizes; ``nd`` their keys' ndim) might
    not tile it: ``False`` proves they do.

    They do when, dimension after dimension, the chunks sharing their extent in the earlier
    dimensions (a band) split the next one into intervals that follow each other from 0 to its
    end: then each band is cut exactly by the next dimension's intervals, down to single chunks.
    Every grid (DTensor sharding) passes; other tilings and every gap or overlap are left to the
    exact check. Linear: a few comparisons per chunk and dimension, a dimension at a time."""
    m = len(rows)
    suspect = np.zeros(len(shapes), dtype=bool)
    if not m:
        return suspect
    new = np.ones(m, dtype=bool)  # first row of its band
    new[1:] = key[1:] != key[:-1]
    last = np.ones(m, dtype=bool)  # last row of its band
    bad = np.zeros(m, dtype=bool)
    for d in range(offsets.shape[1]):
        o, s = offsets[:, d][rows], sizes[:, d][rows]
        if not o.any() and (s == shapes[key, d]).all():
            continue  # every chunk whole in this dimension (FSDP's dim 1): it cuts no band
        stays = np.zeros(m, dtype=bool)  # the same interval as the row before
        stays[1:] = (o[1:] == o[:-1]) & (s[1:] == s[:-1])
        follows = np.zeros(m, dtype=bool)  # the interval right after the row before's
        follows[1:] = o[1:] == o[:-1] + s[:-1]
        last[:-1] = new[1:]
        ok = np.where(new, o == 0, stays | follows) & (~last | (o + s == shapes[key, d]))
        active = nd > d
        bad |= active & ~ok
        new |= active & ~stays
    suspect[key[bad]] = True
    return suspect


def check_key(
    g: GlobalChunks,
    k: int,
    rows: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    shape: np.ndarray,
) -> None:
    """Key ``k``'s distinct non-empty chunks must cover its tensor exactly once."""
    spec = g.specs[k]
    if len(rows) == 0 and math.prod(spec.shape) == 0:
        return
    if len(rows) and _is_grid(offsets, sizes, shape):
        return
    boxes = list(zip(map(tuple, offsets.tolist()), map(tuple, sizes.tolist()), strict=True))
    if not _tiles(boxes, tuple(spec.shape)):
        example = (
            f"; one of its {len(rows)} distinct chunks: {describe_row(g, int(rows[0]))}"
            if len(rows)
            else ""
        )
        raise ValueError(
            f"the chunks of {spec.key!r} {list(spec.shape)} do not cover it exactly once (a gap "
            f"or an overlap){example}. Every element must be saved by exactly one rank's shard"
        )


def _is_grid(offsets: np.ndarray, sizes: np.ndarray, shape: np.ndarray) -> bool:
    """Whether distinct boxes are exactly the cells of a grid that partitions ``shape``: then
    they tile it. Each dimension's distinct intervals must partition it, and the boxes must be
    as many as the grid's cells (distinct boxes made of grid intervals are distinct cells)."""
    cells = 1
    for d in range(len(shape)):
        pairs = np.unique(offsets[:, d].astype(np.int64) * (int(shape[d]) + 1) + sizes[:, d])
        starts, lengths = np.divmod(pairs, int(shape[d]) + 1)
        if (
            starts[0] != 0
            or starts[-1] + lengths[-1] != shape[d]
            or (starts[1:] != starts[:-1] + lengths[:-1]).any()
        ):
            return False
        cells *= len(pairs)
    return cells == len(offsets)


def _tiles(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]) -> bool:
    """Exact check, any boxes: cut the first dimension at every box edge; in each slab the boxes
    spanning it must tile the remaining dimensions (recursively)."""
    if not shape:
        return len(boxes) == 1
    if shape[0] == 0:
        return not boxes
    cuts = sorted({0, shape[0], *(o[0] for o, _ in boxes), *(o[0] + s[0] for o, s in boxes)})
    for a, b in pairwise(cuts):
        spanning = [(o[1:], s[1:]) for o, s in boxes if o[0] <= a and b <= o[0] + s[0]]
        if not _tiles(spanning, shape[1:]):
            return False
    return True
