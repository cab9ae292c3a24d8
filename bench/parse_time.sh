#!/bin/bash
# The 256-node dry run of docs/benchmarks/parse-time.md ("DAG construction"): wall and CPU seconds of
# `snakemake -n --quiet --config nodes=NODES`, ROUNDS times (take the best; the machine is shared), and
# Snakemake's floor: a one-rule workflow, the same command.
# Each CHECKOUT given is timed in turn, round by round (interleaved: the same conditions for a before/after):
#     bash bench/parse_time.sh                                  # this checkout, 3 rounds, 256 nodes
#     ROUNDS=5 bash bench/parse_time.sh /tmp/before .           # a checkout of the old commit (git archive) and this one
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-3}
NODES=${NODES:-256}
export HF_HUB_OFFLINE=1
[ $# -gt 0 ] || set -- "$REPO"
# Snakemake's own floor: the same command on a one-rule workflow (its imports, plugins, persistence, one job)
FLOOR=$(mktemp -d)
trap 'rm -rf "$FLOOR"' EXIT
printf 'rule all:\n    output: "x"\n    shell: "touch {output}"\n' > "$FLOOR/Snakefile"
for _ in $(seq "$ROUNDS"); do
    (cd "$FLOOR" && /usr/bin/time -f "floor (one rule, no config): %e s wall, %U+%S s CPU, %M KB, load $(cut -d' ' -f1 /proc/loadavg)" \
        "$REPO/.venv/bin/snakemake" -n --quiet --cores 1 2>&1 >/dev/null | tail -1)
    for checkout in "$@"; do
        (cd "$checkout" && /usr/bin/time -f "$checkout: %e s wall, %U+%S s CPU, %M KB, load $(cut -d' ' -f1 /proc/loadavg)" \
            "$REPO/.venv/bin/snakemake" -n --quiet --config nodes="$NODES" 2>&1 >/dev/null | tail -1)
    done
done
