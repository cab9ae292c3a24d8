"""The parallelization strategies, one module each (ddp, fsdp, zero for DeepSpeed), and the one place a
strategy is chosen by its name (training.strategy, train_state.json's "strategy"). A new strategy is
one module here, its entry in STRATEGIES and a value of training.strategy in config/schema.yaml.

parallel/base.py says what a strategy owns: its load plan, wrapping, optimizer and step, its
checkpoint, its export reader for consolidation and its memory terms for the planner.
"""

from pipeline_io import UserError

from parallel.base import Strategy
from parallel.ddp import DDPStrategy
from parallel.fsdp import FSDPStrategy
from parallel.zero import DeepSpeedStrategy

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
