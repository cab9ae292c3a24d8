"""Training-loop overhead on CPU: our train.py against a bare PyTorch DDP loop, same model, batch, data.

    .venv/bin/python bench/bench_train.py --steps 60

Both run under torchrun with 2 ranks (gloo, one thread each) on the demo model and one node's
tokenized shard, micro-batch 16, fp32, AdamW, clipping, cosine schedule. Ours also logs, writes
TensorBoard and checks for preemption every step; checkpointing is off in both (interval > steps).
Step time = mean wall time per optimizer step after 10 warm-up steps.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

BARE = r"""
import json, math, sys, time, os
import pyarrow.parquet as pq, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM
data, base, steps, mb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
t = pq.read_table(data, columns=["input_ids", "labels"])
ex = list(zip(t.column("input_ids").to_pylist(), t.column("labels").to_pylist()))
model = DDP(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
order = torch.randperm(len(ex), generator=torch.Generator().manual_seed(0)).tolist()
times = []
for step in range(steps):
    t0 = time.perf_counter()
    idx = [order[(step * mb * world + rank * mb + i) % len(ex)] for i in range(mb)]
    w = max(len(ex[i][0]) for i in idx)
    ids, m = torch.zeros((mb, w), dtype=torch.long), torch.zeros((mb, w), dtype=torch.long)
    lab = torch.full((mb, w), -100)
    for j, i in enumerate(idx):
        n = len(ex[i][0]); ids[j, :n] = torch.tensor(ex[i][0]); lab[j, :n] = torch.tensor(ex[i][1]); m[j, :n] = 1
    loss = model(input_ids=ids, labels=lab, attention_mask=m).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
    loss.item()
    times.append(time.perf_counter() - t0)
if rank == 0:
    print(json.dumps({"step_times": times}))
dist.destroy_process_group()
"""


def demo_arguments(p: argparse.ArgumentParser) -> argparse.Namespace:
    """``p``'s arguments with --data (node0's tokenized shard) and --base (the base model), make run's by default."""
    p.add_argument("--data", type=Path, default=REPO / "results/demo/data/tokenized/node0.parquet")
    p.add_argument("--base", type=Path, default=REPO / "results/demo/base_model")
    a = p.parse_args()
    if not a.data.exists():
        raise SystemExit(f"{a.data} missing: run `make run` first")
    return a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    a = demo_arguments(p)
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    bare = work / "bare.py"
    bare.write_text(BARE)
    out = subprocess.run([*torchrun, str(bare), str(a.data), str(a.base), str(a.steps), "16"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    bare_times = json.loads(out.stdout.strip().splitlines()[-1])["step_times"][10:]
    cfg = {"lr": 3e-3, "precision": "fp32", "micro_batch_size": 16, "max_steps": a.steps, "log_every": 1,
           "checkpoint_every": 10 * a.steps, "warmup_ratio": 0.0, "packing": False}  # fmt: skip
    cmd = [*torchrun, "-m", "workflow_scripts.train.train", "--config", json.dumps(cfg), "--data", str(a.data),
           "--base-model", str(a.base), "--log-dir", str(work / "train"), "--checkpoint-root", str(work / "ckpt"),
           "--state", str(work / "state.json")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    ours = [json.loads(x)["step_time_s"] for x in (work / "train/metrics.jsonl").read_text().splitlines()][10:]
    b, o = statistics.mean(bare_times), statistics.mean(ours)
    print("\n| loop | mean step (ms) | median step (ms) |\n|---|---|---|")
    print(f"| bare PyTorch DDP | {b * 1e3:.1f} | {statistics.median(bare_times) * 1e3:.1f} |")
    print(f"| ours (train.py) | {o * 1e3:.1f} | {statistics.median(ours) * 1e3:.1f} |")
    print(f"\nratio ours / bare: {o / b:.3f}x (target <= 1.15x); {len(ours)} steps each after 10 warm-up")


if __name__ == "__main__":
    main()
