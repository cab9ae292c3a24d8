"""memory_probe: one rank's peak memory in training, by running the workflow's own training step on fake tensors.

The planner (preflight) calls this for DDP and FSDP2. The model is built from its config.json only
(no weight is read): the strategy's own load plan (``Strategy.build``: created on the meta device,
gradient checkpointing, LoRA, FSDP2's ``fully_shard`` and ``to_empty``) runs under
``torch._subclasses.fake_tensor.FakeTensorMode`` with stand-in weight files whose reads are fake
tensors, then the strategy wraps it and makes its optimizer (``parallel.build_strategy``) and the
trainer's own ``train_step`` (train/step.py) runs two optimizer steps (the second with Adam's states allocated) over
synthetic micro-batches of the configured shape: micro_batch_size × max_seq_len, grad_accum of them.
The process group is torch's fake one (``FakeStore``: any world size, no communication), so one
process stands for rank 0 of the configured world. torch's ``MemTracker`` (FSDP2: ``FSDPMemTracker``)
records the live tensor bytes and their peak by category: what the CPU allocator holds on a real run,
tensor for tensor (tests/test_memory_probe.py holds the two within 1% on a tiny model, 2 ranks).

Choices and traps:

- fake *CPU* tensors: fake CUDA tensors abort a CPU build of torch at the first autograd op, and the
  meta device makes SDPA store the sequence × sequence matrix. The attention is SDPA, as on a CPU.
- transformers cannot look into fake position ids, so it always builds the explicit block-diagonal mask
  of packed sequences; real packed bins hold several sequences and get the same mask, so the synthetic
  bins are two sequences each (padded examples: an attention mask with padding). SDPA keeps what it
  makes of the mask for the backward, a bf16 bias a layer (layers × micro_batch × S² × 2 bytes: 0.9 GB of
  23.1 at 4,096 tokens, 14 of 84 GB at 16,384 on an H200, Qwen3-0.6B's 28 layers), which a GPU with
  flash-attn or torch_varlen (model/varlen_attention.py) does not make: for those the probe runs
  ``attention="torch_varlen"``, whose fake kernel makes the tensors the real one does (the sequences' starts
  are not read from fake position ids: a sequence a row, the same sizes).
- DTensor's sharding propagation runs its own nested fake mode: the trackers skip those shadow tensors
  (torch 2.13's trackers compare the fake mode at entry).

What a strategy needs to run here is its own (parallel/: ``fake_probe`` says whether the probe runs it,
``probe_shims`` what torch needs patched, ``probe_prepare`` its wrapper's needs, ``probe_tracker`` torch's
tracker of its memory). What a GPU adds to the live tensors is stated in one place (plan_terms.py's
``GPU_CONSTANTS_GB``), and added by the planner: the CUDA context and NCCL's buffers; and the caching
allocator's headroom (a fraction of the peak: fragmentation and rounding), the strategy's
``allocator_headroom`` (parallel/).

The planner (preflight.probe_memory) runs ``probe`` in a forked child of its own process, bounded by
--probe-timeout.
"""

import contextlib
import dataclasses
import time

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from workflow_scripts.core.settings import PlanConfig
from workflow_scripts.plan.plan_terms import GPU_CONSTANTS_GB  # noqa: F401 (the planner's, for tests)

GB = 2**30
STEPS = 2  # optimizer steps probed: the second runs with the optimizer's states already allocated
ACTIVATIONS = ("Activation", "Temp", "Inputs")  # the tracker's categories of the step's activations
ACTIVATION_PEAK = "Activations peak"  # their own peak over the run (not the global peak's share)


class FakeFiles:
    """CheckpointFiles' stand-in: the names and shapes of the model's own state dict; a read is a new tensor
    of zeros of the requested slice's shape (fake under FakeTensorMode: no memory)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], folder: str):
        self.shapes, self.folder = shapes, folder

    def names(self) -> set[str]:
        return set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        full = self.shapes[name]
        size = [len(range(*s.indices(n))) for s, n in zip(index, full[: len(index)], strict=True)] + list(
            full[len(index) :]
        )
        return torch.zeros(size, dtype=torch.float32)

    def close(self) -> None:
        pass


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """The tensors save_pretrained would write for this config: the meta-built model's state dict."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class SyntheticData:
    """TrainingData's stand-in for train_step: grad_accum micro-batches of micro_batch_size rows of
    max_seq_len tokens, packed as two sequences per row (or padded examples with an attention mask)."""

    def __init__(self, cfg, seq_len: int, vocab: int):
        self.cfg, self.seq_len, self.vocab = cfg, seq_len, vocab

    def batch(self) -> tuple[dict, list[int]]:
        from workflow_scripts.train.batching import collate, collate_packed
        from workflow_scripts.train.objective import REFERENCE_KEY, cached_reference, pairs

        rows, s = self.cfg.micro_batch_size, self.seq_len
        if pairs(self.cfg):  # DPO: micro_batch_size pairs, a chosen and a rejected sequence each, in one forward
            rows *= 2
        half = max(1, s // 2)
        seq = lambda n: ([1 + i % (self.vocab - 1) for i in range(n)],) * 2  # noqa: E731
        if self.cfg.packing:
            batch = collate_packed([[seq(half), seq(s - half)] if s > 1 else [seq(s)] for _ in range(rows)], 0)
            return batch, [half, s - half] * rows
        batch = collate([seq(s)] + [seq(max(1, s - 1))] * (rows - 1), 0)  # padding in every row but the first
        if cached_reference(self.cfg):
            batch[REFERENCE_KEY] = torch.zeros(rows)  # the reference_logps stage's, one a sequence
        return batch, [s] + [max(1, s - 1)] * (rows - 1)

    before_micro = None  # called before each micro-batch (FSDPMemTracker's per-iteration reset)

    def micro_batches(self, step: int):
        for _ in range(self.cfg.grad_accum):
            if self.before_micro:
                self.before_micro()
            yield self.batch()


class NullMetrics:
    def count(self, lengths) -> None:
        pass

    def observe(self, found: dict) -> None:
        pass


def train_config(t: PlanConfig):
    """The trainer's TrainConfig from the planner's keys (settings.PlanConfig's), the rest at defaults."""
    from workflow_scripts.core.settings import TrainConfig, schema, training_config

    keys = set(schema()["properties"]["training"]["properties"]) & {f.name for f in dataclasses.fields(TrainConfig)}
    return training_config({k: v for k, v in dataclasses.asdict(t).items() if k in keys or k == "lora"})


@contextlib.contextmanager
def fake_world(world: int, strategy: type):
    """torch's fake process group of ``world`` ranks, this process rank 0, with ``strategy``'s shims."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with shims(strategy.probe_shims()):
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def shims(patched: dict):
    """What torch does not do under fake tensors by itself (the strategy's ``probe_shims``: functions that
    compute metadata with data-dependent tensor ops run on real tensors, cross-rank checks skipped, fp16's
    overflow test taken as no overflow): each ``(module, name)`` replaced by ``wrap(original)`` meanwhile."""
    saved = {where: getattr(*where) for where in patched}
    for (module, name), wrap in patched.items():
        setattr(module, name, wrap(saved[module, name]))
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


class FakeScalars(TorchDispatchMode):
    """A fake tensor read as a Python number (the step's ``float(grad_norm)``, the load's finite-buffer
    check, Adam's step count) has no value: a bool reads True, a number 1 (fp16's overflow test is
    shimmed: ``shims``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
            return True if args[0].dtype == torch.bool else (1.0 if args[0].is_floating_point() else 1)
        return func(*args, **(kwargs or {}))


def placed_on_fake(strategy: type, mode):
    """The strategy with its ``place`` (storage for the meta-built model, filled from the files) under the
    fake mode: the model is created and LoRA added on real meta tensors, as in training (a parameter
    created fake cannot be swapped for its storage by ``to_empty``)."""

    class Fake(strategy):
        @classmethod
        def place(cls, model, files, cfg, device):
            with mode, FakeScalars():
                strategy.place.__func__(cls, model, files, cfg, device)

    return Fake


class NoHook:
    def remove(self) -> None:
        pass


NO_HOOK = NoHook()


PROPAGATING = [0]  # > 0 while DTensor propagates sharding (propagation_untracked)


@contextlib.contextmanager
def propagation_untracked():
    """DTensor computes an op's output metadata by running it on tensors of the global shape, under the
    fake mode it finds active: the probe's own, so the trackers would count those shadow tensors (a
    whole-model-sized transient in the optimizer step). They are marked here and not tracked."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self, *args, **kwargs):
        PROPAGATING[0] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = marked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def tracker_for(strategy):
    """The strategy's torch tracker (``probe_tracker``: FSDPMemTracker around an FSDP2 model, it tells sharded
    from unsharded parameters and gradients; MemTracker with the model and optimizer registered otherwise),
    counting neither DTensor's shadow tensors nor every module's own peak."""
    return strategy.probe_tracker(tracked)


def tracked(base: type) -> type:
    """A torch memory tracker class (``base``) that skips DTensor's shadow tensors, keeps the global peak and
    the activations' own peak only, and takes frozen parameters (LoRA's base) as hooked."""

    class Tracker(base):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if PROPAGATING[0]:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        activation_peak = 0  # the largest activations (ACTIVATIONS' categories) at any moment

        def _update_peak_stats(self, peak_state) -> None:
            """The global peak only: torch's also walks every module's own peak on every op (most of
            the probe's time at billions of parameters), which the plan does not use; and the peak of
            the activations alone (what ZeRO's plan takes from a probe run without DeepSpeed)."""
            for dev, snap in self._curr_mem_snap.items():
                act = sum(v for k, v in snap.items() if getattr(k, "value", k) in ACTIVATIONS)
                self.activation_peak = max(self.activation_peak, act)
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            """MemTracker hooks every parameter's gradient, which a frozen one (LoRA's base) refuses: those
            are marked hooked with no hook."""
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                    self._param_to_grad_hook_handles[p] = (NO_HOOK, NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return Tracker


def run_steps(strategy, data, steps: int = STEPS) -> dict:
    """train_step ``steps`` times under the strategy's tracker: the peak's bytes by category and in all."""
    from workflow_scripts.train.step import train_step

    tracker = tracker_for(strategy)
    data.before_micro = tracker.reset_mod_stats  # module-wise stats only: the global peak stays
    strategy.model.train()
    with propagation_untracked(), tracker:
        for step in range(steps):
            train_step(strategy, data, step, NullMetrics())
    snap = tracker.get_tracker_snapshot("peak")
    device = next(iter(snap))
    peak = {getattr(k, "value", str(k)): int(v) for k, v in snap[device].items()}
    return peak | {ACTIVATION_PEAK: int(tracker.activation_peak)}


def categories(peak: dict) -> dict:
    """The tracker's categories folded into the plan's components (bytes)."""
    fold = {
        "params": ("Parameter", "Sharded Param", "Unsharded Param"),
        "grads": ("Gradient", "Sharded Grad", "Unsharded Grad"),
        "optimizer": ("Optstate", "OptState"),
        "activations": ACTIVATIONS,
        "buffers": ("Buffer", "All Gather", "Reduce Scatter"),
    }
    out = {k: sum(peak.get(n, 0) for n in names) for k, names in fold.items()}
    out["other"] = peak.get("Total", 0) - sum(out.values())
    return out


def measure(config, t: PlanConfig, steps: int = STEPS, mode=None, attention: str = "sdpa") -> dict:
    """The tracker's peak by category (bytes) over ``steps`` optimizer steps of the planner's config ``t``,
    in the process group that is up: on fake tensors under ``mode`` (a FakeTensorMode), else on real ones
    (the weights zeros: memory does not depend on them). ``attention``: sdpa, or torch_varlen for a GPU
    whose training runs a variable-length flash kernel (its fake kernel: the same tensors, no mask)."""
    from workflow_scripts.model import varlen_attention
    from workflow_scripts.train.parallel import build_strategy, strategy_for

    if attention == varlen_attention.NAME:
        varlen_attention.register()
    cfg = train_config(t)
    device = torch.device("cpu")
    files = FakeFiles(checkpoint_shapes(config), "(config.json only)")
    strategy_class = strategy_for(cfg.strategy)
    if mode is None:
        model = strategy_class.build(config, cfg, attention, files, device)
        strategy = build_strategy(cfg, model, device, total_steps=steps)
        return run_steps(strategy, SyntheticData(cfg, t.max_seq_len, config.vocab_size), steps)
    model = placed_on_fake(strategy_class, mode).build(config, cfg, attention, files, device)
    # DDP moves the model to its device, where it is: a fake parameter would be swapped for itself
    model.to = lambda *args, **kwargs: model
    with mode, FakeScalars():
        strategy = build_strategy(cfg, model, device, total_steps=steps)
        strategy.probe_prepare()  # DDP: its all-reduce in place, its first buckets kept
        return run_steps(strategy, SyntheticData(cfg, t.max_seq_len, config.vocab_size), steps)


def probe(config, t: PlanConfig, world: int, steps: int = STEPS, attention: str = "sdpa") -> dict:
    """Rank 0's peak in training for the planner's config ``t`` at ``world`` ranks, on fake tensors (bytes),
    with the ``attention`` the GPUs run (planned_attention: sdpa or torch_varlen)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from workflow_scripts.train.parallel import STRATEGIES, strategy_for

    strategy = strategy_for(t.strategy)
    if not strategy.fake_probe:
        runs = ", ".join(name for name, s in STRATEGIES.items() if s.fake_probe)
        raise ValueError(f"training.strategy {t.strategy}: no fake-tensor path (only {runs})")
    start = time.perf_counter()
    with fake_world(world, strategy):
        peak = measure(config, t, steps, FakeTensorMode(allow_non_fake_inputs=True), attention)
    return {
        "peak_bytes": peak["Total"],
        "activations_peak_bytes": peak[ACTIVATION_PEAK],
        "components_bytes": categories(peak),
        "tracker_categories_bytes": peak,
        "world_size": world,
        "steps": steps,
        "attention": attention,
        "seconds": round(time.perf_counter() - start, 2),
    }
