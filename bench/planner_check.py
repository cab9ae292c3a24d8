"""Under torchrun: one case of ``bench_scale.py --part planner`` measured on real tensors, through the
trainer's own code: train.init_distributed, parallel.load_model (the checkpoint's safetensors read by the
strategy's load plan), parallel.build_strategy, then train.py's train_step for the planner's two optimizer
steps (memory_probe.STEPS) over memory_probe.SyntheticData (the micro-batches the planner's probe runs:
micro_batch_size × max_seq_len, grad_accum of them). Rank 0 writes every rank's numbers as JSON.

    torchrun --standalone --nproc_per_node 2 bench/planner_check.py MODEL_DIR PLAN_KEYS_JSON OUT [cpu|cuda]

What is measured, per rank, from before the model is built to the end of the second step:

- cpu, the measurement: the peak of the live tensor bytes (``LiveStorages``): every storage an op returns
  on the rank's thread counted from its creation until it is freed, on whichever thread frees it (a
  weakref's callback), and through ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates its unsharded
  parameters that way). That is what the planner's probe predicts (live tensor bytes: on a GPU the
  device allocations ``torch.cuda.max_memory_allocated`` counts, and what is in host memory on a CPU).
  Not seen: allocations inside an op's kernel that do not come back as its output (gloo's staging copies,
  kernel scratch).
- cpu, beside it: the profiler's memory events (``profile_memory=True``: every c10 CPU allocation and free
  made on the rank's thread, kernels' scratch and gloo's staging included, summed in time order). A tensor
  freed on one of gloo's work threads (the input of an asynchronous collective, when the work outlives
  the caller's reference: DeepSpeed's ZeRO-3 all-gathers) has no free event, so this sum overcounts
  there; where the frees are on the rank's thread (DDP, FSDP2) it is the allocator's own peak. Also the
  resident set's peak (VmHWM) above the resident set just before the model is built: it includes what is
  not a tensor (Python objects, the profiler's events, the checkpoint's file pages while they are read).
- cuda: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` above what was allocated before
  the model was built (the planner's live bytes, and its live bytes plus the allocator's headroom).
"""

import itertools
import json
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def live_storages():
    """A LiveStorages mode (made here: torch is imported by the rank, not at this module's import)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_leaves

    class LiveStorages(TorchDispatchMode):
        """The bytes of the storages that ops return on this thread, each counted until it is freed on
        whichever thread frees it (a weakref's callback) and followed through UntypedStorage.resize_
        (FSDP2 frees and re-allocates its unsharded parameters that way): the live bytes and their peak."""

        def __init__(self):
            super().__init__()
            self.sizes, self.live, self.peak = {}, 0, 0

        def change(self, n: int) -> None:
            self.live += n
            self.peak = max(self.peak, self.live)

        def track(self, t) -> None:
            if is_traceable_wrapper_subclass(t):  # DTensor: its local tensor
                for name in t.__tensor_flatten__()[0]:
                    if isinstance(getattr(t, name), torch.Tensor):
                        self.track(getattr(t, name))
                return
            if t.device.type == "meta":
                return
            st = t.untyped_storage()
            key = st._cdata
            if key not in self.sizes:
                self.sizes[key] = st.nbytes()
                self.change(st.nbytes())
                weakref.finalize(st, self.freed, key)

        def freed(self, key) -> None:
            self.change(-self.sizes.pop(key, 0))

        def resized(self, st, size: int) -> None:
            if st._cdata in self.sizes:
                self.change(size - self.sizes[st._cdata])
                self.sizes[st._cdata] = size

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t)
            return out

        def __enter__(self):
            original = self.original_resize = torch.UntypedStorage.resize_
            tracker = self

            def resize_(st, size):
                result = original(st, size)
                tracker.resized(st, size)
                return result

            torch.UntypedStorage.resize_ = resize_
            return super().__enter__()

        def __exit__(self, *exc):
            torch.UntypedStorage.resize_ = self.original_resize
            return super().__exit__(*exc)

    return LiveStorages()


PHASES = ("load", "wrap", "step 1", "step 2")
MARK = 7_777_777  # bytes of a marker allocation (MARK + i after phase i): phase ends in the memory events


def mark(i: int) -> None:
    import torch

    torch.empty(MARK + i, dtype=torch.uint8)  # allocated and freed at once


def allocator_peak(prof) -> dict:
    """The profiler's CPU memory events summed in time order: the peak bytes above the start, the bytes
    live at the end of each phase (``mark``) and the phase the peak falls in."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events = sorted((e for e in events if str(e.device_type()).endswith("CPU")), key=lambda e: e.start_ns())
    marks = {MARK + i: i for i in range(len(PHASES))}
    # ends: phase -> the index in sizes (the markers left out) where it ended
    ends, sizes = {}, [0]
    for e in events:
        if e.nbytes() in marks:
            ends[marks[e.nbytes()]] = len(sizes) - 1
        elif -e.nbytes() not in marks:
            sizes.append(e.nbytes())
    running = list(itertools.accumulate(sizes))
    at = {PHASES[i]: running[k] for i, k in sorted(ends.items())}
    top = max(range(len(running)), key=running.__getitem__)
    phase = next((PHASES[i] for i, k in sorted(ends.items()) if top <= k), "after")
    return {"allocated_peak": max(0, running[top]), "allocated_end": running[-1], "allocated_at": at,
            "peak_in": phase}  # fmt: skip


def run(base: str, t, device_name: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from workflow_scripts.core.host_memory import map_large_allocations
    from workflow_scripts.plan.memory_probe import STEPS, NullMetrics, SyntheticData, train_config
    from workflow_scripts.train.parallel import build_strategy, load_model
    from workflow_scripts.train.step import train_step
    from workflow_scripts.train.train import init_distributed

    map_large_allocations()  # as train.py, before any weight exists
    cfg = train_config(t)
    device = init_distributed(cfg)
    if device.type != device_name:
        raise SystemExit(f"--device {device_name} but the rank's device is {device.type}")
    torch.manual_seed(cfg.seed)
    data = SyntheticData(cfg, t.max_seq_len, AutoConfig.from_pretrained(base).vocab_size)
    dist.barrier()
    record = {"rank": dist.get_rank()}
    start = time.perf_counter()
    tracker, at = [], {}  # the LiveStorages mode (cpu), its live bytes at each phase's end

    def end_of(i: int) -> None:
        mark(i)
        if tracker:
            at[PHASES[i]] = tracker[0].live

    def steps() -> None:
        model, _ = load_model(base, cfg, device)
        end_of(0)
        strategy = build_strategy(cfg, model, device, total_steps=STEPS)
        end_of(1)
        strategy.model.train()
        for step in range(STEPS):
            train_step(strategy, data, step, NullMetrics())
            end_of(2 + step)
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
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, live_storages() as live:
            tracker.append(live)
            steps()
        record["rss_peak"] = status("VmHWM") - before
        record |= allocator_peak(prof) | {"storages_peak": live.peak, "storages_end": live.live, "storages_at": at}
    record["seconds"] = time.perf_counter() - start
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, record)
    return {"ranks": rows}


def main() -> None:
    import os

    import torch.distributed as dist

    from workflow_scripts.core.settings import PlanConfig

    base, t, out = sys.argv[1], PlanConfig.from_json(sys.argv[2]), Path(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    result = run(base, t, device)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU backend can abort in interpreter teardown (train.finish does the same)


if __name__ == "__main__":
    main()
