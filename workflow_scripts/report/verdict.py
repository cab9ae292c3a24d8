"""The verdict: the sentences the report's first page (and eval/leaderboard.txt) opens with.

A lead reads the first paragraph and stops: which model won each headline metric and by how much (or that the
models are tied within the 95% interval), how far from base, where the models learned different things (exact
match per category, the largest differences with their n and an interval), forgetting, and what the training
curves say (where the held-out loss bottomed, whether it still falls, the gap to the training loss). Every
number comes from summary.csv's rows, the per-category exact match of the eval results, the eval split's
category counts and each node's metrics.jsonl; the functions here are pure, so a test holds the sentences to
those files.

A 0-1 score on which every model is within noise of zero (BLEU on three-token answers) names no winner: it is
said in one sentence and left off the first page's lines and plots (``noise_metrics``).
"""

import math

import numpy as np
import pandas as pd

from workflow_scripts.evals.metrics import SCORES, lower_is_better
from workflow_scripts.report.winners import Z95, forgetting, pick, score_table, winners

NOISE = 0.01  # a 0-1 score whose every model's value and upper interval end are at most this: noise around zero
CATEGORY_LINES = 3  # the largest per-category differences said
SMOOTH = 5  # logged values the smoothed training loss (and gradient norm) averages, centred


def g3(x: float) -> str:
    """Three significant figures, trailing zeros kept (0.376, 1.70, 0.00); 1,059 from 1,000 on."""
    if x == 0:
        return "0.00"
    return f"{x:#.3g}".rstrip(".") if abs(x) < 1000 else f"{x:,.0f}"


def with_interval(value: float, lo: float, hi: float) -> str:
    if math.isnan(lo) or math.isnan(hi):
        return g3(value)
    return f"{g3(value)} [{g3(lo)}, {g3(hi)}]"


def noise_metrics(scores: pd.DataFrame) -> list[str]:
    """The held-out 0-1 scores on which every model is within noise of zero: its value and its interval's upper
    end at most NOISE (no model is told apart from a model that answers nothing)."""
    noise = []
    for metric in [m for m in SCORES if m in set(scores["metric"])]:
        rows = scores[scores["metric"] == metric]
        tops = rows[["value", "hi"]].max(axis=1, skipna=True)
        if len(rows) and (tops <= NOISE).all():
            noise.append(metric)
    return noise


def ratio_to_base(metric: str, value: float, base: float | None) -> str:
    """``0.21x base's 6.97``; where base is 0 (a score), base's value alone."""
    if base is None or math.isnan(base):
        return ""
    if base == 0:
        return f"base {g3(base)}"
    ratio = value / base
    return f"{ratio:.2g}x base's {g3(base)}" if ratio < 10 else f"{ratio:,.0f}x base's {g3(base)}"


def metric_sentences(scores: pd.DataFrame, base: str = "base") -> list[str]:
    """One sentence per ranked metric (not a noise one): the winner, its value and interval, its margin over the
    runner-up and the ratio to base; or the models tied within the interval, each with its value."""
    noise = noise_metrics(scores)
    values = scores.set_index(["metric", "model"])
    base_values = scores[scores["model"] == base].set_index("metric")["value"]
    lines = []
    for _, w in winners(scores[~scores["metric"].isin(noise)]).iterrows():
        metric, best = w["metric"], w["best"]
        group = scores[scores["metric"] == metric].set_index("model")
        b = base_values.get(metric)
        direction = "lower" if lower_is_better(metric) else "higher"
        if w["ties"]:
            tied = [best, *w["ties"]]
            each = ", ".join(f"{m} {with_interval(*group.loc[m, ['value', 'lo', 'hi']])}" for m in tied)
            ratio = ratio_to_base(metric, w["value"], b) if base not in tied else ""
            lines.append(f"{metric} ({direction} is better): {' and '.join(tied)} are tied within the 95% interval"
                         f" ({each}){'; the best is ' + ratio if ratio else ''}.")  # fmt: skip
            continue
        others, runner = group.drop(index=best), None
        text = f"{metric} ({direction} is better): {best} wins with {with_interval(w['value'], w['lo'], w['hi'])}"
        if len(others):
            runner = others["value"].idxmin() if lower_is_better(metric) else others["value"].idxmax()
            r = values.loc[(metric, runner)]
            text += (f", {g3(abs(w['value'] - r['value']))} {'below' if lower_is_better(metric) else 'above'}"
                     f" {runner} ({with_interval(r['value'], r['lo'], r['hi'])})")  # fmt: skip
        ratio = ratio_to_base(metric, w["value"], b) if best != base else ""
        lines.append(text + (f"; {ratio}" if ratio and runner != base else "") + ".")
    for metric in noise:
        top = scores[scores["metric"] == metric][["value", "hi"]].max().max()
        lines.append(f"{metric}: every model is within noise of zero (at most {g3(top)}), no winner; it is left off"
                     " this page (summary.csv has it).")  # fmt: skip
    return lines


def overall_sentence(scores: pd.DataFrame) -> str:
    """The first sentence: the model best or tied best on the most ranked metrics (winners.pick) and the count."""
    ranked = scores[~scores["metric"].isin(noise_metrics(scores))]
    if not len(ranked):
        return ""
    table = winners(ranked)
    wins: dict[str, int] = {}
    for _, w in table.iterrows():
        for m in [w["best"], *w["ties"]]:
            wins[m] = wins.get(m, 0) + 1
    model = pick(ranked)
    rest = ", ".join(f"{m} on {n}" for m, n in sorted(wins.items(), key=lambda kv: -kv[1]) if m != model)
    return (f"Overall: {model} is best or tied best on {wins[model]} of {len(table)} ranked metrics"
            f"{' (' + rest + ')' if rest else ''}.")  # fmt: skip


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``p`` of ``n``: sound at 0 and 1, where p ± z·se is not."""
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(p1: float, p2: float, n: int) -> tuple[float, float]:
    """Newcombe's interval of p1 - p2 from the two Wilson intervals (the two models scored on the same n
    examples, taken as independent: wider than a paired interval, so a difference it calls real is)."""
    l1, u1 = wilson(p1, n)
    l2, u2 = wilson(p2, n)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def category_differences(by_category: dict[str, dict[str, float]], counts: dict[str, int],
                         base: str = "base") -> pd.DataFrame:  # fmt: skip
    """Per category, the pair of models (not base, where two others exist) whose exact match differs most, with
    the category's n and the difference's 95% interval; only differences whose interval leaves out 0, largest
    first."""
    models = [m for m in by_category if m != base]
    if len(models) < 2:
        models = list(by_category)
    rows = []
    for category, n in counts.items():
        rates = {m: by_category[m][category] for m in models if category in by_category[m]}
        if len(rates) < 2 or not n:
            continue
        high, low = max(rates, key=rates.get), min(rates, key=rates.get)
        lo, hi = difference_interval(rates[high], rates[low], n)
        if lo > 0:
            rows.append(
                {
                    "category": category,
                    "n": n,
                    "high": high,
                    "high_value": rates[high],
                    "low": low,
                    "low_value": rates[low],
                    "difference": rates[high] - rates[low],
                    "lo": lo,
                    "hi": hi,
                }
            )
    frame = pd.DataFrame(rows, columns=["category", "n", "high", "high_value", "low", "low_value", "difference",
                                        "lo", "hi"])  # fmt: skip
    return frame.sort_values("difference", ascending=False, kind="stable").reset_index(drop=True)


def category_sentence(by_category: dict[str, dict[str, float]], counts: dict[str, int], base: str = "base") -> str:
    """The largest per-category differences between the models, or that none is beyond its interval."""
    if not by_category or not counts:
        return ""
    diffs = category_differences(by_category, counts, base)
    if not len(diffs):
        return "Per category (exact match): no two models differ beyond the 95% interval in any category."
    parts = [f"{d['category']} (n={d['n']}): {d['high']} {g3(d['high_value'])} against {d['low']}'s"
             f" {g3(d['low_value'])}, a difference of {g3(d['difference'])} [{g3(d['lo'])}, {g3(d['hi'])}]"
             for _, d in diffs.head(CATEGORY_LINES).iterrows()]  # fmt: skip
    more = len(diffs) - CATEGORY_LINES
    tail = f"; {more} more categor{'y differs' if more == 1 else 'ies differ'} less" if more > 0 else ""
    return "The models differ most by category (exact match, 95% interval): " + "; ".join(parts) + tail + "."


def forgetting_sentence(scores: pd.DataFrame, base: str = "base") -> str:
    if not (scores["model"] == base).any():
        return ""
    flagged = forgetting(scores, base)
    if not len(flagged):
        return f"Forgetting: no model is worse than {base} beyond the intervals on any metric."
    parts = [
        f"{f['model']} on {f['metric']} ({with_interval(f['value'], f['lo'], f['hi'])} against"
        f" {with_interval(f['base_value'], f['base_lo'], f['base_hi'])})"
        for _, f in flagged.iterrows()
    ]
    return f"Forgetting: worse than {base} beyond the intervals: " + "; ".join(parts) + "."


def smoothed(values: pd.Series, window: int = SMOOTH) -> pd.Series:
    """A centred moving mean over ``window`` logged values (fewer at the ends), taken of the logarithms where every
    value is positive (a geometric mean, as the loss plot's log axis shows it): a trailing mean lags half its
    window behind a falling loss and sat above the held-out curve for a whole LoRA run; a centred one has no
    lag on a straight stretch, an EMA of the same span lags twice as much."""
    if len(values) and (values > 0).all():
        return np.exp(np.log(values).rolling(window, center=True, min_periods=1).mean())
    return values.rolling(window, center=True, min_periods=1).mean()


# logged by every preference loss (train/preference.py), by no SFT step
PREFERENCE_SIGN = "rewards/accuracies"


def preference_note(frame: pd.DataFrame) -> str:
    """A preference run's training side: its reward accuracy at the end (smoothed), and why no gap is given (the
    training loss is DPO's, IPO's, SimPO's or ORPO's; the held-out loss is the chosen answers' cross-entropy)."""
    accuracy = frame[["step", PREFERENCE_SIGN]].dropna()
    note = "; no held-out minus training loss: the training loss is the preference objective's, not a cross-entropy"
    if len(accuracy):
        last = smoothed(accuracy[PREFERENCE_SIGN].astype(float)).iloc[-1]
        note += f"; training reward accuracy {g3(last)} at step {int(accuracy['step'].iloc[-1])}"
    return note


def dynamics_sentence(node: str, frame: pd.DataFrame) -> str:
    """What a node's curves say: the held-out minimum and its step, still improving or rising since, and the gap
    between the (smoothed) training loss and the held-out loss at the last evaluation, against the first."""
    if not len(frame) or "loss" not in frame:
        return ""
    train = smoothed(frame["loss"].astype(float))
    if "eval_loss" not in frame or frame["eval_loss"].notna().sum() == 0:
        return (
            f"{node}: no held-out loss logged during training (training.eval_every); its training loss went"
            f" from {g3(train.iloc[0])} to {g3(train.iloc[-1])} by step {int(frame['step'].iloc[-1])}."
        )
    held = frame.loc[frame["eval_loss"].notna(), ["step", "eval_loss"]].reset_index(drop=True)
    best = held["eval_loss"].idxmin()
    last = held.iloc[-1]
    low = held.iloc[best]
    if len(held) == 1:
        trend = f"held-out loss {g3(last['eval_loss'])} at step {int(last['step'])} (one evaluation)"
    elif best == len(held) - 1:
        before = held.iloc[-2]
        trend = (f"held-out loss at its minimum at the last evaluation, {g3(last['eval_loss'])} at step"
                 f" {int(last['step'])} (from {g3(before['eval_loss'])} at step {int(before['step'])}): still"
                 " improving")  # fmt: skip
    else:
        trend = (
            f"held-out minimum {g3(low['eval_loss'])} at step {int(low['step'])}, rising since to"
            f" {g3(last['eval_loss'])} at step {int(last['step'])}: overfitting after step {int(low['step'])}"
        )
    if PREFERENCE_SIGN in frame:  # a preference objective: its training loss is no loss of the held-out kind
        return f"{node}: {trend}{preference_note(frame)}."
    at = dict(zip(frame["step"], train, strict=True))
    gaps = [(int(s), e - at[s]) for s, e in zip(held["step"], held["eval_loss"], strict=True) if s in at]
    gap = ""
    if gaps:
        step, last_gap = gaps[-1]
        gap = f"; held-out minus training loss {g3(last_gap)} at step {step}"
        if len(gaps) > 1:
            first_step, first_gap = gaps[0]
            grew = "widening" if abs(last_gap) > abs(first_gap) else "narrowing"
            gap += f" ({grew} from {g3(first_gap)} at step {first_step})"
    return f"{node}: {trend}{gap}."


def verdict_lines(summary: pd.DataFrame, tasks: pd.DataFrame | None, curves: dict[str, pd.DataFrame],
                  by_category: dict[str, dict[str, float]] | None = None, counts: dict[str, int] | None = None,
                  base: str = "base") -> list[str]:  # fmt: skip
    """The verdict's sentences in the order a reader asks: who won each metric, where the models differ, did any
    forget, and what training did. ``summary``: summary.csv's rows; ``tasks``: tasks.csv's (the extra tasks'
    metrics); ``curves``: each node's metrics.jsonl as a frame; ``by_category``: each model's exact match per
    category; ``counts``: the held-out examples per category."""
    scores = score_table(summary, tasks)
    lines = [overall_sentence(scores)] + metric_sentences(scores, base)
    lines.append(category_sentence(by_category or {}, counts or {}, base))
    lines.append(forgetting_sentence(scores, base))
    lines += [dynamics_sentence(node, frame) for node, frame in curves.items()]
    return [line for line in lines if line]


def verdict_text(lines: list[str], width: int = 110) -> str:
    """The verdict as leaderboard.txt's first block: "Verdict:", then a bullet per sentence, wrapped."""
    import textwrap

    wrapped = [textwrap.fill(line, width, initial_indent="- ", subsequent_indent="  ") for line in lines]
    return "\n".join(["Verdict:", *wrapped])
