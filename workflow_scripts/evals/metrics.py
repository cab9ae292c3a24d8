"""The metrics of an evaluation result, named once: the held-out set's metrics in one registry (METRICS), which
way is better, and how an extra task's are read from lm-eval's keys.

A held-out metric is one ``Metric`` entry in METRICS (and its per-example function): heldout.py gives lm-eval
its corpus aggregation, evaluation.py writes its value, intervals.py bootstraps it, summarize.py tables it,
winners.py and grid.py rank it, all from the entry. To add one, write its per-example function here and append
``generation_metric(...)`` (scored on the (answer, reference) pairs of the generated answers) or
``loss_metric(...)`` (a function of the token-weighted held-out loss) to METRICS; nothing else changes.
sacrebleu and rouge_score are imported where a metric is computed: the tables read this module without them.
"""

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from workflow_scripts.data.tool_calls import calls_in_text, same_calls

HELDOUT, HELDOUT_LOSS = "heldout", "heldout_loss"  # the held-out set's lm-eval tasks: generation, loss
NOT_METRICS = {"examples", "label_tokens"}  # numeric keys of a result that describe the eval set, not the model
LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte")  # other metric names containing these: lower is better


@dataclass(frozen=True)
class Metric:
    """A held-out metric. ``aggregate`` is the corpus score from per-example rows (the bootstrap recomputes it
    on resampled rows, so it must be the corpus score's own formula); ``per_example`` makes those rows from the
    (answer, reference) pairs, one row per example, or is None for a loss metric, whose rows are each example's
    (summed loss, label tokens). ``corpus`` is the value the result reports: for a generation metric lm-eval's
    aggregation over the pairs (by default aggregate(per_example(pairs))), for a loss metric a function of the
    token-weighted loss. ``ranked``: winners.py names a best model by it (perplexity ranks as eval_loss does)."""

    name: str
    higher_is_better: bool
    aggregate: Callable[[np.ndarray], float]
    per_example: Callable[[list[tuple[str, str]]], np.ndarray] | None = None
    corpus: Callable | None = None
    ranked: bool = True

    @property
    def is_loss(self) -> bool:
        return self.per_example is None

    def score(self, pairs_or_loss) -> float:
        """The reported value: corpus(pairs) (or of the loss), or aggregate(per_example(pairs))."""
        if self.corpus is not None:
            return self.corpus(pairs_or_loss)
        return float(self.aggregate(self.per_example(pairs_or_loss)))


def token_loss(rows: np.ndarray) -> float:
    """Token-weighted loss of (summed loss, tokens) rows."""
    return float(rows[:, 0].sum() / max(rows[:, 1].sum(), 1))


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(50) so a diverged model's perplexity is a number."""
    return math.exp(min(loss, 50))


def loss_metric(name: str, of_loss: Callable[[float], float], **options) -> Metric:
    """A metric that is a function of the token-weighted held-out loss (lower is better)."""
    return Metric(name, False, lambda rows: of_loss(token_loss(rows)), corpus=of_loss, **options)


def generation_metric(name: str, per_example, aggregate=np.mean, corpus=None, higher_is_better=True) -> Metric:
    """A metric of the greedy answers against their references (by default the mean of a per-example score)."""
    return Metric(name, higher_is_better, aggregate, per_example, corpus)


# per-example functions of (answer, reference) pairs
def exact_matches(pairs) -> list[bool]:
    """Per pair: the answer equals its reference, ends stripped and inner runs of whitespace taken as one space."""
    return [re.sub(r"\s+", " ", a).strip() == re.sub(r"\s+", " ", r).strip() for a, r in pairs]


def exact_match(pairs) -> float:
    """The share of answers equal to their reference (exact_matches)."""
    same = exact_matches(pairs)
    return sum(same) / max(len(same), 1)


def rouge_ls(pairs) -> list[float]:
    """Per pair: ROUGE-L F1 as rouge_score's ``RougeScorer(["rougeL"], use_stemmer=False)`` scores it: its
    tokenizer and F-measure over the longest common subsequence of the tokens. Not RougeScorer itself: its module
    imports nltk for the stemmer (off here), and nltk's package import brings scikit-learn and scipy.stats (1.3-1.8
    s of CPU in every evaluation job); tests/evals/test_metrics.py holds the two equal."""
    from rouge_score import scoring, tokenize

    scores = []
    for answer, reference in pairs:
        target, prediction = tokenize.tokenize(reference, None), tokenize.tokenize(answer, None)
        lcs = lcs_length(target, prediction)
        scores.append(scoring.fmeasure(lcs / len(prediction), lcs / len(target)) if lcs else 0.0)
    return scores


def lcs_length(a: list[str], b: list[str]) -> int:
    """The length of the longest common subsequence of ``a`` and ``b`` (rouge_scorer's table, one row kept)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(pairs) -> float:
    """Mean ROUGE-L F1 (rouge_ls)."""
    return sum(rouge_ls(pairs)) / max(len(pairs), 1)


@functools.cache
def sacrebleu_metric(name: str):
    """sacrebleu's BLEU() or CHRF() with its defaults (those of corpus_bleu and corpus_chrf)."""
    import sacrebleu

    return {"bleu": sacrebleu.BLEU, "chrf": sacrebleu.CHRF}[name]()


def sacrebleu_stats(name: str) -> Callable:
    """Per pair: the sacrebleu metric's sufficient statistics (n-gram counts), one reference each."""

    def stats(pairs) -> np.ndarray:
        answers, references = map(list, zip(*pairs, strict=True))
        return np.asarray(sacrebleu_metric(name)._extract_corpus_statistics(answers, [references]), dtype=float)

    return stats


def sacrebleu_score(name: str) -> Callable[[np.ndarray], float]:
    """The sacrebleu metric's corpus score on 0-1 from summed per-example statistics (identical texts give
    100.00000000000004: capped at 1)."""
    return lambda rows: min(sacrebleu_metric(name)._compute_score_from_stats(list(rows.sum(axis=0))).score / 100, 1.0)


def sacrebleu_corpus(name: str) -> Callable:
    """lm-eval's aggregation: sacrebleu's corpus_bleu / corpus_chrf over the pairs, on 0-1 (capped as above)."""

    def corpus(pairs) -> float:
        import sacrebleu

        score = {"bleu": sacrebleu.corpus_bleu, "chrf": sacrebleu.corpus_chrf}[name]
        answers, references = map(list, zip(*pairs, strict=True))
        return min(score(answers, [references]).score / 100, 1.0)

    return corpus


def tool_call_matches(pairs) -> list[float]:
    """Per pair: NaN where the reference makes no tool call (a plain answer); else 1 when the answer's calls parse
    and equal the reference's, names and arguments as JSON values (tool_calls.same_calls), 0 otherwise."""
    out = []
    for answer, reference in pairs:
        expected = calls_in_text(reference)
        out.append(float(same_calls(calls_in_text(answer), expected)) if expected else math.nan)
    return out


def share_of_calls(rows) -> float:
    """The mean of the rows that are tool-call turns (not NaN); NaN when there is none."""
    rows = np.asarray(rows, dtype=float)
    rows = rows[~np.isnan(rows)]
    return float(rows.mean()) if len(rows) else math.nan


def tool_call(pairs) -> float:
    """The share of held-out tool-call turns whose generated calls equal the reference's (tool_call_matches)."""
    return share_of_calls(tool_call_matches(pairs))


def as_floats(per_pair: Callable) -> Callable[[list], np.ndarray]:
    return lambda pairs: np.asarray(per_pair(pairs), dtype=float)


# The registry: a new held-out metric is one entry here (summary.csv's columns follow this order).
METRICS = {
    m.name: m
    for m in [
        loss_metric("eval_loss", lambda loss: loss),
        loss_metric("perplexity", perplexity, ranked=False),
        generation_metric("exact_match", as_floats(exact_matches), corpus=exact_match),
        generation_metric("rouge_l", as_floats(rouge_ls), corpus=rouge_l),
        generation_metric("bleu", sacrebleu_stats("bleu"), sacrebleu_score("bleu"), sacrebleu_corpus("bleu")),
        generation_metric("chrf", sacrebleu_stats("chrf"), sacrebleu_score("chrf"), sacrebleu_corpus("chrf")),
        # over the held-out turns that call tools only; NaN (left out of a result) when the set has none
        Metric("tool_call", True, share_of_calls, as_floats(tool_call_matches), tool_call, ranked=False),
    ]
}
LOSSES = [m.name for m in METRICS.values() if m.is_loss]  # the held-out loss task's (token-weighted)
SCORES = [m.name for m in METRICS.values() if not m.is_loss]  # the held-out generation task's, on 0-1
RANKED = [m.name for m in METRICS.values() if m.ranked]  # winners.py's held-out metrics


def lower_is_better(metric: str) -> bool:
    """A held-out metric by its registry entry; another (a `<task>.<metric>` column by its metric part) by its
    name: losses and perplexities."""
    if metric in METRICS:
        return not METRICS[metric].higher_is_better
    return any(word in metric.split(".")[-1] for word in LOWER_IS_BETTER)


def direction(metric: str) -> str:
    """How a plot or a table says which way is better."""
    return f"{'lower' if lower_is_better(metric) else 'higher'} is better"


def number(value) -> float:
    """A metric's value as a float; NaN for anything else (lm-eval writes "N/A" for a stderr it cannot compute)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def metric_key(key: str) -> tuple[str, bool]:
    """A task's result key as (metric, is its stderr): "acc" and lm-eval's own "acc,none" are ("acc", False),
    "acc_stderr" and "acc_stderr,none" ("acc", True); a filter other than none stays in the name, as
    "exact_match/strict-match"."""
    name, _, filtered = key.partition(",")
    stderr = name.endswith("_stderr")
    name = name.removesuffix("_stderr")
    return (name if filtered in ("", "none") else f"{name}/{filtered}"), stderr


def task_scores(result: dict) -> dict[str, dict[str, tuple[float, float]]]:
    """A result's extra lm-eval tasks as {task: {metric: (value, stderr)}}; metrics in the order written,
    entries that are not numbers (an lm-eval "alias") left out. {} when the result has no "tasks"."""
    tasks = {}
    for task, metrics in (result.get("tasks") or {}).items():
        values, errors = {}, {}
        for key, value in metrics.items():
            metric, stderr = metric_key(key)
            (errors if stderr else values)[metric] = number(value)
        tasks[task] = {m: (v, errors.get(m, math.nan)) for m, v in values.items() if not math.isnan(v)}
    return tasks
