"""Azure Blob Storage (through adlfs): every consolidated file one block blob, its blocks staged by
the ranks and committed by the coordinator with one ``Put Block List``.

The parts are planned as S3's are, with Azure's rules (``plan/azureplan.py``): each rank stages its
runs of 1 MiB or more (a node's ranks, their runs of 64 KiB or more side by side) as blocks of
the final blob (``Put Block``; ids of one fixed length derived from the save, the file and the
block's first byte, so nobody needs to be told them) and stages
the rest in an object of its own; the ranks gather the mixed blocks; the coordinator commits
each blob (``_assemble``). Until then the blocks are invisible; a commit drops every uncommitted
block it does not name, so committing again (``hf-dcp consolidate``) gives the same blob. A
failed save drops its uncommitted blocks (``_discard``); the next save to the path drops those
a killed save left, on the files its save record names (the blobs of other names a listing of
uncommitted blobs finds, where the service lists them). The requests are
``stores/azure_requests.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from fsspec import AbstractFileSystem

from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.azureplan import AZURE_RULES, MAX_BLOCKS
from ..plan.layout import Layout
from ..plan.parts import RANK_PART_BYTES, PartRules
from ..session.records import SAVE_RECORD, SaveRecord
from .azure_requests import AZURE_ERRORS, Azure
from .base import STAGING_DIR
from .parts import PartsStore
from .partsclient import quietly
from .retry import RetryPolicy

__all__ = ["AzureStore"]


class AzureStore(PartsStore):
    """Blocks of the final blobs, committed by the coordinator (see the module docstring)."""

    mode = "azure"
    bound_to_place = "Azure: its bytes sit in uncommitted blocks of the blobs themselves"
    rules = AZURE_RULES
    # Before the save record kept its rules: runs of 1 MiB or more were a rank's own parts.
    legacy_rules = PartRules(min_part=1 << 20, max_parts=MAX_BLOCKS, rank_part=RANK_PART_BYTES)
    client_class = Azure
    client: Azure
    errors = AZURE_ERRORS

    def prepare(self, layout: Layout, overwrite: bool, *, make_files: bool = True) -> None:
        """Also drops the uncommitted blocks a killed save left under this path (invisible, but
        stored): on the files its save record names that this save does not write (those it
        writes, its commit drops), and on blobs that hold nothing else."""
        killed = _recorded_files(self.fs, self.root, self.retry)
        super().prepare(layout, overwrite, make_files=make_files)
        keep = set(layout.names)
        names = sorted({n for n in killed if n not in keep})
        azure = self.client
        orphans = [fsio.join(self.root, n) for n in names] + azure.uncommitted(
            self.root.rstrip("/") + "/"
        )
        parallel_map(azure.discard, sorted(set(orphans)), self.threads)

    def _assemble(self, f: int, layout: Layout, entries: list[dict[str, Any]]) -> None:
        azure = self.client
        azure.commit(fsio.join(self.root, layout.files[f].name), [e["ETag"] for e in entries])

    def _discard(self, names: Sequence[str], save_id: str) -> None:
        """Drop the uncommitted blocks of the save's blobs (and the blobs: the folder holds no
        complete checkpoint while a save runs, so nothing of value goes with them)."""
        azure = self.client
        for name in names:
            path = fsio.join(self.root, name)
            quietly(
                functools.partial(azure.discard, path),
                f"the uncommitted blocks of {azure.url(path)}",
            )

    @classmethod
    def clear_leftovers_under(cls, fs: AbstractFileSystem, folder: str, retry: RetryPolicy) -> int:
        """Drop the uncommitted blocks under ``folder`` (a step being pruned): those of the files
        every save record under it names (the weights', the training state's), and of the blobs
        a listing of uncommitted blobs finds; returns how many blobs."""
        azure = Azure(fs, retry)
        record = f"{STAGING_DIR}/{SAVE_RECORD}"
        saves = [
            p[: -len(record)].rstrip("/")
            for p in fsio.list_tree(fs, folder)
            if p == record or p.endswith("/" + record)
        ]
        roots = {fsio.join(folder, rel) if rel else folder for rel in saves}
        blobs = {fsio.join(r, n) for r in roots for n in _recorded_files(fs, r, retry)}
        blobs.update(azure.uncommitted(folder.rstrip("/") + "/"))
        parallel_map(azure.discard, sorted(blobs), 8)
        return len(blobs)


def _recorded_files(fs: AbstractFileSystem, root: str, retry: RetryPolicy) -> list[str]:
    """The files the save record under ``root`` names (a save that did not finish), or none."""
    where = fsio.join(root, STAGING_DIR, SAVE_RECORD)
    try:
        raw = retry.call(
            lambda: fsio.read_all(fs, where),
            operation="read",
            url=fsio.url_of(fs, where),
            errors=AZURE_ERRORS,
            keep_permanent=True,
        )
        return [name for name, _ in SaveRecord.decode(raw, where).files]
    except (FileNotFoundError, ValueError):
        return []
