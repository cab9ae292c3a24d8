"""Training metrics: throughput accounting, when to log, and where (metrics.jsonl, the log, and the sinks of
logging.trackers: TensorBoard, wandb, MLflow; trackers.py).

The loop counts each micro-batch's sequence lengths; every `log_every` steps (and at the last)
the logger all-reduces loss, tokens and model FLOPs over the ranks and rank 0 writes one record.
A step with a held-out loss (evaluator.py) is logged too, its record carrying the eval_* fields;
the evaluation's time is not counted in the interval's throughput.
"""

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.core.pipeline_io import atomic_path
from workflow_scripts.train.trackers import TrackerSettings, open_sinks, require

log = logging.getLogger("train")


def flops_per_sequence_fn(model, n_params: int):
    """Training FLOPs of a sequence of length s: 6 N s for the matmuls (forward and backward;
    N without the input-embedding lookup) plus PaLM's attention term 12 L d s^2 (L layers,
    d = heads x head dim), the convention MFU figures are quoted in."""
    c = model.config
    embed = model.get_input_embeddings().weight.numel()
    n_matmul = n_params if getattr(c, "tie_word_embeddings", False) else n_params - embed
    attn_dim = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    layers = c.num_hidden_layers

    def flops(lengths: list[int]) -> float:
        return sum(6 * n_matmul * s + 12 * layers * attn_dim * s * s for s in lengths)

    return flops


def peak_memory_gb(device) -> float:
    """Peak GPU memory allocated, or on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """metrics.jsonl and the trackers' sinks on rank 0; a progress line per log interval."""

    def __init__(self, folder: Path, cfg, device, plan, flops_of, start_step: int, trackers=None, run=None):
        """``trackers``: trackers.TrackerSettings (None: TensorBoard alone); ``run``: plan.json's record, which the
        trackers log with the training config."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cfg, self.device, self.plan, self.flops_of = cfg, device, plan, flops_of
        self.path, self.sinks = folder / "metrics.jsonl", []
        self.lines: list[str] = []  # rank 0: every record of the file, the resumed ones (the checkpoint's copy) first
        trackers = trackers or TrackerSettings(trackers=["tensorboard"])
        require(trackers.trackers)  # on every rank: a missing package stops them all
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
            self.sinks = open_sinks(trackers, folder, start_step, config, run or {})
            if self.path.exists():
                self.lines = self.path.read_text().splitlines(keepends=True)
        self.bytes = sum(len(line.encode()) for line in self.lines)  # the file's size as this job writes it
        self.tokens, self.flops, self.clock, self.last_logged = 0, 0.0, time.perf_counter(), start_step
        self.observed: dict[str, list] = {}  # the objective's metrics of each micro-batch since the last record

    def count(self, lengths: list[int]) -> None:
        """A micro-batch's real tokens (its sequences' lengths)."""
        self.tokens += sum(lengths)
        self.flops += self.flops_of(lengths)

    def observe(self, found: dict) -> None:
        """A micro-batch's metrics of the objective (train/objective.py: DPO's rewards/*, logps/*), 0-d tensors."""
        for name, value in found.items():
            self.observed.setdefault(name, []).append(value.detach())

    def observed_means(self) -> dict:
        """The observed metrics' means over the interval's micro-batches and all ranks (every rank observes the
        same names as many times); {} without any (SFT)."""
        if not self.observed:
            return {}
        names = sorted(self.observed)
        means = torch.stack([torch.stack(self.observed[n]).double().mean() for n in names]).to(self.device)
        dist.all_reduce(means)
        self.observed = {}
        return {n: v / self.world for n, v in zip(names, means.tolist(), strict=True)}

    def should_log(self, step: int) -> bool:
        return step % self.cfg.log_every == 0 or step == self.plan.total_steps

    def log(self, step: int, loss_sum: torch.Tensor, grad_norm: float, lr: float, extra: dict | None = None,
            held_out: dict | None = None) -> None:  # fmt: skip
        """After optimizer step ``step`` (1-based): the interval's mean loss and throughput over all ranks;
        ``extra``: fp16's loss scale and skipped steps; ``held_out``: the step's held-out loss fields (the
        same on every rank), which log the step whatever log_every says."""
        if not (self.should_log(step) or held_out):
            return
        stats = [loss_sum.item() / self.cfg.grad_accum, float(self.tokens), self.flops]
        stats = torch.tensor(stats, dtype=torch.float64, device=self.device)
        dist.all_reduce(stats)
        # the training steps' time: the evaluation's is its own field
        observed = self.observed_means()
        elapsed = time.perf_counter() - self.clock - (held_out or {}).get("eval_time_s", 0.0)
        model_tflops = stats[2].item() / elapsed / self.world / 1e12  # model FLOPs, not hardware FLOPs
        self.write(
            {
                "step": step,
                "loss": stats[0].item() / self.world,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": stats[1].item() / elapsed,
                "step_time_s": elapsed / (step - self.last_logged),
                "tflops_per_rank": model_tflops,
                "mfu": model_tflops / self.cfg.peak_tflops
                if self.device.type == "cuda" and self.cfg.peak_tflops
                else None,
                "peak_memory_gb": peak_memory_gb(self.device),
                "epoch": (step - 1) / self.plan.steps_per_epoch,
                # which SLURM job trained this step: a resumed run shows where the next job took over
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            }
            | observed
            | (extra or {})
            | (held_out or {})
        )
        self.tokens, self.flops, self.clock, self.last_logged = 0, 0.0, time.perf_counter(), step

    def write(self, record: dict) -> None:
        if self.rank != 0:
            return
        self.lines.append(json.dumps(record) + "\n")
        self.keep_file(appended=len(self.lines[-1].encode()))
        for sink in self.sinks:
            sink.log(record)
        log.info(
            "step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f%s",
            record["step"], self.plan.total_steps, record["loss"], record["lr"], record["grad_norm"],
            record["tokens_per_s"], f" eval_loss {record['eval_loss']:.4f}" if "eval_loss" in record else "",
        )  # fmt: skip

    def keep_file(self, appended: int = 0) -> None:
        """Append the newest record, or write the file whole where it is not what this job wrote: metrics.jsonl
        is a declared output, which a second Snakemake starting this job deletes before the trainer lock
        stops it (and again as it fails), so no step goes missing from a live job's file."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = None
        if appended and size == self.bytes:
            with self.path.open("a") as f:
                f.write(self.lines[-1])
        elif size != self.bytes + appended:
            with atomic_path(self.path) as tmp:
                tmp.write_text("".join(self.lines))
        self.bytes += appended

    def close(self) -> None:
        """The file as written; each sink closed, its run finished where the last step was logged (else stopped)."""
        if self.rank == 0:
            self.keep_file()
        sinks, self.sinks = self.sinks, []  # closed once: a stop's on_exit may come before the end's close
        for sink in sinks:
            try:
                sink.close(finished=self.last_logged == self.plan.total_steps)
            except Exception as e:  # a tracker that cannot finish its run (its service gone in a stop) fails no job
                log.warning("could not close %s: %s", type(sink).__name__, e)
