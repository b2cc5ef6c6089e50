"""Trainer integrations: each module plugs this package's checkpoints into one trainer and is the
only place that trainer is imported (install its extra: ``pip install 'hf_dcp_storage[torchtitan]'``
or ``'hf_dcp_storage[lightning]'``).

* ``integrations.torchtitan``: ``HFCheckpointManager``, torchtitan's ``CheckpointManager`` with our
  step checkpoints on any fsspec store.
* ``integrations.lightning``: ``HFModelParallelStrategy``, Lightning's ``ModelParallelStrategy``
  (FSDP2/TP) saving and loading our checkpoint folders at any fsspec URL.

They build on the public API, ``steps/``, the writer and the reader only
(``tests/test_architecture.py``).
"""
