#!/usr/bin/env bash
# Add the benchmark peers (requirements-bench.txt) to the dev venv (.venv), after scripts/test.sh or
# scripts/demo.sh made it:
#
#     bash scripts/setup/bench_peers.sh
#     .venv/bin/python -m benchmarks.bench_object_store
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ -x .venv/bin/python ] || { echo "bench_peers.sh: no .venv: run scripts/test.sh or scripts/demo.sh first" >&2; exit 1; }
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt -r requirements-bench.txt
