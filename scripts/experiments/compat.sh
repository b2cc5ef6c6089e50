#!/usr/bin/env bash
# Run the whole test suite under another torch release, in a venv of its own:
#
#     bash scripts/experiments/compat.sh 2.14.1            # lies on this machine's disk
#     bash scripts/experiments/compat.sh 2.15.0 [-k ...]   # from the registry: a CUDA build, several GB
#
# The venv is .venv-torch-VERSION (reused by a later run): that torch, the dev set of
# requirements-dev.txt but for its torch pin, and this package. PIP_CONSTRAINT=/dev/null lifts,
# for this venv only, the cap some machines put on torch in pip's global configuration. Extra
# arguments go to pytest. CI runs the pinned set only (scripts/test.sh); the compat table
# of docs/reliability.md ("Tested torch releases") holds what this script found.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
VERSION=${1:?usage: scripts/experiments/compat.sh TORCH_VERSION [pytest args...]}
shift
PY=${PYTHON:-python3}
VENV=.venv-torch-$VERSION
export PIP_CONSTRAINT=/dev/null
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$VERSION"
grep -v '^torch==' requirements-dev.txt > "$VENV/requirements-no-torch.txt"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$VERSION" -r "$VENV/requirements-no-torch.txt"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
echo "compat: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') in $VENV" >&2
exec "$VENV/bin/python" -m pytest "$@"
