"""Confidence intervals of the held-out scores: a bootstrap over the held-out examples.

Every model is scored on the same examples, and every model's resamples are drawn with the same seed, so the
intervals of two models come from the same resampled sets. An interval is the 2.5th to 97.5th percentile of
RESAMPLES recomputed scores (95%); ``stderr`` is their standard deviation. Each metric of metrics.py's registry
is recomputed by its own aggregate from its per-example rows (the loss token-weighted: summed loss over summed
label tokens of the resampled examples; BLEU and chrF from the resampled examples' summed sacrebleu statistics),
exactly as the corpus scores are computed from all of them: a new metric gets its interval from its entry.
evaluation.py writes them into a model's result; summarize.py puts them in summary.csv.
"""

import math
from collections.abc import Callable, Sequence

import numpy as np

from workflow_scripts.evals.metrics import METRICS

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


def heldout_intervals(pairs: list[tuple[str, str]], losses: np.ndarray, **resampling) -> dict[str, dict]:
    """The interval of each held-out metric of metrics.METRICS: a loss metric's from ``losses``
    (example_losses), a generation metric's from its per-example rows of the (answer, reference) ``pairs``, one
    per example (none without pairs); each recomputes the metric's own aggregate on the resampled rows."""
    out = {}
    for name, metric in METRICS.items():
        if metric.is_loss:
            out[name] = bootstrap(metric.aggregate, losses, **resampling)
        elif pairs:
            out[name] = bootstrap(metric.aggregate, metric.per_example(pairs), **resampling)
    return out
