"""Pure planning of Azure consolidated files: each one blob whose blocks the ranks stage.

A consolidated file on Azure Blob is one block blob. Its parts are cut as S3's are
(``plan/parts.py``, ``plan/partplan.py``) with Azure's rules (``AZURE_RULES``: no minimum block
size, at most 50,000 blocks a blob; a rank stages every run of 1 MiB or more of its own as blocks
(a node's ranks gather their runs of 64 KiB or more side by side into blocks of the node's),
smaller runs and column-sharded tensors are staged in an object and gathered into blocks by the
ranks), and every part is a block of the final blob (``Put Block``), named by ``block_id``. The
coordinator commits each blob with one ``Put Block List`` of its blocks in file order. Pure.
"""

from __future__ import annotations

import base64

from .parts import NODE_PART_BYTES, RANK_PART_BYTES, PartRules

__all__ = ["AZURE_RULES", "BLOCK_ID_BYTES", "MAX_BLOCKS", "block_id"]

# Azure: at most 50,000 committed blocks a blob (each up to 4,000 MiB).
MAX_BLOCKS = 50_000
# No minimum block size: as on GCS, a rank stages each of its runs of 1 MiB or more as blocks of
# its own, the ranks of a node each run of theirs of ``NODE_PART_BYTES`` or more; a file whose
# runs would make more than 50,000 blocks gathers its smallest runs until it fits
# (``plan/parts.plan_file_parts``).
AZURE_RULES = PartRules(
    min_part=1,
    max_parts=MAX_BLOCKS,
    rank_part=RANK_PART_BYTES,
    own_part=1 << 20,
    node_part=NODE_PART_BYTES,
)
# Every block id of a blob must have the same length (before base64): 16 characters of the save
# id, the file's index and the part's first byte, fixed width.
BLOCK_ID_BYTES = 16 + 1 + 6 + 1 + 13


def block_id(save_id: str, file: int, start: int) -> str:
    """The id of the block holding bytes from ``start`` of file ``file`` in save ``save_id``
    (base64, as the service wants it): derived, so every rank names the blocks it stages and
    the coordinator the list it commits without being told; the save id keeps blocks a killed
    save left on the same blob from ever being taken for this save's.

    Raises:
        ValueError: a file index or offset too large for the fixed width.
    """
    if not 0 <= file < 10**6 or not 0 <= start < 10**13:
        raise ValueError(
            f"block id for file {file}, offset {start}: out of the fixed-width range (files < "
            "10^6, offsets < 10^13 bytes)"
        )
    raw = f"{save_id[:16]:0<16}-{file:06d}-{start:013d}".encode("ascii")
    assert len(raw) == BLOCK_ID_BYTES
    return base64.b64encode(raw).decode("ascii")
