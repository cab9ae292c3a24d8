"""Preference losses (training.objective: dpo) as pure functions of per-sequence log-probabilities.

A pair's policy log-probabilities (and, for the losses that have one, the reference model's) come in as
``PairLogps``: each answer's summed log-probability over its answer tokens and how many tokens that is
(``answer_logps`` computes them from a forward's logits and labels). ``preference_loss`` turns them into the
batch's loss and the metrics under TRL's names, so a curve here reads like one from TRL's trainers:

- ``sigmoid``: DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing (cDPO), as TRL's
  DPOTrainer and CPOTrainer compute it;
- ``ipo``: IPO (Azar et al. 2023, eq. 17) on the log-ratios averaged over the answer's tokens, as TRL's
  DPOTrainer does (its authors' normalization);
- ``simpo``: SimPO (Meng et al. 2024): reference-free, on average log-probabilities, with the target margin
  ``gamma`` (TRL's CPOTrainer, loss_type simpo, simpo_gamma);
- ``orpo``: ORPO (Hong et al. 2024): reference-free, the chosen answers' NLL minus ``beta`` (the paper's
  lambda) times the log-sigmoid of the log odds ratio of the average log-probabilities (TRL's ORPOTrainer).

Rewards are ``beta`` times the log-ratios to the reference (sigmoid, ipo) or ``beta`` times the average
log-probabilities (simpo, orpo), as TRL logs them; ``logps/*`` are the summed log-probabilities for the
reference-based losses and the averaged ones for the reference-free ones (what each TRL trainer logs).
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.settings import REFERENCE_FREE_LOSSES


@dataclasses.dataclass(frozen=True)
class PairLogps:
    """A batch of pairs' log-probabilities: each answer's sum over its answer tokens, and their counts."""

    chosen: torch.Tensor  # (pairs,)
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # (pairs,), answer tokens of each chosen answer
    rejected_tokens: torch.Tensor

    def averaged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The average log-probability per answer token of each chosen and rejected answer."""
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """training.dpo: the loss and its constants (their defaults are config/schema.yaml's)."""

    loss: str
    beta: float
    label_smoothing: float
    gamma: float  # SimPO's target reward margin


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the summed log-probability of its answer tokens and their count. ``labels`` are the
    model's (unshifted: logits at t predict label t + 1; IGNORE where nothing is trained), so the pair's
    answer tokens are exactly the ones its SFT loss would train on. The log-softmax is taken in fp32."""
    target = labels[:, 1:]
    logits = logits[:, :-1].float()
    token_logps = -F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="none")
    mask = target != IGNORE
    return (token_logps * mask).sum(-1), mask.sum(-1)


def split_pairs(summed: torch.Tensor, tokens: torch.Tensor) -> PairLogps:
    """A concatenated batch's per-sequence results ([chosen..., rejected...]) as its pairs."""
    chosen, rejected = summed.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    return PairLogps(chosen, rejected, chosen_tokens, rejected_tokens)


def smoothed_sigmoid(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(beta x), with the labels flipped at rate ``label_smoothing`` (cDPO)."""
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


# A loss: (settings, policy, reference or None) -> (per-pair losses, chosen rewards, rejected rewards,
# the chosen and rejected log-probabilities logged as logps/*, extra metrics)
LossFn = Callable[[DPOSettings, PairLogps, PairLogps | None], tuple]


def _sigmoid(s: DPOSettings, policy: PairLogps, ref: PairLogps) -> tuple:
    chosen_ratio, rejected_ratio = policy.chosen - ref.chosen, policy.rejected - ref.rejected
    losses = smoothed_sigmoid(chosen_ratio - rejected_ratio, s.beta, s.label_smoothing)
    return losses, s.beta * chosen_ratio, s.beta * rejected_ratio, policy.chosen, policy.rejected, {}


def _ipo(s: DPOSettings, policy: PairLogps, ref: PairLogps) -> tuple:
    chosen_ratio, rejected_ratio = policy.chosen - ref.chosen, policy.rejected - ref.rejected
    delta = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(min=1)
    losses = (delta - 1 / (2 * s.beta)) ** 2
    return losses, s.beta * chosen_ratio, s.beta * rejected_ratio, policy.chosen, policy.rejected, {}


def _simpo(s: DPOSettings, policy: PairLogps, ref: None) -> tuple:
    chosen, rejected = policy.averaged()
    losses = smoothed_sigmoid(chosen - rejected - s.gamma / s.beta, s.beta, s.label_smoothing)
    return losses, s.beta * chosen, s.beta * rejected, chosen, rejected, {}


def _orpo(s: DPOSettings, policy: PairLogps, ref: None) -> tuple:
    chosen, rejected = policy.averaged()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    # the chosen answers' cross-entropy, the mean over all their tokens (TRL's ORPO: the batch's SFT loss)
    nll = -policy.chosen.sum() / policy.chosen_tokens.sum().clamp(min=1)
    losses = nll - s.beta * ratio  # its mean is ORPO's loss: nll - beta * mean(ratio)
    extra = {"nll_loss": nll, "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()}
    return losses, s.beta * chosen, s.beta * rejected, chosen, rejected, extra


LOSSES: dict[str, LossFn] = {"sigmoid": _sigmoid, "ipo": _ipo, "simpo": _simpo, "orpo": _orpo}
REFERENCE_FREE = REFERENCE_FREE_LOSSES  # the losses that read no reference model


def needs_reference(loss: str) -> bool:
    return loss not in REFERENCE_FREE


def preference_loss(
    s: DPOSettings, policy: PairLogps, reference: PairLogps | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's loss (the mean over its pairs) and its metrics under TRL's names (detached scalars)."""
    if needs_reference(s.loss) and reference is None:
        raise ValueError(f"training.dpo.loss {s.loss} needs the reference model's log-probabilities")
    losses, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, extra = LOSSES[s.loss](s, policy, reference)
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.mean(),
        "logps/rejected": rejected_logps.mean(),
        **extra,
    }
    return losses.mean(), {k: v.detach().float() for k, v in metrics.items()}


METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")  # fmt: skip
