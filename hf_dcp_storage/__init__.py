"""Save and load torch.distributed.checkpoint state dicts as Hugging Face safetensors, on any
fsspec store.

    import torch.distributed.checkpoint as dcp
    from hf_dcp_storage import HFStorageWriter, HFStorageReader

    dcp.save(state_dict, storage_writer=HFStorageWriter("s3://bucket/run/step_1000"))
    dcp.load(state_dict, storage_reader=HFStorageReader("s3://bucket/run/step_1000"))

The command line ``hf-dcp`` (``tools/cli.py``) and the checkpoint tools behind it are exported
here too. Names load on first use (PEP 562), so ``hf-dcp ls`` and ``prune`` start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "HFStorageWriter": "writer",
    "HFStorageReader": "reader",
    "HFSavePlanner": "planner",
    "HFLoadPlanner": "planner",
    "TIED_EMBEDDINGS": "planner",
    "RetryPolicy": "stores.retry",
    "CheckpointManager": "steps.manager",
    "inspect_checkpoint": "tools.inspection",
    "verify_checkpoint": "tools.verify",
    "consolidate_checkpoint": "tools.consolidate",
    "convert_dcp_to_hf": "tools.convert",
    "convert_hf_to_dcp": "tools.convert",
    "list_steps": "steps.runs",
    "prune_run": "steps.runs",
}
__all__ = [
    "TIED_EMBEDDINGS",
    "CheckpointManager",
    "HFLoadPlanner",
    "HFSavePlanner",
    "HFStorageReader",
    "HFStorageWriter",
    "RetryPolicy",
    "consolidate_checkpoint",
    "convert_dcp_to_hf",
    "convert_hf_to_dcp",
    "inspect_checkpoint",
    "list_steps",
    "prune_run",
    "verify_checkpoint",
]

if TYPE_CHECKING:
    from .planner import TIED_EMBEDDINGS, HFLoadPlanner, HFSavePlanner
    from .reader import HFStorageReader
    from .steps.manager import CheckpointManager
    from .steps.runs import list_steps, prune_run
    from .stores.retry import RetryPolicy
    from .tools.consolidate import consolidate_checkpoint
    from .tools.convert import convert_dcp_to_hf, convert_hf_to_dcp
    from .tools.inspection import inspect_checkpoint
    from .tools.verify import verify_checkpoint
    from .writer import HFStorageWriter


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
