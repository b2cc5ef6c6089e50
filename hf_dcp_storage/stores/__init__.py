"""One module per destination kind, behind one small interface (``base.py``): local disk, S3, GCS,
Azure Blob, and any other fsspec store. ``registry.py`` is the one table of them: which store a
path gets (``open_store``), how loads read it (``ranges_for``), how pruning clears a killed save's
leftovers (``clear_leftovers_under``)."""

from __future__ import annotations

from .registry import backend_of, clear_leftovers_under, open_store, ranges_for, store_for_mode

__all__ = ["backend_of", "clear_leftovers_under", "open_store", "ranges_for", "store_for_mode"]
