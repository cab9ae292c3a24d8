"""train_node: fine-tune one node's model under torchrun (DDP, FSDP2 or DeepSpeed; full or LoRA).

Reads top to bottom: config → process group → data plan → model → parallelize →
resume → loop (batch, forward, backward, clip, step, log, maybe checkpoint) → final
checkpoint → train_state.json. Checkpoints live outside Snakemake's declared
outputs, so a failed or preempted job keeps them and its retry resumes.

    torchrun --nproc_per_node 2 workflow_scripts/train.py --config '{...}' ...
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from checkpoint import Checkpointer
from pipeline_io import UserError, cli, file_sha256, write_json
from strategies import build_strategy

log = logging.getLogger("train")
IGNORE = -100
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on SIGTERM/SIGUSR1; a retry resumes


@dataclasses.dataclass
class TrainConfig:
    strategy: str = "ddp"  # ddp | fsdp | deepspeed
    zero_stage: int = 2
    offload: str = "none"  # none | optimizer | all
    deepspeed_config: str | None = None  # a user-supplied DeepSpeed JSON, used as the base
    peft: str = "none"  # none | lora
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list = dataclasses.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    mode: str = "per_node"  # per_node | joint
    procs_per_node: int = 1
    precision: str = "fp32"  # fp32 | bf16
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.05
    warmup_steps: int | None = None  # overrides warmup_ratio
    weight_decay: float = 0.0
    adam_betas: list = dataclasses.field(default_factory=lambda: [0.9, 0.95])
    micro_batch_size: int = 8
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int | None = None
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    collective_timeout_s: int = 600
    peak_tflops: float = 989.0  # per GPU, for MFU (H100 SXM dense bf16)
    gpu_memory_gb: float = 80.0  # what the preflight plan checks against

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UserError(f"training: unknown key(s) {unknown}")
        cfg = cls(**raw)
        if cfg.strategy not in ("ddp", "fsdp", "deepspeed"):
            raise UserError(f"training.strategy: {cfg.strategy!r} is not one of ddp, fsdp, deepspeed")
        if cfg.peft not in ("none", "lora"):
            raise UserError(f"training.peft: {cfg.peft!r} is not one of none, lora")
        if cfg.precision not in ("fp32", "bf16"):
            raise UserError(f"training.precision: {cfg.precision!r} is not one of fp32, bf16")
        return cfg


# ---------------------------------------------------------------- data


def load_examples(paths: list[Path]) -> list[tuple[list[int], list[int]]]:
    """The examples of the shards, concatenated in order (joint mode trains on every node's shard)."""
    examples = []
    for path in paths:
        table = pq.read_table(path, columns=["input_ids", "labels"])
        examples += zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist(), strict=True)
    return examples


def data_sha256(paths: list[Path]) -> str:
    """One shard's content hash, or a hash of the shards' hashes in order."""
    shas = [file_sha256(p) for p in paths]
    return shas[0] if len(shas) == 1 else hashlib.sha256("\n".join(shas).encode()).hexdigest()


@dataclasses.dataclass
class DataPlan:
    """How the examples become optimizer steps over all ranks (of every node); the data position is the step."""

    examples: int
    world_size: int
    micro_batch_size: int
    grad_accum: int
    epochs: float
    max_steps: int | None

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.examples // self.global_batch)

    @property
    def total_steps(self) -> int:
        if self.max_steps:
            return self.max_steps
        return max(1, math.ceil(self.epochs * self.steps_per_epoch))


def micro_batch_indices(plan: DataPlan, seed: int, step: int, micro: int, rank: int) -> list[int]:
    """Example indices for (step, micro-batch, rank): a seeded permutation per epoch."""
    epoch, pos = divmod(step, plan.steps_per_epoch)
    order = torch.randperm(plan.examples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    start = (pos * plan.grad_accum + micro) * plan.micro_batch_size * plan.world_size
    start += rank * plan.micro_batch_size
    return [order[(start + i) % plan.examples] for i in range(plan.micro_batch_size)]


def collate(examples, pad_id: int) -> dict:
    """Pad to the longest example in the micro-batch."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


# ---------------------------------------------------------------- schedule


def lr_lambda(cfg: TrainConfig, total_steps: int):
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return factor


# ---------------------------------------------------------------- model


def attention_implementation(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_model(base: str, cfg: TrainConfig, device: torch.device):
    from transformers import AutoModelForCausalLM

    attn = attention_implementation(device)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation=attn)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.peft == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    return model, attn


# ---------------------------------------------------------------- metrics


class MetricsLog:
    """metrics.jsonl and TensorBoard on rank 0; a progress line per log interval."""

    def __init__(self, folder: Path, rank: int, start_step: int):
        self.rank, self.path = rank, folder / "metrics.jsonl"
        self.writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(folder), purge_step=start_step + 1)

    def write(self, record: dict, total_steps: int) -> None:
        if self.rank != 0:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self.writer.add_scalar(f"train/{key}", value, record["step"])
        log.info(
            "step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f",
            record["step"], total_steps, record["loss"], record["lr"], record["grad_norm"], record["tokens_per_s"],
        )  # fmt: skip

    def close(self) -> None:
        if self.writer:
            self.writer.close()


class StopSignal:
    """SIGTERM or SIGUSR1 (SLURM preemption or time limit) asks for a checkpoint and a clean exit.

    The handler only sets a flag; the loop finishes its step, and every rank agrees
    (an all-reduce of the flags) before all of them checkpoint together.
    """

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agreed(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def peak_memory_gb(device) -> float:
    """Peak GPU memory allocated, or on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_key(cfg: TrainConfig, data_sha: str, base: str) -> str:
    """Checkpoints are only resumed by a job with the same config, data and base model."""
    text = json.dumps([dataclasses.asdict(cfg), data_sha, base], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- main


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="training config as JSON")
    p.add_argument("--data", required=True, nargs="+", type=Path, help="tokenized shard(s) (Parquet)")
    p.add_argument("--base-model", required=True)
    p.add_argument("--log-dir", required=True, type=Path, help="metrics.jsonl and TensorBoard events")
    p.add_argument("--checkpoint-root", required=True, type=Path)
    p.add_argument("--state", required=True, type=Path, help="train_state.json written at the end")
    a = p.parse_args(argv)
    cfg = TrainConfig.from_json(a.config)

    # process group: NCCL on GPUs, gloo on CPU
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.collective_timeout_s)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    # data plan
    examples = load_examples(a.data)
    plan = DataPlan(len(examples), world, cfg.micro_batch_size, cfg.grad_accum, cfg.epochs, cfg.max_steps)
    if len(examples) < plan.micro_batch_size * world:
        raise UserError(
            f"{' '.join(map(str, a.data))}: {len(examples)} examples, fewer than one micro-batch on every rank"
        )

    # model, parallelized
    model, attn = load_model(a.base_model, cfg, device)
    n_params = sum(t.numel() for t in model.parameters())  # before sharding hides them
    n_trainable = sum(t.numel() for t in model.parameters() if t.requires_grad)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    strategy = build_strategy(cfg, model, device, plan.total_steps, lr_lambda(cfg, plan.total_steps))

    # resume from the newest complete checkpoint of this exact config
    key = run_key(cfg, data_sha256(a.data), a.base_model)
    ckpt = Checkpointer(a.checkpoint_root / key, strategy, rank, cfg.keep_checkpoints)
    start_step = ckpt.resume(a.log_dir / "metrics.jsonl")
    hosts = [None] * world  # where each rank runs: SLURM's node name, or the hostname
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    plan_record = {
        "shards": [p.name for p in a.data],
        "examples": plan.examples,
        "tokens": sum(len(ids) for ids, _ in examples),
        "world_size": world,
        "nodes": world // int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        "hosts": hosts,
        "global_batch": plan.global_batch,
        "steps_per_epoch": plan.steps_per_epoch,
        "total_steps": plan.total_steps,
        "start_step": start_step,
        "attention": attn,
        "strategy": cfg.strategy,
        "peft": cfg.peft,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
    }
    if rank == 0:
        (a.log_dir / "preempted.json").unlink(missing_ok=True)
        write_json(a.log_dir / "plan.json", plan_record)
        log.info("plan: %s", plan_record)

    metrics = MetricsLog(a.log_dir, rank, start_step)
    stop = StopSignal()
    strategy.model.train()
    tokens, clock, last_logged = 0, time.perf_counter(), start_step
    for step in range(start_step, plan.total_steps):
        loss_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            batch = collate([examples[i] for i in micro_batch_indices(plan, cfg.seed, step, micro, rank)], pad_id)
            tokens += int(batch["attention_mask"].sum())
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = strategy.forward_backward(batch, last_micro=micro == cfg.grad_accum - 1)
            loss_sum += loss.detach()
        grad_norm = strategy.step()
        done = step + 1
        if done % cfg.log_every == 0 or done == plan.total_steps:
            stats = torch.tensor([loss_sum.item() / cfg.grad_accum, float(tokens)], device=device)
            dist.all_reduce(stats)
            elapsed = time.perf_counter() - clock
            tokens_per_s = stats[1].item() / elapsed
            # 6 N flops per token for forward and backward (attention's extra term left out)
            model_tflops = 6 * n_params * tokens_per_s / world / 1e12
            metrics.write(
                {
                    "step": done,
                    "loss": stats[0].item() / world,
                    "lr": strategy.current_lr(),
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": elapsed / (done - last_logged),
                    "tflops_per_rank": model_tflops,
                    "mfu": model_tflops / cfg.peak_tflops if device.type == "cuda" else None,
                    "peak_memory_gb": peak_memory_gb(device),
                    "epoch": step / plan.steps_per_epoch,
                },
                plan.total_steps,
            )
            tokens, clock, last_logged = 0, time.perf_counter(), done
        if done % cfg.checkpoint_every == 0 and done < plan.total_steps:
            ckpt.save(done, a.log_dir / "metrics.jsonl")
        if done < plan.total_steps and stop.agreed(device):
            # the marker first: once save()'s last barrier lets any rank exit, srun (joint mode) or
            # torchrun may end the others, rank 0 included
            if rank == 0:
                write_json(a.log_dir / "preempted.json", {"step": done, "signal": stop.received, "time": time.time()})
            if done % cfg.checkpoint_every:
                ckpt.save(done, a.log_dir / "metrics.jsonl")
            if rank == 0:
                log.warning("%s: checkpointed at step %d; exiting %d so a retry resumes", stop.received or "signal",
                            done, EXIT_PREEMPTED)  # fmt: skip
            metrics.close()
            dist.destroy_process_group()
            sys.exit(EXIT_PREEMPTED)

    final = ckpt.save(plan.total_steps, a.log_dir / "metrics.jsonl")
    metrics.close()
    if rank == 0:
        write_json(
            a.state,
            {
                "checkpoint": str(final),
                "step": plan.total_steps,
                "strategy": cfg.strategy,
                "zero_stage": cfg.zero_stage,
                "peft": cfg.peft,
                "base_model": a.base_model,
                "config": dataclasses.asdict(cfg),
                "plan": plan_record,
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    if cfg.strategy == "deepspeed":
        # Everything is on disk. DeepSpeed's CPU backend can abort in interpreter teardown
        # ("terminate called without an active exception"), which would fail a finished job.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
