"""``verify_checkpoint``: every defect of a checkpoint folder, each named by file and key.

A broken checkpoint is the expected input here, so nothing about it raises: each defect becomes
one :class:`Problem` and the checks go on, to find them all. Only a path that is no checkpoint at
all, or a store that cannot be read, raises.

For an HF checkpoint (``model.safetensors.index.json`` plus shards, or a single
``model.safetensors``), in order:

1. the index: valid JSON, a ``weight_map`` of strings, file names that stay inside the folder,
   a well-formed checksum table (``crc32``, 8 hex digits per key, only keys the map names) and
   ``metadata.total_size`` equal to the bytes of the tensors it names;
2. every file the index names: it exists, its header decodes against the real file size
   (tiling, offsets, dtype and shape agreement, truncation), and nothing follows the last tensor;
   where the index records the files' headers (``metadata.headers``), each copy equals the file's;
3. coverage: each index key is in its file's header, each header key is in the index (mapped to
   that file), no key is in two files;
4. leftovers: ``*.safetensors`` files the index does not name, a ``.hf_dcp_staging/`` folder;
5. checksums: every tensor's bytes read once, their CRC32 compared with the recorded value.

A ``CheckpointManager`` step folder also gets its ``COMMITTED`` marker and its ``training_state/``
checked (the latter as an HF checkpoint of its own). A PyTorch DCP checkpoint gets its
``.metadata`` and the sizes of the ``.distcp`` files it names checked; it records no checksums.

The checksum pass (``tools/crcpass.py``) reads each file in ``BLOCK_BYTES`` ranged reads,
``thread_count`` at a time across all files and within each file, so memory stays
``thread_count * BLOCK_BYTES`` whatever the checkpoint's size; each block yields the CRC32 of
its share of every tensor it overlaps, and the shares are combined in order (``format/crc.py``:
``crc32_combine``).
"""

from __future__ import annotations

import os
from typing import Any

from ..io import fsio
from .checks import HfDir
from .crcpass import BLOCK_BYTES, check_checksums
from .folderchecks import Verification
from .folders import FORMAT_DCP, FORMAT_HF, check_thread_count, is_step_folder, open_checkpoint
from .progress import NO_PROGRESS, Progress
from .verify_report import Problem, VerifyReport

__all__ = ["BLOCK_BYTES", "Problem", "VerifyReport", "verify_checkpoint"]


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    thread_count: int = 8,
    checksums: bool = True,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``path`` and report every defect (see the module docstring).

    Args:
        path: the checkpoint folder (or a ``CheckpointManager`` step folder), local or any
            fsspec URL.
        storage_options: passed to fsspec.
        thread_count: reads in flight (headers, then checksum blocks); memory of the checksum
            pass is about ``thread_count * BLOCK_BYTES``.
        checksums: read every tensor and compare its CRC32 with the index's; ``False`` checks the
            structure only (index and headers: no tensor data is read).
        progress: told the checksum pass's total bytes once (``start``), then each block read.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` when no problem was found.

    Raises:
        FileNotFoundError: ``path`` does not exist or is no checkpoint (not even an unfinished one).
        ValueError: a bad ``thread_count``.
        OSError: the store failed to answer (after retries), e.g. access denied.
    """
    check_thread_count(thread_count)
    fs, root, folder, kind = open_checkpoint(path, storage_options)
    report = VerifyReport(url=fsio.url_of(fs, root), format=kind)
    run = Verification(fs, root, report, storage_options, thread_count, checksums)
    if kind == FORMAT_HF:
        jobs = run.hf(HfDir(root, folder, ""))
    elif kind == FORMAT_DCP:
        jobs = run.dcp(folder)
    else:
        jobs = run.incomplete(folder)
    if is_step_folder(folder):
        jobs += run.step(folder)
    if not checksums:
        report.notes.append("checksums not checked (checksums=False): structure only")
    if jobs:
        report.bytes_checked += check_checksums(
            jobs, run.read_range, thread_count, progress or NO_PROGRESS, run.problem
        )
    return report
