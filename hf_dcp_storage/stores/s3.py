"""S3 (and S3-compatible endpoints, through s3fs): every consolidated file one multipart upload,
assembled by the server from the parts the ranks upload.

S3 is a part store (``stores/parts.py`` says how every part store writes); what is S3's own:

- its rules: every part but the last holds at least 5 MiB (``S3_RULES``), so more of a save's
  small runs are staged and gathered than on GCS or Azure;
- ``prepare`` aborts the uploads a killed save left under the path (invisible, but billed),
  then creates one multipart upload per file of more than one part (``_make_files``); a
  one-part file is a single PUT, by its rank or by the coordinator;
- ``_assemble`` completes a file's upload; ``_discard`` (and ``abort``, on a failing rank,
  which learns every upload of the save from its record) aborts them;
- ``reconcile`` tells, for ``hf-dcp consolidate``, the uploads an interrupted save had
  completed (by their ETag) from those that are gone;
- ``clear_leftovers_under``: pruning a step aborts its open uploads.

The requests themselves, retried, are ``stores/s3_requests.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsspec import AbstractFileSystem

from ..io import fsio
from ..io.parallel import parallel_map
from ..plan.layout import Layout
from ..plan.parts import S3_RULES
from ..plan.rankplan import RankPlan
from ..session.records import SAVE_RECORD, CompletionRecord, SaveRecord
from .base import STAGING_DIR
from .parts import PartsStore
from .partsclient import quietly
from .retry import RetryPolicy
from .s3_requests import S3, S3_ERRORS, multipart_etag

__all__ = ["S3Store"]

logger = logging.getLogger(__name__)


class S3Store(PartsStore):
    """Multipart uploads the ranks fill (see the module docstring)."""

    mode = "s3"
    bound_to_place = "S3: its bytes sit in multipart uploads bound to their keys"
    rules = S3_RULES
    client_class = S3
    client: S3
    errors = S3_ERRORS

    # -- coordinator
    # --------------------------------------------------------------------------------

    def prepare(self, layout: Layout, overwrite: bool, *, make_files: bool = True) -> None:
        """Also aborts the uploads a killed save left unfinished under this path (listed beside
        the folder's listing), then creates the uploads."""
        with ThreadPoolExecutor(1) as pool:
            listing = pool.submit(self.client.list_uploads, self.root.rstrip("/") + "/")
            super().prepare(layout, overwrite, make_files=False)
            orphans = listing.result()
        bucket = self.root.split("/", 1)[0]
        parallel_map(
            lambda o: self.client.abort_upload(f"{bucket}/{o[0]}", o[1]), orphans, self.threads
        )
        if make_files:
            self._make_files(layout)

    def _make_files(self, layout: Layout) -> None:
        """One multipart upload per file of more than one part."""
        files = [f for f, parts in enumerate(self.parts) if len(parts) > 1]

        def create(f: int) -> None:
            self.uploads[f] = self.client.create_upload(fsio.join(self.root, layout.files[f].name))

        try:
            parallel_map(create, files, self.threads)
        except BaseException:
            self._discard(layout.names, self.save_id)
            raise

    def undo_prepare(self, layout: Layout) -> None:
        self._discard(layout.names, self.save_id)

    def reconcile(self, layout: Layout, completion: CompletionRecord | None) -> None:
        """The files whose upload the interrupted save had completed already (``completed``);
        refuses, before completing anything, when an upload is gone otherwise (aborted: its
        bytes are lost). A completed file is told from a stale object of the same name (an
        older checkpoint's) by its ETag: the one the recorded parts make (``multipart_etag``)."""
        open_ids = {
            upload_id for _, upload_id in self.client.list_uploads(self.root.rstrip("/") + "/")
        }
        gone = []
        for f, upload_id in sorted(self.uploads.items()):
            if upload_id in open_ids:
                continue
            plan = layout.files[f]
            parts = completion.parts.get(plan.name) if completion is not None else None
            head = self.client.head(fsio.join(self.root, plan.name)) if parts else None
            if head is not None and head == (plan.size, multipart_etag(parts or ())):
                self.completed.add(f)
            else:
                gone.append(plan.name)
        if gone:
            raise ValueError(
                f"{fsio.url_of(self.fs, self.root)}: the save's multipart uploads of {gone} no "
                "longer exist (aborted by the failing save itself, by a later save to this path, "
                "or by a bucket lifecycle rule), so their bytes are gone; save the checkpoint "
                "again"
            )

    def _assemble(self, f: int, layout: Layout, entries: list[dict[str, Any]]) -> None:
        upload_id = self.uploads.get(f)
        if upload_id is None:  # a one-part file: its part was the whole object
            return
        parts = [{"PartNumber": e["PartNumber"], "ETag": e["ETag"]} for e in entries]
        self.client.complete_upload(
            fsio.join(self.root, layout.files[f].name), upload_id, parts, layout.files[f].size
        )

    def _discard(self, names: Sequence[str], save_id: str) -> None:
        """Abort this save's uploads (of files ``names[f]``); a failing abort is only logged."""
        for f, upload_id in self.uploads.items():
            path = fsio.join(self.root, names[f])
            quietly(
                functools.partial(self.client.abort_upload, path, upload_id),
                f"the multipart upload of {self.client.url(path)}",
            )

    # -- each rank
    # ----------------------------------------------------------------------------------

    def abort(self, rank_plan: RankPlan) -> None:
        """Abort every multipart upload of the save, so that the other ranks' next parts fail
        too: those this rank's plan names and the rest from the save record, which the
        coordinator wrote before any rank began. Best effort: what cannot be read or aborted is
        logged (the next save to this path aborts what is left)."""
        uploads = dict(rank_plan.store.uploads)
        where = fsio.join(self.root, STAGING_DIR, SAVE_RECORD)
        try:
            record = SaveRecord.decode(
                self._retried(lambda: fsio.read_all(self.fs, where), "read", where), where
            )
            if record.save_id == rank_plan.save_id:
                uploads.update(record.uploads)
        except Exception as exc:  # noqa: BLE001 - the failure being handled is the one to report
            logger.warning(
                "could not read the save record %s (%s); aborting the uploads this rank knows of",
                where,
                exc,
            )
        self.uploads = uploads
        super().abort(rank_plan)

    # -- pruning
    # ------------------------------------------------------------------------------------

    @classmethod
    def clear_leftovers_under(cls, fs: AbstractFileSystem, folder: str, retry: RetryPolicy) -> int:
        """Abort every unfinished multipart upload under ``folder`` (``bucket/key``); returns how
        many. Such uploads (of a killed save) are invisible in listings but billed, and only a
        save to the same path would otherwise abort them."""
        s3 = S3(fs, retry)
        bucket = folder.split("/", 1)[0]
        orphans = s3.list_uploads(folder.rstrip("/") + "/")
        parallel_map(lambda o: s3.abort_upload(f"{bucket}/{o[0]}", o[1]), orphans, 8)
        return len(orphans)
