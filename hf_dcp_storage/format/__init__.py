"""The bytes on disk: safetensors headers, the HF index and file names, CRC32s; encode,
decode, validate. Pure: nothing here touches a store or a process group."""
