"""The metrics of an evaluation result, named once: which ones the held-out set has, which way is better, and
how an extra task's are read from lm-eval's keys. evaluation.py writes them (heldout.py computes them),
summarize.py tables and plots them, grid.py compares a grid's variants by them."""

import math

HELDOUT, HELDOUT_LOSS = "heldout", "heldout_loss"  # the held-out set's lm-eval tasks: generation, loss
LOSSES = ["eval_loss", "perplexity"]  # the held-out loss task's (token-weighted), lower is better
SCORES = ["exact_match", "rouge_l", "bleu", "chrf"]  # the held-out generation task's, all on 0-1, higher is better
NOT_METRICS = {"examples", "label_tokens"}  # numeric keys of a result that describe the eval set, not the model
LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte")  # metric names containing these; higher is better otherwise


def lower_is_better(metric: str) -> bool:
    """By the metric's name (a `<task>.<metric>` column by its metric part): losses and perplexities."""
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
