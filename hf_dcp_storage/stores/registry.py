"""The one table of destination kinds: which store a path gets, how loads read it, how pruning
clears what a killed save left. The only place that names a filesystem implementation or a
store module; nothing outside ``stores/`` asks which backend it is on.

Importing this module imports no store (and so no torch): a store module is imported on first
use, so the listing and pruning tools stay light.

To add a store: one module (a ``Store`` subclass; a part store subclasses ``PartsStore`` and
brings a ``PartsClient``), one row in ``_BACKENDS``, one entry in the store conformance suite
(``tests/test_store_conformance.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsspec import AbstractFileSystem

from ..io import fsio
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .base import Store
    from .reads import Ranges

__all__ = [
    "Backend",
    "backend_of",
    "clear_leftovers_under",
    "makedirs_creates_buckets",
    "open_store",
    "ranges_for",
    "store_class",
    "store_for_mode",
]


@dataclass(frozen=True)
class Backend:
    """One destination kind.

    ``mode``: its name, recorded in the save record (so ``hf-dcp consolidate`` finishes a save
    with the kind that began it); ``module``/``store``: its module under ``stores/`` and its
    ``Store`` class; ``package``/``filesystem``: the fsspec implementation it serves (the
    package, and the class where the package has several), or ``None`` for the kinds chosen by
    the writer's options instead (``open_store``); ``creates_buckets``: its filesystem's
    ``makedirs`` creates a missing bucket (which nothing here ever wants done)."""

    mode: str
    module: str
    store: str
    package: str | None = None
    filesystem: str | None = None
    creates_buckets: bool = False

    def store_class(self) -> type[Store]:
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.store)

    def serves(self, fs: AbstractFileSystem) -> bool:
        """Whether ``fs`` is this backend's filesystem, told without importing its package."""
        kind = type(fs)
        return (
            self.package is not None
            and kind.__module__.split(".")[0] == self.package
            and self.filesystem in (None, kind.__name__)
        )


_BACKENDS = (
    Backend("s3", "s3", "S3Store", "s3fs", creates_buckets=True),  # S3 and S3-compatible endpoints
    Backend("gcs", "gcs", "GcsStore", "gcsfs"),
    Backend(
        "azure", "azure", "AzureStore", "adlfs", "AzureBlobFileSystem"
    ),  # not adlfs's Data Lake Gen1
    Backend("direct", "local", "LocalStore"),  # local disk, positioned writes
    Backend("staged", "staged", "StagedStore"),  # any other fsspec store, and local disk on request
)
_BY_MODE = {b.mode: b for b in _BACKENDS}


def backend_of(fs: AbstractFileSystem) -> Backend | None:
    """The backend whose filesystem ``fs`` is, or ``None`` (local disk, ``memory://``, any other
    fsspec store: the writer's options choose)."""
    return next((b for b in _BACKENDS if b.serves(fs)), None)


def open_store(
    fs: AbstractFileSystem,
    root: str,
    *,
    direct_write: bool | None,
    retry: RetryPolicy,
    threads: int,
    where: str | None = None,
    direct_io: bool | None = None,
) -> Store:
    """The store a save to ``root`` writes through (the same answer on every rank): the
    backend's on an object store with one (S3's multipart uploads, composed GCS objects,
    committed Azure blocks); positioned writes on local disk unless ``direct_write=False``;
    staged objects merged per file anywhere else. ``where``: the path as the user gave it, for
    messages; ``direct_io``: the local store's use of ``O_DIRECT`` (``stores/local.py``).

    Raises:
        ValueError: ``direct_write=True`` where positioned writes are impossible.
    """
    local = fsio.is_local(fs)
    if direct_write and not local:
        raise ValueError(
            f"direct_write=True needs positioned writes, which {where or fsio.url_of(fs, root)} "
            "does not support; use direct_write=None (automatic) or False"
        )
    backend = backend_of(fs)
    if backend is not None:
        return backend.store_class()(fs, root, retry=retry, threads=threads)
    if local and direct_write is not False:
        from .local import LocalStore

        return LocalStore(fs, root, retry=retry, threads=threads, direct_io=direct_io)
    return _BY_MODE["staged"].store_class()(fs, root, retry=retry, threads=threads)


def store_for_mode(
    mode: str, fs: AbstractFileSystem, root: str, *, retry: RetryPolicy, threads: int
) -> Store:
    """The store that finishes an interrupted save recorded as ``mode`` (``consolidate``)."""
    return store_class(mode)(fs, root, retry=retry, threads=threads)


def store_class(mode: str) -> type[Store]:
    """The store class of the kind recorded as ``mode``."""
    return _BY_MODE[mode].store_class()


def ranges_for(fs: AbstractFileSystem, retry: RetryPolicy) -> Ranges:
    """How loads read byte ranges of ``fs``'s objects: the backend's own ranged GETs, local
    files read in place, fsspec's ranged reads anywhere else."""
    backend = backend_of(fs) or _BY_MODE["direct" if fsio.is_local(fs) else "staged"]
    return backend.store_class().ranges(fs, retry)


def makedirs_creates_buckets(fs: AbstractFileSystem) -> bool:
    """Whether ``fs.makedirs`` (as DCP's own writers call it) would create a missing bucket."""
    backend = backend_of(fs)
    return backend is not None and backend.creates_buckets


def clear_leftovers_under(
    fs: AbstractFileSystem, folder: str, retry: RetryPolicy | None = None
) -> int:
    """(pruning a step) Clear what killed saves under ``folder`` left that a listing does not
    show and deleting its objects does not remove (S3's open multipart uploads, Azure's
    uncommitted blocks); returns how many were cleared. Nothing to do elsewhere."""
    backend = backend_of(fs)
    return (
        0
        if backend is None
        else backend.store_class().clear_leftovers_under(fs, folder, retry or RetryPolicy())
    )
