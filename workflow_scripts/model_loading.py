"""The base model for training, loaded the way its strategy needs: no rank ever holds a full fp32 copy
it does not train.

- ``ddp`` and DeepSpeed ZeRO-1/2 keep a full replica on every rank by design. It is read once,
  directly in the dtype training keeps: fp32 master weights for DDP's full fine-tuning, the compute
  dtype for DeepSpeed (its optimizer keeps the fp32 master partitions) and for a LoRA's frozen base.
- ``fsdp``: the model is built on the meta device (no memory), ``fully_shard`` per decoder block and
  on the root, ``to_empty`` on the device, and each rank copies only its own slices out of the
  memory-mapped checkpoint files (torchtitan's and torchtune's approach, without a rank-0 broadcast).
  Non-persistent buffers (rotary tables) are recomputed by transformers' own initializer.
- DeepSpeed ZeRO-3: the model is created under ``deepspeed.zero.Init``, which transformers enables
  while an ``HfDeepSpeedConfig`` is alive, so parameters are partitioned as they load.

LoRA adapters are fp32 and initialized from a generator seeded by training.seed and the adapter's
name (peft's default init: A uniform in ±1/sqrt(fan_in), B zero), so every strategy, sharded or
not, starts from the same adapters.
"""

import hashlib
import json
import logging
import math
from pathlib import Path

import torch
from pipeline_io import UserError
from strategies import compute_dtype, deepspeed_config, offloaded, shard_fsdp

log = logging.getLogger("train")

_KEEP_ALIVE = []  # HfDeepSpeedConfig: transformers holds it by weak reference until deepspeed.initialize


def load_dtype(cfg) -> torch.dtype:
    """The dtype the base weights are kept in while training."""
    if cfg.peft == "lora" or cfg.strategy == "deepspeed":
        return compute_dtype(cfg)
    return torch.float32  # DDP/FSDP full fine-tuning: the parameters are the fp32 master weights


def sharded_load(cfg) -> str | None:
    """How this config loads without a full replica per rank: "meta" (FSDP), "zero3", or None."""
    if cfg.strategy == "fsdp":
        return "meta"
    if cfg.strategy == "deepspeed" and cfg.zero_stage == 3:
        return "zero3"
    return None


def attention_implementation(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_model(base: str, cfg, device: torch.device):
    """The model, ready for ``strategies.build_strategy``: (model, attention implementation).

    With FSDP the model comes back already sharded and filled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = attention_implementation(device)
    how = sharded_load(cfg)
    if how == "meta":
        config = AutoConfig.from_pretrained(base)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=load_dtype(cfg), attn_implementation=attn)
    else:
        if how == "zero3":
            import deepspeed
            import torch.distributed as dist
            from transformers.integrations import HfDeepSpeedConfig

            deepspeed.init_distributed()  # zero.Init partitions over DeepSpeed's view of the process group

            _KEEP_ALIVE.append(HfDeepSpeedConfig(deepspeed_config(cfg, dist.get_world_size())))
        model = AutoModelForCausalLM.from_pretrained(base, dtype=load_dtype(cfg), attn_implementation=attn)
    # No KV cache in training: with one, transformers ignores the position ids when building the
    # attention mask, and packed sequences would attend to each other.
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.peft == "lora":
        model = add_lora(model, cfg, materialize=how != "meta")
    if how == "meta":
        shard_fsdp(model, cfg, device)
        fill_from_checkpoint(model, base, cfg, device)
    return model, attn


# ---------------------------------------------------------------- LoRA


def add_lora(model, cfg, materialize: bool):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    if materialize:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if is_adapter(name):
                    p.data = lora_init(name, p.shape, cfg.seed).to(p.device)
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_init(name: str, shape, seed: int) -> torch.Tensor:
    """peft's default init of one adapter matrix, from a generator seeded by (seed, name): fp32."""
    out = torch.zeros(tuple(shape), dtype=torch.float32)
    if ".lora_A." in name:
        digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
        bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5))
        out.uniform_(-bound, bound, generator=torch.Generator().manual_seed(digest))
    return out


# ---------------------------------------------------------------- checkpoint files


class CheckpointFiles:
    """The base model's tensors by name, read lazily from memory-mapped safetensors files (one
    file or an index); a slice reads only its own bytes."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            weight_map = None
        else:
            raise UserError(
                f"{folder}: no model.safetensors or model.safetensors.index.json (sharded loading reads"
                " safetensors; convert the checkpoint with save_pretrained(safe_serialization=True))"
            )
        from safetensors import safe_open

        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.handles = {f: safe_open(str(folder / f), framework="pt") for f in files}
        self.where = {k: f for f, h in self.handles.items() for k in h.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)

    def names(self) -> set[str]:
        return set(self.where)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.handles[self.where[name]].get_slice(name)[index]


def checkpoint_name(param_name: str, available: set[str], prefix: str) -> str | None:
    """The checkpoint key of a (possibly peft-wrapped) parameter name."""
    name = param_name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    for candidate in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
        if candidate in available:
            return candidate
    return None


def local_index(param) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of a (sharded) parameter and where it sits in the full tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the expected {tuple(shape)}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def fill_from_checkpoint(model, base: str, cfg, device: torch.device) -> None:
    """Materialize a meta-built, sharded model on ``device``: every rank reads its own slices."""
    from fingerprint import local_model_folder

    model.to_empty(device=device if not offloaded(cfg, device) else torch.device("cpu"))
    files = CheckpointFiles(local_model_folder(base))
    available = files.names()
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = getattr(inner, "base_model_prefix", "model")
    missing = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, index = local_index(param)
            if is_adapter(name):
                local.copy_(lora_init(name, param.shape, cfg.seed)[index])
                continue
            key = checkpoint_name(name, available, prefix)
            if key is None:
                missing.append(name)
                continue
            local.copy_(files.read(key, index))
        # non-persistent buffers (rotary inv_freq) are not in checkpoints: transformers' own init
        for module_name, module in inner.named_modules():
            if any(True for _ in module.buffers(recurse=False)):
                inner._init_weights(module)
                for buffer_name, buffer in module.named_buffers(recurse=False):
                    if not torch.isfinite(buffer).all():
                        raise RuntimeError(f"buffer {module_name}.{buffer_name} was not re-initialized")
    if missing:
        raise UserError(
            f"{files.folder}: {len(missing)} parameter(s) of the model are not in its checkpoint, e.g."
            f" {missing[:3]} (an unusual key layout; strategy ddp or deepspeed loads it through transformers)"
        )
    log.info("loaded %s shard by shard from %s", type(inner).__name__, files.folder)
