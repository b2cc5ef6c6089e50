"""One save or load in progress, whatever the store: the claim that keeps it alone on its writer or
reader, the record a save keeps of itself on the store, and the ranks' meeting on the job's
key-value store."""
