"""What fits when a training config does not: each change re-planned by the planner itself, not guessed.

``propose(t, plan)`` tries, in order of how little each changes the experiment: gradient checkpointing,
a smaller micro-batch with more accumulation (the same global batch), the strategy's sharded
alternative (DDP and ZeRO-1/2: ZeRO-3, the ``sharded_alternative`` of parallel/), each strategy's own
proposals (``Strategy.proposals``: DeepSpeed ZeRO-3's partial optimizer offload, training.offload_ratio at
the smallest ratio, in hundredths, that fits both the GPUs and the host, and ZeRO-3 with the optimizer on
NVMe), more nodes on one model (training.mode: joint) and
LoRA. ``plan(t)`` is preflight's ``Planner.plan``: the same estimate (fake-tensor probe, ZeRO's terms,
host RAM) as the job's own config. Each proposal is kept with its planned GPU and host GB; the best is
the first that fits. With the fake-tensor probe on, the proposals' probes share one --probe-timeout
(the refusal stays minutes at most); past it a proposal is planned by the formula, and its ``method``
says so.
"""

import dataclasses

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import PlanConfig, PlannedConfig
from workflow_scripts.train.parallel.base import change_keys

MAX_NODES = 16  # more nodes: tried up to this many on one model


def varied(t: PlanConfig, change: dict) -> PlanConfig:
    """``t`` with ``change``'s keys: a PlannedConfig where the change says where ZeRO's optimizer states go."""
    if "optimizer_device" in change and not isinstance(t, PlannedConfig):
        t = PlannedConfig(**vars(t))
    return dataclasses.replace(t, **change)


def _try(label: str, change: dict, t: PlanConfig, plan) -> dict:
    try:
        est = plan(varied(t, change))
    except UserError as e:  # e.g. a global batch the new world size does not divide
        return {"proposal": label, "change": change, "gpu_gb": None, "host_gb": None, "fits": False, "why": str(e)}
    return {
        "proposal": label,
        "change": change,
        "gpu_gb": round(est["total_gb"], 2),
        "host_gb": round(est["host"]["peak_gb"], 1),
        "fits": est["fits"],
        "host_limit_gb": est["host"]["memory_gb"],
        "grad_accum": est["grad_accum"],
        "world_size": est["world_size"],
        "method": est["method"],
    } | {k: v for k, v in (est.get("model_states") or {}).items() if k.startswith("sub_groups")}


def keys(change: dict) -> str:
    return change_keys(change)


def checkpointing(t: PlanConfig, plan) -> list[dict]:
    if t.gradient_checkpointing:
        return []
    change = {"gradient_checkpointing": True}
    return [_try(keys(change), change, t, plan)]


def smaller_micro_batch(t: PlanConfig, plan) -> list[dict]:
    """Halving the micro-batch, accumulation doubled (or grad_accum derived from global_batch_size), down
    to the first that fits (or 1)."""
    mb, out = t.micro_batch_size, []
    while mb > 1 and mb % 2 == 0:
        mb //= 2
        change = {"micro_batch_size": mb}
        if t.global_batch_size is None:
            change["grad_accum"] = t.grad_accum * (t.micro_batch_size // mb)
        out = [_try(keys(change) + " (the same global batch)", change, t, plan)]
        if out[0]["fits"]:
            break
    return out


def sharded(t: PlanConfig, plan) -> list[dict]:
    """The strategy's sharded alternative (DDP, ZeRO-1/2: ZeRO-3), which loads partitions, not a replica per rank."""
    from workflow_scripts.train.parallel import strategy_for

    change = strategy_for(t.strategy).sharded_alternative(t)
    if change is None:
        return []
    return [_try(f"{keys(change)} (weights, gradients and optimizer states sharded over the ranks)", change, t, plan)]


def offered(t: PlanConfig, plan) -> list[dict]:
    """Each strategy's own proposals (``Strategy.proposals``: DeepSpeed's ZeRO-3 partial and NVMe offload), in
    STRATEGIES' order; a strategy that inherits its parent's offers them once."""
    from workflow_scripts.train.parallel import STRATEGIES

    out, seen = [], set()
    for strategy in STRATEGIES.values():
        if strategy.proposals.__func__ not in seen:
            seen.add(strategy.proposals.__func__)
            out += strategy.proposals(t, lambda label, change: _try(label, change, t, plan))
    return out


def more_nodes(t: PlanConfig, plan) -> list[dict]:
    """One model over more nodes (joint mode), doubling up to MAX_NODES: the first that fits."""
    now = t.nodes if t.mode == "joint" else 1
    out, nodes = [], 2 * now
    while nodes <= MAX_NODES:
        change = {"mode": "joint", "nodes": nodes}
        out = [_try(f"{keys(change)} (one model over {nodes * t.procs_per_node} GPUs)", change, t, plan)]
        if out[0]["fits"]:
            break
        nodes *= 2
    return out


def lora(t: PlanConfig, plan) -> list[dict]:
    if t.peft == "lora":
        return []
    change = {"peft": "lora"}
    return [_try(keys(change) + f" (r {t.lora['r']} on {', '.join(t.lora['target_modules'])})", change, t, plan)]


PROPOSALS = (checkpointing, smaller_micro_batch, sharded, offered, more_nodes, lora)


def propose(t: PlanConfig, plan) -> list[dict]:
    """Every proposal for the config ``t``, each re-planned by ``plan``, in PROPOSALS' order."""
    return [p for make in PROPOSALS for p in make(t, plan)]


def best(proposals: list[dict]) -> dict | None:
    return next((p for p in proposals if p["fits"]), None)


def said(chosen: dict | None, proposals: list[dict]) -> str:
    """The refusal's advice: the best proposal with its numbers, or that none of them fits."""
    if chosen is None:
        return f"none of {len(proposals)} re-planned changes fits (plan/memory.json lists them)"
    others = sum(p["fits"] for p in proposals) - 1
    return (
        f"fits with {chosen['proposal']}: {chosen['gpu_gb']:.1f} GB per GPU, {chosen['host_gb']:.0f} GB host per node"
        f" (re-planned; {others} other fitting change{'s' * (others != 1)} in plan/memory.json)"
    )
