#!/usr/bin/env bash
# The GPU checklist of docs/benchmarks/gpu.md in one command, for a machine with one GPU:
#
#     bash bench/gpu_checklist.sh OUT_DIR [PLANNER_WORKDIR]
#
# 1. the workflow's environment check (workflow_scripts/ops/environment.py): GPU, bf16, the attention backend
#    training gets and why, bf16 matmul TFLOP/s            -> OUT_DIR/check.json, OUT_DIR/env.log
# 2. bench/bench_gpu.py: train.py against the HF Trainer, tokens/s and MFU on the Qwen3-0.6B shape, and train.py
#    again with TRAIN_ATTENTION=sdpa (BENCH_GPU_ARGS, default "--attention-too sdpa": the attention's baseline)
#                                     -> OUT_DIR/bench_gpu.log, bench_gpu_runs.tar.gz (each run's log and metrics)
# 3. bench/bench_scale.py --part planner --device cuda: the planner against torch.cuda.max_memory_allocated
#    (plans kept in PLANNER_WORKDIR/plans.jsonl are reused: make them on a CPU machine with --plan-only)
#                                                          -> OUT_DIR/planner.log, planner_rows.jsonl, smi.csv
# 4. where a step's time goes: bench/bench_attention.py (one packed row's forward + backward by attention
#    implementation, and the optimizer step) and our run profiled (TRAIN_PROFILE_STEPS, train/profiler.py)
#                                            -> OUT_DIR/attention.log, profile.log, profile_ours.txt
# STEPS (default "env gpu planner profile") names the steps to run, e.g. STEPS="env profile" for what a lease has not
# measured yet. Each step has its own time limit (seconds: ENV_S, GPU_S, PLANNER_S, ATTN_S + PROFILE_S) and a failed
# step does not stop the next; each step's start is stamped in OUT_DIR/device.txt (where the time went when a limit
# stops one). Step 4 needs transformers' flex_attention (compiled by Triton) for its second row; a failure is a row.
set -u
out=${1:?OUT_DIR}
work=$(realpath -m "${2:-/tmp/bench_gpu_planner}")
py=${PYTHON:-python3}
mkdir -p "$out" "$work"
want() { [[ " ${STEPS:-env gpu planner profile} " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$py" -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'
    echo "start $(date +%T)"
} >"$out/device.txt" 2>&1

if want env; then
    timeout "${ENV_S:-120}" "$py" -m workflow_scripts.ops.environment \
        --config '{"strategy": "fsdp", "precision": "bf16", "procs_per_node": 1}' \
        --output "$out/check.json" >"$out/env.log" 2>&1
    echo "environment check: rc $?"
fi
echo "bench_gpu start $(date +%T)" >>"$out/device.txt"

if want gpu; then
    timeout "${GPU_S:-300}" "$py" bench/bench_gpu.py --shape qwen3-0.6b --seq 4096 --steps 30 ${BENCH_GPU_ARGS---attention-too sdpa} \
        --workdir /tmp/bench_gpu >"$out/bench_gpu.log" 2>&1
    echo "bench_gpu: rc $?"
fi
echo "planner start $(date +%T)" >>"$out/device.txt"
# each run's own output and metrics, also when the time limit stopped it
tar -czf "$out/bench_gpu_runs.tar.gz" -C /tmp/bench_gpu --exclude='*.safetensors' --exclude=ckpt --exclude='*.parquet' --exclude=token-store --exclude='*.bin' --exclude='*.pt' \
    . 2>/dev/null

if want planner; then
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader -lms 500 >"$out/smi.csv" 2>&1 &
    smi=$!
    # PLANNER_CASES: the cases to measure (bench_scale.py's --case; all four unless set)
    # shellcheck disable=SC2086
    timeout "${PLANNER_S:-300}" "$py" bench/bench_scale.py --part planner --device cuda --nproc 1 --precision bf16 \
        --vocab 151936 --layers 28 --seq 2048 --workdir "$work" --case ${PLANNER_CASES:-ddp fsdp fsdp-lora zero3} \
        >"$out/planner.log" 2>&1
    echo "planner: rc $?"
    kill "$smi" 2>/dev/null
fi
cp "$work/planner_rows.jsonl" "$out/" 2>/dev/null
echo "profile start $(date +%T)" >>"$out/device.txt"
if want profile; then
    timeout "${ATTN_S:-150}" "$py" bench/bench_attention.py --shape qwen3-0.6b --seq 4096 >"$out/attention.log" 2>&1
    echo "attention: rc $?"
    timeout "${PROFILE_S:-150}" "$py" bench/bench_gpu.py --shape qwen3-0.6b --seq 4096 --steps 10 --warmup 4 \
        --profile-steps 8-9 --no-trainer --workdir /tmp/bench_gpu_profile >"$out/profile.log" 2>&1
    echo "profile: rc $?"
    cp /tmp/bench_gpu_profile/ours/profile/rank0.txt "$out/profile_ours.txt" 2>/dev/null
fi
echo "end $(date +%T)" >>"$out/device.txt"
exit 0
