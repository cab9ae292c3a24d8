"""What every parallelization strategy shares, and the seams each one fills.

A strategy is one class (one module of this package) that knows, for its way of spreading a model
over ranks:

- the load plan (classmethods, before it exists): the dtype the base weights are kept in, how the
  model is created (``create``: on the meta device by default) and filled from the safetensors files
  (``place``), so that no rank holds a full fp32 copy it does not train;
- training (an instance: ``__init__`` wraps the model and makes the optimizer and schedule):
  ``forward_backward`` per micro-batch, ``step`` per optimizer step, ``save``/``load`` of its own
  native checkpoint (checkpoint.Checkpointer decides when; ``load`` reshards one saved at another
  world size), what of its settings keys a checkpoint (``key_extra``);
- the export reader consolidation reads that checkpoint through (``export_source``);
- its process group's backend (``process_group_backend``: train.py starts it);
- its memory terms for the planner (preflight): which of weights, gradients and optimizer states
  it shards, what it holds on the host at load and in training, its own GPU terms beside the
  formula's and the probe's (``unsharded_gradient_bytes``, ``probed_components``), and what to try
  when it does not fit (``sharded_alternative``, ``proposals``);
- its part in the fake-tensor probe (memory_probe.py): whether the probe runs it (``fake_probe``),
  what torch needs patched to run it on fake tensors (``probe_shims``), what its wrapper needs
  after it is built (``probe_prepare``) and which torch tracker counts its memory (``probe_tracker``).

The base class holds AdamW (no decay on norms and biases), the lr schedule and the clipped step.
"""

import dataclasses
import logging
import math
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

from workflow_scripts.core.settings import PlanConfig
from workflow_scripts.model.model_loading import add_lora, attention_implementation, materialize
from workflow_scripts.model.weights import DTYPES, CheckpointFiles
from workflow_scripts.train import chunked_loss
from workflow_scripts.train.objective import objective_for

log = logging.getLogger("train")


def compute_dtype(cfg) -> torch.dtype:
    return DTYPES[cfg.precision]


def compute_bytes(t: PlanConfig) -> int:
    """Bytes per weight in the compute dtype (training.precision): 2 in bf16 and fp16, 4 in fp32."""
    return DTYPES[t.precision].itemsize


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


@dataclasses.dataclass(frozen=True)
class Footprint:
    """A training run as the planner (preflight) sees it: parameter counts and ranks. ``c`` is the
    compute dtype's bytes per weight; the trainable parameters are all of them, or the LoRA adapters'."""

    params: int
    trainable: int
    largest_layer: int  # the parameters of the largest module (its own, not its children's)
    c: int
    procs: int  # ranks per node
    world: int

    @property
    def nodes(self) -> int:
        return self.world // self.procs

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


# The training keys of a strategy that loads partitions rather than a replica per rank (host advice).
SHARDED_LOAD = {"strategy": "deepspeed", "zero_stage": 3}


def change_keys(change: dict) -> str:
    """A proposal's config change as the refusal names it: ``training.key: value, ...``."""
    return ", ".join(f"training.{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items())


def on_real_tensors(fn):
    """``fn`` run outside the fake mode (the probe's shims: metadata computed with data-dependent ops)."""

    def wrapper(*args, **kwargs):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapper


def skipped(fn):
    """``fn`` not run at all (the probe's shims: a cross-rank check with nothing to check on fake tensors)."""
    return lambda *args, **kwargs: None


def stepped(fn):
    """GradScaler's overflow test skipped: the optimizer steps (the probe's shims: found_inf has no value)."""

    def no_overflow(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    return no_overflow


class Strategy:
    """A strategy: see the module docstring. A subclass wraps the model, runs micro-batches and
    saves/loads; its classmethods are its load plan, export reader and memory terms."""

    model: torch.nn.Module
    scaler = None  # a GradScaler with fp16
    skipped = 0  # optimizer steps fp16 skipped for overflowing gradients
    # what its ranks import beside ranks.RANK_IMPORTS (ranks.py imports them once, before it forks the ranks)
    rank_imports: tuple[str, ...] = ()
    offloads = True  # training.offload applies
    # The planner's allocator headroom: what the CUDA caching allocator reserves above the live tensor peak
    # (fragmentation, block rounding), a fraction of that peak. DDP measured 6% on an H200 (docs/benchmarks/gpu.md,
    # "GPU checklist"); ZeRO has not been measured on a GPU.
    allocator_headroom = 0.10

    def __init__(self, cfg, device, total_steps: int):
        self.cfg, self.device, self.total_steps = cfg, device, total_steps
        self.objective = objective_for(cfg)  # what a micro-batch's loss is (training.objective)

    @classmethod
    def process_group_backend(cls, cfg, device_type: str) -> str:
        """torch.distributed's backend for this strategy's process group: gloo on CPU, NCCL on GPUs."""
        return "nccl" if device_type == "cuda" else "gloo"

    @classmethod
    def unmet(cls, report: dict) -> list[str]:
        """What keeps this strategy from running on a machine (check_environment's report), one line each."""
        return []

    # ------------------------------------------------------------ load plan

    @classmethod
    def load_dtype(cls, cfg) -> torch.dtype:
        """The dtype the base weights are kept in while training: the fp32 master weights of a full
        fine-tuning, a LoRA's frozen base in the compute dtype."""
        return compute_dtype(cfg) if cfg.peft == "lora" else torch.float32

    @classmethod
    def sharded_load(cls, cfg) -> str | None:
        """How this config loads without a full replica per rank ("meta", "zero3"), or None."""
        return None

    @classmethod
    def load_model(cls, base: str, cfg, device: torch.device):
        """The model, ready for this strategy: (model, attention implementation)."""
        from transformers import AutoConfig

        from workflow_scripts.core.fingerprint import local_model_folder

        attn = attention_implementation(device, compute_dtype(cfg))
        config = AutoConfig.from_pretrained(base)
        files = CheckpointFiles(local_model_folder(base))
        model = cls.build(config, cfg, attn, files, device)
        files.close()
        how = cls.sharded_load(cfg) or "one replica per rank"
        log.info("loaded %s from %s (%s)", type(model).__name__, files.folder, how)
        return model, attn

    @classmethod
    def build(cls, config, cfg, attn: str, files, device: torch.device):
        """The model from its config and weight files (the planner's memory probe passes stand-in files
        under fake tensors): created, prepared for training, LoRA added, placed on ``device``."""
        model = cls.create(config, cfg, attn, files)
        # No KV cache in training: with one, transformers ignores the position ids when building the
        # attention mask, and packed sequences would attend to each other.
        model.config.use_cache = False
        if cfg.chunked_loss:
            chunked_loss.install(model)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.peft == "lora":
            model = add_lora(model, cfg, materialize=cls.filled_on_creation(cfg))
        cls.place(model, files, cfg, device)
        return model

    @classmethod
    def create(cls, config, cfg, attn: str, files: CheckpointFiles):
        """The model before LoRA: on the meta device, filled by ``place``."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=cls.load_dtype(cfg), attn_implementation=attn)

    @classmethod
    def filled_on_creation(cls, cfg) -> bool:
        """Whether ``create`` gave the model its weights (then LoRA's adapters are initialized as added)."""
        return False

    @classmethod
    def place(cls, model, files: CheckpointFiles, cfg, device: torch.device) -> None:
        """Give the meta-built model storage on ``device`` and fill it from the files."""
        materialize(model, files, cfg.seed, device, tie=True)

    # ------------------------------------------------------------ training

    def param_groups(self, params) -> list[dict]:
        """The trainable parameters: weight decay on matrices, none on norms and biases."""
        params = [p for p in params if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        return [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        groups = self.param_groups(params)
        fused = self.device.type == "cuda" or None
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=tuple(self.cfg.adam_betas), fused=fused)

    def make_scheduler(self, optimizer) -> LambdaLR:
        return LambdaLR(optimizer, lr_lambda(self.cfg, self.total_steps))

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model inside the strategy's wrapper (the PeftModel with LoRA): what a forward bypassing the
        wrapper runs, as the DPO reference with its adapters disabled."""
        return self.model

    def compute_loss(self, batch: dict) -> torch.Tensor:
        """A micro-batch's loss through the wrapped model: its objective's (SFT: the model's own loss)."""
        return self.objective.loss(self.model, self.unwrapped, batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.cfg.grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def eval_loss(self, batch) -> torch.Tensor:
        """A batch's mean loss in a forward pass only (the caller holds torch.no_grad and model.eval())."""
        return self.model(**batch).loss

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

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ------------------------------------------------------------ checkpoint

    def key_extra(self, base_model: str) -> str | None:
        """What besides the training config, data and base model keys this strategy's checkpoints
        (checkpoint.run_key): the DeepSpeed JSON's content, for every strategy as it always was."""
        from workflow_scripts.core.fingerprint import optional_file_sha256

        return optional_file_sha256(self.cfg.deepspeed_config)

    def extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()} | (
            {"scaler": self.scaler.state_dict(), "skipped": self.skipped} if self.scaler else {}
        )

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])
            self.skipped = state["skipped"]

    def save(self, folder: Path, writes) -> None:
        """Write this rank's part of the checkpoint into ``folder``, through ``writes`` (manifest.Writes:
        each file hashed as it is written) wherever the library lets us hand it the stream."""
        raise NotImplementedError

    def load(self, folder: Path, saved_world: int) -> dict:
        """Load ``folder``, saved by ``saved_world`` ranks: at another world size than this job's the
        state is resharded (DDP's is world-size free, DCP reshards FSDP2's, DeepSpeed loads a universal
        copy). Returns what plan.json's ``resharded_from`` adds about how ({} for nothing)."""
        raise NotImplementedError

    @classmethod
    def export_source(cls, folder: Path, shapes: dict[str, torch.Size], exclude_frozen: bool):
        """The reader consolidation takes this strategy's final checkpoint through (weights.stream reads it)."""
        raise NotImplementedError

    # ------------------------------------------------------------ memory terms (preflight)

    @classmethod
    def shards(cls, t: PlanConfig) -> tuple[bool, bool, bool]:
        """Whether the weights, the gradients and the optimizer states are sharded over the world."""
        return False, False, False

    @classmethod
    def host_load_bytes(cls, t: PlanConfig, f: Footprint, largest_file: int) -> float:
        """Host bytes per node as the trainer builds the model: by default one full replica passes
        through host memory per rank (the trainable weights in fp32, the frozen ones in c)."""
        return f.procs * cls.replica_bytes(f)

    @classmethod
    def replica_bytes(cls, f: Footprint) -> float:
        return f.frozen * f.c + f.trainable * 4

    @classmethod
    def offloaded_bytes(cls, t: PlanConfig, f: Footprint) -> float:
        """Host bytes per node that CPU offload holds in training."""
        return 0.0

    @classmethod
    def unsupported(cls, t: PlanConfig) -> str | None:
        """A planner key this strategy cannot apply, as a one-line error, or None."""
        if t.offload_ratio < 1:
            ratio, name = t.offload_ratio, t.strategy
            return f"training.offload_ratio {ratio} applies to DeepSpeed ZeRO-3 with offload, not {name}"
        return None

    @classmethod
    def model_states(cls, t: PlanConfig, layout, world: int) -> dict | None:
        """Per-rank bytes of what this strategy keeps by its own arithmetic (``gpu`` and ``host`` components),
        for a strategy the fake-tensor probe cannot run; None where the probe runs the real step. ``layout()``
        gives the model's parameters (parallel/zero_memory.Layout)."""
        return None

    @classmethod
    def unsharded_gradient_bytes(cls, t: PlanConfig, trainable: int) -> int:
        """The formula's per-GPU bytes of gradients held unsharded beside ``shards``' (none by default)."""
        return 0

    @classmethod
    def probed_components(cls, t: PlanConfig, probed: dict) -> tuple[dict, str]:
        """The GPU's share of the probe's components (bytes), and what the plan's ``method`` adds about it:
        all of them by default (what the probe tracked is on the GPU)."""
        return dict(probed["components_bytes"]), ""

    @classmethod
    def proposals(cls, t: PlanConfig, attempt) -> list[dict]:
        """The changes to this strategy it offers a config ``t`` (of any strategy) that does not fit, each
        re-planned by ``attempt(label, change)`` (proposals.py: in STRATEGIES' order, after the sharded
        alternative). None by default."""
        return []

    # ------------------------------------------------------------ the fake-tensor probe (memory_probe.py)

    fake_probe = False  # whether memory_probe runs this strategy's training step on fake tensors

    @classmethod
    def probe_shims(cls) -> dict:
        """What torch needs patched to run this strategy on fake tensors: {(module, name): wrap}, the
        attribute replaced by ``wrap(original)`` while the probe runs. fp16's loss scaler: its overflow test
        reads found_inf (no value), so the step is taken as an overflow-free real step, which allocates the
        optimizer's states."""
        from torch.amp.grad_scaler import GradScaler

        return {(GradScaler, "_maybe_opt_step"): stepped}

    def probe_prepare(self) -> None:
        """What the wrapped model needs, under the fake mode, before the probe runs its steps (nothing)."""

    def probe_tracker(self, tracked):
        """torch's memory tracker of this strategy's step: ``tracked(cls)`` is memory_probe's subclass of a
        torch tracker class; by default MemTracker with the model and optimizer registered."""
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = tracked(MemTracker)()
        tracker.track_external(self.model, self.optimizer)
        return tracker

    @classmethod
    def probe_config(cls, t: PlanConfig) -> PlanConfig:
        """The planner keys the fake-tensor probe runs: this config itself, where the probe runs it."""
        return t

    @classmethod
    def sharded_alternative(cls, t: PlanConfig) -> dict | None:
        """The training keys of a strategy that loads partitions instead of this one's replica per rank
        (None: this one already does)."""
        return None
