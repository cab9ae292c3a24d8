"""Parallelization strategies behind one small interface.

Each strategy owns the wrapped model, the optimizer and the lr scheduler, and knows
how to run one micro-batch, take an optimizer step, and save/load its own native
checkpoint (consolidate.py turns those into Hugging Face folders). The base class
holds what they share: AdamW, the lr schedule, the clipped step.

- ``ddp``: DistributedDataParallel; rank 0 writes ``state.pt``.
- ``fsdp``: FSDP2 ``fully_shard`` per decoder layer and on the root; a
  torch.distributed.checkpoint folder ``dcp/``.
- ``deepspeed``: ZeRO 1-3 with optional CPU offload; DeepSpeed's own checkpoint.
"""

import contextlib
import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(cfg) -> torch.dtype:
    return DTYPES[cfg.precision]


def offloaded(cfg, device: torch.device) -> bool:
    """FSDP2 CPU offload (DeepSpeed reads training.offload itself); on a CPU run there is nothing to offload to."""
    return cfg.offload != "none" and device.type == "cuda"


def loss_scaler(cfg, device, sharded: bool):
    """fp16: dynamic loss scaling (a step whose gradients overflow is skipped and the scale halved).
    FSDP's gradients are sharded, so its scaler agrees on overflow over all ranks."""
    if cfg.precision != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def lr_lambda(cfg, total_steps: int):
    """The learning-rate factor of each step: linear warmup, then cosine, linear or constant decay
    to min_lr_ratio."""
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


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks, found by the class names transformers marks as unsplittable."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"no decoder layers found in {type(base).__name__} (looked for {sorted(names)})")
    return layers


def trainable_state_dict(model) -> dict:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


class Strategy:
    """What every strategy shares: AdamW (no decay on norms and biases), the lr schedule, the
    clipped optimizer step. A subclass wraps the model, runs micro-batches and saves/loads."""

    model: torch.nn.Module
    scaler = None  # a GradScaler with fp16
    skipped = 0  # optimizer steps fp16 skipped for overflowing gradients

    def __init__(self, cfg, device, total_steps: int):
        self.cfg, self.device, self.total_steps = cfg, device, total_steps

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        params = [p for p in params if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = self.device.type == "cuda" or None
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=tuple(self.cfg.adam_betas), fused=fused)

    def make_scheduler(self, optimizer) -> LambdaLR:
        return LambdaLR(optimizer, lr_lambda(self.cfg, self.total_steps))

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.cfg.grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> float:
        """Clip the gradients by global norm, step, advance the schedule; the norm before clipping.
        With fp16, a step whose gradients overflowed is skipped (and counted)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.skipped += int(self.scaler.get_scale() < scale)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def loss_scale_stats(self) -> dict:
        """fp16's loss scale and the optimizer steps skipped so far for overflowing gradients."""
        if self.cfg.precision != "fp16":
            return {}
        return {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped}

    def extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()} | (
            {"scaler": self.scaler.state_dict(), "skipped": self.skipped} if self.scaler else {}
        )

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])
            self.skipped = state["skipped"]

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


class DDPStrategy(Strategy):
    def __init__(self, cfg, model, device, total_steps):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(cfg, device, total_steps)
        self.inner = model.to(device)
        self.model = DistributedDataParallel(self.inner, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = self.make_optimizer(self.inner.parameters())
        self.scheduler = self.make_scheduler(self.optimizer)
        self.autocast = torch.autocast(device.type, dtype=compute_dtype(cfg), enabled=cfg.precision != "fp32")
        self.scaler = loss_scaler(cfg, device, sharded=False)

    def forward_backward(self, batch, last_micro: bool):
        sync = contextlib.nullcontext() if last_micro else self.model.no_sync()
        with sync:
            with self.autocast:
                loss = self.model(**batch).loss
            self.backward(loss)
        return loss

    def save(self, folder: Path) -> None:
        if dist.get_rank() == 0:
            state = {
                "model": trainable_state_dict(self.inner),
                "optimizer": self.optimizer.state_dict(),
                **self.extra_state(),
            }
            torch.save(state, folder / "state.pt")

    def load(self, folder: Path) -> None:
        state = torch.load(folder / "state.pt", map_location=self.device, weights_only=True)
        # only trainable tensors are saved; tied weights appear once in named_parameters
        needed = {n for n, p in self.inner.named_parameters() if p.requires_grad}
        _, unexpected = self.inner.load_state_dict(state["model"], strict=False)
        lacking = sorted(needed - set(state["model"]))
        if unexpected or lacking:
            raise RuntimeError(f"{folder / 'state.pt'}: does not match the model ({unexpected[:2]} {lacking[:2]})")
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_extra_state(state)


def fsdp_kwargs(cfg, device) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    return {
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype(cfg), reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if offloaded(cfg, device) else OffloadPolicy(),
    }


def shard_fsdp(model, cfg, device) -> None:
    """FSDP2: ``fully_shard`` each decoder block, then the root. A model on the meta device stays
    there (model_loading fills it); a materialized one moves to the device one block at a time."""
    from torch.distributed.fsdp import fully_shard

    kwargs = fsdp_kwargs(cfg, device)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


class FSDPStrategy(Strategy):
    def __init__(self, cfg, model, device, total_steps):
        from torch.distributed.fsdp import FSDPModule

        super().__init__(cfg, device, total_steps)
        if not isinstance(model, FSDPModule):  # model_loading shards while loading; tests pass whole models
            shard_fsdp(model, cfg, device)
        self.model = model
        self.optimizer = self.make_optimizer(model.parameters())
        self.scheduler = self.make_scheduler(self.optimizer)
        self.scaler = loss_scaler(cfg, device, sharded=True)

    def forward_backward(self, batch, last_micro: bool):
        self.model.set_requires_gradient_sync(last_micro)
        loss = self.model(**batch).loss
        self.backward(loss)
        return loss

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.cfg.peft != "none")

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(folder / "dcp"))
        if dist.get_rank() == 0:
            torch.save(self.extra_state(), folder / "scheduler.pt")

    def load(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self._options(),
        )
        self.load_extra_state(torch.load(folder / "scheduler.pt", weights_only=True))


def hidden_size(config) -> int | None:
    """The model's hidden size, found as transformers' DeepSpeed integration finds it (the largest of
    ``hidden_sizes``, or the text model's for a multimodal config); None if it has none."""
    for c in (config, getattr(config, "text_config", None)):
        if getattr(c, "hidden_size", None):
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


def layer_parameters(config) -> int | None:
    """One decoder layer's weights in a Llama/Qwen-style config (attention at its q and kv widths, a gated
    MLP); None for another layout (mixture of experts, no such fields)."""
    c = getattr(config, "text_config", None) or config
    if getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None):
        return None
    h, heads, ffn = (getattr(c, k, None) for k in ("hidden_size", "num_attention_heads", "intermediate_size"))
    if not all(isinstance(v, int) for v in (h, heads, ffn)):
        return None
    head, kv = getattr(c, "head_dim", None) or h // heads, getattr(c, "num_key_value_heads", None) or heads
    return h * head * (2 * heads + 2 * kv) + 3 * h * ffn


def zero_buffer_sizes(stage: int, config) -> dict:
    """ZeRO's buffer sizes (in elements) scaled to the model, as transformers fills DeepSpeed's "auto"
    values, plus ZeRO-3's sub-group and reuse window. DeepSpeed's defaults are sized for big GPUs, not
    for one layer, and on the CPU accelerator each is host memory. Per rank, h the hidden size, n the
    parameters, N the ranks (docs/benchmarks.md measures them on a 0.6B model, 2 ranks, bf16):

    - ``reduce_bucket_size`` h² (default 5e8): gradients are copied into a bucket of this many
      elements in the compute dtype, all-reduced whole, and this rank's slices added to its gradient
      partition; the bucket is kept for the whole run. Default: up to 5e8 x 2 bytes (1 GB) touched;
      here 2 h² bytes (2 MB at h = 1024). A larger gradient (the embedding) is reduce-scattered alone.
    - ``sub_group_size`` (ZeRO-3) 10 h² (default 1e9): the fp32 master partition is split into groups
      of about this many elements and the optimizer steps one group at a time. What ``initialize``
      and the step allocate besides the states is one group's size: the fp32 cast of the bf16
      partition before its clone (initialize), a zeroed fp32 gradient buffer (initialize), the
      group's gradients flattened and cast to fp32 for AdamW and AdamW's ``sqrt``/division
      temporaries (step: 3 x 4 bytes a group element at once). With the default the whole partition
      (n / N elements) is one group: 12 n / N bytes at once in the step, 8 n / N in initialize.
      10 h² is two thirds of a Qwen3 layer; a single larger tensor (the embedding) is a group of its own.
    - ``stage3_prefetch_bucket_size`` 0.9 h² (default 5e7): parameters gathered ahead of use.
    - ``stage3_param_persistence_threshold`` 10 h (default 1e5): tensors this small (norms, biases)
      stay gathered on every rank.
    - ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` two decoder layers
      (layer_parameters; defaults 1e9, kept for other layouts): once the first step has traced the
      module order, a gathered parameter used again within this many elements is kept gathered, and
      prefetching stops at this many. Two layers hold the one computing and the next, and a layer's
      recompute and backward under gradient checkpointing, as FSDP2 keeps one block unsharded at a
      time; at 32B (487M a layer) it is about the default, while with the default a model under 1e9
      parameters (the 0.6B proxy) stays gathered in the compute dtype after the first step.

    None of these changes a step's arithmetic: the same elementwise sums and updates in the same
    dtypes, grouped differently (the gradient norm is summed per sub-group, so its last bits depend
    on the grouping; a run and its resume use the same sizes). A checkpoint's optimizer state is
    saved per sub-group: the ZeRO section is part of the checkpoint key (train.checkpoint_folder)."""
    hidden, layer = hidden_size(config), layer_parameters(config)
    if hidden is None:  # DeepSpeed's defaults (training.deepspeed_config can set them)
        return {}
    sizes = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        sizes |= {
            "sub_group_size": 10 * hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        }
    if stage == 3 and layer:
        sizes |= {"stage3_max_live_parameters": 2 * layer, "stage3_max_reuse_distance": 2 * layer}
    return sizes


def quiet_deepspeed_collectives() -> None:
    """DeepSpeed 0.19 calls torch.distributed's deprecated ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor``, and the warning repeats on every call (something in each step resets
    Python's once-per-location registry): with layer-sized buckets, hundreds of lines a step."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def deepspeed_config(cfg, world_size: int, model_config) -> dict:
    """DeepSpeed JSON from our config, on top of a user-supplied one when given; ZeRO's buffer sizes
    from the model's shape (zero_buffer_sizes) where that JSON does not set them."""
    base = json.loads(Path(cfg.deepspeed_config).read_text()) if cfg.deepspeed_config else {}
    zero = {"stage": cfg.zero_stage, **base.get("zero_optimization", {})}
    for key, size in zero_buffer_sizes(zero["stage"], model_config).items():
        if zero.get(key, "auto") == "auto":  # unset, or transformers' "auto"
            zero[key] = size
    if cfg.offload in ("optimizer", "all"):
        zero.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": True})
    if cfg.offload == "all" and cfg.zero_stage == 3:
        zero.setdefault("offload_param", {"device": "cpu", "pin_memory": True})
    return base | {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world_size,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        # dynamic loss scaling (loss_scale 0), as torch's GradScaler: start at 2^16, halve on overflow
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedStrategy(Strategy):
    def __init__(self, cfg, model, device, total_steps):
        import deepspeed

        super().__init__(cfg, device, total_steps)
        quiet_deepspeed_collectives()
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=self.make_optimizer(model.parameters()),
            lr_scheduler=self.make_scheduler,
            config=deepspeed_config(cfg, dist.get_world_size(), model.config),
        )

    def forward_backward(self, batch, last_micro: bool):
        # the engine scales by gradient_accumulation_steps and steps at the boundary
        loss = self.model(**batch).loss
        self.model.backward(loss)
        self.model.step()
        return loss

    def step(self) -> float:
        """The engine clipped and stepped at the last micro-batch's boundary; its norm."""
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def loss_scale_stats(self) -> dict:
        if self.cfg.precision != "fp16":
            return {}
        return {"loss_scale": float(self.optimizer.cur_scale), "skipped_steps": int(self.model.skipped_steps)}

    def save(self, folder: Path) -> None:
        self.model.save_checkpoint(
            str(folder.parent), tag=folder.name, exclude_frozen_parameters=self.cfg.peft != "none"
        )

    def load(self, folder: Path) -> None:
        path, _ = self.model.load_checkpoint(
            str(folder.parent), tag=folder.name, load_module_strict=self.cfg.peft == "none"
        )
        if path is None:
            raise RuntimeError(f"{folder}: DeepSpeed could not load this checkpoint")


STRATEGIES = {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "deepspeed": DeepSpeedStrategy}


def build_strategy(cfg, model, device, total_steps: int) -> Strategy:
    return STRATEGIES[cfg.strategy](cfg, model, device, total_steps)
