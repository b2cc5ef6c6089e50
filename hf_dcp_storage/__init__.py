"""Save and load torch.distributed.checkpoint state dicts as Hugging Face safetensors, on any fsspec store.

    import torch.distributed.checkpoint as dcp
    from hf_dcp_storage import HFStorageWriter, HFStorageReader

    dcp.save(state_dict, storage_writer=HFStorageWriter("s3://bucket/run/step_1000"))
    dcp.load(state_dict, storage_reader=HFStorageReader("s3://bucket/run/step_1000"))
"""

from .planner import HFLoadPlanner, HFSavePlanner
from ._retry import RetryPolicy
from .manager import CheckpointManager
from .reader import HFStorageReader
from .writer import HFStorageWriter

__all__ = ["HFStorageWriter", "HFStorageReader", "HFSavePlanner", "HFLoadPlanner", "RetryPolicy", "CheckpointManager"]
__version__ = "0.1.0"
