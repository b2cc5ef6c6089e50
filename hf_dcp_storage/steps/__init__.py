"""Step checkpoints of a training run: ``CheckpointManager`` (step_N folders, the commit marker,
exact resume), retention rules, training state as tensors + JSON, and listing and pruning a run."""
