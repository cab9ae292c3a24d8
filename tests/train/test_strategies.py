"""A strategy is complete in its module (parallel/__init__.py): the schema's training.strategy values are
STRATEGIES' names, and every strategy answers each hook the trainer, the planner, its proposals and the
fake-tensor probe ask it, without a strategy's name compared anywhere else."""

import re

import pytest
from conftest import REPO

from workflow_scripts.core.settings import PlanConfig, schema, training_config
from workflow_scripts.train.parallel import STRATEGIES
from workflow_scripts.train.parallel.base import Strategy

# What train.py, preflight.py, proposals.py and memory_probe.py ask a strategy class.
CLASS_HOOKS = (
    "process_group_backend", "unmet", "load_model", "export_source", "shards", "host_load_bytes",
    "offloaded_bytes", "unsupported", "model_states", "probe_config", "sharded_alternative",
    "unsharded_gradient_bytes", "probed_components", "proposals", "probe_shims",
)  # fmt: skip
INSTANCE_HOOKS = ("forward_backward", "step", "save", "load", "probe_prepare", "probe_tracker")


def test_the_schemas_strategies_are_STRATEGIES():
    assert schema()["properties"]["training"]["properties"]["strategy"]["enum"] == list(STRATEGIES)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_answers_every_hook(name):
    strategy = STRATEGIES[name]
    assert issubclass(strategy, Strategy)
    for hook in CLASS_HOOKS + INSTANCE_HOOKS:
        assert callable(getattr(strategy, hook, None)), (name, hook)
    for hook in ("forward_backward", "save", "load", "export_source"):  # the base raises or has none
        assert getattr(strategy, hook) is not getattr(Strategy, hook, None), (name, hook)
    cfg = training_config({"strategy": name})
    assert strategy.process_group_backend(cfg, "cpu") == "gloo"
    assert strategy.process_group_backend(cfg, "cuda") in ("nccl", "cpu:gloo,cuda:nccl")
    assert isinstance(strategy.fake_probe, bool)
    if strategy.fake_probe:
        assert all(callable(wrap) for wrap in strategy.probe_shims().values())
    t = PlanConfig.build({"strategy": name, "zero_stage": 2, "offload": "none", "fsdp_no_sync": False, "grad_accum": 1})
    assert strategy.unsharded_gradient_bytes(t, 10) >= 0
    assert len(strategy.shards(t)) == 3


def test_no_strategy_name_is_compared_outside_parallel():
    """Branches on a strategy's name live in its module: train.py, the planner and the rules ask hooks."""
    names = "|".join(re.escape(n) for n in (*STRATEGIES, "zero", "zero3"))
    compared = re.compile(rf"""(==|!=|\bin\b)\s*[("'\[{{]*["']({names})["']|["']({names})["']\s*(==|!=|\bin\b)""")
    package = REPO / "workflow_scripts"
    inside = package / "train" / "parallel"
    files = [p for p in package.rglob("*.py") if inside not in p.parents]
    files += [*(REPO / "rules").glob("*.smk"), REPO / "Snakefile"]
    assert len(files) > 60  # every module outside train/parallel/, in every package
    found = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for path in files
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if compared.search(line)
    ]
    assert not found, found
