#!/usr/bin/env bash
# Make (or update) .venv-integrations: the pinned set of requirements-integrations.txt (torchtitan,
# Lightning, their fsspec/s3fs) and this package, for the trainer-integration tests:
#
#     bash scripts/setup/integrations_venv.sh
#     .venv-integrations/bin/python -m pytest tests/integrations     # or, from the main suite,
#     .venv/bin/python -m pytest tests/test_integrations.py          # which runs them in it
#
# scripts/test.sh runs this first (HF_DCP_TEST_INTEGRATIONS=0 skips it, and the tests that need it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-python3}
VENV=.venv-integrations
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-integrations.txt
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
