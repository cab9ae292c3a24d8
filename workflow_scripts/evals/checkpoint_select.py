"""Per-checkpoint evaluation (eval.checkpoints) and the best checkpoint's export (consolidate.select): pure pieces.

Which kept checkpoints a run scores, the rows of eval/checkpoints.csv built from their results (evaluation.py's
JSON, one per checkpoint), and which step is best on a metric. The metric's direction comes from the registry
(metrics.py): a held-out metric by its entry, a task's `<task>.<metric>` by its name (losses lower, scores higher).
The rules (rules/checkpoint_eval.smk), checkpoint_scores.py and export/consolidate.py share them, so the step
exported is the row the table marks best.
"""

import json
import math
import re
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.evals.metrics import METRICS, lower_is_better, task_scores

LEVEL_Z = 1.959964  # a task's interval from lm-eval's stderr: value +- z * stderr (95%, as the bootstrap's)
HELD_OUT = {"eval_loss": "held-out loss", "perplexity": "held-out perplexity"}


def kept_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under a run key's folder (step-<N> with its COMPLETE marker, as
    train/checkpoint.py writes them; read here without importing torch, at the workflow's parse)."""
    if not Path(root).is_dir():
        return []
    folders = (p for p in Path(root).iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / "COMPLETE").is_file())
    return sorted(int(p.name.split("-")[1]) for p in folders)


def steps_to_score(kept: list[int], mode: str, every: int | None) -> list[int]:
    """The kept checkpoints' steps eval.checkpoints scores: none for ``last`` (evaluate_model scores the exported
    model), every one for ``all``, for ``every_n`` those at multiples of eval.checkpoint_every and the newest
    (the run's end, whatever its step)."""
    kept = sorted(set(kept))
    if mode == "last" or not kept:
        return []
    if mode == "all":
        return kept
    if mode == "every_n":
        return [s for s in kept if s % every == 0 or s == kept[-1]]
    raise UserError(f"eval.checkpoints: {mode!r} is none of last, all, every_n")


def select_metric(select: str, tasks: list[str], checkpoints: str) -> str | None:
    """consolidate.select's metric (None for ``last``): ``best:<held-out metric>`` of the registry or
    ``best:<task>.<metric>`` of a task of eval.tasks. An unknown one, or best without per-checkpoint scores,
    stops with one line naming the key."""
    if select == "last":
        return None
    kind, _, metric = select.partition(":")
    if kind != "best" or not metric:
        raise UserError(f"consolidate.select: {select!r} is neither last nor best:<metric>")
    task, dot, name = metric.partition(".")
    if not dot and metric not in METRICS:
        known = ", ".join(METRICS)
        raise UserError(f"consolidate.select: {metric!r} is no held-out metric ({known}) nor <task>.<metric>")
    if dot and (task not in tasks or not name):
        raise UserError(f"consolidate.select: {metric!r}: {task!r} is not a task of eval.tasks ({tasks})")
    if checkpoints == "last":
        raise UserError(f"consolidate.select: {select} needs eval.checkpoints all or every_n (it is last)")
    return metric


def metric_value(result: dict, metric: str) -> tuple[float, float, float]:
    """(value, interval low, interval high) of ``metric`` in one evaluation result: a held-out metric with its
    bootstrap interval, a task's with value +- 1.96 stderr; NaNs where the result lacks it."""
    if "." not in metric:
        value = result.get(metric)
        bounds = (result.get("intervals") or {}).get(metric) or {}
        nan = math.nan
        return (nan if value is None else float(value)), bounds.get("lo", nan), bounds.get("hi", nan)
    task, _, name = metric.partition(".")
    value, stderr = task_scores(result).get(task, {}).get(name, (math.nan, math.nan))
    return value, value - LEVEL_Z * stderr, value + LEVEL_Z * stderr


def result_metrics(result: dict) -> list[str]:
    """Every metric of a result, in the registry's order then each task's: the csv's metric columns."""
    held_out = [m for m in METRICS if isinstance(result.get(m), int | float)]
    return held_out + [f"{t}.{m}" for t, scores in task_scores(result).items() for m in scores]


def score_row(model: str, step: int, tokens_seen: int | None, result: dict) -> dict:
    """One row of checkpoints.csv: model, step, tokens seen, each metric with its interval (``_lo``, ``_hi``)."""
    row = {"model": model, "step": step, "tokens_seen": tokens_seen}
    for metric in result_metrics(result):
        value, lo, hi = metric_value(result, metric)
        row |= {metric: value, f"{metric}_lo": lo, f"{metric}_hi": hi}
    return row


def tokens_seen(step: int, plan: dict) -> int | None:
    """Training tokens read up to ``step`` (the node's plan.json: tokens per epoch over steps per epoch)."""
    tokens, per_epoch = plan.get("tokens"), plan.get("steps_per_epoch")
    return round(tokens * step / per_epoch) if tokens and per_epoch else None


def best_step(scores: dict[int, dict], metric: str, where: str = "consolidate.select") -> tuple[int, float]:
    """(step, value) of the best of ``scores`` ({step: evaluation result}) on ``metric``: the lowest loss, the
    highest score; the later step on a tie. A metric no result has stops with one line naming it."""
    values = {step: metric_value(result, metric)[0] for step, result in scores.items()}
    values = {step: v for step, v in values.items() if not math.isnan(v)}
    if not values:
        raise UserError(f"{where}: no scored checkpoint has {metric} (steps {sorted(scores)})")
    sign = 1 if lower_is_better(metric) else -1
    step = min(values, key=lambda s: (sign * values[s], -s))
    return step, values[step]


def metric_words(metric: str) -> str:
    """How the leaderboard says the selection: "best held-out loss", "best demo_mc.acc"."""
    return f"best {HELD_OUT.get(metric, metric)}"


def selection_text(model: str, selected: dict) -> str:
    """ "node0 at step 300 of 560, best held-out loss (1.234)": the exported checkpoint of a best: selection."""
    return (
        f"{model} at step {selected['step']} of {selected['last_step']}, {metric_words(selected['metric'])}"
        f" ({selected['value']:.4g}; {selected['candidates']} checkpoints scored)"
    )


def selection_lines(folders: list[Path]) -> str:
    """The leaderboard's lines for the models exported by consolidate.select best (their consolidation.json's
    ``selected``): "Exported: node0 at step 300 of 560, best held-out loss (...)"; "" when every one is the last."""
    lines = []
    for folder in folders:
        record = Path(folder) / "consolidation.json"
        selected = json.loads(record.read_text()).get("selected") if record.exists() else None
        if selected:
            lines.append(f"Exported: {selection_text(Path(folder).name, selected)}\n")
    return "".join(lines)
