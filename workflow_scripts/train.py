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
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on SIGTERM/SIGUSR1/SIGURG; a retry resumes


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
    micro_batch_size: int = 8  # examples, or packed bins of max_seq_len tokens with packing
    packing: bool = True  # padding-free batches from the packing plan
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


def load_bins(plans: list[Path], shards: list[Path]) -> list[list[int]]:
    """The packing plans written by tokenize_shard (example indices of each bin), one per shard,
    as indices into the shards' concatenated examples."""
    if len(plans) != len(shards):
        raise UserError(f"{len(plans)} packing plan(s) for {len(shards)} shard(s)")
    bins, offset = [], 0
    for plan, shard in zip(plans, shards, strict=True):
        count = pq.ParquetFile(shard).metadata.num_rows
        own = pq.read_table(plan, columns=["examples"]).column("examples").to_pylist()
        if sorted(i for b in own for i in b) != list(range(count)):
            raise UserError(f"{plan}: packing plan does not cover the {count} examples of {shard.name} exactly once")
        bins += [[offset + i for i in b] for b in own]
        offset += count
    return bins


@dataclasses.dataclass
class DataPlan:
    """How the data units (examples, or packed bins) of every shard become optimizer steps over all ranks
    (of every node, in joint mode); the data position is the step."""

    examples: int  # units: examples, or bins when packing
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
    """Unit indices for (step, micro-batch, rank): a seeded permutation per epoch."""
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


def collate_packed(rows: list[list[tuple[list[int], list[int]]]], pad_id: int) -> dict:
    """Padding-free packing: each row holds its sequences back to back.

    Position ids restart at 0 for every sequence and no attention mask is passed, so
    transformers builds block-diagonal causal attention from the position ids (SDPA and
    eager) or calls flash-attention's varlen kernel (one row): no token attends across
    sequences. The first label of every sequence is masked, so the last token of one
    sequence is never trained to predict the next. Rows shorter than the longest are
    filled with pad tokens forming their own masked pseudo-sequence.
    """
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for ids, lab in row:
            n = len(ids)
            input_ids[r, at : at + n] = torch.tensor(ids)
            labels[r, at + 1 : at + n] = torch.tensor(lab[1:])
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions}


class Batches:
    """Micro-batches of a node's data: padded examples, or packed bins (one row per bin,
    or all bins in one row for flash-attention, whose varlen path takes a single row)."""

    def __init__(self, examples, bins: list[list[int]] | None, pad_id: int, one_row: bool):
        self.examples, self.bins, self.pad_id, self.one_row = examples, bins, pad_id, one_row

    def __len__(self) -> int:
        return len(self.bins) if self.bins is not None else len(self.examples)

    def make(self, indices: list[int]) -> tuple[dict, list[int]]:
        """The batch for these unit indices and the lengths of its sequences (real tokens)."""
        if self.bins is None:
            items = [self.examples[i] for i in indices]
            batch = collate(items, self.pad_id)
        else:
            rows = [[self.examples[j] for j in self.bins[i]] for i in indices]
            rows = [[seq for row in rows for seq in row]] if self.one_row else rows
            items = [seq for row in rows for seq in row]
            batch = collate_packed(rows, self.pad_id)
        return batch, [len(ids) for ids, _ in items]


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
    # No KV cache in training: with one, transformers ignores the position ids when building the
    # attention mask, and packed sequences would attend to each other.
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    """SIGTERM, SIGUSR1 or SIGURG (SLURM's warning before the time limit, preemption) asks for a
    checkpoint and a clean exit.

    The handler only sets a flag; the loop finishes its step, and every rank agrees
    (an all-reduce of the flags) before all of them checkpoint together. profiles/slurm asks
    SLURM for SIGURG (`--signal=URG@600`): its default action is to ignore it, so Snakemake,
    the rule's shell and torchrun, which share the job step with the ranks and receive it too,
    carry on, while SIGUSR1 would kill Snakemake and with it the job (README, "On a SLURM cluster").
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGURG)

    def __init__(self):
        self.received = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agreed(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def resumed_after(marker: Path, start_step: int) -> dict | None:
    """The previous job's preemption record when this job resumes from the checkpoint it wrote."""
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return record if start_step and record.get("step") == start_step else None


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
    p.add_argument("--packing", nargs="+", type=Path, help="each shard's packing plan (needed with training.packing)")
    p.add_argument("--base-model", required=True)
    p.add_argument("--log-dir", required=True, type=Path, help="metrics.jsonl and TensorBoard events")
    p.add_argument("--checkpoint-root", required=True, type=Path)
    p.add_argument("--state", required=True, type=Path, help="train_state.json written at the end")
    a = p.parse_args(argv)
    cfg = TrainConfig.from_json(a.config)
    # first: a stop signal during start-up is remembered and honoured after the first step
    stop = StopSignal()

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

    # data plan: packed bins (padding-free) or padded examples
    if cfg.packing and a.packing is None:
        raise UserError("training.packing is true but no --packing plan was given")
    examples = load_examples(a.data)
    bins = load_bins(a.packing, a.data) if cfg.packing else None
    units = len(bins) if cfg.packing else len(examples)
    plan = DataPlan(units, world, cfg.micro_batch_size, cfg.grad_accum, cfg.epochs, cfg.max_steps)
    if units < plan.micro_batch_size * world:
        what = "packed bins" if cfg.packing else "examples"
        shards = " ".join(map(str, a.data))
        raise UserError(f"{shards}: {units} {what}, fewer than one micro-batch on every rank")

    # model, parallelized
    model, attn = load_model(a.base_model, cfg, device)
    n_params = sum(t.numel() for t in model.parameters())  # before sharding hides them
    n_trainable = sum(t.numel() for t in model.parameters() if t.requires_grad)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = Batches(examples, bins, pad_id, one_row=attn == "flash_attention_2")
    flops_of = flops_per_sequence_fn(model, n_params)
    strategy = build_strategy(cfg, model, device, plan.total_steps, lr_lambda(cfg, plan.total_steps))

    # resume from the newest complete checkpoint of this exact config
    data_sha = data_sha256(a.data) + (data_sha256(a.packing) if cfg.packing else "")
    key = run_key(cfg, data_sha, a.base_model)
    ckpt = Checkpointer(a.checkpoint_root / key, strategy, rank, cfg.keep_checkpoints)
    start_step = ckpt.resume(a.log_dir / "metrics.jsonl")
    hosts = [None] * world  # where each rank runs: SLURM's node name, or the hostname
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    plan_record = {
        "shards": [p.name for p in a.data],
        "examples": len(examples),
        "packed_bins": len(bins) if cfg.packing else None,
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
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "resumed_after": resumed_after(a.log_dir / "preempted.json", start_step) if rank == 0 else None,
    }
    if rank == 0:
        (a.log_dir / "preempted.json").unlink(missing_ok=True)
        write_json(a.log_dir / "plan.json", plan_record)
        log.info("plan: %s", plan_record)

    metrics = MetricsLog(a.log_dir, rank, start_step)
    strategy.model.train()
    tokens, flops, clock, last_logged = 0, 0.0, time.perf_counter(), start_step
    for step in range(start_step, plan.total_steps):
        loss_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            batch, lengths = batches.make(micro_batch_indices(plan, cfg.seed, step, micro, rank))
            tokens += sum(lengths)
            flops += flops_of(lengths)
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = strategy.forward_backward(batch, last_micro=micro == cfg.grad_accum - 1)
            loss_sum += loss.detach()
        grad_norm = strategy.step()
        done = step + 1
        if done % cfg.log_every == 0 or done == plan.total_steps:
            stats = [loss_sum.item() / cfg.grad_accum, float(tokens), flops]
            stats = torch.tensor(stats, dtype=torch.float64, device=device)
            dist.all_reduce(stats)
            elapsed = time.perf_counter() - clock
            tokens_per_s = stats[1].item() / elapsed
            model_tflops = stats[2].item() / elapsed / world / 1e12  # model FLOPs, not hardware FLOPs
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
                    # which SLURM job trained this step: a resumed run shows where the next job took over
                    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                },
                plan.total_steps,
            )
            tokens, flops, clock, last_logged = 0, 0.0, time.perf_counter(), done
        if done % cfg.checkpoint_every == 0 and done < plan.total_steps:
            ckpt.save(done, a.log_dir / "metrics.jsonl")
        if done < plan.total_steps and stop.agreed(device):
            # the marker first: once save()'s last barrier lets any rank exit, srun (joint mode) or
            # torchrun may end the others, rank 0 included
            if rank == 0:
                write_json(
                    a.log_dir / "preempted.json",
                    {"step": done, "signal": stop.received, "time": time.time(),
                     "slurm_job_id": os.environ.get("SLURM_JOB_ID")},
                )  # fmt: skip
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
