"""Google Cloud Storage (through gcsfs): every consolidated file composed server-side from parts the
ranks upload as objects.

The parts are planned as S3's are, with GCS's rules (``plan/gcsplan.py``): each rank uploads its
runs of 1 MiB or more as part objects under the save's staging folder (resumable uploads for
the large ones) and stages the rest; the ranks gather the mixed parts; then the coordinator
composes each file (``_assemble``): up to 32 sources a compose, as a tree for more
(``plan/gcsplan.compose_tree``), every level's composes of every file in parallel, each part
required at the generation its upload made (so a stray object of the same name never enters
the file). The tree's intermediate objects are deleted as soon as their file is composed; the
parts go with the staging folder once the index is written (until then ``hf-dcp consolidate``
composes the files again from them: composing is idempotent). A failed save deletes its parts
and intermediates (``_discard``). The requests are ``stores/gcs_requests.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsspec import AbstractFileSystem

from ..io import fsio
from ..io.parallel import parallel_map
from ..io.retry import RetryPolicy
from ..plan.gcsplan import GCS_RULES, compose_tree, part_name
from ..plan.layout import Layout
from .base import STAGING_DIR, Ranges
from .gcs_requests import GCS
from .parts import PartsStore, quietly

__all__ = ["GcsStore", "GcsRanges"]

# Composes of one file's tree level in flight at once (files are composed in parallel too).
_COMPOSES_IN_FLIGHT = 8


class GcsRanges(Ranges):
    """Ranged GETs through the library's own retried requests, up to 16 in flight per call."""

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        super().__init__(fs, retry)
        self.gcs = GCS(fs, retry)

    def get_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self.gcs.get_spans([(path, start, end) for start, end in ranges])

    def get_range(self, path: str, start: int, end: int) -> bytes:
        return self.gcs.get_range(path, start, end)


class GcsStore(PartsStore):
    """Part objects composed by the server (see the module docstring)."""

    mode = "gcs"
    rules = GCS_RULES

    def _client(self, fs: AbstractFileSystem, retry: RetryPolicy) -> GCS:
        return GCS(fs, retry)

    def _staging(self) -> str:
        return fsio.join(self.root, STAGING_DIR)

    def _assemble(self, f: int, layout: Layout, entries: list[dict[str, Any]]) -> None:
        name = layout.files[f].name
        gcs: GCS = self.client  # type: ignore[assignment]
        parts = [part_name(self._staging(), name, e["PartNumber"]) for e in entries]
        generation = {p: e["ETag"] for p, e in zip(parts, entries, strict=True)}
        levels = compose_tree(name, fsio.join(self.root, name), parts, self._staging())
        made: dict[str, str] = {}  # intermediate -> its generation
        for level in levels:
            def one(c: Any) -> None:
                meta = gcs.compose(c.target, [(s, generation.get(s) or made.get(s)) for s in c.sources])
                made[c.target] = str(meta["generation"])

            parallel_map(one, level, _COMPOSES_IN_FLIGHT)
        intermediates = [c.target for level in levels[:-1] for c in level]
        if intermediates:
            quietly(lambda: gcs.delete_many(intermediates, self.threads), f"the intermediate objects of {gcs.url(fsio.join(self.root, name))}")

    def _discard(self, names: Sequence[str], save_id: str) -> None:
        """Delete the save's part objects and compose intermediates (from a fresh listing of
        the staging folder; the staged objects and records stay for ``hf-dcp consolidate``'s
        refusal and the next save, as on S3)."""
        gcs: GCS = self.client  # type: ignore[assignment]
        for sub in ("parts", "compose"):
            folder = fsio.join(self._staging(), sub)
            quietly(lambda folder=folder: fsio.remove_tree(self.fs, folder), gcs.url(folder))
