"""One module per destination kind, behind one small interface (``base.py``): local disk, S3, GCS,
Azure Blob, and any other fsspec store; ``open_store`` picks the kind a path gets, ``ranges_for``
how loads read it."""

from __future__ import annotations

from fsspec import AbstractFileSystem

from ..io import fsio
from ..io.retry import RetryPolicy
from .azure import AzureRanges, AzureStore
from .base import Ranges, Store
from .gcs import GcsRanges, GcsStore
from .local import LocalStore
from .s3 import S3Ranges, S3Store
from .staged import StagedStore

__all__ = ["open_store", "store_for_mode", "ranges_for"]

_BY_MODE: dict[str, type[Store]] = {cls.mode: cls for cls in (LocalStore, StagedStore, S3Store, GcsStore, AzureStore)}


def open_store(
    fs: AbstractFileSystem, root: str, *, direct_write: bool | None, retry: RetryPolicy, threads: int, where: str | None = None, direct_io: bool | None = None
) -> Store:
    """The store a save to ``root`` writes through (the same answer on every rank): S3's
    multipart uploads on s3fs, composed part objects on gcsfs, committed blocks on adlfs's
    Azure Blob filesystem; positioned writes on local disk unless ``direct_write=False``;
    staged objects merged per file anywhere else. ``where``: the path as the user gave it, for
    messages; ``direct_io``: the local store's use of ``O_DIRECT`` (``stores/local.py``).

    Raises:
        ValueError: ``direct_write=True`` where positioned writes are impossible.
    """
    if direct_write and not fsio.is_local(fs):
        raise ValueError(
            f"direct_write=True needs positioned writes, which {where or fsio.url_of(fs, root)} does not "
            f"support; use direct_write=None (automatic) or False"
        )
    if fsio.is_s3(fs):
        return S3Store(fs, root, retry=retry, threads=threads)
    if fsio.is_gcs(fs):
        return GcsStore(fs, root, retry=retry, threads=threads)
    if fsio.is_azure(fs):
        return AzureStore(fs, root, retry=retry, threads=threads)
    if fsio.is_local(fs) and direct_write is not False:
        return LocalStore(fs, root, retry=retry, threads=threads, direct_io=direct_io)
    return StagedStore(fs, root, retry=retry, threads=threads)


def store_for_mode(mode: str, fs: AbstractFileSystem, root: str, *, retry: RetryPolicy, threads: int) -> Store:
    """The store that finishes an interrupted save recorded as ``mode`` (``consolidate``)."""
    return _BY_MODE[mode](fs, root, retry=retry, threads=threads)


def ranges_for(fs: AbstractFileSystem, retry: RetryPolicy) -> Ranges:
    """How loads read byte ranges of ``fs``'s objects."""
    if fsio.is_s3(fs):
        return S3Ranges(fs, retry)
    if fsio.is_gcs(fs):
        return GcsRanges(fs, retry)
    if fsio.is_azure(fs):
        return AzureRanges(fs, retry)
    return Ranges(fs, retry)
