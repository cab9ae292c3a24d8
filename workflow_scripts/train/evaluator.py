"""The held-out loss during training: every `training.eval_every` steps and at the last, on a fixed subset.

The subset is the first `training.eval_samples` examples of the tokenized eval set (the one the workflow's
evaluation reads after training), the same at every evaluation. Each rank evaluates its share in padded
micro-batches of `micro_batch_size` examples; every rank runs the same number of forward passes (a rank
short of examples runs one that counts nothing), as FSDP2 and ZeRO-3 gather weights in collectives. The
loss summed over the label tokens and the token count are all-reduced: the result is the token-weighted
mean over the subset, as the held-out evaluation computes it.

The pass runs under no_grad in eval mode (no dropout) and returns the model to train mode; the RNG state
is forked around it, so the training losses are the same as without it.
"""

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.train.batching import collate, load_examples


def eval_batches(rows: int, samples: int | None, world: int, rank: int, batch_size: int) -> list[list[int]]:
    """This rank's micro-batches (example indices) of the first ``samples`` of ``rows`` examples (all when
    None): example i goes to rank i // batch_size % world, so the ranks take whole batches in turn. Every rank
    gets the same number of batches; a rank's batch past the end is empty (a forward pass that counts nothing)."""
    n = rows if samples is None else min(samples, rows)
    per_round = batch_size * world
    rounds = math.ceil(n / per_round)
    return [
        list(range(r * per_round + rank * batch_size, min(n, r * per_round + (rank + 1) * batch_size)))
        for r in range(rounds)
    ]


def label_tokens(labels: torch.Tensor) -> int:
    """The tokens a causal LM's loss averages over: each label but the first of its row, not IGNORE."""
    return int((labels[:, 1:] != IGNORE).sum())


class Evaluator:
    """Decides when to evaluate (``due``) and runs the pass (``evaluate``); ``maybe_evaluate`` after each step
    returns the record's held-out fields, or {}."""

    def __init__(self, strategy, path: Path, store_root: Path, cfg, total_steps: int, pad_id: int):
        self.strategy, self.cfg, self.total_steps, self.pad_id = strategy, cfg, total_steps, pad_id
        self.examples = load_examples([path], store_root)
        if len(self.examples) == 0:
            raise UserError(f"{path}: the eval set has no examples; training.eval_every needs some (or set it null)")
        self.batches = eval_batches(
            len(self.examples), cfg.eval_samples, dist.get_world_size(), dist.get_rank(), cfg.micro_batch_size
        )

    @property
    def samples(self) -> int:
        return len(self.examples) if self.cfg.eval_samples is None else min(self.cfg.eval_samples, len(self.examples))

    def due(self, step: int) -> bool:
        return step % self.cfg.eval_every == 0 or step == self.total_steps

    def maybe_evaluate(self, step: int) -> dict:
        if not self.due(step):
            return {}
        start = time.perf_counter()
        loss, tokens = self.evaluate()
        return {"eval_loss": loss, "eval_tokens": tokens, "eval_samples": self.samples,
                "eval_time_s": time.perf_counter() - start}  # fmt: skip

    def evaluate(self) -> tuple[float, int]:
        """The token-weighted mean loss over the subset (every rank's share) and its token count."""
        model, device = self.strategy.model, self.strategy.device
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, tokens
        model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                for indices in self.batches:
                    # a rank with no examples left runs its first example, counted as nothing
                    batch = collate([self.examples[i] for i in indices or [0]], self.pad_id)
                    tokens = label_tokens(batch["labels"]) if indices else 0
                    loss = self.strategy.eval_loss({k: v.to(device) for k, v in batch.items()})
                    if tokens:
                        totals[0] += loss.detach().double() * tokens
                        totals[1] += tokens
                    self.examples.release()
        finally:
            model.train()
        dist.all_reduce(totals)
        if totals[1] == 0:
            raise UserError("the eval set's subset has no label tokens to compute a held-out loss on")
        return (totals[0] / totals[1]).item(), int(totals[1].item())
