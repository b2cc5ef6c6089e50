"""Scripts: set-up (``setup/``: venvs, installers, the local object-store servers), experiments
(``experiments/``: run as ``python -m scripts.experiments.NAME`` from the repository root), and at
the top the entry points ``test.sh``, ``demo.sh`` and ``gpu_check.py``."""
