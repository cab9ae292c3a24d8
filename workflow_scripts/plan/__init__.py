"""plan: plan_training before any GPU is asked for: preflight (the memory plan from the formulas and the strategy's
own terms, and the proposals when it does not fit), memory_probe (the real training step under fake tensors),
proposals. The strategy-specific parts are hooks on train/parallel's Strategy, never a strategy name here."""
