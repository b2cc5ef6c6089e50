"""Google Cloud Storage (through gcsfs): every consolidated file composed server-side from parts the
ranks upload as objects.

The parts are planned as S3's are, with GCS's rules (``plan/gcsplan.py``): each rank uploads its
runs of 1 MiB or more (a node's ranks, their runs of 64 KiB or more side by side) as part objects
under the save's staging folder (resumable uploads for the large ones) and stages the rest; the
ranks gather the mixed parts; then the coordinator composes each file (``_assemble``): up to 32
sources a compose, as a tree for more (``plan/gcsplan.compose_tree``), every level's composes of
every file in parallel, each part required at the generation its upload made (so a stray object of
the same name never enters the file), and each composed file checked against its parts before
anything is committed: its size, and its CRC32C against the one the parts' CRC32Cs make in order
(``_check_composed``: a server that ignores the preconditions, as fake-gcs-server does, cannot slip
a changed part in). Parts and intermediates sit in a folder named by the save's id, so no other save
(nor a stale compose of a killed one) ever reads or writes this save's. The tree's intermediate
objects are deleted as soon as their file is composed; the parts go with the staging folder once the
index is written (until then ``hf-dcp consolidate`` composes the files again from them: composing is
idempotent). A failed save deletes its parts and intermediates (``_discard``). The requests are
``stores/gcs_requests.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..format.crc32c import crc32c_from_gcs, crc32c_of_pieces
from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.gcsplan import GCS_RULES, compose_tree, part_name
from ..plan.layout import Layout
from ..plan.parts import MAX_PARTS, RANK_PART_BYTES, PartRules
from .base import STAGING_DIR
from .gcs_requests import GCS, GCS_ERRORS
from .parts import PartsStore
from .partsclient import quietly

__all__ = ["GcsStore"]

# Composes of one file's tree level in flight at once (files are composed in parallel too).
_COMPOSES_IN_FLIGHT = 8


class GcsStore(PartsStore):
    """Part objects composed by the server (see the module docstring)."""

    mode = "gcs"
    bound_to_place = "GCS: its parts are objects in the bucket, composed there"
    rules = GCS_RULES
    # Before the save record kept its rules: runs of 1 MiB or more were a rank's own parts.
    legacy_rules = PartRules(min_part=1 << 20, max_parts=MAX_PARTS, rank_part=RANK_PART_BYTES)
    client_class = GCS
    client: GCS
    errors = GCS_ERRORS

    def _staging(self) -> str:
        return fsio.join(self.root, STAGING_DIR)

    def staging_names(self) -> list[str] | None:
        return None  # the parts and the compose intermediates live there too: list the folder

    def _assemble(self, f: int, layout: Layout, entries: list[dict[str, Any]]) -> None:
        name = layout.files[f].name
        gcs = self.client
        parts = [part_name(self._staging(), self.save_id, name, e["PartNumber"]) for e in entries]
        generation = {p: e["ETag"] for p, e in zip(parts, entries, strict=True)}
        levels = compose_tree(
            name, fsio.join(self.root, name), parts, self._staging(), self.save_id
        )
        made: dict[str, dict[str, Any]] = {}  # composed object -> its metadata
        for level in levels:

            def one(c: Any) -> None:
                made[c.target] = gcs.compose(
                    c.target,
                    [(s, generation.get(s) or str(made[s]["generation"])) for s in c.sources],
                )

            parallel_map(one, level, _COMPOSES_IN_FLIGHT)
        intermediates = [c.target for level in levels[:-1] for c in level]
        if intermediates:
            quietly(
                lambda: gcs.delete_many(intermediates, self.threads),
                f"the intermediate objects of {gcs.url(fsio.join(self.root, name))}",
            )
        self._check_composed(f, layout, entries, made[levels[-1][0].target])

    def _check_composed(
        self, f: int, layout: Layout, entries: list[dict[str, Any]], meta: dict[str, Any]
    ) -> None:
        """Refuse a composed file that is not its recorded parts' bytes in order: its size must
        be the planned one and its CRC32C (GCS computes it for every object) the one the parts'
        CRC32Cs, as their uploads got them, make end to end. The generation preconditions keep a
        replaced part out of a compose on GCS itself; this holds where they are not enforced
        (fake-gcs-server ignores them) and whatever changed a part after its upload.

        Raises:
            RuntimeError: the file differs (it is deleted: no index ever names it).
        """
        plan, gcs = layout.files[f], self.client
        assert isinstance(gcs, GCS)
        ends = [p.end for p in self.parts[f]]
        sizes = [
            b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)
        ]  # the parts tile the file, header first
        size = int(meta.get("size", -1))
        want = (
            crc32c_of_pieces(
                (crc32c_from_gcs(e["CRC32C"]), n) for e, n in zip(entries, sizes, strict=True)
            )
            if all("CRC32C" in e for e in entries)
            else None
        )
        got = crc32c_from_gcs(meta["crc32c"]) if want is not None and meta.get("crc32c") else None
        if size == plan.size and (want is None or got is None or got == want):
            return
        path = fsio.join(self.root, plan.name)
        quietly(lambda: gcs.delete(path), gcs.url(path))
        raise RuntimeError(
            f"{gcs.url(path)}: composed from its {len(entries)} parts, it is not their bytes in "
            f"order (size {size}, crc32c {got if got is None else f'{got:08x}'}; the parts make "
            f"{plan.size} bytes, crc32c {want if want is None else f'{want:08x}'}): a part object "
            "changed after its upload (another writer replaced it, which a server that ignores "
            "generation preconditions lets through); nothing is committed, save the checkpoint "
            "again"
        )

    def _discard(self, names: Sequence[str], save_id: str) -> None:
        """Delete the save's part objects and compose intermediates (from a fresh listing of
        the staging folder; the staged objects and records stay for ``hf-dcp consolidate``'s
        refusal and the next save, as on S3)."""
        gcs = self.client
        for sub in ("parts", "compose"):
            folder = fsio.join(self._staging(), sub)
            quietly(functools.partial(fsio.remove_tree, self.fs, folder), gcs.url(folder))
