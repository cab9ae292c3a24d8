"""train_node: fine-tune one node's model under torchrun (DDP, FSDP2 or DeepSpeed; full or LoRA).

Reads top to bottom: setup (config, process group, data, model, strategy, resume) → train
(one `train_step` per optimizer step; the held-out evaluator, the metrics logger, the checkpointer
and the stop signal each decide for themselves whether to act after it) → finish (final checkpoint,
train_state.json). Checkpoints live outside Snakemake's declared outputs, so a failed or
preempted job keeps them and its retry resumes.

    torchrun --nproc_per_node 2 -m workflow_scripts.train.train --config '{"lr": 1e-4, ...}' ...

--config is the workflow's `training` section as JSON; missing keys take config/schema.yaml's defaults.
"""

import argparse
import dataclasses
import json
import logging
import multiprocessing
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.core.fingerprint import cache_file_for, model_fingerprint, model_location
from workflow_scripts.core.host_memory import map_large_allocations
from workflow_scripts.core.pipeline_io import UserError, cli, write_json
from workflow_scripts.core.settings import TrainConfig, for_world, recorded_config
from workflow_scripts.data.token_store import store_root_for
from workflow_scripts.model.model_loading import VARLEN_KERNELS
from workflow_scripts.train.batching import TrainingData
from workflow_scripts.train.checkpoint import Checkpointer, run_key, superseded
from workflow_scripts.train.divergence import DeadModel, NonFiniteStop
from workflow_scripts.train.evaluator import Evaluator
from workflow_scripts.train.metrics_logger import MetricsLogger, flops_per_sequence_fn
from workflow_scripts.train.parallel import build_strategy, load_model, strategy_for
from workflow_scripts.train.preemption import StopSignal
from workflow_scripts.train.profiler import StepProfiler
from workflow_scripts.train.step import train_step
from workflow_scripts.train.trackers import TrackerSettings
from workflow_scripts.train.trainer_lock import one_trainer
from workflow_scripts.train.watchdog import exit_watchdog, keep_until_exit

log = logging.getLogger("train")


# ---------------------------------------------------------------- setup


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the training config as JSON")
    p.add_argument("--data", required=True, nargs="+", type=Path, help="tokenized shard(s) (Parquet)")
    p.add_argument("--packing", nargs="+", type=Path, help="each shard's packing plan (needed with training.packing)")
    p.add_argument("--eval-data", type=Path, help="the tokenized eval set (needed with training.eval_every)")
    p.add_argument("--reference-logps", nargs="+", type=Path,
                   help="each shard's reference log-probabilities (training.dpo.reference cached)")  # fmt: skip
    p.add_argument("--base-model", required=True)
    p.add_argument("--environment", type=Path, help="check_environment's report: the GPU's peak for the MFU")
    p.add_argument("--log-dir", required=True, type=Path, help="metrics.jsonl and TensorBoard events")
    p.add_argument("--checkpoint-root", required=True, type=Path)
    p.add_argument("--state", required=True, type=Path, help="train_state.json written at the end")
    p.add_argument("--trackers", help="logging.trackers and the tracker run's identity as JSON (trackers.py)")
    a = p.parse_args(argv)
    a.base_model = model_location(a.base_model)  # a fetch record: its snapshot folder (train_state's base_model)
    return a


def intra_op_threads() -> None:
    """torch's intra-op threads as OMP_NUM_THREADS asks (the rule divides the job's cores among its ranks). OpenMP
    reads the variable when torch loads it: a rank that ranks.py forked got it from the launcher, not from the value
    torchrun sets for each rank."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def process_group_backend(cfg: TrainConfig, device_type: str) -> str:
    """The strategy's (Strategy.process_group_backend): gloo on CPU, NCCL on GPUs, and FSDP2 offloading to
    the host adds gloo for its CPU tensors."""
    return strategy_for(cfg.strategy).process_group_backend(cfg, device_type)


def init_distributed(cfg: TrainConfig) -> torch.device:
    """The process group (process_group_backend); this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    dist.init_process_group(process_group_backend(cfg, device.type), timeout=timeout)
    return device


def checkpoint_folder(strategy, data: TrainingData, base_model: str, checkpoint_root: Path) -> Path:
    """This training's checkpoints: keyed by config (its global batch, not the world size: checkpoint.run_key),
    data, base model content and what the strategy adds (Strategy.key_extra: the DeepSpeed JSON's content;
    with DeepSpeed, the ZeRO section it runs with). A run keyed before the GPU's keys left the key
    (checkpoint.NOT_KEYED) goes on in its folder."""
    base = model_fingerprint(base_model, cache_file_for(checkpoint_root))
    world, extra = dist.get_world_size(), strategy.key_extra(base_model)
    folder = checkpoint_root / run_key(strategy.cfg, world, data.sha256, base, extra)
    before = checkpoint_root / run_key(strategy.cfg, world, data.sha256, base, extra, legacy=True)
    return before if before.is_dir() and not folder.exists() else folder


def parameter_counts(model) -> dict:
    return {
        "parameters": sum(t.numel() for t in model.parameters()),
        "trainable_parameters": sum(t.numel() for t in model.parameters() if t.requires_grad),
    }


def describe_run(cfg, data, sizes, attn, start_step, resumed, resharded) -> dict:
    """plan.json: what this job trains, where, and from which step."""
    world = dist.get_world_size()
    hosts = [None] * world  # where each rank runs: SLURM's node name, or the hostname
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    return data.describe() | {
        "world_size": world,
        "nodes": world // int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        "hosts": hosts,
        "start_step": start_step,
        "grad_accum": cfg.grad_accum,
        "resharded_from": resharded,  # the resumed checkpoint's world size, when it was another (Checkpointer._load)
        "attention": attn,
        "strategy": cfg.strategy,
        "peft": cfg.peft,
        **sizes,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "resumed_after": resumed,
    }


# ---------------------------------------------------------------- train


def held_out_evaluator(strategy, a: argparse.Namespace, data: TrainingData, pad_id: int) -> Evaluator | None:
    """The held-out loss during training (training.eval_every), or None when it is off."""
    cfg = strategy.cfg
    if cfg.eval_every is None:
        return None
    if a.eval_data is None:
        raise UserError("training.eval_every is set but the trainer was given no --eval-data (the tokenized eval set)")
    return Evaluator(strategy, a.eval_data, store_root_for(a.checkpoint_root), cfg, data.plan.total_steps, pad_id)


def train(
    strategy, data, metrics, ckpt, stop, start_step: int, evaluator: Evaluator | None = None,
    dead: DeadModel | None = None, profiler: StepProfiler | None = None,
) -> None:  # fmt: skip
    last = data.plan.total_steps
    profiler = profiler or StepProfiler.off()
    profiler.check_reachable(start_step, last)
    # a NaN/inf loss or grad norm, or a model learning nothing for training.dead_model_steps, stops before anything
    # saves the step
    diverged = NonFiniteStop(strategy, ckpt, dead)
    strategy.model.train()
    for step in range(start_step + 1, last + 1):
        with profiler.step(step):  # TRAIN_PROFILE_STEPS: where the step's time goes (profiler.py)
            loss_sum, grad_norm = train_step(strategy, data, step - 1, metrics)
        diverged.check(step, loss_sum, grad_norm, on_exit=metrics.close)
        held_out = evaluator.maybe_evaluate(step) if evaluator else {}
        metrics.log(step, loss_sum, grad_norm, strategy.current_lr(), strategy.loss_scale_stats(), held_out)
        ckpt.maybe_save(step, last)
        stop.maybe_exit(step, last, strategy.device, ckpt, on_exit=metrics.close)


# ---------------------------------------------------------------- main


def with_measured_peak(cfg: TrainConfig, environment: Path | None) -> TrainConfig:
    """training.peak_tflops, or where it is null the GPU's figure check_environment found (None: no MFU)."""
    if cfg.peak_tflops is not None or environment is None:
        return cfg
    peak = json.loads(environment.read_text()).get("gpu", {}).get("peak_tflops")
    return dataclasses.replace(cfg, peak_tflops=peak)


@cli
def main(argv=None) -> None:
    a = parse_args(argv)
    # Before any weights exist: every allocation over 1 MiB gets its own mapping, returned to the kernel
    # when freed. glibc otherwise raises its mmap threshold after the first large free (up to 32 MiB) and
    # keeps freed partitions in its heap: ZeRO-3 kept 1.43-1.52x its by-design host state after
    # deepspeed.initialize at 2 ranks (docs/benchmarks/training-and-memory.md, bench_scale.py --part zero3-host).
    # mallopt is what MALLOC_MMAP_THRESHOLD_ sets at process start, without depending on how the job was launched.
    map_large_allocations()
    intra_op_threads()
    cfg = TrainConfig.from_json(a.config)
    stop = StopSignal(a.log_dir / "preempted.json")  # first: a signal during start-up is not lost
    device = init_distributed(cfg)
    one_trainer(a.checkpoint_root, device)  # rank 0 locks the checkpoints for the job's life; a second trainer ends
    stop.take_over()  # the previous job's preempted.json, read and removed: a failure from here is no preemption
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = for_world(cfg, world)  # grad_accum: what keeps training.global_batch_size at this world size
    torch.manual_seed(cfg.seed)
    data = TrainingData(cfg, a.data, a.packing, world, rank, store_root_for(a.checkpoint_root), a.reference_logps)

    model, attn = load_model(a.base_model, cfg, device)
    sizes = parameter_counts(model)  # before sharding hides them
    vocab = getattr(model.config, "vocab_size", None) or model.get_output_embeddings().weight.shape[0]
    dead = DeadModel(cfg.dead_model_steps, vocab, sizes["trainable_parameters"] > 0)  # the dead-model stop
    flops_of = flops_per_sequence_fn(model, sizes["parameters"])
    pad_id = model.config.pad_token_id or 0
    data.bind(pad_id=pad_id, one_row=attn in VARLEN_KERNELS)
    strategy = build_strategy(cfg, model, device, data.plan.total_steps)
    evaluator = held_out_evaluator(strategy, a, data, pad_id)

    root = checkpoint_folder(strategy, data, a.base_model, a.checkpoint_root)
    ckpt = Checkpointer(root, strategy, rank, cfg.keep_checkpoints, cfg.checkpoint_every, a.log_dir / "metrics.jsonl")
    start_step = ckpt.resume(data.plan.total_steps)
    run_record = describe_run(cfg, data, sizes, attn, start_step, stop.resumed_after(start_step), ckpt.resharded)
    if rank == 0:
        run_record |= {"checkpoints": str(root), "superseded_checkpoints": superseded(root)}
        write_json(a.log_dir / "plan.json", run_record)
        log.info("plan: %s", run_record)

    trackers = TrackerSettings.from_json(a.trackers)
    metrics = MetricsLogger(
        a.log_dir, with_measured_peak(cfg, a.environment), device, data.plan, flops_of, start_step, trackers, run_record
    )
    profiler = StepProfiler.from_env(a.log_dir, rank, device)  # TRAIN_PROFILE_STEPS, else off
    train(strategy, data, metrics, ckpt, stop, start_step, evaluator, dead, profiler)
    final = ckpt.save(data.plan.total_steps)
    metrics.close()
    finish(strategy, a, final, run_record)
    keep_until_exit(locals())  # a forked rank ends in torchrun's code (os._exit): its objects are never torn down


def finish(strategy, a: argparse.Namespace, final: Path, run_record: dict) -> None:
    """train_state.json (what consolidate_node reads), then a clean exit on every rank: one that has not ended
    2 minutes later says where it hangs and ends itself (exit_watchdog)."""
    cfg = strategy.cfg
    on_disk = exit_watchdog()
    if dist.get_rank() == 0:
        write_json(a.state, {
            "checkpoint": str(final), "step": run_record["total_steps"], "strategy": cfg.strategy,
            "zero_stage": cfg.zero_stage, "peft": cfg.peft, "base_model": a.base_model,
            "config": recorded_config(cfg), "plan": run_record, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        })  # fmt: skip
    dist.barrier()
    on_disk.set()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    if multiprocessing.parent_process() is None:
        # A new Python (torchrun's own start: GPUs, TRAIN_FORK_RANKS=0). Everything is on disk: end here, not in
        # interpreter teardown, where DeepSpeed's CPU backend can abort ("terminate called without an active
        # exception") and a process group's destructor, run with the GIL held, can wait on a thread that waits for
        # the GIL (a forked DDP rank hung there in a loaded test run, its stacks dumped by exit_watchdog). A rank
        # that ranks.py forked returns to torchrun's code, which reports it done and ends it by os._exit; main()
        # keeps its objects alive until then (keep_until_exit).
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
