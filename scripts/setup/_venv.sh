# Sourced by scripts/test.sh and scripts/demo.sh: a project venv (.venv) with the pinned set and the package.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
# Azurite, the Azure Blob emulator of the Azure tests, from the committed lock file (needs Node.js;
# without it those tests skip, saying so).
if command -v npm >/dev/null 2>&1; then
    (cd scripts/setup/azurite && npm ci --no-audit --no-fund --loglevel=error) || echo "_venv.sh: npm ci of Azurite failed: the Azure tests will skip" >&2
else
    echo "_venv.sh: npm not found: the Azure tests skip (apt-get install nodejs npm)" >&2
fi
