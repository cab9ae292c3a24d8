"""plan_training: estimate GPU and host memory before any training job is queued, and stop if either cannot fit.

GPU, per GPU, for DDP and FSDP2: the workflow's own training step run on fake tensors (memory_probe.py,
in a forked child bounded by --probe-timeout): rank 0's peak of live tensor bytes by component (params,
grads, optimizer, activations, buffers) over two optimizer steps of the configured micro-batch ×
max_seq_len × grad_accum, plus the stated constants (allocator headroom, plan_terms' CUDA context and NCCL
buffers); FSDP2 with offload leaves out the shards CPUOffloadPolicy keeps on the host. plan/memory.json
keeps the formula below as ``formula`` (the cross-check; memory.csv shows both) and says in ``method``
how the plan's numbers were made. DeepSpeed has no fake-tensor path: its model states are ZeRO's own
terms (parallel/zero_memory.py, from DeepSpeed 0.19's source), and its activations and logits the
probe's run of the same micro-batch, sequence, checkpointing and LoRA under FSDP2 (their own peak), plus
the same constants. When the probe is off, fails or runs out of time, the formula's activations (or the
whole formula, for DDP and FSDP2) stand, and ``method`` and the console say why.

When either does not fit, plan_training re-plans the config with each change that could make it fit
(proposals.py: gradient checkpointing, a smaller micro-batch with more accumulation, ZeRO-3's partial
offload at the ratio that fits both, NVMe offload, LoRA, more nodes), lists them all in plan/memory.json
(``proposals``, with their GPU and host GB) and names the best one that fits in its one-line refusal.

The formula, per GPU, in bytes, by the usual accounting (ZeRO paper; Korthikanti et al. 2022 for
activations):

- weights: 2 per parameter in bf16 or fp16 (4 in fp32), sharded by ZeRO-3 / FSDP, on the CPU with
  ``offload: all``;
- fp32 master weights (bf16 and fp16 only) and AdamW's two moments: 4 + 8 per *trainable* parameter,
  sharded by ZeRO-1/2/3 / FSDP, on the CPU with any offload;
- gradients: the compute dtype per trainable parameter, sharded by ZeRO-2/3 / FSDP;
- activations per layer and token: about 52 × hidden bytes in 16-bit (the fake-tensor probe's
  measure at Llama-3-8B/70B shapes, issue 24: SDPA with a mask saves K/V expanded to every head,
  fp32 norm casts, SwiGLU's widths; no sequence² term), only the layer inputs (2 × hidden) with
  gradient checkpointing plus one layer's worth; the logits: vocab × 12 bytes per token (the bf16
  logits, their fp32 cast at the loss and its gradient), for one slice of chunked_loss.slice_tokens
  tokens with ``chunked_loss`` (the default, for the architectures it supports), else the micro-batch's;
- FSDP2 with ``fsdp_no_sync`` and grad_accum > 1: the unsharded fp32 gradient, 4 per trainable parameter;
- the caching allocator's headroom, a fraction of the above (the strategy's ``allocator_headroom``: 10%,
  FSDP2 30%, as measured on an H200), and plan_terms' stated CUDA context and NCCL buffers (0.5 + 0.5);
  the same GPU-only terms (GPU_ONLY_TERMS) as a plan by the fake-tensor probe.

Host RAM, per node (its ``procs_per_node`` ranks; the world is nodes × procs_per_node in joint mode,
procs_per_node per node otherwise; c is the compute dtype's bytes, 2 in bf16/fp16, 4 in fp32; the
trainable parameters are all of them, or the LoRA adapters' with ``peft: lora``, whose frozen base
is kept in the compute dtype and the adapters in fp32), for a GPU run, at two moments:

- at load, as the trainer builds the model:
  FSDP2 builds it on the meta device and fills each rank's shard from the memory-mapped safetensors:
  the largest checkpoint file (its pages are shared by the node's ranks) plus every rank's shard
  (fp32 trainable weights, frozen ones in c);
  DeepSpeed ZeRO-3 builds it under ``deepspeed.zero.Init``, partitioned as it loads, while
  transformers reads one safetensors file at a time: the largest file, plus the node's partitions
  (c per parameter / nodes) when ``offload: all`` keeps them on the host;
  DDP and ZeRO-1/2 hold one full replica per rank, which passes through host memory once per rank:
  procs_per_node replicas (DeepSpeed: every weight in c, its fp32 master copy is made later; DDP:
  the trainable weights in fp32, which autocast keeps as the master weights, the frozen ones in c).
  The largest checkpoint file is measured where the model's folder is here (a local folder or a
  hub model in the cache), else taken as the model's size in its dtype up to 5 GB (hub checkpoints
  are sharded at 5 GB or less) or, for a from-scratch preset, up to 50 GB (save_pretrained's shard).
- in training, what CPU offload keeps on the host: DeepSpeed ZeRO's terms read from DeepSpeed 0.19's
  source (parallel/zero_memory.py: the bf16 parameter and gradient partitions, the pinned fp32
  gradient of each sub-group, the fp32 master and Adam's moments, 20 bytes a parameter with
  ``offload: all`` before torch's power-of-two rounding of pinned blocks; training.offload_ratio
  keeps part of the optimizer on the GPU), per rank × the node's ranks; DeepSpeed's own estimators
  (``estimate_zero3_model_states_mem_needs``), which put the gradients on the GPU and add a 1.5
  factor, stay beside it as ``host.deepspeed_estimator_gb`` (the cross-check).
  FSDP2's CPUOffloadPolicy (``offload: optimizer`` or ``all``) keeps each rank's shard of the
  parameters, gradients and optimizer states on the host: 4 + 4 + 8 = 16 bytes per trainable
  parameter / world per rank (frozen ones: c), i.e. 16 / nodes per node. DDP has no offload.
- both moments: 1.5 GB per rank for the Python process (torch, transformers and deepspeed imported:
  0.4 GB) and the host side of the CUDA context.

The peak of the two is compared with the training job's host memory: the train_node / train_joint
job's ``mem_mb`` resource (profiles/slurm sets it from TRAIN_MEM_MB; SLURM reads it in MiB, per
node), passed as ``--host-memory-mb``; without it there is no limit to check. GB here are GiB.
On a CPU run (the demo) the GPU column's weights and states are on the host as well.

Each strategy's terms are its own (workflow_scripts/train/parallel/: ``shards``, ``host_load_bytes``,
``offloaded_bytes``, ``unsharded_gradient_bytes``, ``probed_components``, ``model_states``, ``probe_config``,
``fake_probe``, ``unsupported``); this module holds the shared arithmetic, and ``Planner`` plans any training
config of one model (the job's, or a proposal's). What it shares with memory_probe.py (the model's config, the
GPU constants) is plan_terms.py's.
"""

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

from workflow_scripts.core.fingerprint import model_location
from workflow_scripts.core.pipeline_io import UserError, cli, write_json
from workflow_scripts.core.settings import PlanConfig, accumulation, job_ranks
from workflow_scripts.plan.plan_terms import GPU_CONSTANTS_GB, load_config
from workflow_scripts.train.parallel import strategy_for
from workflow_scripts.train.parallel.base import Footprint, compute_bytes

GB = 2**30  # the plan's GB are GiB, as SLURM's and nvidia-smi's
GPU_ONLY_TERMS = ("allocator_headroom", "cuda_context", "nccl_buffers")  # beside the live tensors of a plan
HOST_OVERHEAD_GB = 1.5  # per rank: Python with torch and transformers (0.4 GB), the CUDA context's host side
HUB_SHARD_BYTES = 5 * 10**9  # hub checkpoints: files of at most 5 GB (transformers 4's max_shard_size)
SAVE_SHARD_BYTES = 50 * 10**9  # save_pretrained's max_shard_size (transformers 5): build_demo_model's files
ACTIVATION_BYTES = 52  # per token, hidden unit and layer in 16-bit (the formula; the probe measures them)
LOGIT_BYTES = 12  # per token and vocabulary entry at the loss
PROBE_TIMEOUT_S = 600  # the fake-tensor probe's bound; past it the formula's estimate stands, and says so
ASSUMED_GPU_GB = 80  # training.gpu_memory_gb unset and no GPU measured (a CPU run): an 80 GB GPU's, as before


def gpu_memory(configured: float | None, environment: Path | None) -> tuple[float, str]:
    """The GPU memory (GiB) the plan compares with, and where it comes from: training.gpu_memory_gb when set,
    else the smallest GPU check_environment measured on the training partition (its --output), else assumed."""
    if configured is not None:
        return configured, "training.gpu_memory_gb"
    gpus = json.loads(environment.read_text()).get("gpu", {}).get("gpus") if environment else None
    if gpus:
        smallest = min(gpus, key=lambda g: g["memory_gb"])
        return smallest["memory_gb"], f"measured by check_environment: {smallest['name']}"
    return ASSUMED_GPU_GB, "assumed: check_environment saw no GPU (a CPU run); set training.gpu_memory_gb"


def model_to_params(config) -> tuple[int, int]:
    """The parameters of the model and of its largest module (its own parameters, not its children's),
    as DeepSpeed's ``model_to_params`` counts them, on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(p.numel() for p in model.parameters()), largest


def lora_parameters(config, r: int, targets: list[str]) -> int:
    """Trainable parameters of LoRA adapters on the named projections of every layer."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    shapes = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, config.intermediate_size), "up_proj": (h, config.intermediate_size),
        "down_proj": (config.intermediate_size, h),
    }  # fmt: skip
    return layers * sum(r * (i + o) for name, (i, o) in shapes.items() if name in targets)


def trainable_parameters(config, n_params: int, t: PlanConfig) -> int:
    if t.peft == "lora":
        return lora_parameters(config, t.lora["r"], t.lora["target_modules"])
    return n_params


def live_gb(plan: dict) -> float:
    """A plan's live tensor GiB per GPU: its total without the GPU-only terms (headroom, CUDA context, NCCL)."""
    return plan["total_gb"] - sum(v for k, v in plan["per_gpu_gb"].items() if k in GPU_ONLY_TERMS)


def logit_tokens(config, t: PlanConfig, tokens: int) -> int:
    """The tokens whose logits exist at once: one slice with training.chunked_loss, else the micro-batch's."""
    from workflow_scripts.train.chunked_loss import slice_tokens, supported

    if t.chunked_loss and supported(config) is None:
        return min(tokens, slice_tokens(config.vocab_size))
    return tokens


def estimate(config, n_params: int, t: PlanConfig, world: int, seq_len: int) -> dict:
    """Per-GPU memory in GB, by component, for the training config ``t``."""
    half = compute_bytes(t) == 2
    offload = t.offload
    trainable = trainable_parameters(config, n_params, t)
    strategy = strategy_for(t.strategy)
    shard_params, shard_grads, shard_optim = strategy.shards(t)
    w = compute_bytes(t)
    weights = n_params * w / (world if shard_params else 1) * (0 if offload == "all" else 1)
    master = trainable * (4 if half else 0)
    optim = (trainable * 8 + master) / (world if shard_optim else 1) * (0 if offload != "none" else 1)
    grads = trainable * w / (world if shard_grads else 1)
    unsharded_grads = strategy.unsharded_gradient_bytes(t, trainable)  # FSDP2's with training.fsdp_no_sync
    tokens = t.micro_batch_size * seq_len
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    per_layer = ACTIVATION_BYTES * h * tokens * (w / 2)
    if t.gradient_checkpointing:
        activations = layers * 2 * h * tokens * (w / 2) + per_layer
    else:
        activations = layers * per_layer
    logits = LOGIT_BYTES * vocab * logit_tokens(config, t, tokens)
    gb = {
        "weights": weights,
        "optimizer_states": optim,
        "gradients": grads,
        "unsharded_gradients": unsharded_grads,
        "activations": activations,
        "logits": logits,
    }
    gb = {k: v / GB for k, v in gb.items()}
    gb["allocator_headroom"] = sum(gb.values()) * strategy.allocator_headroom
    gb |= GPU_CONSTANTS_GB
    return {
        "parameters": n_params,
        "trainable_parameters": trainable,
        "world_size": world,
        "tokens_per_micro_batch": tokens,
        "per_gpu_gb": gb,
        "total_gb": sum(gb.values()),
        "without_checkpointing_gb": None,
    }


def planned_attention(environment: Path | None) -> str:
    """The attention the probe runs: torch_varlen where check_environment found that training gets a
    variable-length flash kernel (flash-attn's or PyTorch's: the same tensors, no sequence × sequence mask),
    else sdpa (SDPA's mask: an upper bound for those kernels)."""
    from workflow_scripts.model import varlen_attention
    from workflow_scripts.model.model_loading import VARLEN_KERNELS

    found = json.loads(environment.read_text()).get("attention") if environment else None
    return varlen_attention.NAME if found in VARLEN_KERNELS else "sdpa"


def probe_memory(
    model: str, t: PlanConfig, world: int, timeout: float, attention: str = "sdpa"
) -> tuple[dict | None, str]:
    """memory_probe.py's run of the training step on fake tensors, in a child process (its own fake process
    group, bounded in time): its result and how the GPU memory was estimated, or None and why not."""
    formula = "by the formula (module docstring)"
    if not strategy_for(t.strategy).fake_probe:
        return None, f"{formula}: no fake-tensor path for {t.strategy}"
    if timeout <= 0:
        return None, f"{formula}: the fake-tensor probe is off (--probe-timeout 0)"
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "probe.json", Path(tmp) / "probe.log"
        code = forked(functools.partial(run_probe, model, t, world, out, log, attention), timeout)
        if code is None:
            return None, f"{formula}: the fake-tensor probe took over {timeout:.0f} s (--probe-timeout)"
        if code != 0 or not out.exists():
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            return None, f"{formula}: the fake-tensor probe failed ({(lines or ['no output'])[-1][:200]})"
        result = json.loads(out.read_text())
    how = f"by the fake-tensor probe of the training step ({result['seconds']:.0f} s, attention {attention})"
    return result, f"{how}, plus stated constants"


def forked(target, timeout: float) -> int | None:
    """Run ``target`` in a forked child: its exit code, or None when it ran past ``timeout`` seconds (killed).
    A fork, not a new Python: the child has this process's torch and transformers imported (plan_training:
    22 s of CPU before, 14 s after, the demo on a slow 2-core machine)."""
    sys.stdout.flush()
    sys.stderr.flush()  # nothing of this process's buffers written twice
    child = multiprocessing.get_context("fork").Process(target=target, daemon=True)
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return None
    return child.exitcode


def run_probe(model: str, t: PlanConfig, world: int, out: Path, log: Path, attention: str = "sdpa") -> None:
    """memory_probe's run in the forked child, its result in ``out``; its output (and a traceback) in ``log``,
    whose last line says why it failed. One thread: the child needs no parallel kernels, and OpenMP's pool does
    not survive a fork."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = os.fdopen(fd, "w", buffering=1)  # where the parent's streams were not fds 1 and 2
    import torch

    from workflow_scripts.plan.memory_probe import probe

    torch.set_num_threads(1)
    result = probe(load_config(model, t), t, world, attention=attention)
    write_json(out, result | {"peak_gb": result["peak_bytes"] / GB})
    print(f"memory_probe: {result['peak_bytes'] / GB:.3f} GiB live per rank ({math.ceil(result['seconds'])} s)")


def planned(est: dict, probed: dict | None, note: str, t: PlanConfig) -> dict:
    """The plan's GPU memory: the probe's components where it ran (the formula's as the cross-check),
    else the formula's, with how it was estimated."""
    formula = {k: est.pop(k) for k in ("per_gpu_gb", "total_gb", "without_checkpointing_gb")}
    est |= {"method": note, "formula": formula, "probe": probed}
    if probed is None:
        return est | {"per_gpu_gb": formula["per_gpu_gb"], "total_gb": formula["total_gb"]}
    strategy = strategy_for(t.strategy)
    parts, on_host = strategy.probed_components(t, probed)  # FSDP2's offload: the shards live on the host
    est["method"] += on_host
    gb = {k: v / GB for k, v in parts.items()}
    gb["allocator_headroom"] = sum(gb.values()) * strategy.allocator_headroom
    gb |= GPU_CONSTANTS_GB
    return est | {"per_gpu_gb": gb, "total_gb": sum(gb.values())}


def with_states(est: dict, states: dict, probed: dict | None, note: str, headroom: float) -> dict:
    """The plan's GPU memory for a strategy that states its own model states (ZeRO): those, plus the probe's
    activations peak where it ran (else the formula's activations and logits), plus the stated constants."""
    formula = {k: est.pop(k) for k in ("per_gpu_gb", "total_gb", "without_checkpointing_gb")}
    parts = {k: v / GB for k, v in states["gpu"].items()}
    if probed is not None:
        parts["activations"] = probed["activations_peak_bytes"] / GB
    else:
        parts["activations"] = formula["per_gpu_gb"]["activations"] + formula["per_gpu_gb"]["logits"]
    how = f"model states by ZeRO's terms (parallel/zero_memory.py); activations {note}"
    parts["allocator_headroom"] = sum(parts.values()) * headroom
    parts |= GPU_CONSTANTS_GB
    est |= {"method": how, "formula": formula, "probe": probed, "model_states": states}
    return est | {"per_gpu_gb": parts, "total_gb": sum(parts.values())}


def footprint(n_params: int, trainable: int, largest_layer: int, t: PlanConfig, world: int) -> Footprint:
    return Footprint(n_params, trainable, largest_layer, compute_bytes(t), t.procs_per_node, world)


def offloaded_bytes(n_params: int, trainable: int, largest_layer: int, t: PlanConfig, world: int) -> float:
    """Host bytes per node that CPU offload holds in training (see the module docstring)."""
    return strategy_for(t.strategy).offloaded_bytes(t, footprint(n_params, trainable, largest_layer, t, world))


def host_estimate(
    n_params: int, trainable: int, largest_layer: int, t: PlanConfig, world: int, largest_file: int, states=None
) -> dict:
    """Host RAM per node in GB at load and in training, for the training config ``t`` (module docstring);
    ``states``: the strategy's own per-rank model states (ZeRO's), whose ``host`` part is what offload keeps."""
    strategy, f = strategy_for(t.strategy), footprint(n_params, trainable, largest_layer, t, world)
    overhead = f.procs * HOST_OVERHEAD_GB
    at_load = strategy.host_load_bytes(t, f, largest_file) / GB + overhead
    offloaded = f.procs * sum(states["host"].values()) if states else strategy.offloaded_bytes(t, f)
    in_training = offloaded / GB + overhead
    # ZeRO: DeepSpeed's own estimator beside its corrected terms, as the cross-check
    cross = {"deepspeed_estimator_gb": strategy.offloaded_bytes(t, f) / GB + overhead} if states else {}
    return {
        "nodes": f.nodes,
        "ranks_per_node": f.procs,
        "largest_checkpoint_file_gb": largest_file / GB,
        "at_load_gb": at_load,
        "in_training_gb": in_training,
        "peak_gb": max(at_load, in_training),
    } | cross


def dtype_bytes(config) -> int:
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    return 2 if dtype.removeprefix("torch.") in ("bfloat16", "float16") else 4


def largest_checkpoint_file(model: str, config, n_params: int, preset: bool) -> tuple[int, str]:
    """Bytes of the base model's largest weight file, and how they were found."""
    if preset:  # build_demo_model saves fp32 in files of up to 50 GB
        return min(n_params * 4, SAVE_SHARD_BYTES), "assumed: a from-scratch preset's fp32 files"
    from workflow_scripts.core.fingerprint import local_model_folder

    try:
        folder = local_model_folder(model)
    except UserError:
        folder = None
    files = [p for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern)] if folder else []
    if files:
        return max(p.stat().st_size for p in files), f"measured in {folder}"
    return min(n_params * dtype_bytes(config), HUB_SHARD_BYTES), "assumed: files of at most 5 GB"


def host_limit(mem_mb: int | None) -> str:
    return "no mem_mb set" if mem_mb is None else f"{mem_mb / 1024:.0f} (mem_mb {mem_mb})"


class Planner:
    """One model's plans: ``plan(t)`` for any training config ``t`` (the job's, or a proposal's), with the
    model's shape, checkpoint file and fake-tensor probes computed once (probes cached by their config)."""

    def __init__(self, model: str, t: PlanConfig, timeout: float, host_memory_mb: int | None, attention: str = "sdpa"):
        from workflow_scripts.model.presets import preset_name

        self.model, self.timeout, self.host_memory_mb = model, timeout, host_memory_mb
        self.attention = attention  # planned_attention: what the probe runs
        self.config = load_config(model, t)
        self.n, self.largest_layer = model_to_params(self.config)
        self.largest_file, self.file_source = largest_checkpoint_file(
            model, self.config, self.n, preset_name(model) is not None
        )
        self.probes, self.base = {}, None
        self.deadline = None  # the proposals' probes share one --probe-timeout (set_budget)

    def set_budget(self) -> None:
        """From now on the probes together take at most one --probe-timeout; past it, the formula."""
        self.deadline = time.monotonic() + self.timeout

    def probe(self, t: PlanConfig, world: int) -> tuple[dict | None, str]:
        key = json.dumps([dataclasses.asdict(t), world], sort_keys=True)
        if key not in self.probes:
            left = self.timeout if self.deadline is None else self.deadline - time.monotonic()
            if self.timeout > 0 and left <= 0:
                return None, "by the formula (module docstring): the proposals' --probe-timeout is spent"
            self.probes[key] = probe_memory(self.model, t, world, left, self.attention)
        return self.probes[key]

    def layout(self, t: PlanConfig):
        from workflow_scripts.train.parallel.zero_memory import base_parameters, layout

        self.base = self.base or base_parameters(self.config)
        return layout(self.config, self.base, t)

    def plan(self, t: PlanConfig) -> dict:
        """GPU memory per GPU and host memory per node of the training config ``t`` (module docstring)."""
        strategy = strategy_for(t.strategy)
        if error := strategy.unsupported(t):
            raise UserError(error)
        if t.gpu_memory_gb is None:  # a caller without check_environment's report (main resolves it first)
            t = dataclasses.replace(t, gpu_memory_gb=gpu_memory(None, None)[0])
        world, seq_len = job_ranks(vars(t), t.nodes), t.max_seq_len  # joint: every node's ranks
        t = dataclasses.replace(
            t, grad_accum=accumulation(t.micro_batch_size, t.grad_accum, t.global_batch_size, world)
        )
        est = estimate(self.config, self.n, t, world, seq_len)
        no_ckpt = dataclasses.replace(t, gradient_checkpointing=False)
        est["without_checkpointing_gb"] = estimate(self.config, self.n, no_ckpt, world, seq_len)["total_gb"]
        states = strategy.model_states(t, lambda: self.layout(t), world)
        probed, note = self.probe(strategy.probe_config(t), world)
        headroom = strategy_for(t.strategy).allocator_headroom
        est = with_states(est, states, probed, note, headroom) if states else planned(est, probed, note, t)
        host = host_estimate(
            self.n, est["trainable_parameters"], self.largest_layer, t, world, self.largest_file, states
        )
        limit_gb = None if self.host_memory_mb is None else self.host_memory_mb / 1024
        host |= {
            "largest_checkpoint_file": self.file_source,
            "memory_mb": self.host_memory_mb,
            "memory_gb": limit_gb,
            "fits": None if limit_gb is None else host["peak_gb"] <= limit_gb,
        }
        gpu_fits = est["total_gb"] <= t.gpu_memory_gb
        return est | {
            "grad_accum": t.grad_accum,
            "gpu_memory_gb": t.gpu_memory_gb,
            "gpu_fits": gpu_fits,
            "host": host,
            "fits": gpu_fits and host["fits"] is not False,
        }


def table_rows(est: dict, mem_mb: int | None) -> list[tuple[str, str]]:
    host = est["host"]
    rows = [("component", "GB")] + [(k, f"{v:.2f}") for k, v in est["per_gpu_gb"].items()]
    rows += [
        ("total per GPU", f"{est['total_gb']:.2f}"),
        (f"GPU memory ({est['gpu_memory_source']})", f"{est['gpu_memory_gb']:.1f}"),
    ]
    rows += [("estimated by", est["method"].replace(",", ";"))]
    rows += [(f"formula (cross-check): {k}", f"{v:.2f}") for k, v in est["formula"]["per_gpu_gb"].items()]
    rows += [("formula (cross-check): total per GPU", f"{est['formula']['total_gb']:.2f}")]
    rows += [
        ("host RAM per node at load", f"{host['at_load_gb']:.2f}"),
        ("host RAM per node in training", f"{host['in_training_gb']:.2f}"),
        ("host memory (TRAIN_MEM_MB)", host_limit(mem_mb)),
    ]
    if "deepspeed_estimator_gb" in host:
        rows += [
            (
                "DeepSpeed's estimator (cross-check): host RAM per node in training",
                f"{host['deepspeed_estimator_gb']:.2f}",
            )
        ]
    rows += [(f"proposal: {p['proposal'].replace(',', ';')}", f"{p['gpu_gb']:.2f} GPU / {p['host_gb']:.1f} host"
              f"{'' if p['fits'] else ' (does not fit)'}") for p in est.get("proposals", [])]  # fmt: skip
    return rows


@cli
def main(argv=None) -> None:
    from workflow_scripts.plan.proposals import best, propose, said

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="base model folder, hub id, demo or preset:<size>")
    p.add_argument("--config", required=True, help="its config keys as JSON (settings.PlanConfig)")
    p.add_argument(
        "--host-memory-mb", type=int, help="host memory of one training job per node (its mem_mb, SLURM's MiB)"
    )
    p.add_argument("--environment", type=Path, help="check_environment's report: the GPUs it measured")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--table", required=True, type=Path)
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=PROBE_TIMEOUT_S,
        help="seconds the fake-tensor probe may take (0: off, the formula only)",
    )
    a = p.parse_args(argv)
    a.model = model_location(a.model)  # a fetch record: its snapshot folder
    t = PlanConfig.from_json(a.config)
    capacity, source = gpu_memory(t.gpu_memory_gb, a.environment)
    t = dataclasses.replace(t, gpu_memory_gb=capacity)
    planner = Planner(a.model, t, a.probe_timeout, a.host_memory_mb, planned_attention(a.environment))
    est = planner.plan(t) | {"gpu_memory_source": source}
    if not est["fits"]:
        planner.set_budget()
        est["proposals"] = propose(t, planner.plan)
    write_json(a.output, est)
    a.table.write_text("".join(f"{k},{v}\n" for k, v in table_rows(est, a.host_memory_mb)))
    host, n = est["host"], est["parameters"]
    what = f"{n / 1e9:.2f}B parameters, {t.strategy}, world size {est['world_size']}"
    if not est["gpu_fits"]:
        has = (
            f"training.gpu_memory_gb is {capacity:.1f}"
            if source == "training.gpu_memory_gb"
            else (f"the GPU has {capacity:.1f} ({source})")
        )
        raise UserError(
            f"training needs about {est['total_gb']:.1f} GB per GPU but {has} "
            f"({what}; {est['method']}); {said(best(est['proposals']), est['proposals'])}"
        )
    moment = "in training" if host["in_training_gb"] >= host["at_load_gb"] else "at load"
    if host["fits"] is False:
        more = f"TRAIN_MEM_MB={math.ceil(host['peak_gb'] * 1024)} or more (nodes with that much memory)"
        raise UserError(
            f"training needs about {host['peak_gb']:.0f} GB of host memory per node ({moment}) but the training job "
            f"has {host['memory_gb']:.0f} GB (mem_mb {a.host_memory_mb}: TRAIN_MEM_MB in profiles/slurm; {what}, "
            f"offload {t.offload}, {host['ranks_per_node']} ranks per node); "
            f"{said(best(est['proposals']), est['proposals'])}; or {more}"
        )
    print(f"preflight: GPU memory {est['method']}")
    print(
        f"preflight: {est['total_gb']:.2f} GB per GPU of {capacity:.1f} GB ({source}); "
        f"host {host['peak_gb']:.1f} GB per node ({moment}) of {host_limit(a.host_memory_mb)}"
    )


if __name__ == "__main__":
    main()
