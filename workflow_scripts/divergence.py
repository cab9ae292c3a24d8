"""The non-finite stop: a NaN or infinite loss or gradient norm ends the job before the step is saved.

fp16's dynamic loss scaling skips a step whose gradients overflow (its norm is inf, the scale is
halved, the weights are untouched): that norm is expected and passes. A non-finite loss never does.
The ranks agree (the step's losses all-reduced; the gradient norm is already global), so all of them
stop at the same step, with one line on rank 0: the step, the values, the checkpoint a rerun resumes
from. Nothing is saved after it, so the checkpoints kept are the good ones before it.

``WORKFLOW_TEST_NAN_AT_STEP`` is for the tests only: the last rank's loss at that step is taken as NaN.
"""

import math
import os

import torch
import torch.distributed as dist
from checkpoint import stop_job

TEST_HOOK = "WORKFLOW_TEST_NAN_AT_STEP"


def non_finite(loss: float, grad_norm: float, overflow_skipped: bool) -> bool:
    """Whether a step's mean loss and gradient norm stop the job (an fp16 overflow step's norm does not)."""
    return not math.isfinite(loss) or (not math.isfinite(grad_norm) and not overflow_skipped)


class NonFiniteStop:
    def __init__(self, strategy, checkpointer):
        self.strategy, self.checkpointer = strategy, checkpointer
        self.skipped = self._skipped()
        self.forced = int(os.environ.get(TEST_HOOK) or 0)

    def _skipped(self) -> int:
        return self.strategy.loss_scale_stats().get("skipped_steps", 0)

    def check(self, step: int, loss_sum: torch.Tensor, grad_norm: float, on_exit) -> None:
        """After optimizer step ``step``, before anything logs or saves it: stop every rank if it diverged."""
        skipped = self._skipped()
        overflow, self.skipped = skipped > self.skipped, skipped
        loss = loss_sum.detach().float().reshape(1).clone()
        if step == self.forced and dist.get_rank() == dist.get_world_size() - 1:
            loss.fill_(math.nan)
        dist.all_reduce(loss)  # NaN or inf on any rank stays so
        mean = loss.item() / (dist.get_world_size() * self.strategy.cfg.grad_accum)
        if not non_finite(mean, grad_norm, overflow):
            return
        on_exit()
        resume = self.checkpointer.newest_good
        then = f"a rerun resumes from {resume}" if resume else "no checkpoint yet: a rerun starts from step 0"
        values = f"loss {mean:.4g}, gradient norm {grad_norm:.4g}"
        stop_job(
            f"step {step}: {values}: not finite; stopped, nothing of it saved; {then}" if dist.get_rank() == 0 else None
        )
