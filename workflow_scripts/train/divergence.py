"""The non-finite stop: a NaN or infinite loss or gradient norm ends the job before the step is saved.

fp16's dynamic loss scaling skips a step whose gradients overflow (its norm is inf, the scale is
halved, the weights are untouched): that norm is expected and passes. A non-finite loss never does.
The ranks agree (the step's losses all-reduced; the gradient norm is already global), so all of them
stop at the same step, with one line on rank 0: the step, the values, the checkpoint a rerun resumes
from. Nothing is saved after it, so the checkpoints kept are the good ones before it.

The dead-model stop ends the job the same way when the model has stopped learning for good: for
training.dead_model_steps optimizer steps in a row (0: never) the gradient norm is exactly zero with
trainable parameters, or the loss sits at ln(vocabulary), a uniform prediction, within DEAD_TOLERANCE
(a learning rate of 1e6 for 1e-6 collapses the demo model so in about 20 steps, which then trains on to
exit 0 having learnt nothing).

``WORKFLOW_TEST_NAN_AT_STEP`` is for the tests only: the last rank's loss at that step is taken as NaN.
"""

import math
import os

import torch
import torch.distributed as dist

from workflow_scripts.train.checkpoint import stop_job

TEST_HOOK = "WORKFLOW_TEST_NAN_AT_STEP"


def non_finite(loss: float, grad_norm: float, overflow_skipped: bool) -> bool:
    """Whether a step's mean loss and gradient norm stop the job (an fp16 overflow step's norm does not)."""
    return not math.isfinite(loss) or (not math.isfinite(grad_norm) and not overflow_skipped)


DEAD_TOLERANCE = 1e-5  # of ln(vocabulary): a loss this close to a uniform prediction's is one


class DeadModel:
    """Counts the optimizer steps in a row that show a model learning nothing (see the module's doc)."""

    def __init__(self, steps: int, vocab: int, trainable: bool):
        self.steps, self.uniform, self.trainable = steps, math.log(max(vocab, 2)), trainable
        self.streak = 0

    def dead(self, loss: float, grad_norm: float) -> bool:
        """Whether one step's mean loss and gradient norm are those of a dead model."""
        flat = self.trainable and grad_norm == 0.0
        return flat or abs(loss - self.uniform) <= DEAD_TOLERANCE * self.uniform

    def update(self, loss: float, grad_norm: float) -> bool:
        """Count one step; True when it makes training.dead_model_steps in a row (never when that is 0)."""
        self.streak = self.streak + 1 if self.dead(loss, grad_norm) else 0
        return 0 < self.steps <= self.streak


class NonFiniteStop:
    def __init__(self, strategy, checkpointer, dead: DeadModel | None = None):
        self.strategy, self.checkpointer, self.dead = strategy, checkpointer, dead
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
        if non_finite(mean, grad_norm, overflow):
            self.stop(step, f"loss {mean:.4g}, gradient norm {grad_norm:.4g}: not finite", on_exit)
        # the same values on every rank (the loss all-reduced, the norm global): they stop at the same step
        if self.dead is not None and not overflow and self.dead.update(mean, grad_norm):
            why = (
                f"loss {mean:.6g} (ln(vocabulary {round(math.exp(self.dead.uniform))}) = {self.dead.uniform:.6g}),"
                f" gradient norm {grad_norm:.4g}: the model has learnt nothing for {self.dead.streak} steps in a row"
                f" (training.dead_model_steps; training.lr {self.strategy.cfg.lr:g} too high?)"
            )
            self.stop(step, why, on_exit)

    def stop(self, step: int, why: str, on_exit) -> None:
        on_exit()
        resume = self.checkpointer.newest_good
        then = f"a rerun resumes from {resume}" if resume else "no checkpoint yet: a rerun starts from step 0"
        stop_job(f"step {step}: {why}; stopped, nothing of it saved; {then}" if dist.get_rank() == 0 else None)
