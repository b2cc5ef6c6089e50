#!/usr/bin/env bash
# Install everything, then run the end-to-end demo (2 CPU ranks train FSDP2, save HF, reload on 1 and 3).
source "$(dirname "${BASH_SOURCE[0]}")/setup/_venv.sh"
exec .venv/bin/python examples/demo_fsdp.py "$@"
