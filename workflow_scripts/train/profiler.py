"""Where a training step's time goes: torch.profiler over chosen optimizer steps, on request.

    TRAIN_PROFILE_STEPS=6-7 snakemake ...        # or train.py under torchrun with the variable set

A diagnostic, not a training setting: an environment variable (it reaches SLURM jobs, whose sbatch exports the
environment), so it changes neither the workflow's parameters (nothing reruns for it) nor the checkpoint key. Over
the steps FIRST-LAST (1-based, inclusive) each rank writes, in the run's log folder:

- ``profile/rank<k>.txt``: the wall time of the profiled steps, the time the device's kernels took (their union
  on the timeline, so "busy" is a fraction of the wall time), the share of that time by kind of kernel (matrix
  products, attention, the optimizer's, elementwise, reductions, communication, copies) and the top operators
  and kernels by their own device time;
- ``profile/rank<k>.pt.trace.json``: the timeline, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Device time is CUDA's kernels where there is a GPU; on a CPU the operators' own CPU time stands in for it.
"""

import json
import logging
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from workflow_scripts.core.pipeline_io import UserError

log = logging.getLogger("train")

ENV = "TRAIN_PROFILE_STEPS"

# kernel-name patterns, first match wins: what a share of the device's time was spent on
KINDS = (
    ("communication", r"nccl|allreduce|all_reduce|allgather|reduce_scatter|gloo"),
    ("attention", r"flash|fmha|attention|attn|sdpa|efficient_attention|cutlass.*mha"),
    ("matrix products", r"gemm|cutlass|cublas|sm90_xmma|sm80_xmma|nvjet|matmul|\bmm\b|addmm|bmm|linear"),
    ("optimizer", r"multi_tensor|adam|foreach|fused_.*optim"),
    ("copies", r"memcpy|memset|copy_|to_copy|cat|index"),
    ("reductions", r"reduce|softmax|sum|norm|max|logsumexp|cross_entropy|nll"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi|silu|mul|add|pow|rsqrt|neg|exp"),
)


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``FIRST-LAST`` or ``STEP`` (1-based optimizer steps) -> (first, last); None when unset or empty."""
    if not text or not text.strip():
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", text)
    if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < int(m.group(1))):
        raise ValueError(f"{ENV}={text!r}: expected FIRST-LAST or STEP, optimizer steps from 1 (e.g. 6-7)")
    first = int(m.group(1))
    return first, int(m.group(2) or first)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.I):
            return kind
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: time the device was busy, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def self_seconds(events: list[dict]) -> list[float]:
    """Each event's own duration in seconds: its ``dur`` less that of the events nested in it on its thread
    (CPU operators nest: a backward node holds the matmul it calls; GPU kernels do not)."""
    own = [e["dur"] for e in events]
    threads: dict = {}
    for i, e in enumerate(events):
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    for indices in threads.values():
        stack: list[int] = []
        for i in sorted(indices, key=lambda j: (events[j]["ts"], -events[j]["dur"])):
            start = events[i]["ts"]
            while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= start:
                stack.pop()
            if stack:
                own[stack[-1]] -= events[i]["dur"]
            stack.append(i)
    return [max(0.0, d) / 1e6 for d in own]


def summarize(trace: dict, wall_s: float, steps: tuple[int, int], device: str) -> str:
    """The text report of a Chrome trace (torch.profiler's export) over ``wall_s`` seconds of profiled steps."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    on_device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not on_device:  # a CPU: the operators stand in for kernels (their nesting counted once by the union)
        on_device = [e for e in events if e.get("cat") == "cpu_op"]
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in on_device]) / 1e6
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e, secs in zip(on_device, self_seconds(on_device), strict=True):
        by_kind[kind_of(e["name"])] = by_kind.get(kind_of(e["name"]), 0.0) + secs
        by_name.setdefault(e["name"], []).append(secs)
    total = sum(by_kind.values()) or 1.0
    n_steps = steps[1] - steps[0] + 1
    lines = [
        f"steps {steps[0]}-{steps[1]} on {device}: {wall_s:.3f} s wall ({wall_s / n_steps:.3f} s a step), "
        f"device busy {busy:.3f} s ({busy / wall_s:.0%} of the wall time; the rest is the device waiting on the "
        "host: launches, Python, data, synchronization)",
        "(recording every operator slows the host's side: compare the wall time a step with the unprofiled steps' "
        "in metrics.jsonl)",
        "",
        "| kind | device s | share |",
        "|---|---|---|",
    ]
    for kind, secs in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {secs:.3f} | {secs / total:.1%} |")
    lines += ["", "| kernel (top 25 by its own device time) | calls | device s | share |", "|---|---|---|---|"]
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    for name, durs in top:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| {short.replace('|', '/')} | {len(durs)} | {sum(durs):.4f} | {sum(durs) / total:.1%} |")
    return "\n".join(lines) + "\n"


class StepProfiler:
    """torch.profiler over the optimizer steps TRAIN_PROFILE_STEPS names, around train.py's ``train_step``;
    does nothing when the variable is unset."""

    def __init__(self, log_dir: Path, rank: int, device: torch.device, steps: tuple[int, int] | None):
        self.steps = steps  # (first, last), 1-based and inclusive; None: off
        self.out = Path(log_dir) / "profile"
        self.rank, self.device = rank, device
        self.prof, self.started = None, 0.0

    @classmethod
    def from_env(cls, log_dir: Path, rank: int, device: torch.device) -> "StepProfiler":
        """The steps TRAIN_PROFILE_STEPS names (off when unset); a malformed value stops the job in one line."""
        try:
            steps = parse_steps(os.environ.get(ENV))
        except ValueError as e:
            raise UserError(str(e)) from None
        if steps and rank == 0:
            log.info("profiling optimizer steps %d-%d (%s) into %s", *steps, ENV, Path(log_dir) / "profile")
        return cls(log_dir, rank, device, steps)

    def check_reachable(self, start_step: int, last_step: int) -> None:
        """Say so when this job runs none or only part of the profiled steps (a resumed or shorter run)."""
        if self.steps and (self.steps[0] <= start_step or self.steps[1] > last_step):
            log.warning("%s=%d-%d: this job trains steps %d-%d, so nothing is profiled (%s is not written)", ENV,
                        *self.steps, start_step + 1, last_step, self.out)  # fmt: skip
            self.steps = None

    @classmethod
    def off(cls) -> "StepProfiler":
        return cls(Path("."), 0, torch.device("cpu"), None)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def step(self, step: int):
        """Around optimizer step ``step`` (1-based)."""
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            yield
            return
        if step == self.steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._sync()
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
            self.started = time.perf_counter()
        with torch.profiler.record_function(f"step {step}"):
            yield
        if step == self.steps[1]:
            self._sync()
            wall = time.perf_counter() - self.started
            self.prof.stop()
            self.write(wall)

    def write(self, wall_s: float) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"rank{self.rank}.pt.trace.json"
        self.prof.export_chrome_trace(str(trace))
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        report = summarize(json.loads(trace.read_text()), wall_s, self.steps, name)
        (self.out / f"rank{self.rank}.txt").write_text(report)
        log.info("profile of steps %d-%d: %s\n%s", *self.steps, self.out, report)
        self.prof = None
