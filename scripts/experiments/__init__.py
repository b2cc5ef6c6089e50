"""Longer checks than the suite's, run by hand from the repository root: ``python -m
scripts.experiments.kill_matrix``, ``python -m scripts.experiments.soak_s3``, ``bash
scripts/experiments/flake_check.sh``, ``bash scripts/experiments/compat.sh``."""
