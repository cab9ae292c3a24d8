"""Loading a base model for training, the parts every strategy's load plan shares (parallel/): the
attention implementation, LoRA adapters with a seeded init, and filling a meta-built model (sharded
or whole) from the safetensors files, each rank reading only its own slices (torchtitan's and
torchtune's approach, without a rank-0 broadcast). Non-persistent buffers (rotary tables) are
recomputed by transformers' own initializer.

LoRA adapters are fp32 and initialized from a generator seeded by training.seed and the adapter's
name (peft's default init: A uniform in ±1/sqrt(fan_in), B zero), so every strategy, sharded or
not, starts from the same adapters.
"""

import hashlib
import logging
import math
import os

import torch

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.model import varlen_attention
from workflow_scripts.model.weights import READ_BYTES, CheckpointFiles, checkpoint_name

log = logging.getLogger("train")


FLASH_ATTN_MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and newer; T4 (7.5) and V100 (7.0) do not


def choose_attention(installed: str | None, capability: tuple[int, int] | None, dtype: torch.dtype,
                     varlen: bool = False) -> tuple[str, str]:  # fmt: skip
    """The attention implementation and why: flash-attn 2 where it is installed (``installed``: its
    version), the GPU's compute capability (None: no GPU) is 8.0 or more and training runs in 16 bits;
    else, on such a GPU, PyTorch's own variable-length flash kernel where this torch has it (``varlen``:
    model/varlen_attention.py, the same packed attention without flash-attn); else PyTorch's SDPA (a
    masked kernel over each packed row). A T4 or V100 with flash-attn installed would fail at the first
    forward."""
    if capability is None:
        return "sdpa", "no GPU (flash-attn runs on CUDA only)"
    cap = ".".join(map(str, capability))
    if tuple(capability) < FLASH_ATTN_MIN_CAPABILITY:
        need = ".".join(map(str, FLASH_ATTN_MIN_CAPABILITY))
        what = f"flash-attn {installed}" if installed else "a flash kernel"
        return "sdpa", f"{what} needs compute capability {need} or more, this GPU has {cap}"
    if dtype not in (torch.float16, torch.bfloat16):
        what = "flash-attn" if installed else "a flash kernel"
        return "sdpa", f"{what} runs in fp16/bf16 only, training.precision is {str(dtype).removeprefix('torch.')}"
    if installed:
        return "flash_attention_2", f"flash-attn {installed} on compute capability {cap}"
    if varlen:
        return varlen_attention.NAME, f"flash-attn not installed: PyTorch's variable-length flash kernel on {cap}"
    return "sdpa", "flash-attn not installed"


ATTENTION_CHOICES = ("sdpa", varlen_attention.NAME, "flash_attention_2", "flex_attention", "eager")
# the variable-length flash kernels: all bins of a micro-batch in one row, no sequence × sequence mask
VARLEN_KERNELS = ("flash_attention_2", varlen_attention.NAME)


def forced_attention() -> str | None:
    """``TRAIN_ATTENTION`` where set (an environment's choice, like flash-attn's installation: it changes no
    parameter and reruns nothing), checked; else None."""
    forced = os.environ.get("TRAIN_ATTENTION")
    if forced and forced not in ATTENTION_CHOICES:
        raise UserError(f"TRAIN_ATTENTION={forced}: not one of {', '.join(ATTENTION_CHOICES)}")
    return forced or None


def flash_attn_version() -> str | None:
    """flash-attn's version if it imports (a build for another torch fails here, not at the first forward)."""
    try:
        import flash_attn

        return getattr(flash_attn, "__version__", None) or "installed"
    except ImportError:
        return None


def attention_implementation(device: torch.device, dtype: torch.dtype) -> str:
    """What ``choose_attention`` picks for this device, or ``TRAIN_ATTENTION`` where set (forced_attention)."""
    if forced := forced_attention():
        impl, reason = forced, "TRAIN_ATTENTION"
    else:
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        installed = flash_attn_version() if capability else None
        impl, reason = choose_attention(installed, capability, dtype, varlen_attention.available())
    if impl == varlen_attention.NAME:
        varlen_attention.register()
    log.info("attention: %s (%s)", impl, reason)
    return impl


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


def materialize(model, files: CheckpointFiles, seed: int, device: torch.device, tie: bool) -> None:
    """Give a meta-built model (sharded by FSDP, or whole) real storage on ``device`` and fill it:
    each rank reads only its own slice of every tensor, then recomputes non-persistent buffers.
    ``tie``: re-tie shared weights first (to_empty gave each tensor new storage: tied embeddings are
    two again; FSDP's sharded parameters stay as fully_shard made them)."""
    model.to_empty(device=device)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if tie:
        inner.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, index = local_index(param)
            if is_adapter(name):
                local.copy_(lora_init(name, param.shape, seed)[index])
            else:
                copy_rows(local, files, source_key(files, name, param.shape, inner), index)
        # non-persistent buffers (rotary inv_freq) are not in checkpoints: transformers' own init
        for module_name, module in inner.named_modules():
            if any(True for _ in module.buffers(recurse=False)):
                inner._init_weights(module)
                for buffer_name, buffer in module.named_buffers(recurse=False):
                    if not torch.isfinite(buffer).all():
                        raise RuntimeError(f"buffer {module_name}.{buffer_name} was not re-initialized")


def copy_rows(local: torch.Tensor, files: CheckpointFiles, key: str, index: tuple[slice, ...]) -> None:
    """local = the checkpoint tensor's ``index`` slice, read READ_BYTES at a time (a 150k-token embedding
    is 300 MB in bf16, which would otherwise be one more transient copy)."""
    if not index:
        local.copy_(files.read(key, index))
        return
    rows = index[0]
    row_bytes = max(1, local[:1].numel() * local.element_size())
    step = max(1, READ_BYTES // row_bytes)
    for at in range(rows.start, rows.stop, step):
        end = min(at + step, rows.stop)
        local[at - rows.start : end - rows.start].copy_(files.read(key, (slice(at, end), *index[1:])))


def source_key(files: CheckpointFiles, name: str, shape, inner) -> str:
    """The checkpoint tensor a parameter loads from; a one-line error when there is none or it differs."""
    key = checkpoint_name(name, files.names(), getattr(inner, "base_model_prefix", "model"))
    if key is None:
        raise UserError(
            f"{files.folder}: parameter {name} is not in the checkpoint (an unusual key layout;"
            " a checkpoint saved by transformers' save_pretrained loads)"
        )
    if tuple(files.shape(key)) != tuple(shape):
        raise UserError(f"{files.folder}: {key} has shape {list(files.shape(key))}, the model expects {list(shape)}")
    return key
