#!/usr/bin/env bash
# Install everything, then run the whole test suite.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python -m pytest "$@"
