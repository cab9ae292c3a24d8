"""plan_training: estimate per-GPU memory before any training job is queued, and stop if it cannot fit.

The estimate follows the usual accounting (ZeRO paper; Korthikanti et al. 2022 for
activations), per GPU, in bytes:

- weights: 2 per parameter in bf16 (4 in fp32), sharded by ZeRO-3 / FSDP, on the CPU with ``offload: all``;
- fp32 master weights (bf16 only) and AdamW's two moments: 4 + 8 per *trainable* parameter,
  sharded by ZeRO-1/2/3 / FSDP, on the CPU with any offload;
- gradients: the compute dtype per trainable parameter, sharded by ZeRO-2/3 / FSDP;
- activations per layer and token: about 34 × hidden bytes in bf16 (attention is SDPA/flash,
  so no sequence² term), only the layer inputs (2 × hidden) with gradient checkpointing plus one
  layer's worth; the logits: vocab × 4 bytes per token, twice (values and gradient);
- a fixed 1.5 GB for the CUDA context, NCCL buffers and allocator slack.
"""

import argparse
import json
from pathlib import Path

from pipeline_io import UserError, cli, write_json
from settings import option
from transformers import AutoConfig

OVERHEAD_GB = 1.5


def count_parameters(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


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


def estimate(config, n_params: int, t: dict, world: int, seq_len: int) -> dict:
    """Per-GPU memory in GB, by component, for the training config ``t``."""
    bf16 = t["precision"] == "bf16"
    strategy, stage, offload = t["strategy"], t.get("zero_stage", 0), t["offload"]
    trainable = (
        lora_parameters(config, t["lora"]["r"], t["lora"]["target_modules"]) if t["peft"] == "lora" else n_params
    )
    shard_params = strategy == "fsdp" or (strategy == "deepspeed" and stage == 3)
    shard_grads = shard_params or (strategy == "deepspeed" and stage >= 2)
    shard_optim = strategy == "fsdp" or strategy == "deepspeed"
    w = 2 if bf16 else 4
    weights = n_params * w / (world if shard_params else 1) * (0 if offload == "all" else 1)
    master = trainable * (4 if bf16 else 0)
    optim = (trainable * 8 + master) / (world if shard_optim else 1) * (0 if offload != "none" else 1)
    grads = trainable * w / (world if shard_grads else 1)
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
        "activations": activations,
        "logits": logits,
    }
    gb = {k: v / 2**30 for k, v in gb.items()}
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


def advice(t: dict, est: dict) -> str:
    """What to change, biggest saving first."""
    gb = est["per_gpu_gb"]
    tips = []
    if not t["gradient_checkpointing"] and gb["activations"] > 1:
        tips.append("training.gradient_checkpointing: true")
    if t["strategy"] == "ddp" and gb["weights"] + gb["optimizer_states"] + gb["gradients"] > 4:
        tips.append("training.strategy: fsdp (or deepspeed with zero_stage: 3)")
    if t["strategy"] == "deepspeed" and t["zero_stage"] < 3:
        tips.append("training.zero_stage: 3")
    if t["offload"] == "none" and t["strategy"] != "ddp":
        tips.append("training.offload: optimizer")
    if t["peft"] == "none":
        tips.append("training.peft: lora")
    if t["micro_batch_size"] > 1:
        tips.append("a smaller training.micro_batch_size (with grad_accum to keep the batch)")
    tips.append("more training.procs_per_node (GPUs)")
    return "; ".join(tips)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="base model folder, hub id, demo or preset:<size>")
    p.add_argument("--training", required=True, help="the training config as JSON")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument(
        "--vocab-size", type=int, help="vocabulary of a from-scratch preset", **option("model.demo_vocab_size")
    )
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--table", required=True, type=Path)
    a = p.parse_args(argv)
    t = json.loads(a.training)
    from demo_model import preset_config
    from presets import preset_name

    preset = preset_name(a.model)
    if preset:  # the from-scratch shape, before the (possibly huge) model is built
        config = preset_config(preset, a.vocab_size, a.seq_len)
    else:
        config = AutoConfig.from_pretrained(a.model)
    n = count_parameters(config)
    world = t.get("world_size", t["procs_per_node"])  # joint mode: every node's ranks
    est = estimate(config, n, t, world, a.seq_len)
    est["without_checkpointing_gb"] = estimate(config, n, t | {"gradient_checkpointing": False}, world, a.seq_len)[
        "total_gb"
    ]
    capacity = t["gpu_memory_gb"]
    est |= {"gpu_memory_gb": capacity, "fits": est["total_gb"] <= capacity}
    write_json(a.output, est)
    rows = [("component", "GB per GPU")] + [(k, f"{v:.2f}") for k, v in est["per_gpu_gb"].items()]
    rows += [("total", f"{est['total_gb']:.2f}"), ("GPU memory", f"{capacity:.0f}")]
    a.table.write_text("".join(f"{k},{v}\n" for k, v in rows))
    if not est["fits"]:
        raise UserError(
            f"training needs about {est['total_gb']:.1f} GB per GPU but training.gpu_memory_gb is {capacity:.0f} "
            f"({n / 1e9:.2f}B parameters, {t['strategy']}, world size {world}); try: {advice(t, est)}"
        )
    print(f"preflight: {est['total_gb']:.2f} GB per GPU of {capacity:.0f} GB")


if __name__ == "__main__":
    main()
