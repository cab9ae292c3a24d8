"""Honest winners: the best model per metric with its interval, ties said as ties, the models worse than their
base beyond the interval (forgetting), and where the winner is with two lines that load it.

The held-out scores carry a 95% bootstrap interval (intervals.py; summary.csv's ``<metric>_lo``/``_hi``); an
extra lm-eval task's metric its value ± 1.96 stderr (tasks.csv). Another model ties the best one when either's
value lies in the other's interval. A trained model (or soup) shows forgetting on a metric when its interval lies
wholly on the worse side of its base model's interval. summarize.py writes the lines into eval/leaderboard.txt, which
`make run` prints and the report's first page shows.
"""

import math

import pandas as pd

from workflow_scripts.evals.metrics import HELDOUT, LOSSES, RANKED, lower_is_better

Z95 = 1.959964  # the normal quantile of a 95% interval, for a task's value ± Z95 stderr
HELDOUT_METRICS = RANKED  # the registry's ranked metrics (perplexity ranks as eval_loss does: left out)
SCORE_COLUMNS = ["model", "metric", "value", "lo", "hi"]


def score_table(summary: pd.DataFrame, tasks: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per model x metric with its interval: the held-out metrics from summary.csv's columns (the
    interval NaN where a result has none), then each extra task's metrics (``<task>.<metric>``) from tasks.csv."""
    rows = []
    for metric in HELDOUT_METRICS:
        if metric not in summary:
            continue
        for _, r in summary.iterrows():
            lo, hi = r.get(f"{metric}_lo", math.nan), r.get(f"{metric}_hi", math.nan)
            rows.append({"model": r["model"], "metric": metric, "value": r[metric], "lo": lo, "hi": hi})
    if tasks is not None:
        for _, r in tasks[tasks["task"] != HELDOUT].iterrows():
            half = Z95 * r["stderr"]
            rows.append({"model": r["model"], "metric": f"{r['task']}.{r['metric']}", "value": r["value"],
                         "lo": r["value"] - half, "hi": r["value"] + half})  # fmt: skip
    table = pd.DataFrame(rows, columns=SCORE_COLUMNS)
    return table[table["value"].notna()].reset_index(drop=True)


def inside(value: float, lo: float, hi: float) -> bool:
    return lo <= value <= hi  # False where the interval is NaN


def winners(scores: pd.DataFrame) -> pd.DataFrame:
    """Per metric (in score_table's order): the best model, its value and interval, and the models tied with it
    (value in its interval or its value in theirs; without intervals only an equal value ties)."""
    rows = []
    for metric, group in scores.groupby("metric", sort=False):
        group = group.set_index("model")
        best = group["value"].idxmin() if lower_is_better(metric) else group["value"].idxmax()
        b = group.loc[best]
        ties = [
            m
            for m, r in group.drop(index=best).iterrows()
            if r["value"] == b["value"] or inside(r["value"], b["lo"], b["hi"]) or inside(b["value"], r["lo"], r["hi"])
        ]
        rows.append({"metric": metric, "best": best, "value": b["value"], "lo": b["lo"], "hi": b["hi"], "ties": ties})
    return pd.DataFrame(rows, columns=["metric", "best", "value", "lo", "hi", "ties"])


def forgetting(scores: pd.DataFrame, base: str = "base") -> pd.DataFrame:
    """The (model, metric) pairs where a model other than ``base`` is worse than ``base`` beyond the intervals:
    the model's whole interval above base's for a loss, below it for a score (where one has no interval, its
    value stands for it; where neither has one, nothing is flagged). A BLEU of 0 [0, 0] against base's
    0.001 [0, 0.001] is no forgetting."""
    base_rows = scores[scores["model"] == base].set_index("metric")
    base_values = base_rows["value"]
    rows = []
    for _, r in scores[scores["model"] != base].iterrows():
        if r["metric"] not in base_values:
            continue
        b, lower = base_values[r["metric"]], lower_is_better(r["metric"])
        b_lo, b_hi = base_rows.loc[r["metric"], ["lo", "hi"]]
        # the model's interval (its value without one) beyond base's interval (base's value without one)
        near, far = (r["lo"], b_hi) if lower else (r["hi"], b_lo)
        if math.isnan(near) and math.isnan(far):  # no interval to be beyond
            continue
        near = r["value"] if math.isnan(near) else near
        far = b if math.isnan(far) else far
        worse = near > far if lower else near < far
        if worse:
            rows.append({"model": r["model"], "metric": r["metric"], "value": r["value"], "lo": r["lo"],
                         "hi": r["hi"], "base_value": b, "base_lo": b_lo, "base_hi": b_hi})  # fmt: skip
    return pd.DataFrame(rows, columns=["model", "metric", "value", "lo", "hi", "base_value", "base_lo", "base_hi"])


def bounds(lo: float, hi: float) -> str:
    return f" [{lo:.3f}, {hi:.3f}]" if not (math.isnan(lo) or math.isnan(hi)) else ""


def winner_lines(scores: pd.DataFrame, base: str = "base") -> list[str]:
    """The leaderboard's first lines: a line per metric naming its best model (or the tie), its value and 95%
    interval and base's value, then the forgetting flags (or a line saying there are none)."""
    table = winners(scores)
    base_values = scores[scores["model"] == base].set_index("metric")["value"]
    width = max([len(m) for m in table["metric"]] + [11])
    lines = ["Best model per metric (95% interval in brackets; a model within the best one's interval ties it):"]
    for _, w in table.iterrows():
        who = " = ".join([w["best"], *w["ties"]]) + " (tie)" if w["ties"] else w["best"]
        line = f"  {w['metric']:<{width}}  {who} {w['value']:.3f}{bounds(w['lo'], w['hi'])}"
        if w["metric"] in base_values and w["best"] != base:
            line += f", base {base_values[w['metric']]:.3f}"
        lines.append(line + f" ({'lower' if lower_is_better(w['metric']) else 'higher'} is better)")
    flagged = forgetting(scores, base)
    if not len(base_values):
        return lines
    if not len(flagged):
        lines.append(f"Forgetting: no model is worse than {base} beyond the intervals on any metric")
    for _, f in flagged.iterrows():
        lines.append(
            f"Forgetting: {f['model']} is worse than {base} on {f['metric']}: {f['value']:.3f}"
            f"{bounds(f['lo'], f['hi'])} vs {f['base_value']:.3f}{bounds(f['base_lo'], f['base_hi'])}"
        )
    return lines


def pick(scores: pd.DataFrame) -> str:
    """The model to load: the one that is best (or tied best) on the most metrics, ties broken by eval loss."""
    table = winners(scores)
    wins: dict[str, int] = {}
    for _, w in table.iterrows():
        for m in [w["best"], *w["ties"]]:
            wins[m] = wins.get(m, 0) + 1
    losses = scores[scores["metric"] == LOSSES[0]].set_index("model")["value"]
    return min(wins, key=lambda m: (-wins[m], losses.get(m, math.inf)))


def load_lines(model: str, folder: str, wins: list[str]) -> list[str]:
    """Where ``model`` is and the two lines that load it with transformers."""
    return [
        f"Load {model} (best or tied best on {', '.join(wins)}), folder {folder}:",
        "  from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'  model, tokenizer = AutoModelForCausalLM.from_pretrained("{folder}"),'
        f' AutoTokenizer.from_pretrained("{folder}")',
    ]


def best_model_lines(scores: pd.DataFrame, folders: dict[str, str]) -> list[str]:
    """load_lines for pick's model, where its folder is known."""
    if not len(scores):
        return []
    model = pick(scores)
    table = winners(scores)
    won = [w["metric"] for _, w in table.iterrows() if model in [w["best"], *w["ties"]]]
    return load_lines(model, folders[model], won) if model in folders else []
