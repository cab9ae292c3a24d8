"""A training job's CPU and wall time by launcher: torchrun (each rank a new Python) against train/ranks.py (the ranks
forked after the imports, as train_node starts them on a machine without GPUs).

    .venv/bin/python bench/bench_ranks.py --strategy ddp --procs 2 --repeats 2

The same train.py job each way, alternating (the demo model and node0's tokenized shard from `make run`, fp32,
one thread a rank, 12 steps, a checkpoint at 6 and 12): CPU is the job's and its children's (getrusage), wall from
start to exit; the losses are compared, which must be equal.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_train import demo_arguments

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
LAUNCHERS = {
    "torchrun": [str(Path(sys.executable).parent / "torchrun")],
    "ranks.py": [sys.executable, str(REPO / "workflow_scripts/train/ranks.py")],
}


def run(launcher: list[str], procs: int, cfg: dict, data: Path, base: Path, work: Path) -> tuple[float, float, list]:
    """One job: (CPU seconds, wall seconds, the logged losses)."""
    cmd = [*launcher, "--standalone", "--nproc_per_node", str(procs), "--max-restarts", "0",
           str(REPO / "workflow_scripts/train/train.py"), "--config", json.dumps(cfg), "--data", str(data),
           "--base-model", str(base), "--log-dir", str(work / "train"), "--checkpoint-root", str(work / "ckpt"),
           "--state", str(work / "state.json")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRAIN_FORK_RANKS="1")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    losses = [json.loads(x)["loss"] for x in (work / "train/metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(work)
    return cpu, wall, losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp", "deepspeed"))
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    a = demo_arguments(p)  # --data, --base: make run's
    cfg = {"lr": 3e-3, "precision": "fp32", "micro_batch_size": 2, "max_steps": 12, "log_every": 2,
           "checkpoint_every": 6, "packing": False, "strategy": a.strategy}  # fmt: skip
    cfg |= {"zero_stage": 3} if a.strategy == "deepspeed" else {}
    work = Path(tempfile.mkdtemp(prefix="bench_ranks_"))
    results = {name: [] for name in LAUNCHERS}
    for i in range(a.repeats):
        for name, launcher in LAUNCHERS.items():
            results[name].append(run(launcher, a.procs, cfg, a.data, a.base, work / f"{name}-{i}"))
    losses = {tuple(r[2]) for rs in results.values() for r in rs}
    print(f"\n{a.strategy}, {a.procs} rank(s), {a.repeats} job(s) each, alternating\n")
    print("| launcher | CPU per job (s) | wall per job (s) |\n|---|---|---|")
    cpu = {name: statistics.mean(r[0] for r in rs) for name, rs in results.items()}
    for name, rs in results.items():
        runs = ", ".join(f"{r[0]:.1f}" for r in rs)
        print(f"| {name} | {cpu[name]:.1f} ({runs}) | {statistics.mean(r[1] for r in rs):.1f} |")
    ratio = cpu["ranks.py"] / cpu["torchrun"]
    print(f"\nratio ranks.py / torchrun, CPU: {ratio:.2f}x; losses equal: {len(losses) == 1}")


if __name__ == "__main__":
    main()
