"""The preference losses (train/preference.py) against TRL's trainers and the published formulas, values and
gradients, on fixed tensors; answer_logps against a per-token loop."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.settings import training_config
from workflow_scripts.train.preference import (
    LOSSES,
    METRIC_NAMES,
    PairLogps,
    answer_logps,
    preference_loss,
    split_pairs,
)
from workflow_scripts.train.preference import DPOSettings as Settings

PAIRS = 6


def DPOSettings(loss: str, **constants) -> Settings:  # noqa: N802 (the dataclass, with the schema's defaults)
    defaults = {k: v for k, v in training_config({}).dpo.items() if k in Settings.__dataclass_fields__}
    return Settings(**(defaults | {"loss": loss} | constants))


def pairs(seed: int = 0, requires_grad: bool = False) -> tuple[PairLogps, PairLogps]:
    """Policy and reference log-probabilities of PAIRS pairs: summed over 3-20 answer tokens, each token's
    log-probability in (-3, -0.05), so the averages stay below 0 (ORPO's log1mexp)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 21, (2, PAIRS), generator=g)
    per_token = -(0.05 + 2.95 * torch.rand(4, PAIRS, generator=g, dtype=torch.float64))
    policy_c, policy_r = (per_token[i] * tokens[i] for i in (0, 1))
    ref_c, ref_r = (per_token[i + 2] * tokens[i] for i in (0, 1))
    if requires_grad:
        policy_c, policy_r = policy_c.clone().requires_grad_(), policy_r.clone().requires_grad_()
    return PairLogps(policy_c, policy_r, tokens[0], tokens[1]), PairLogps(ref_c, ref_r, tokens[0], tokens[1])


def reference_formula(s: Settings, p: PairLogps, r: PairLogps) -> torch.Tensor:
    """The losses as the papers write them, independently of the module (mean over pairs)."""
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    if s.loss == "sigmoid":  # DPO eq. 7, cDPO's smoothing
        h = s.beta * ((p.chosen - r.chosen) - (p.rejected - r.rejected))
        return (-(1 - s.label_smoothing) * torch.log(sig(h)) - s.label_smoothing * torch.log(sig(-h))).mean()
    if s.loss == "ipo":  # IPO eq. 17, log-ratios per answer token
        h = (p.chosen - r.chosen) / p.chosen_tokens - (p.rejected - r.rejected) / p.rejected_tokens
        return ((h - 1 / (2 * s.beta)) ** 2).mean()
    avg_c, avg_r = p.chosen / p.chosen_tokens, p.rejected / p.rejected_tokens
    if s.loss == "simpo":  # SimPO eq. 6
        h = s.beta * avg_c - s.beta * avg_r - s.gamma
        return (-(1 - s.label_smoothing) * torch.log(sig(h)) - s.label_smoothing * torch.log(sig(-h))).mean()
    # ORPO eq. 6-7: odds(y) = P / (1 - P) with P the average-token probability
    odds = lambda lp: torch.exp(lp) / (1 - torch.exp(lp))  # noqa: E731
    nll = -p.chosen.sum() / p.chosen_tokens.sum()
    return nll - s.beta * torch.log(sig(torch.log(odds(avg_c) / odds(avg_r)))).mean()


SETTINGS = [
    DPOSettings("sigmoid", beta=0.1),
    DPOSettings("sigmoid", beta=0.5, label_smoothing=0.2),
    DPOSettings("ipo", beta=0.1),
    DPOSettings("simpo", beta=2.0, gamma=0.5),
    DPOSettings("simpo", beta=2.5, gamma=1.0, label_smoothing=0.1),
    DPOSettings("orpo", beta=0.1),
]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"{s.loss}-{s.beta}-{s.label_smoothing}")
def test_loss_and_gradients_match_the_published_formulas(s):
    policy, ref = pairs(requires_grad=True)
    loss, metrics = preference_loss(s, policy, ref)
    expected = reference_formula(s, policy, ref)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5, rel=1e-6)
    grads = torch.autograd.grad(loss, [policy.chosen, policy.rejected])
    expected_grads = torch.autograd.grad(expected, [policy.chosen, policy.rejected])
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert set(METRIC_NAMES) <= set(metrics) and all(v.ndim == 0 and not v.requires_grad for v in metrics.values())


def test_sigmoid_rewards_and_accuracy_are_trls():
    policy, ref = pairs(1)
    s = DPOSettings("sigmoid", beta=0.3)
    _, m = preference_loss(s, policy, ref)
    chosen, rejected = s.beta * (policy.chosen - ref.chosen), s.beta * (policy.rejected - ref.rejected)
    assert m["rewards/chosen"].item() == pytest.approx(chosen.mean().item())
    assert m["rewards/margins"].item() == pytest.approx((chosen - rejected).mean().item())
    assert m["rewards/accuracies"].item() == pytest.approx((chosen > rejected).double().mean().item())
    assert m["logps/chosen"].item() == pytest.approx(policy.chosen.mean().item())


def test_a_reference_loss_without_a_reference_is_refused_and_the_reference_free_ones_need_none():
    policy, _ = pairs()
    with pytest.raises(ValueError, match="reference"):
        preference_loss(DPOSettings("sigmoid"), policy)
    for loss in ("simpo", "orpo"):
        assert torch.isfinite(preference_loss(DPOSettings(loss), policy)[0])
    assert set(LOSSES) == {"sigmoid", "ipo", "simpo", "orpo"}


def test_dpo_at_equal_policy_and_reference_is_log_2():
    _, ref = pairs()
    loss, m = preference_loss(DPOSettings("sigmoid", beta=0.1), ref, ref)
    assert loss.item() == pytest.approx(math.log(2)) and m["rewards/margins"].item() == 0


def test_answer_logps_sum_the_answer_tokens_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :3] = IGNORE
    labels[1, :5] = IGNORE
    labels[2, :] = IGNORE
    summed, count = answer_logps(logits, labels)
    logp = logits.log_softmax(-1)
    for b in range(3):
        want = sum(logp[b, t - 1, labels[b, t]].item() for t in range(1, 7) if labels[b, t] != IGNORE)
        assert summed[b].item() == pytest.approx(want)
        assert count[b].item() == int((labels[b, 1:] != IGNORE).sum())
    pair = split_pairs(torch.arange(4.0), torch.tensor([1, 2, 3, 4]))
    assert pair.chosen.tolist() == [0, 1] and pair.rejected_tokens.tolist() == [3, 4]


# ---------------------------------------------------------------- TRL, where it is installed (requirements.lock)


@pytest.fixture(scope="module")
def trl_trainers():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    return CPOTrainer, ORPOTrainer


def cpo(trainer, loss_type, s: Settings):
    """TRL's CPOTrainer.cpo_loss bound to the settings it reads (no model, no accelerator)."""
    me = SimpleNamespace(beta=s.beta, label_smoothing=s.label_smoothing, loss_type=loss_type, simpo_gamma=s.gamma,
                         alpha=0.0, accelerator=SimpleNamespace(device="cpu"))  # fmt: skip
    return lambda chosen, rejected: trainer.cpo_loss(me, chosen, rejected)


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"{s.loss}-{s.beta}-{s.label_smoothing}")
def test_losses_and_gradients_match_trl(trl_trainers, s):
    """DPO's sigmoid is CPO's on the log-ratios; TRL's DPOTrainer (1.x) computes IPO as CPO's ipo on the
    log-ratios per answer token; SimPO is CPO's simpo on average log-probabilities; ORPO the ORPOTrainer's."""
    CPOTrainer, ORPOTrainer = trl_trainers
    policy, ref = pairs(2, requires_grad=True)
    loss, metrics = preference_loss(s, policy, ref)
    avg_c, avg_r = policy.averaged()
    if s.loss == "sigmoid":
        losses, chosen, rejected = cpo(CPOTrainer, "sigmoid", s)(policy.chosen - ref.chosen,
                                                                 policy.rejected - ref.rejected)  # fmt: skip
        want = losses.mean()
    elif s.loss == "ipo":
        c, r = (
            (policy.chosen - ref.chosen) / policy.chosen_tokens,
            (policy.rejected - ref.rejected) / policy.rejected_tokens,
        )
        want = cpo(CPOTrainer, "ipo", s)(c, r)[0].mean()
    elif s.loss == "simpo":
        losses, chosen, rejected = cpo(CPOTrainer, "simpo", s)(avg_c, avg_r)
        want = losses.mean()
        assert metrics["rewards/chosen"].item() == pytest.approx(chosen.mean().item(), abs=1e-6)
        assert metrics["rewards/accuracies"].item() == pytest.approx((chosen > rejected).double().mean().item())
    else:
        me = SimpleNamespace(beta=s.beta, accelerator=SimpleNamespace(device="cpu"))
        losses, chosen, rejected, ratio, log_odds = ORPOTrainer.odds_ratio_loss(me, avg_c, avg_r)
        want = -policy.chosen.sum() / policy.chosen_tokens.sum() - losses.mean()
        assert metrics["log_odds_ratio"].item() == pytest.approx(ratio.item(), abs=1e-5)
        assert metrics["log_odds_chosen"].item() == pytest.approx(log_odds.item(), abs=1e-5)
        assert metrics["rewards/margins"].item() == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    assert loss.item() == pytest.approx(want.item(), abs=1e-5)
    for got, expected in zip(torch.autograd.grad(loss, [policy.chosen, policy.rejected]),
                             torch.autograd.grad(want, [policy.chosen, policy.rejected]), strict=True):  # fmt: skip
        torch.testing.assert_close(got.to(expected.dtype), expected, atol=1e-5, rtol=1e-5)


def test_answer_logps_match_trls(trl_trainers):
    _, ORPOTrainer = trl_trainers
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 9, 13, generator=g)
    labels = torch.randint(0, 13, (4, 9), generator=g)
    labels[:, :4] = IGNORE
    summed, _ = answer_logps(logits, labels)
    torch.testing.assert_close(summed, ORPOTrainer.get_batch_logps(logits, labels), atol=1e-5, rtol=1e-5)
