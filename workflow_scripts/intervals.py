"""Confidence intervals of the held-out scores: a bootstrap over the held-out examples.

Every model is scored on the same examples, and every model's resamples are drawn with the same seed, so the
intervals of two models come from the same resampled sets. An interval is the 2.5th to 97.5th percentile of
RESAMPLES recomputed scores (95%); ``stderr`` is their standard deviation. The loss is recomputed token-weighted
(summed loss over summed label tokens of the resampled examples), BLEU and chrF from the resampled examples'
summed sacrebleu statistics, exactly as the corpus scores are computed from all of them.
evaluation.py writes them into a model's result; summarize.py puts them in summary.csv.
"""

import math
from collections.abc import Callable, Sequence

import numpy as np

RESAMPLES, SEED, LEVEL = 1000, 0, 0.95


def resample_indices(examples: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``resamples`` rows of ``examples`` indices drawn with replacement, the same for the same arguments."""
    return np.random.default_rng(seed).integers(0, examples, size=(resamples, examples))


def interval(replicates: Sequence[float], level: float = LEVEL) -> dict[str, float]:
    """The percentile interval of bootstrap ``replicates`` at ``level`` and their standard deviation."""
    values = np.asarray(replicates, dtype=float)
    tail = (1 - level) / 2
    lo, hi = np.quantile(values, [tail, 1 - tail])
    return {"lo": float(lo), "hi": float(hi), "stderr": float(values.std(ddof=1)) if len(values) > 1 else math.nan}


def bootstrap(statistic: Callable[[np.ndarray], float], columns: np.ndarray, **resampling) -> dict[str, float]:
    """The interval of ``statistic`` over resampled rows of ``columns`` (one row per example)."""
    columns = np.asarray(columns)
    if not len(columns):
        return {"lo": math.nan, "hi": math.nan, "stderr": math.nan}
    return interval([statistic(columns[rows]) for rows in resample_indices(len(columns), **resampling)])


def example_losses(span_losses: Sequence[tuple[float, int]], spans_per_example: Sequence[int]) -> np.ndarray:
    """Per example (summed loss, label tokens) from its spans' pairs, the spans in example order (an example
    with no scored span is (0, 0))."""
    if sum(spans_per_example) != len(span_losses):
        raise ValueError(f"{len(span_losses)} scored spans, but the examples have {sum(spans_per_example)}")
    out = np.zeros((len(spans_per_example), 2))
    bounds = np.cumsum([0, *spans_per_example])
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        out[i] = np.sum(np.asarray(span_losses[start:end], dtype=float).reshape(-1, 2), axis=0)
    return out


def token_loss(rows: np.ndarray) -> float:
    """Token-weighted loss of (summed loss, tokens) rows."""
    return float(rows[:, 0].sum() / max(rows[:, 1].sum(), 1))


def sacrebleu_statistic(metric) -> Callable[[np.ndarray], float]:
    """A sacrebleu metric's corpus score (on 0-1, capped at 1 as heldout.corpus does) from the rows of its
    per-example statistics."""
    return lambda rows: min(metric._compute_score_from_stats(list(rows.sum(axis=0))).score / 100, 1.0)


def heldout_intervals(pairs: list[tuple[str, str]], losses: np.ndarray, **resampling) -> dict[str, dict]:
    """The interval of each held-out score: eval_loss and perplexity from ``losses`` (example_losses), exact
    match, ROUGE-L, BLEU and chrF from the (answer, reference) ``pairs``, one per example."""
    import sacrebleu
    from heldout import exact_matches, rouge_ls

    out = {"eval_loss": bootstrap(token_loss, losses, **resampling)}
    out["perplexity"] = bootstrap(lambda rows: math.exp(min(token_loss(rows), 50)), losses, **resampling)
    if not pairs:
        return out
    out["exact_match"] = bootstrap(np.mean, np.asarray(exact_matches(pairs), dtype=float), **resampling)
    out["rouge_l"] = bootstrap(np.mean, np.asarray(rouge_ls(pairs)), **resampling)
    answers, references = map(list, zip(*pairs, strict=True))
    for name, metric in (("bleu", sacrebleu.BLEU()), ("chrf", sacrebleu.CHRF())):
        stats = np.asarray(metric._extract_corpus_statistics(answers, [references]), dtype=float)
        out[name] = bootstrap(sacrebleu_statistic(metric), stats, **resampling)
    return out
