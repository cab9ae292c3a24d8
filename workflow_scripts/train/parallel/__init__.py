"""The parallelization strategies, one module each (ddp, fsdp, zero for DeepSpeed), and the one place a
strategy is chosen by its name (training.strategy, train_state.json's "strategy").

A new strategy touches exactly three files:

1. its module here (parallel/<name>.py): a subclass of parallel.base.Strategy (or of another strategy)
   with the hooks it does not inherit;
2. its entry in STRATEGIES below (its name -> its class);
3. its value in training.strategy's ``enum`` in config/schema.yaml (tests/train/test_strategies.py holds
   the enum equal to STRATEGIES' names).

Nothing outside this package compares a strategy's name (tests/train/test_strategies.py checks every
module of workflow_scripts/ outside it, rules/ and the Snakefile): train.py, the planner (preflight.py, proposals.py),
the fake-tensor probe (memory_probe.py), consolidation and check_environment ask the class
``strategy_for`` returns. parallel/base.py says what a strategy owns: its load plan, wrapping,
optimizer and step, its process group's backend, its checkpoint, its export reader for consolidation,
its memory terms and proposals for the planner and its part in the fake-tensor probe. The arrows point
down: those modules import this package, which imports none of them.
"""

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.train.parallel.base import Strategy
from workflow_scripts.train.parallel.ddp import DDPStrategy
from workflow_scripts.train.parallel.fsdp import FSDPStrategy
from workflow_scripts.train.parallel.zero import DeepSpeedStrategy

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "deepspeed": DeepSpeedStrategy}


def strategy_for(name: str) -> type[Strategy]:
    """The strategy class of ``name``."""
    if name not in STRATEGIES:
        raise UserError(f"training.strategy: unknown strategy {name!r} (one of {', '.join(STRATEGIES)})")
    return STRATEGIES[name]


def load_model(base: str, cfg, device):
    """The base model loaded by cfg's strategy's plan: (model, attention implementation)."""
    return strategy_for(cfg.strategy).load_model(base, cfg, device)


def build_strategy(cfg, model, device, total_steps: int) -> Strategy:
    """cfg's strategy around ``model``: wrapped, with its optimizer and schedule."""
    return strategy_for(cfg.strategy)(cfg, model, device, total_steps)
