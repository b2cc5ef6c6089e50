"""What every store and tool shares for I/O: fsspec queries that never answer from a cache,
retries, the thread pool, host buffers and slabs, a save's records, and the ranks' meeting on the
job's store."""
