"""One optimizer step, the unit both the trainer (train.py's loop) and the planner's fake-tensor probe
(plan/memory_probe.py, which runs this very function on fake tensors to predict its memory) execute.
"""

import torch

from workflow_scripts.train.batching import TrainingData
from workflow_scripts.train.metrics_logger import MetricsLogger


def train_step(strategy, data: TrainingData, step: int, metrics: MetricsLogger) -> tuple[torch.Tensor, float]:
    """One optimizer step (0-based ``step``) over grad_accum micro-batches: the summed loss, the grad norm."""
    loss_sum = torch.zeros((), device=strategy.device)
    for micro, (batch, lengths) in enumerate(data.micro_batches(step)):
        metrics.count(lengths)
        batch = {k: v.to(strategy.device) for k, v in batch.items()}
        loss = strategy.forward_backward(batch, last_micro=micro == data.cfg.grad_accum - 1)
        loss_sum += loss.detach()
        if found := strategy.objective.metrics():  # the objective's own (DPO's rewards/*, logps/*), else none
            metrics.observe(found)
    return loss_sum, strategy.step()
