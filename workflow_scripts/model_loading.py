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

import contextlib
import hashlib
import json
import logging
import math
import os
import struct
from pathlib import Path

import torch
from pipeline_io import UserError
from strategies import compute_dtype, deepspeed_config, offloaded, quiet_deepspeed_collectives, shard_fsdp

log = logging.getLogger("train")

READ_BYTES = 64 * 2**20  # checkpoint bytes read per copy
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

    With FSDP the model comes back already sharded and filled, with ZeRO-3 already partitioned."""
    from fingerprint import local_model_folder
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = attention_implementation(device)
    config = AutoConfig.from_pretrained(base)
    files = CheckpointFiles(local_model_folder(base))
    how = sharded_load(cfg)
    if how == "zero3":
        model = zero3_model(config, cfg, attn)
        fill_partitions(model, files)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=load_dtype(cfg), attn_implementation=attn)
    # No KV cache in training: with one, transformers ignores the position ids when building the
    # attention mask, and packed sequences would attend to each other.
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.peft == "lora":
        model = add_lora(model, cfg, materialize=how == "zero3")
    if how != "zero3":
        if how == "meta":
            shard_fsdp(model, cfg, device)
        materialize(model, files, cfg, device)
    files.close()
    log.info("loaded %s from %s (%s)", type(model).__name__, files.folder, how or "one replica per rank")
    return model, attn


def zero3_model(config, cfg, attn: str):
    """The model created under zero.Init: each parameter is partitioned over the ranks as its module
    is created, in the load dtype, and not initialized (the checkpoint fills every partition).

    The model class is instantiated directly, in the contexts transformers' from_pretrained uses for
    ZeRO-3: from_config would also gather every module once to initialize its weights (a transient
    that measured 0.4x the fp32 model bytes per rank on a 0.6B model)."""
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    quiet_deepspeed_collectives()
    deepspeed.init_distributed()  # zero.Init partitions over DeepSpeed's view of the process group
    ds_config = deepspeed_config(cfg, dist.get_world_size(), config)
    _KEEP_ALIVE.append(HfDeepSpeedConfig(ds_config))  # transformers' is_deepspeed_zero3_enabled()
    config = AutoConfig.for_model(**config.to_dict() | {"attn_implementation": attn})
    default = torch.get_default_dtype()
    torch.set_default_dtype(load_dtype(cfg))
    try:
        zero_init = deepspeed.zero.Init(config_dict_or_path=ds_config)
        with no_init_weights(), prevent_arange_dtype_change(), no_init_broadcast(), zero_init:
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    finally:
        torch.set_default_dtype(default)
    model.tie_weights()  # as from_config does after construction: tied embeddings are one parameter
    return model


@contextlib.contextmanager
def no_init_broadcast():
    """zero.Init broadcasts every new parameter from rank 0 before partitioning it, so that random
    inits agree; ours are filled from the checkpoint afterwards, and the broadcast only costs each
    other rank a full-size receive buffer of every tensor (the embedding: 0.15x this 0.6B model's
    fp32 bytes). DeepSpeed 0.19's Init._zero_init_param, without the broadcast."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param

    def partition_only(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        Init._zero_init_param = original


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


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


class CheckpointFiles:
    """The base model's tensors by name, read from safetensors files (one file or an index) with
    positioned reads: a slice of rows, or a range of the flattened tensor, reads only its own bytes,
    and nothing is memory-mapped (mapped file pages would count in every rank's resident set)."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise UserError(
                f"{folder}: no model.safetensors or model.safetensors.index.json (sharded loading reads"
                " safetensors; convert the checkpoint with save_pretrained(safe_serialization=True))"
            )
        self.tensors = {}  # name -> (file descriptor, dtype, shape, offset of its first byte)
        for name in files:
            fd = os.open(folder / name, os.O_RDONLY)
            (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, size, 8))
            for key, meta in header.items():
                if key != "__metadata__":
                    dtype = SAFETENSORS_DTYPES[meta["dtype"]]
                    self.tensors[key] = (fd, dtype, tuple(meta["shape"]), 8 + size + meta["data_offsets"][0])

    def names(self) -> set[str]:
        return set(self.tensors)

    def close(self) -> None:
        for fd in {fd for fd, *_ in self.tensors.values()}:
            os.close(fd)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][2]

    def read_flat(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the flattened tensor."""
        fd, dtype, _, offset = self.tensors[name]
        item = torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(count * item, dtype=torch.uint8)
        view, at = memoryview(buf.numpy()), 0
        while at < len(view):
            got = os.preadv(fd, [view[at:]], offset + start * item + at)
            if got == 0:
                raise UserError(f"{self.folder}: {name} is cut short (a truncated safetensors file)")
            at += got
        return buf.view(dtype)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice ``index`` (one slice per dimension) of a tensor: its rows are read, the rest cut in memory."""
        shape = self.shape(name)
        if not shape:
            return self.read_flat(name, 0, 1).view(())
        rows, width = index[0], math.prod(shape[1:])
        block = self.read_flat(name, rows.start * width, (rows.stop - rows.start) * width)
        return block.view(rows.stop - rows.start, *shape[1:])[(slice(None), *index[1:])]


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


def materialize(model, files: CheckpointFiles, cfg, device: torch.device) -> None:
    """Give a meta-built model (sharded by FSDP, or whole) real storage on ``device`` and fill it:
    each rank reads only its own slice of every tensor, then recomputes non-persistent buffers."""
    model.to_empty(device=torch.device("cpu") if cfg.strategy == "fsdp" and offloaded(cfg, device) else device)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if cfg.strategy != "fsdp":
        inner.tie_weights()  # to_empty gave each tensor new storage: tied embeddings are two again
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, index = local_index(param)
            if is_adapter(name):
                local.copy_(lora_init(name, param.shape, cfg.seed)[index])
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


def fill_partitions(model, files: CheckpointFiles) -> None:
    """ZeRO-3: each rank copies its own partition (a range of the flattened tensor) from the files."""
    import torch.distributed as dist

    with torch.no_grad():
        for name, param in model.named_parameters():
            key = source_key(files, name, param.ds_shape, model)
            part = param.ds_tensor
            start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
            count = max(0, min(part.ds_numel, param.ds_numel - start))
            for at in range(start, start + count, READ_BYTES // part.element_size()):
                end = min(at + READ_BYTES // part.element_size(), start + count)
                part.data[at - start : end - start].copy_(files.read_flat(key, at, end - at))


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
