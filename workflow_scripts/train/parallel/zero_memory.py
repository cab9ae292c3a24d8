"""ZeRO's memory terms for the planner, per rank, read from DeepSpeed 0.19's own source rather than from its
estimators (``estimate_zero3_model_states_mem_needs`` counts offloaded gradients on the GPU, leaves out the
bf16 gradient partition on the host and the pinned blocks' rounding, and hedges with a 1.5 buffer factor).

ZeRO-3 (``runtime/zero/stage3.py``, ``partition_parameters.py``), each trainable parameter of n elements
has a partition of ceil(n / N) elements on each of the N ranks; the optimizer's parameter groups (decay,
no decay) are cut into sub-groups of at least ``sub_group_size`` partition elements, as
``_create_fp16_sub_groups`` does (zero_buffer_sizes sets 10 h²):

- GPU, no offload: the bf16 partitions (c per element), the bf16 gradient partition
  (``grad_partitions_flat_buffer``, in the gradient accumulation dtype, which is the model's), the fp32
  master and Adam's two moments (4 + 8) and one fp32 gradient buffer of the largest sub-group
  (``initialize_optimizer_states``' ``gradient_buffer``, shared by the sub-groups); in fp32 the master is
  the parameter partition itself (``_create_fp32_partitions`` copies only when the dtype or the device
  differs), so 8 bytes an element;
- with ``offload_optimizer`` (cpu): the gradient partition lives on the host, pinned, one block; each
  sub-group's fp32 master, fp32 gradient (pinned, one block per sub-group) and Adam's moments live on the
  host, except with ``offload_optimizer.ratio`` r < 1 (training.offload_ratio): the first
  int((1 - r) × sub-groups) sub-groups stay on the GPU, 16 bytes an element there (master, gradient,
  moments), stepped by a torch AdamW (``backup_optimizer``), the rest on the host, stepped by
  DeepSpeedCPUAdam; the pinned gradient block of a GPU sub-group is made on the host first and stays
  in torch's pinned cache (one block of that size is reused);
- with ``offload_param`` (offload: all) the bf16 partitions live on the host, pinned, one block per
  parameter group (``param_groups_fp16_flat_cpu_memory``); a frozen parameter's (LoRA's base) is
  pinned on its own (``partition_parameters``);
- on the GPU besides: the parameters gathered for compute (``stage3_max_live_parameters``, two decoder
  layers, plus the largest parameter: the embedding or head is gathered whole), the reduce bucket
  (h² elements) and the largest parameter's full gradient (a gradient larger than the bucket is
  reduced alone), and the small parameters every rank keeps whole (``param_persistence_threshold``).
- NVMe (``offload_optimizer.device: nvme``): the sub-groups' states are swapped to disk; the host keeps
  the pinned gradient partition, ``buffer_count`` (4) pinned swap buffers of the largest sub-group and
  one fp32 gradient buffer of that size.

ZeRO's buffer sizes scaled to the model (``zero_buffer_sizes``, which the trainer's DeepSpeed config takes)
live here too, as the planner reads them.

ZeRO-1/2 (``stage_1_and_2.py``): every rank holds the bf16 weights; the fp32 master and Adam's moments
are partitioned (flat, one partition per parameter group); gradients are whole (stage 1) or partitioned
(stage 2); with offload the master partition, a bf16 copy of it and the fp32 gradient partition are
pinned on the host, with Adam's moments, plus a pinned bf16 buffer of the largest parameter.

torch rounds each pinned block up to a power of two (``CachingHostAllocator``: ``PowerOf2Ceil`` with
the default ``pinned_max_round_threshold``), so each pinned block is counted at its rounded size
(``pinned``) and the rounding is shown as its own component. training.offload_pin_memory false
(offload_optimizer.pin_memory) leaves the optimizer's buffers unpinned: no rounding there (the
parameters' offload_param blocks stay pinned).
"""

import dataclasses
import math

from workflow_scripts.core.settings import PlanConfig

GB = 2**30
ADAM = 8  # Adam's two fp32 moments, bytes per element
MASTER = 4  # the fp32 master weight
SWAP_BUFFERS = 4  # offload_optimizer.buffer_count (DeepSpeed's default): NVMe swap buffers


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
    parameters, N the ranks (docs/benchmarks/training-and-memory.md measures them on a 0.6B model, 2 ranks, bf16):

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


def pinned(nbytes: float) -> int:
    """Bytes torch's pinned-memory allocator takes for a block of ``nbytes``: the next power of two."""
    nbytes = int(math.ceil(nbytes))
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Layout:
    """The model's parameters as ZeRO partitions them: trainable (numel, ndim) in model order, frozen numels,
    the hidden size, one decoder layer's parameters and the largest parameter."""

    trainable: tuple[tuple[int, int], ...]
    frozen: tuple[int, ...]
    hidden: int
    layer: int | None
    largest: int

    @property
    def groups(self) -> list[list[int]]:
        """The trainer's parameter groups (Strategy.param_groups): matrices (weight decay), then the rest."""
        return [[n for n, d in self.trainable if d >= 2], [n for n, d in self.trainable if d < 2]]


def base_parameters(config) -> list[tuple[str, int, int]]:
    """(name, numel, ndim) of every parameter of the model, built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, p.numel(), p.dim()) for name, p in model.named_parameters()]


def lora_adapters(config, r: int, targets: list[str]) -> list[tuple[int, int]]:
    """LoRA's trainable matrices (A: r × in, B: out × r) on the targeted projections of every layer."""
    h = config.hidden_size
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv, ffn = config.num_attention_heads * head, config.num_key_value_heads * head, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}  # fmt: skip
    one = [m for name, (i, o) in shapes.items() if name in targets for m in ((r * i, 2), (o * r, 2))]
    return one * config.num_hidden_layers


def layout(config, base: list[tuple[str, int, int]], t: PlanConfig) -> Layout:
    if t.peft == "lora":
        trainable = tuple(lora_adapters(config, t.lora["r"], t.lora["target_modules"]))
        frozen = tuple(n for _, n, _ in base)
    else:
        trainable, frozen = tuple((n, d) for _, n, d in base), ()
    largest = max(n for _, n, _ in base)
    return Layout(trainable, frozen, hidden_size(config), layer_parameters(config), largest)


def sub_groups(group: list[int], size: int) -> list[int]:
    """Partition elements of each sub-group of one parameter group (stage3's _create_fp16_sub_groups)."""
    if not group:
        return []
    if size >= sum(group):
        return [sum(group)]
    out, acc = [], 0
    for i, n in enumerate(group):
        acc += n
        if acc >= size or i == len(group) - 1:
            out.append(acc)
            acc = 0
    return out


def zero3(t: PlanConfig, lay: Layout, world: int, device: str = "cpu") -> dict:
    """ZeRO-3's bytes per rank on the GPU and on the host, by component (module docstring). ``device`` is
    offload_optimizer's device when the optimizer is offloaded (cpu or nvme)."""
    c, h = 2 if t.precision in ("bf16", "fp16") else 4, lay.hidden
    offload, ratio = t.offload, t.offload_ratio if t.offload != "none" else 1.0
    part = lambda n: -(-n // world)  # noqa: E731  (ceil(n / N), a partition's elements)
    groups = [[part(n) for n in g] for g in lay.groups]
    size = 10 * h * h  # zero_buffer_sizes' sub_group_size
    subs = [s for g in groups for s in sub_groups(g, size)]
    on_gpu = len(subs) if offload == "none" else int((1 - ratio) * len(subs))
    gpu_subs, host_subs = subs[:on_gpu], subs[on_gpu:]
    trainable = sum(sum(g) for g in groups)
    frozen = [part(n) for n in lay.frozen]
    persistent = 10 * h  # stage3_param_persistence_threshold: whole on every rank
    whole = sum(n for n, _ in lay.trainable if n < persistent) + sum(n for n in lay.frozen if n < persistent)
    live = 2 * lay.layer if lay.layer else 10**9  # zero_buffer_sizes' max live parameters, else DeepSpeed's 1e9
    gpu = {
        "params": c * whole + (0 if offload == "all" else c * (trainable + sum(frozen))),
        "grads": c * trainable if offload == "none" else 0,
        "optimizer": ((ADAM + (0 if c == 4 else MASTER)) * trainable + 4 * max(subs, default=0))
        if offload == "none"
        else 16 * sum(gpu_subs),
        "buffers": c * (live + lay.largest) + c * (h * h + lay.largest),
    }
    host, rounding = {}, 0

    def pin(nbytes, optimizer: bool = True):
        """A pinned block's bytes, its rounding counted apart (the optimizer's blocks unless pin_memory is off)."""
        nonlocal rounding
        if not optimizer or t.offload_pin_memory:
            rounding += pinned(nbytes) - int(math.ceil(nbytes))
        return int(math.ceil(nbytes))

    if offload == "all":
        host["params"] = sum(pin(c * sum(g), False) for g in groups if g) + sum(pin(c * n, False) for n in frozen)
    if offload != "none":
        host["grads"] = pin(c * trainable)
        if device == "nvme":
            largest = max(subs, default=0)
            host["optimizer"] = SWAP_BUFFERS * pin(4 * largest) + 4 * largest
        else:
            pinning = t.offload_pin_memory  # a GPU sub-group's pinned block, kept in torch's cache
            cached = pin(4 * max(gpu_subs)) if gpu_subs and pinning else 0
            host["optimizer"] = sum((MASTER + ADAM) * s + pin(4 * s) for s in host_subs) + cached
    host["pinned_rounding"] = rounding
    return {
        "gpu": gpu,
        "host": host,
        "sub_groups": len(subs),
        "sub_groups_on_gpu": on_gpu,
        "offload_ratio": ratio,
    }


def zero12(t: PlanConfig, lay: Layout, world: int) -> dict:
    """ZeRO-1/2's bytes per rank on the GPU and on the host, by component (module docstring)."""
    c, h, stage, offload = 2 if t.precision in ("bf16", "fp16") else 4, lay.hidden, t.zero_stage, t.offload
    trainable = sum(n for n, _ in lay.trainable)
    parts = [-(-sum(g) // world) for g in lay.groups if g]
    partition = sum(parts)
    gpu = {
        "params": c * (trainable + sum(lay.frozen)),
        "grads": c * (trainable if stage == 1 else partition) if offload == "none" else 0,
        "optimizer": (MASTER + ADAM + 4) * partition if offload == "none" else 0,
        "buffers": c * h * h + (c * lay.largest if offload != "none" else 0),
    }
    host, rounding = {}, 0
    if offload != "none":
        blocks = [b for p in parts for b in (4 * p, c * p, 4 * p)] + [c * lay.largest]
        rounding = sum(pinned(b) - b for b in blocks) if t.offload_pin_memory else 0
        host["optimizer"] = sum(blocks) + ADAM * partition
        host["grads"] = c * partition if t.grad_accum > 1 else 0  # accumulated_grads_in_cpu
    host["pinned_rounding"] = rounding
    return {"gpu": gpu, "host": host}


def model_states(t: PlanConfig, lay: Layout, world: int, device: str = "cpu") -> dict:
    """ZeRO's model states per rank (bytes): ``gpu`` and ``host`` components, for the stage of ``t``."""
    return zero3(t, lay, world, device) if t.zero_stage == 3 else zero12(t, lay, world)


def best_ratio(slack) -> float | None:
    """The training.offload_ratio, in hundredths, with the most room: ``slack(ratio)`` is the smaller of the
    GPU's and the host's free share under that ratio's plan (None where it does not fit); the ratio with the
    largest, so that neither side sits at its edge. None if no ratio fits."""
    room = {r / 100: slack(r / 100) for r in range(1, 101)}
    fitting = {r: v for r, v in room.items() if v is not None}
    return max(fitting, key=lambda r: (fitting[r], r)) if fitting else None  # ties: the same split, the plainer ratio


def ratio_for(t: PlanConfig, attempt, keys: dict) -> tuple[dict, dict, str]:
    """ZeRO-3 with ``keys`` at the offload_ratio of best_ratio, re-planned by ``attempt(label, change)`` (1.0,
    all offloaded, where none fits): that plan, its change, and how many optimizer sub-groups are on the host."""
    base = {"strategy": "deepspeed", "zero_stage": 3} | keys
    found = {}

    def slack(ratio: float) -> float | None:
        p = found[ratio] = attempt("", base | {"offload_ratio": ratio})
        if not p["fits"]:
            return None
        host = 1 - p["host_gb"] / limit if (limit := p.get("host_limit_gb")) else 1.0
        return min(1 - p["gpu_gb"] / t.gpu_memory_gb, host)

    ratio = best_ratio(slack) or 1.0
    result = found.get(ratio) or attempt("", base | {"offload_ratio": ratio})
    split = (
        f"{result['sub_groups'] - result['sub_groups_on_gpu']} of {result['sub_groups']}"
        if "sub_groups" in result
        else "all"
    )
    return result, base | {"offload_ratio": ratio}, split
