#!/usr/bin/env bash
# Run the whole suite N times on a fresh clone of HEAD, the last LOADED runs with two
# CPU-burning processes beside it, and print a table of runs x failures and wall times:
#
#     bash scripts/experiments/flake_check.sh 5        # 5 runs, the last 2 under load
#     bash scripts/experiments/flake_check.sh 3 0      # 3 runs, none under load
#
# Each run is `.ci/run`, as CI calls it (CI=true, no standard input), in one clone made once in
# a temp folder (the first run installs everything there, as on a fresh machine; the later ones
# find the venvs made). A suite that passes only on an idle machine fails here. Each run's
# pytest output is kept in the clone as run-K.log; the clone is left for a look, its path printed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RUNS=${1:?usage: scripts/experiments/flake_check.sh RUNS [LOADED]}
LOADED=${2:-2}
if ! [[ $RUNS =~ ^[1-9][0-9]*$ && $LOADED =~ ^[0-9]+$ ]] || (( LOADED > RUNS )); then
    echo "flake_check.sh: RUNS=$RUNS must be an int >= 1 and LOADED=$LOADED an int in [0, RUNS]" >&2
    exit 2
fi
CLONE=$(mktemp -d /tmp/hf_dcp_flake.XXXXXX)
git clone -q "$PWD" "$CLONE/repo"
echo "flake_check: $RUNS runs of $(git rev-parse --short HEAD) in $CLONE/repo, the last $LOADED with 2 CPU burners" >&2
rows=()
failed_runs=0
for ((k = 1; k <= RUNS; k++)); do
    burners=()
    if (( k > RUNS - LOADED )); then
        for _ in 1 2; do
            python3 -c "while True: pass" &
            burners+=($!)
        done
    fi
    started=$(date +%s)
    set +e
    (cd "$CLONE/repo" && CI=true bash .ci/run </dev/null >"run-$k.log" 2>&1)
    rc=$?
    set -e
    wall=$(( $(date +%s) - started ))
    for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done
    # pytest's closing line: "N failed, M passed ... in S.SSs (...)"
    summary=$(grep -E '^=*[ ]*[0-9]+ (passed|failed)' "$CLONE/repo/run-$k.log" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')
    (( rc == 0 )) || failed_runs=$((failed_runs + 1))
    rows+=("| $k | ${#burners[@]} | $rc | ${summary:-no pytest summary} | $wall |")
    echo "flake_check: run $k of $RUNS done (exit $rc, ${wall} s)" >&2
done
echo "| run | CPU burners | exit | pytest | wall s (.ci/run) |"
echo "|---:|---:|---:|---|---:|"
printf '%s\n' "${rows[@]}"
echo
echo "runs with a failure: $failed_runs of $RUNS; logs: $CLONE/repo/run-K.log"
(( failed_runs == 0 ))
