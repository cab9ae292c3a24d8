#!/bin/bash
# The 256-node dry run of docs/benchmarks.md ("DAG construction"): wall and CPU seconds of
# `snakemake -n --quiet --config nodes=NODES`, ROUNDS times (take the best; the machine is shared).
# Each CHECKOUT given is timed in turn, round by round (interleaved: the same conditions for a before/after):
#     bash bench/parse_time.sh                                  # this checkout, 3 rounds, 256 nodes
#     ROUNDS=5 bash bench/parse_time.sh /tmp/before .           # a checkout of the old commit (git archive) and this one
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-3}
NODES=${NODES:-256}
export HF_HUB_OFFLINE=1
[ $# -gt 0 ] || set -- "$REPO"
for _ in $(seq "$ROUNDS"); do
    for checkout in "$@"; do
        (cd "$checkout" && /usr/bin/time -f "$checkout: %e s wall, %U+%S s CPU, %M KB, load $(cut -d' ' -f1 /proc/loadavg)" \
            "$REPO/.venv/bin/snakemake" -n --quiet --config nodes="$NODES" 2>&1 >/dev/null | tail -1)
    done
done
