"""Moving a checkpoint's bytes: tensors to slabs and host buffers, positioned and ``O_DIRECT`` I/O
on local disk with its aligned buffers, the thread pool, the garbage collector paused for a load's
bulk steps, and the fsspec operations (never answered from a cache) that read a folder's listing,
index and headers."""
