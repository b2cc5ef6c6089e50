#!/usr/bin/env bash
# Install everything, then run the whole test suite.
source "$(dirname "${BASH_SOURCE[0]}")/setup/_venv.sh"
# Formatting, lint and types first (config in pyproject.toml): a finding fails the run, as a
# failing test does. HF_DCP_TEST_LINT=0 skips them (e.g. while iterating on one test).
if [ "${HF_DCP_TEST_LINT:-1}" != 0 ]; then
    .venv/bin/ruff format --check .
    .venv/bin/ruff check .
    .venv/bin/mypy
fi
# Ceph radosgw, the second S3 server the S3 tests run against (Debian packages; needs root).
if [ "${HF_DCP_TEST_RADOSGW:-1}" != 0 ] && ! scripts/setup/install_radosgw.sh; then
    echo "test.sh: Ceph radosgw unavailable (reason above): the S3 tests run against moto only" >&2
fi
# The trainer integrations' venv (torchtitan, Lightning and the fsspec they allow, pinned in
# requirements-integrations.txt): tests/test_integrations.py runs tests/integrations/ in it.
if [ "${HF_DCP_TEST_INTEGRATIONS:-1}" != 0 ]; then
    bash scripts/setup/integrations_venv.sh
fi
exec .venv/bin/python -m pytest "$@"
