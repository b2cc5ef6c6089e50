#!/usr/bin/env bash
# Install everything, then run the whole test suite.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
# Ceph radosgw, the second S3 server the S3 tests run against (Debian packages; needs root).
if [ "${HF_DCP_TEST_RADOSGW:-1}" != 0 ] && ! scripts/install_radosgw.sh; then
    echo "test.sh: Ceph radosgw unavailable (reason above): the S3 tests run against moto only" >&2
fi
# The trainer integrations' venv (torchtitan, Lightning and the fsspec they allow, pinned in
# requirements-integrations.txt): tests/test_integrations.py runs tests/integrations/ in it.
if [ "${HF_DCP_TEST_INTEGRATIONS:-1}" != 0 ]; then
    bash scripts/integrations_venv.sh
fi
exec .venv/bin/python -m pytest "$@"
