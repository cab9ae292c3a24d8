"""The held-out metric registry (metrics.METRICS): every consumer derives its metrics from it."""

import numpy as np
import pytest

from workflow_scripts.evals.metrics import LOSSES, METRICS, RANKED, SCORES, lower_is_better

PAIRS = [("the cat sat", "the cat sat"), ("a dog", "the dog ran"), ("", "x y"), ("one two  three", "one two three")]


@pytest.mark.parametrize("name", SCORES)
def test_a_generation_metrics_aggregate_of_its_rows_is_its_corpus_score(name):
    """The bootstrap recomputes aggregate on resampled rows: on all rows it is the value lm-eval reports."""
    metric = METRICS[name]
    rows = metric.per_example(PAIRS)
    assert len(rows) == len(PAIRS)
    assert metric.aggregate(rows) == pytest.approx(metric.score(PAIRS))


def test_a_loss_metrics_aggregate_is_its_value_of_the_token_weighted_loss():
    rows = np.array([[6.0, 3], [2.0, 1]])
    for name in LOSSES:
        assert METRICS[name].aggregate(rows) == pytest.approx(METRICS[name].score(8 / 4))


def test_every_consumer_takes_its_metrics_from_the_registry():
    from workflow_scripts.evals.heldout import GENERATION_METRICS
    from workflow_scripts.evals.intervals import heldout_intervals
    from workflow_scripts.report.summarize import COLUMNS
    from workflow_scripts.report.winners import HELDOUT_METRICS

    assert list(GENERATION_METRICS) == SCORES and COLUMNS[1:] == list(METRICS)
    assert HELDOUT_METRICS == RANKED and "perplexity" not in RANKED
    intervals = heldout_intervals(PAIRS, np.array([[1.0, 2], [3.0, 1], [0.5, 1], [2.0, 2]]), resamples=20)
    assert list(intervals) == list(METRICS)
    assert [lower_is_better(m) for m in METRICS] == [not METRICS[m].higher_is_better for m in METRICS]
    assert lower_is_better("demo.word_perplexity") and not lower_is_better("demo.acc")
