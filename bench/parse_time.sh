#!/bin/bash
# The 256-node dry run of docs/benchmarks/parse-time.md ("DAG construction"): wall and CPU seconds of
# `snakemake -n --quiet --config nodes=NODES`, ROUNDS times (take the best; the machine is shared), and two of
# Snakemake's floors: a one-rule workflow (its imports, plugins, persistence), and a bare workflow of the same DAG's
# shape (one split, NODES+1 tokenizations, NODES trainings and consolidations, NODES+1 evaluations: ~1,030 jobs with
# the same files per job, no config, no functions, no checks): what Snakemake alone takes for such a DAG.
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
mkdir "$FLOOR/shape"
cat > "$FLOOR/shape/Snakefile" <<EOF
N = [f"node{i}" for i in range($NODES)]
R = "results/demo"
wildcard_constraints:
    node=r"node\d+", shard=r"node\d+|eval", model=r"base|node\d+"
rule all:
    input: expand(R + "/models/{node}", node=N), expand(R + "/eval/{model}.json", model=["base"] + N)
rule split:
    output: expand(R + "/data/splits/{shard}.parquet", shard=N + ["eval"])
    log: "logs/split.log"
    shell: "touch {output}"
rule tokenize:
    input: R + "/data/splits/{shard}.parquet", R + "/base_model"
    output: R + "/tok/{shard}.parquet", R + "/tok/{shard}.packing", R + "/tok/{shard}.json", R + "/tok/{shard}.rejects"
    log: "logs/tokenize/{shard}.log"
    shell: "touch {output}"
rule plan:
    output: R + "/plan.json"
    shell: "touch {output}"
rule env:
    output: R + "/env.json"
    shell: "touch {output}"
rule base_model:
    output: directory(R + "/base_model")
    shell: "mkdir {output}"
rule train:
    input: R + "/env.json", R + "/plan.json", R + "/tok/{node}.parquet", R + "/tok/{node}.packing", R + "/base_model", R + "/tok/eval.parquet"
    output: R + "/train/{node}/metrics.jsonl", R + "/train/{node}/state.json"
    log: "logs/train/{node}.log"
    shell: "touch {output}"
rule consolidate:
    input: R + "/train/{node}/state.json"
    output: directory(R + "/models/{node}")
    log: "logs/consolidate/{node}.log"
    shell: "mkdir {output}"
rule evaluate:
    input: lambda w: R + "/base_model" if w.model == "base" else R + f"/models/{w.model}", R + "/tok/eval.parquet"
    output: R + "/eval/{model}.json", R + "/eval/{model}.lm_eval.json"
    log: "logs/evaluate/{model}.log"
    shell: "touch {output}"
EOF
for _ in $(seq "$ROUNDS"); do
    (cd "$FLOOR" && /usr/bin/time -f "floor (one rule, no config): %e s wall, %U+%S s CPU, %M KB, load $(cut -d' ' -f1 /proc/loadavg)" \
        "$REPO/.venv/bin/snakemake" -n --quiet --cores 1 2>&1 >/dev/null | tail -1)
    (cd "$FLOOR/shape" && /usr/bin/time -f "floor (the same DAG's shape, bare rules): %e s wall, %U+%S s CPU, %M KB, load $(cut -d' ' -f1 /proc/loadavg)" \
        "$REPO/.venv/bin/snakemake" -n --quiet --cores 1 2>&1 >/dev/null | tail -1)
    for checkout in "$@"; do
        (cd "$checkout" && /usr/bin/time -f "$checkout: %e s wall, %U+%S s CPU, %M KB, load $(cut -d' ' -f1 /proc/loadavg)" \
            "$REPO/.venv/bin/snakemake" -n --quiet --config nodes="$NODES" 2>&1 >/dev/null | tail -1)
    done
done
