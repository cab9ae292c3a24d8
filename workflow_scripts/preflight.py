"""plan_training: estimate GPU and host memory before any training job is queued, and stop if either cannot fit.

GPU, per GPU, for DDP and FSDP2: the workflow's own training step run on fake tensors (memory_probe.py,
in a subprocess bounded by --probe-timeout): rank 0's peak of live tensor bytes by component (params,
grads, optimizer, activations, buffers) over two optimizer steps of the configured micro-batch ×
max_seq_len × grad_accum, plus memory_probe's stated constants (allocator headroom, CUDA context, NCCL
buffers); FSDP2 with offload leaves out the shards CPUOffloadPolicy keeps on the host. plan/memory.json
keeps the formula below as ``formula`` (the cross-check; memory.csv shows both) and says in ``method``
how the plan's numbers were made. For DeepSpeed (no fake-tensor path), or when the probe fails or runs
out of time, the formula is the plan, and ``method`` and the console say why.

The formula, per GPU, in bytes, by the usual accounting (ZeRO paper; Korthikanti et al. 2022 for
activations):

- weights: 2 per parameter in bf16 or fp16 (4 in fp32), sharded by ZeRO-3 / FSDP, on the CPU with
  ``offload: all``;
- fp32 master weights (bf16 and fp16 only) and AdamW's two moments: 4 + 8 per *trainable* parameter,
  sharded by ZeRO-1/2/3 / FSDP, on the CPU with any offload;
- gradients: the compute dtype per trainable parameter, sharded by ZeRO-2/3 / FSDP;
- activations per layer and token: about 34 × hidden bytes in 16-bit (attention is SDPA/flash,
  so no sequence² term), only the layer inputs (2 × hidden) with gradient checkpointing plus one
  layer's worth; the logits: vocab × 4 bytes per token, twice (values and gradient);
- FSDP2 with ``fsdp_no_sync`` and grad_accum > 1: the unsharded fp32 gradient, 4 per trainable parameter;
- a fixed 1.5 GB for the CUDA context, NCCL buffers and allocator slack.

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
- in training, what CPU offload keeps on the host, by DeepSpeed's own accounting
  (``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` with ``zero_init=True``
  and ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``, deepspeed
  0.19), applied to the trainable parameters only:
  ZeRO-3 with ``offload: all`` (offload_param and offload_optimizer): c + 16 bytes per parameter
  (DeepSpeed's 18 in bf16/fp16: the 16-bit parameter, then fp32 master weights, gradients and Adam's
  two moments, 4 + 4 + 8), with ``offload: optimizer`` 16, times 1/nodes (DeepSpeed's gpus_factor)
  times its additional_buffer_factor 1.5; without offload DeepSpeed counts 4 bytes of the largest
  layer per rank, × 1.5. The frozen base of a LoRA run is partitioned onto the host too with
  ``offload: all``: c per frozen parameter / nodes, × 1.5.
  ZeRO-1/2 with ``offload: optimizer``: 16 bytes per parameter / nodes, × 1.5. DeepSpeed's ZeRO-2
  estimator writes max(4 × total GPUs, 16) and no 1/nodes: the 4 bytes per GPU are the fp32 replica
  each rank loads without zero.Init (counted here at load, in the dtype the trainer loads), and
  ZeRO-2 partitions the offloaded states over every rank as ZeRO-3 does; for one node of at most 4
  GPUs the two agree.
  FSDP2's CPUOffloadPolicy (``offload: optimizer`` or ``all``) keeps each rank's shard of the
  parameters, gradients and optimizer states on the host: 4 + 4 + 8 = 16 bytes per trainable
  parameter / world per rank (frozen ones: c), i.e. 16 / nodes per node. DDP has no offload.
- both moments: 1.5 GB per rank for the Python process (torch, transformers and deepspeed imported:
  0.4 GB) and the host side of the CUDA context.

The peak of the two is compared with the training job's host memory: the train_node / train_joint
job's ``mem_mb`` resource (profiles/slurm sets it from TRAIN_MEM_MB; SLURM reads it in MiB, per
node), passed as ``--host-memory-mb``; without it there is no limit to check. GB here are GiB.
On a CPU run (the demo) the GPU column's weights and states are on the host as well.

Each strategy's terms are its own (workflow_scripts/parallel/: ``shards``, ``host_load_bytes``,
``offloaded_bytes``, ``gpu_tips``, ``sharded_alternative``); this module holds the shared arithmetic.
"""

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from parallel import strategy_for
from parallel.base import Footprint, compute_bytes
from pipeline_io import UserError, cli, write_json
from settings import PlanConfig, accumulation, job_ranks
from transformers import AutoConfig

GB = 2**30  # the plan's GB are GiB, as SLURM's and nvidia-smi's
OVERHEAD_GB = 1.5
HOST_OVERHEAD_GB = 1.5  # per rank: Python with torch and transformers (0.4 GB), the CUDA context's host side
HUB_SHARD_BYTES = 5 * 10**9  # hub checkpoints: files of at most 5 GB (transformers 4's max_shard_size)
SAVE_SHARD_BYTES = 50 * 10**9  # save_pretrained's max_shard_size (transformers 5): build_demo_model's files
PROBE_TIMEOUT_S = 600  # the fake-tensor probe's bound; past it the formula's estimate stands, and says so


def load_config(model: str, t: dict):
    """The model's config: a from-scratch preset's shape (before the possibly huge model is built), or config.json."""
    from presets import preset_config, preset_name

    preset = preset_name(model)
    if preset:
        return preset_config(preset, t["demo_vocab_size"], t["max_seq_len"])
    return AutoConfig.from_pretrained(model)


def model_to_params(config) -> tuple[int, int]:
    """The parameters of the model and of its largest module (its own parameters, not its children's),
    as DeepSpeed's ``model_to_params`` counts them, on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(p.numel() for p in model.parameters()), largest


def count_parameters(config) -> int:
    return model_to_params(config)[0]


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


def trainable_parameters(config, n_params: int, t: dict) -> int:
    if t["peft"] == "lora":
        return lora_parameters(config, t["lora"]["r"], t["lora"]["target_modules"])
    return n_params


def estimate(config, n_params: int, t: dict, world: int, seq_len: int) -> dict:
    """Per-GPU memory in GB, by component, for the training config ``t``."""
    half = compute_bytes(t) == 2
    offload = t["offload"]
    trainable = trainable_parameters(config, n_params, t)
    shard_params, shard_grads, shard_optim = strategy_for(t["strategy"]).shards(t)
    w = compute_bytes(t)
    weights = n_params * w / (world if shard_params else 1) * (0 if offload == "all" else 1)
    master = trainable * (4 if half else 0)
    optim = (trainable * 8 + master) / (world if shard_optim else 1) * (0 if offload != "none" else 1)
    grads = trainable * w / (world if shard_grads else 1)
    # FSDP2 with training.fsdp_no_sync: every rank holds the unsharded fp32 gradient until the last micro-batch
    no_sync = t["strategy"] == "fsdp" and t.get("fsdp_no_sync") and t.get("grad_accum", 1) > 1
    unsharded_grads = trainable * 4 if no_sync else 0
    tokens = t["micro_batch_size"] * seq_len
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    per_layer = 34 * h * tokens * (w / 2)
    if t["gradient_checkpointing"]:
        activations = layers * 2 * h * tokens * (w / 2) + per_layer
    else:
        activations = layers * per_layer
    logits = 2 * vocab * tokens * 4
    gb = {
        "weights": weights,
        "optimizer_states": optim,
        "gradients": grads,
        "unsharded_gradients": unsharded_grads,
        "activations": activations,
        "logits": logits,
    }
    gb = {k: v / GB for k, v in gb.items()}
    gb["overhead"] = OVERHEAD_GB
    return {
        "parameters": n_params,
        "trainable_parameters": trainable,
        "world_size": world,
        "tokens_per_micro_batch": tokens,
        "per_gpu_gb": gb,
        "total_gb": sum(gb.values()),
        "without_checkpointing_gb": None,
    }


def probe_memory(model: str, t: dict, world: int, timeout: float) -> tuple[dict | None, str]:
    """memory_probe.py's run of the training step on fake tensors, in a subprocess (its own fake process
    group, bounded in time): its result and how the GPU memory was estimated, or None and why not."""
    from memory_probe import FAKE_PATH_STRATEGIES

    formula = "by the formula (module docstring)"
    if t["strategy"] not in FAKE_PATH_STRATEGIES:
        return None, f"{formula}: DeepSpeed has no fake-tensor path"
    if timeout <= 0:
        return None, f"{formula}: the fake-tensor probe is off (--probe-timeout 0)"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        cmd = [sys.executable, str(Path(__file__).with_name("memory_probe.py")), "--model", model,
               "--config", json.dumps(t), "--world", str(world), "--output", str(out)]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"{formula}: the fake-tensor probe took over {timeout:.0f} s (--probe-timeout)"
        if proc.returncode != 0 or not out.exists():
            why = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            return None, f"{formula}: the fake-tensor probe failed ({why})"
        result = json.loads(out.read_text())
    return result, f"by the fake-tensor probe of the training step ({result['seconds']:.0f} s), plus stated constants"


def planned(est: dict, probed: dict | None, note: str, t: dict) -> dict:
    """The plan's GPU memory: the probe's components where it ran (the formula's as the cross-check),
    else the formula's, with how it was estimated."""
    from memory_probe import ALLOCATOR_HEADROOM, GPU_CONSTANTS_GB

    formula = {k: est.pop(k) for k in ("per_gpu_gb", "total_gb", "without_checkpointing_gb")}
    est |= {"method": note, "formula": formula, "probe": probed}
    if probed is None:
        return est | {"per_gpu_gb": formula["per_gpu_gb"], "total_gb": formula["total_gb"]}
    parts = dict(probed["components_bytes"])
    if t["strategy"] == "fsdp" and t["offload"] != "none":  # CPUOffloadPolicy: the shards live on the host
        cats = probed["tracker_categories_bytes"]
        parts["params"] -= cats.get("Sharded Param", 0)
        parts["grads"] -= cats.get("Sharded Grad", 0)
        parts["optimizer"] = 0
        est["method"] += "; FSDP2 offload: sharded parameters, gradients and optimizer states on the host"
    gb = {k: v / GB for k, v in parts.items()}
    gb["allocator_headroom"] = sum(gb.values()) * ALLOCATOR_HEADROOM
    gb |= GPU_CONSTANTS_GB
    return est | {"per_gpu_gb": gb, "total_gb": sum(gb.values())}


def footprint(n_params: int, trainable: int, largest_layer: int, t: dict, world: int) -> Footprint:
    return Footprint(n_params, trainable, largest_layer, compute_bytes(t), t["procs_per_node"], world)


def offloaded_bytes(n_params: int, trainable: int, largest_layer: int, t: dict, world: int) -> float:
    """Host bytes per node that CPU offload holds in training (see the module docstring)."""
    return strategy_for(t["strategy"]).offloaded_bytes(t, footprint(n_params, trainable, largest_layer, t, world))


def host_estimate(n_params: int, trainable: int, largest_layer: int, t: dict, world: int, largest_file: int) -> dict:
    """Host RAM per node in GB at load and in training, for the training config ``t`` (module docstring)."""
    strategy, f = strategy_for(t["strategy"]), footprint(n_params, trainable, largest_layer, t, world)
    overhead = f.procs * HOST_OVERHEAD_GB
    at_load = strategy.host_load_bytes(t, f, largest_file) / GB + overhead
    in_training = strategy.offloaded_bytes(t, f) / GB + overhead
    return {
        "nodes": f.nodes,
        "ranks_per_node": f.procs,
        "largest_checkpoint_file_gb": largest_file / GB,
        "at_load_gb": at_load,
        "in_training_gb": in_training,
        "peak_gb": max(at_load, in_training),
    }


def dtype_bytes(config) -> int:
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    return 2 if dtype.removeprefix("torch.") in ("bfloat16", "float16") else 4


def largest_checkpoint_file(model: str, config, n_params: int, preset: bool) -> tuple[int, str]:
    """Bytes of the base model's largest weight file, and how they were found."""
    if preset:  # build_demo_model saves fp32 in files of up to 50 GB
        return min(n_params * 4, SAVE_SHARD_BYTES), "assumed: a from-scratch preset's fp32 files"
    from fingerprint import local_model_folder

    try:
        folder = local_model_folder(model)
    except UserError:
        folder = None
    files = [p for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern)] if folder else []
    if files:
        return max(p.stat().st_size for p in files), f"measured in {folder}"
    return min(n_params * dtype_bytes(config), HUB_SHARD_BYTES), "assumed: files of at most 5 GB"


def advice(t: dict, est: dict) -> str:
    """What to change for the GPUs, biggest saving first."""
    gb = est["per_gpu_gb"]
    tips = []
    if not t["gradient_checkpointing"] and gb["activations"] > 1:
        tips.append("training.gradient_checkpointing: true")
    strategy = strategy_for(t["strategy"])
    tips += strategy.gpu_tips(t, gb)
    if t["offload"] == "none" and strategy.offloads:
        tips.append("training.offload: optimizer")
    if t["peft"] == "none":
        tips.append("training.peft: lora")
    if t["micro_batch_size"] > 1:
        tips.append("a smaller training.micro_batch_size (with grad_accum to keep the batch)")
    tips.append("more training.procs_per_node (GPUs)")
    return "; ".join(tips)


def host_advice(t: dict, host: dict, peak) -> str:
    """What to change for the host memory, each change with its estimate: ``peak(t, world)`` is the host
    peak per node in GB of another training config."""
    tips = [f"TRAIN_MEM_MB={math.ceil(host['peak_gb'] * 1024)} or more (nodes with that much memory)"]
    procs, nodes = t["procs_per_node"], host["nodes"]
    world = procs * nodes
    if host["in_training_gb"] >= host["at_load_gb"]:  # offloaded states: split them over more nodes
        more = max(2, t.get("nodes", 1)) if t.get("mode", "per_node") == "per_node" else 2 * nodes
        where = "training.mode: joint" if t.get("mode", "per_node") == "per_node" else "training.mode joint"
        tips.append(f"{where} on {more} nodes ({peak(t, more * procs):.0f} GB per node; one model over them)")
        if t["offload"] == "all":
            tips.append(f"training.offload: optimizer ({peak(t | {'offload': 'optimizer'}, world):.0f} GB)")
    elif (sharded := strategy_for(t["strategy"]).sharded_alternative(t)) is not None:
        keys = " with ".join(f"{k}: {v}" for k, v in sharded.items())
        tips.append(f"training.{keys} ({peak(t | sharded, world):.0f} GB; it loads partitions, not a replica per rank)")
    if t["peft"] == "none":
        tips.append(f"training.peft: lora ({peak(t | {'peft': 'lora'}, world):.0f} GB)")
    return "; ".join(tips)


def host_limit(mem_mb: int | None) -> str:
    return "no mem_mb set" if mem_mb is None else f"{mem_mb / 1024:.0f} (mem_mb {mem_mb})"


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="base model folder, hub id, demo or preset:<size>")
    p.add_argument("--config", required=True, help="its config keys as JSON (settings.PlanConfig)")
    p.add_argument(
        "--host-memory-mb", type=int, help="host memory of one training job per node (its mem_mb, SLURM's MiB)"
    )
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--table", required=True, type=Path)
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=PROBE_TIMEOUT_S,
        help="seconds the fake-tensor probe may take (0: off, the formula only)",
    )
    a = p.parse_args(argv)
    t = dataclasses.asdict(PlanConfig.from_json(a.config))
    seq_len = t["max_seq_len"]
    from presets import preset_name

    preset = preset_name(a.model)
    config = load_config(a.model, t)
    n, largest_layer = model_to_params(config)
    world = job_ranks(t, t["nodes"])  # joint: every node's ranks
    t["grad_accum"] = accumulation(t["micro_batch_size"], t["grad_accum"], t["global_batch_size"], world)
    est = estimate(config, n, t, world, seq_len)
    est["without_checkpointing_gb"] = estimate(config, n, t | {"gradient_checkpointing": False}, world, seq_len)[
        "total_gb"
    ]
    capacity = t["gpu_memory_gb"]
    probed, note = probe_memory(a.model, t, world, a.probe_timeout)
    est = planned(est, probed, note, t)
    largest_file, file_source = largest_checkpoint_file(a.model, config, n, preset is not None)

    def host_peak(alt: dict, alt_world: int) -> float:
        trainable = trainable_parameters(config, n, alt)
        return host_estimate(n, trainable, largest_layer, alt, alt_world, largest_file)["peak_gb"]

    host = host_estimate(n, est["trainable_parameters"], largest_layer, t, world, largest_file)
    limit_gb = None if a.host_memory_mb is None else a.host_memory_mb / 1024
    host |= {
        "largest_checkpoint_file": file_source,
        "memory_mb": a.host_memory_mb,
        "memory_gb": limit_gb,
        "fits": None if limit_gb is None else host["peak_gb"] <= limit_gb,
    }
    gpu_fits = est["total_gb"] <= capacity
    est |= {
        "gpu_memory_gb": capacity,
        "gpu_fits": gpu_fits,
        "host": host,
        "fits": gpu_fits and host["fits"] is not False,
    }
    write_json(a.output, est)
    rows = [("component", "GB")] + [(k, f"{v:.2f}") for k, v in est["per_gpu_gb"].items()]
    rows += [("total per GPU", f"{est['total_gb']:.2f}"), ("GPU memory (training.gpu_memory_gb)", f"{capacity:.0f}")]
    rows += [("estimated by", est["method"].replace(",", ";"))]
    rows += [(f"formula (cross-check): {k}", f"{v:.2f}") for k, v in est["formula"]["per_gpu_gb"].items()]
    rows += [("formula (cross-check): total per GPU", f"{est['formula']['total_gb']:.2f}")]
    rows += [
        ("host RAM per node at load", f"{host['at_load_gb']:.2f}"),
        ("host RAM per node in training", f"{host['in_training_gb']:.2f}"),
        ("host memory (TRAIN_MEM_MB)", host_limit(a.host_memory_mb)),
    ]
    a.table.write_text("".join(f"{k},{v}\n" for k, v in rows))
    if not gpu_fits:
        raise UserError(
            f"training needs about {est['total_gb']:.1f} GB per GPU but training.gpu_memory_gb is {capacity:.0f} "
            f"({n / 1e9:.2f}B parameters, {t['strategy']}, world size {world}; {est['method']}); try: "
            f"{advice(t, est['formula'])}"
        )
    moment = "in training" if host["in_training_gb"] >= host["at_load_gb"] else "at load"
    if host["fits"] is False:
        raise UserError(
            f"training needs about {host['peak_gb']:.0f} GB of host memory per node ({moment}) but the training job "
            f"has {limit_gb:.0f} GB (mem_mb {a.host_memory_mb}: TRAIN_MEM_MB in profiles/slurm; {n / 1e9:.2f}B "
            f"parameters, {t['strategy']}, offload {t['offload']}, {host['ranks_per_node']} ranks per node); try: "
            f"{host_advice(t, host, host_peak)}"
        )
    print(f"preflight: GPU memory {est['method']}")
    print(
        f"preflight: {est['total_gb']:.2f} GB per GPU of {capacity:.0f} GB; host {host['peak_gb']:.1f} GB per node "
        f"({moment}) of {host_limit(a.host_memory_mb)}"
    )


if __name__ == "__main__":
    main()
