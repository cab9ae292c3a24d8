"""The held-out metric registry (metrics.METRICS): every consumer derives its metrics from it."""

import numpy as np
import pytest

from workflow_scripts.evals.metrics import LOSSES, METRICS, RANKED, SCORES, lower_is_better

CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
QWEN3_CALL = f"<think>\n\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"
TOOL_PAIRS = [
    (QWEN3_CALL, QWEN3_CALL),  # the same call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"days": 2.0, "city": "Oslo"}}\n</tool_call>', QWEN3_CALL),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen", "days": 2}}\n</tool_call>', QWEN3_CALL),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}\n</tool_call>', QWEN3_CALL),  # cut
    ('{"name": "get_time", "parameters": {"city": "Oslo"}}', '{"name": "get_time", "parameters": {"city": "Oslo"}}'),
]
PAIRS = [("the cat sat", "the cat sat"), ("a dog", "the dog ran"), ("", "x y"), ("one two  three", "one two three")]


@pytest.mark.parametrize("name", SCORES)
def test_a_generation_metrics_aggregate_of_its_rows_is_its_corpus_score(name):
    """The bootstrap recomputes aggregate on resampled rows: on all rows it is the value lm-eval reports."""
    metric = METRICS[name]
    rows = metric.per_example(PAIRS)
    assert len(rows) == len(PAIRS)
    assert metric.aggregate(rows) == pytest.approx(metric.score(PAIRS), nan_ok=True)  # tool_call: NaN, no calls
    tools = TOOL_PAIRS + PAIRS
    assert metric.aggregate(metric.per_example(tools)) == pytest.approx(metric.score(tools))


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


def test_tool_call_scores_the_held_out_turns_that_call_tools():
    """tool_call: the share of held-out turns whose reference makes tool calls where the answer's calls parse and
    equal the reference's, names and arguments as JSON values (2 and 2.0 alike, key order free); a plain reference
    is no part of it, and a set without any tool call has no score (NaN: left out of the result)."""
    from workflow_scripts.data.tool_calls import calls_in_text, json_equal, same_calls
    from workflow_scripts.evals.metrics import tool_call, tool_call_matches

    assert tool_call_matches(TOOL_PAIRS + PAIRS[:1]) == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
        pytest.approx(float("nan"), nan_ok=True),
    ]
    assert tool_call(TOOL_PAIRS + PAIRS) == pytest.approx(3 / 5)
    assert np.isnan(tool_call(PAIRS)) and np.isnan(tool_call([]))
    assert calls_in_text(QWEN3_CALL) == [("get_weather", {"city": "Oslo", "days": 2})]
    two = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    )
    assert calls_in_text(two) == [("a", {}), ("b", {"x": 1})]  # arguments as a JSON string: parsed
    assert same_calls(calls_in_text(two)[::-1], calls_in_text(two))  # parallel calls in any order
    assert not same_calls(calls_in_text(two)[:1], calls_in_text(two))  # a call left out
    assert not json_equal(True, 1) and json_equal(1, 1.0) and not json_equal([1, 2], [2, 1]) and not json_equal("1", 1)


def test_rouge_l_is_rouge_scores_to_the_last_digit():
    """metrics.rouge_ls re-does RougeScorer(["rougeL"]) without its nltk import: the same F1 on texts with case,
    punctuation, digits, non-ASCII letters, repeats and empty sides."""
    from rouge_score import rouge_scorer

    rng = np.random.default_rng(0)
    words = ["The", "cat", "sat", "on", "the", "mat.", "Ünïcode", "42", "a-b", "...", "", "dog,", "RAN", "ran"]
    texts = [" ".join(rng.choice(words, size=rng.integers(0, 12))) for _ in range(300)]
    pairs = [(texts[i], texts[-i - 1]) for i in range(len(texts))] + PAIRS + [(t, t) for t in texts[:20]]
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    expected = [scorer.score(reference, answer)["rougeL"].fmeasure for answer, reference in pairs]
    assert METRICS["rouge_l"].per_example(pairs).tolist() == expected
    assert any(0 < e < 1 for e in expected) and any(e == 1 for e in expected) and any(e == 0 for e in expected)
