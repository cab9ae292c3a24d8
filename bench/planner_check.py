"""Under torchrun: one case of ``bench_scale.py --part planner`` measured on real tensors, through the
trainer's own code: train.init_distributed, parallel.load_model (the checkpoint's safetensors read by the
strategy's load plan), parallel.build_strategy, then train.py's train_step for the planner's two optimizer
steps (memory_probe.STEPS) over memory_probe.SyntheticData (the micro-batches the planner's probe runs:
micro_batch_size × max_seq_len, grad_accum of them). Rank 0 writes every rank's numbers as JSON.

    torchrun --standalone --nproc_per_node 2 bench/planner_check.py MODEL_DIR PLAN_KEYS_JSON OUT [cpu|cuda]

What is measured, per rank, from before the model is built to the end of the second step:

- cpu: the peak of the bytes torch's CPU allocator holds for this rank's tensors, from the profiler's
  memory events (``profile_memory=True``: every c10 CPU allocation and free the rank makes, tensors and
  kernels' scratch alike, summed in time order; what existed before the profiler started is not counted).
  On a GPU these are the device allocations ``torch.cuda.max_memory_allocated`` counts; the planner's
  probe predicts the same quantity (live tensor bytes). Allocations made on threads the profiler does not
  follow (gloo's work threads) are not seen; the collectives gloo runs on the calling thread are. Also
  the resident set's peak (VmHWM) above the resident set just before the model is built: a cross-check
  that includes what is not a tensor (Python objects, the allocator's free pages, the checkpoint's file
  pages while they are read).
- cuda: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` above what was allocated before
  the model was built (the planner's live bytes, and its live bytes plus the allocator's headroom).
"""

import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow_scripts"))


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def allocator_peak(prof) -> tuple[int, int]:
    """The profiler's CPU memory events summed in time order: (peak, end) bytes above the start."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events = sorted((e for e in events if str(e.device_type()).endswith("CPU")), key=lambda e: e.start_ns())
    running = list(itertools.accumulate(e.nbytes() for e in events)) or [0]
    return max(0, max(running)), running[-1]


def run(base: str, t: dict, device_name: str) -> dict:
    import torch
    import torch.distributed as dist
    from host_memory import map_large_allocations
    from memory_probe import STEPS, NullMetrics, SyntheticData, train_config
    from parallel import build_strategy, load_model
    from train import init_distributed, train_step
    from transformers import AutoConfig

    map_large_allocations()  # as train.py, before any weight exists
    cfg = train_config(t)
    device = init_distributed(cfg)
    if device.type != device_name:
        raise SystemExit(f"--device {device_name} but the rank's device is {device.type}")
    torch.manual_seed(cfg.seed)
    data = SyntheticData(cfg, t["max_seq_len"], AutoConfig.from_pretrained(base).vocab_size)
    dist.barrier()
    record = {"rank": dist.get_rank()}
    start = time.perf_counter()

    def steps() -> None:
        model, _ = load_model(base, cfg, device)
        strategy = build_strategy(cfg, model, device, total_steps=STEPS)
        strategy.model.train()
        for step in range(STEPS):
            train_step(strategy, data, step, NullMetrics())
        record["params"] = sum(p.numel() for p in model.parameters())

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        steps()
        torch.cuda.synchronize()
        record |= {"allocated_peak": torch.cuda.max_memory_allocated() - before,
                   "reserved_peak": torch.cuda.max_memory_reserved() - before}  # fmt: skip
    else:
        from torch.profiler import ProfilerActivity, profile

        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident set
        before = status("VmRSS")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            steps()
        record["rss_peak"] = status("VmHWM") - before
        record["allocated_peak"], record["allocated_end"] = allocator_peak(prof)
    record["seconds"] = time.perf_counter() - start
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, record)
    return {"ranks": rows}


def main() -> None:
    import os

    import torch.distributed as dist

    base, t, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    result = run(base, t, device)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU backend can abort in interpreter teardown (train.finish does the same)


if __name__ == "__main__":
    main()
