"""checkpoint_scores: every scored checkpoint of every trained model in one table, and its curves over steps.

eval.checkpoints all or every_n scores each kept checkpoint as its own job (rules/checkpoint_eval.smk:
evaluation.py on the checkpoint consolidated); this gathers their results into eval/checkpoints.csv (model,
step, tokens seen, every metric with its interval) and eval/checkpoints.png (a panel per metric over steps,
one line per model with its interval as a band). A checkpoint scored earlier and pruned since (by a later save
of the same run key) keeps its row: its result stays under eval/checkpoints/<model>/<checkpoint key>/, and the
results there of the model's current key are read too, so an old checkpoint's scores are reused, never recomputed.
"""

import argparse
import json
import math
import re
from pathlib import Path

import pandas as pd

from workflow_scripts.core.pipeline_io import UserError, atomic_path, cli
from workflow_scripts.core.plotting import model_color, plt, save_png
from workflow_scripts.evals.checkpoint_select import score_row, tokens_seen
from workflow_scripts.evals.metrics import direction

STEP_FILE = re.compile(r"step-(\d+)\.json")


def scored_results(state_path: Path, scores_root: Path, mode: str, every: int | None) -> dict[int, Path]:
    """{step: result file} of one trained model: the results under scores_root/<model>/<its checkpoint key>/
    (train_state.json's plan names the key's folder), every_n's multiples only where eval.checkpoints is
    every_n (and whichever its jobs asked for, passed as --results)."""
    state = json.loads(state_path.read_text())
    model = state_path.parent.name
    key = Path(state["plan"]["checkpoints"]).name
    found = {}
    for path in (scores_root / model / key).glob("step-*.json"):
        match = STEP_FILE.fullmatch(path.name)
        if match and (mode == "all" or (every and int(match.group(1)) % every == 0)):
            found[int(match.group(1))] = path
    return found


def table(states: list[Path], results: list[Path], scores_root: Path, mode: str, every: int | None) -> pd.DataFrame:
    """checkpoints.csv: a row per model and step, sorted so; a result file not valid JSON stops naming it."""
    rows = []
    asked = {(p.parent.parent.name, int(STEP_FILE.fullmatch(p.name).group(1))): p for p in results}
    for state_path in states:
        model = state_path.parent.name
        plan = json.loads(state_path.read_text())["plan"]
        found = scored_results(state_path, scores_root, mode, every)
        found |= {step: p for (m, step), p in asked.items() if m == model}
        for step, path in sorted(found.items()):
            try:
                result = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"{path}: unreadable checkpoint result ({type(e).__name__})") from None
            rows.append(score_row(model, step, tokens_seen(step, plan), result))
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=["model", "step", "tokens_seen"])
    frame["tokens_seen"] = frame["tokens_seen"].astype("Int64")
    return frame.sort_values(["model", "step"], kind="stable").reset_index(drop=True)


def metric_columns(frame: pd.DataFrame) -> list[str]:
    """The metrics of the table (each column that has its _lo and _hi beside it), in its order."""
    return [c for c in frame.columns if f"{c}_lo" in frame.columns and f"{c}_hi" in frame.columns]


def plot(frame: pd.DataFrame, path: Path) -> None:
    """A panel per metric over steps, each model a line in its colour with its interval as a band."""
    metrics = [m for m in metric_columns(frame) if frame[m].notna().any()] or ["(none scored)"]
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics, strict=False):
        for model, part in frame.groupby("model", sort=True) if metric in frame else ():
            color = model_color(str(model))
            ax.plot(part["step"], part[metric], marker="o", color=color, label=str(model))
            ax.fill_between(part["step"], part[f"{metric}_lo"], part[f"{metric}_hi"], color=color, alpha=0.15)
        ax.set_title(f"{metric} ({direction(metric)})" if metric in frame else metric, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        axes.flat[0].legend(handles, labels, fontsize=8)
    save_png(fig, path)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--states", nargs="+", required=True, type=Path, help="train_state.json of each trained model")
    p.add_argument("--results", nargs="*", default=[], type=Path, help="the checkpoint results the jobs made")
    p.add_argument("--scores-root", required=True, type=Path, help="eval/checkpoints: <model>/<key>/step-<N>.json")
    p.add_argument("--mode", required=True, choices=["all", "every_n"], help="eval.checkpoints")
    p.add_argument("--every", type=int, default=None, help="eval.checkpoint_every (every_n)")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--plot", required=True, type=Path)
    a = p.parse_args(argv)
    frame = table(a.states, a.results, a.scores_root, a.mode, a.every)
    with atomic_path(a.output) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.6g")
    plot(frame, a.plot)
    counts = frame.groupby("model").size().to_dict() if len(frame) else {}
    print(f"{a.output}: " + (", ".join(f"{m} {n} checkpoint(s)" for m, n in counts.items()) or "no checkpoint"))


if __name__ == "__main__":
    main()
