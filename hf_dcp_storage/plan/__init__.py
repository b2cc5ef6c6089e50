"""Pure planning, no I/O: the layout of the files, compact plans, placement of every chunk, the
spreading of finishing work, S3 parts and gather tasks, packed plan data, the rank-plan types."""
