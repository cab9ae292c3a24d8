"""summarize's figures: training and held-out loss curves, throughput, the leaderboard, exact match per
category and one panel per task. summarize.py makes the tables these are drawn from and calls them; a figure
takes a frame and a path, saves a PNG (plotting.save_png) and returns what a test checks."""

import math
from pathlib import Path

import pandas as pd

from workflow_scripts.core.pipeline_io import read_metrics
from workflow_scripts.core.plotting import model_color, plt, save_png
from workflow_scripts.evals.metrics import HELDOUT, SCORES
from workflow_scripts.report.verdict import SMOOTH, smoothed
from workflow_scripts.report.winners import score_table, winners


def read_curve(path: Path) -> pd.DataFrame:
    """A node's metrics.jsonl as a frame, a row per logged step (pipeline_io.read_metrics)."""
    return pd.DataFrame(read_metrics(path))


def smoothed_loss(frame: pd.DataFrame, window: int = SMOOTH) -> pd.Series:
    """The training loss, each point the mean of the ``window`` logged losses around it (verdict.smoothed)."""
    return smoothed(frame["loss"].astype(float), window)


def held_out_points(frame: pd.DataFrame) -> pd.DataFrame:
    """The records with a held-out loss logged during training (training.eval_every): step, eval_loss."""
    if "eval_loss" not in frame:
        return pd.DataFrame({"step": [], "eval_loss": []})
    return frame.loc[frame["eval_loss"].notna(), ["step", "eval_loss"]]


def steps_per_epoch(frame: pd.DataFrame) -> float | None:
    """Optimizer steps per epoch, from two records' step and epoch ((step - 1) / steps per epoch)."""
    if "epoch" not in frame:
        return None
    known = frame.dropna(subset=["epoch"])
    if len(known) < 2 or known["epoch"].iloc[-1] == known["epoch"].iloc[0]:
        return None
    return (known["step"].iloc[-1] - known["step"].iloc[0]) / (known["epoch"].iloc[-1] - known["epoch"].iloc[0])


def plot_curves(curves: dict[str, pd.DataFrame], path: Path) -> list[str]:
    """Training loss (faint: as logged; solid: smoothed) and the held-out loss during training per node, with
    the epochs on the top axis; the gradient norm beside (the learning rate, the same schedule on every node,
    hid one node's line behind another's; it stays in metrics.jsonl and TensorBoard). Returns the loss panel's
    legend labels."""
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    for name, frame in curves.items():
        colour = model_color(name)
        ax_loss.plot(frame["step"], frame["loss"], color=colour, alpha=0.25, lw=1)
        ax_loss.plot(
            frame["step"], smoothed_loss(frame), color=colour, label=f"{name} training (centred mean of {SMOOTH})"
        )
        points = held_out_points(frame)
        if len(points):
            ax_loss.plot(points["step"], points["eval_loss"], color=colour, ls="--", marker="o", ms=4,
                         label=f"{name} held-out")  # fmt: skip
        if "grad_norm" in frame and frame["grad_norm"].notna().any():
            ax_lr.plot(frame["step"], frame["grad_norm"], color=colour, alpha=0.25, lw=1)
            ax_lr.plot(frame["step"], smoothed(frame["grad_norm"].astype(float)), color=colour,
                       label=name)  # fmt: skip
    ax_loss.set(xlabel="step", ylabel="loss", title="Training and held-out loss per node", yscale="log")
    # 0.5, 2, not 5 x 10^-1; between the powers of ten, 2, 3 and 5 only
    ax_loss.yaxis.set_major_formatter(lambda y, _: f"{y:g}")
    ax_loss.yaxis.set_minor_formatter(
        lambda y, _: f"{y:g}" if round(y / 10 ** math.floor(math.log10(y))) in (2, 3, 5) else ""
    )
    ax_lr.set(xlabel="step", ylabel="gradient norm", title="Gradient norm per node (faint: as logged)")
    per_epoch = {steps_per_epoch(frame) for frame in curves.values()}
    if len(per_epoch) == 1 and None not in per_epoch:  # the epochs on top where every node has the same
        spe = per_epoch.pop()
        top = ax_loss.secondary_xaxis("top", functions=(lambda s: s / spe, lambda e: e * spe))
        top.set_xlabel("epoch")
    for ax in (ax_loss, ax_lr):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    labels = [t.get_text() for t in ax_loss.get_legend().get_texts()]
    save_png(fig, path, dpi=110)
    return labels


def median_throughput(curves: dict[str, pd.DataFrame]) -> dict[str, float]:
    """Median tokens/s of each node over its logged intervals (the first one includes start-up)."""
    return {
        name: float(frame["tokens_per_s"].median())
        for name, frame in curves.items()
        if "tokens_per_s" in frame and frame["tokens_per_s"].notna().any()
    }


def plot_throughput(curves: dict[str, pd.DataFrame], path: Path) -> dict[str, float]:
    """Training throughput (tokens/s of all of a node's ranks together) per logged interval, every node overlaid."""
    medians = median_throughput(curves)
    fig, ax = plt.subplots(figsize=(11, 4))
    for name, median in medians.items():
        frame = curves[name]
        ax.plot(frame["step"], frame["tokens_per_s"], marker="o", ms=3, color=model_color(name),
                label=f"{name} (median {median:,.0f})")  # fmt: skip
    ax.set(xlabel="step", ylabel="tokens/s per node", title="Training throughput per node", ylim=(0, None))
    ax.grid(alpha=0.3)
    if medians:
        ax.legend()
    save_png(fig, path, dpi=110)
    return medians


def leaderboard_title(table: pd.DataFrame) -> tuple[str, list[str]]:
    """leaderboard.png's title and the models it outlines, in the verdict's words: the lowest eval loss, or the
    models tied with it within the 95% interval (winners.winners, as the text says); the highest exact match on
    a second line where that is another model or tie."""
    scores = score_table(table)
    board = winners(scores).set_index("metric")
    loss = board.loc["eval_loss"]
    best = table.set_index("model").loc[loss["best"]]
    vs_base = f", {best['eval_loss_vs_base']:.2f}x the base model's loss" if "eval_loss_vs_base" in best else ""
    tied = [loss["best"], *loss["ties"]]
    if loss["ties"]:
        title = (
            f"Eval loss: {' and '.join(tied)} tied within the 95% interval (lowest {best['eval_loss']:.3f}{vs_base})"
        )
    else:
        title = f"Lowest eval loss: {loss['best']} ({best['eval_loss']:.3f}{vs_base})"
    if "exact_match" in board.index:
        em = board.loc["exact_match"]
        top = [em["best"], *em["ties"]]
        if set(top) != set(tied):
            title += f"\nexact match: {' and '.join(top)} tied" if em["ties"] else f"\nhighest exact match: {top[0]}"
    return title, tied


def plot_leaderboard(table: pd.DataFrame, path: Path) -> str:
    """Eval loss per model with its 95% interval (where summary.csv has one), the lowest outlined (and every
    model tied with it) and named in the title (leaderboard_title). Returns the title."""
    title, outlined = leaderboard_title(table)
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(table) + 1.6))
    errors = None
    if {"eval_loss_lo", "eval_loss_hi"} <= set(table):
        errors = [
            (table["eval_loss"] - table["eval_loss_lo"]).tolist(),
            (table["eval_loss_hi"] - table["eval_loss"]).tolist(),
        ]
    ax.barh(table["model"], table["eval_loss"], xerr=errors, capsize=4, color=[model_color(m) for m in table["model"]],
            edgecolor=["black" if m in outlined else "none" for m in table["model"]], linewidth=2)  # fmt: skip
    for y, (loss, em) in enumerate(zip(table["eval_loss"], table["exact_match"], strict=True)):
        ax.text(loss, y, f"  loss {loss:.3f}   exact match {em:.3f}", va="bottom")
    ax.invert_yaxis()
    ax.set_xlim(0, table["eval_loss"].max() * 1.45)
    ax.set_title(title, fontweight="bold")
    ax.set_xlabel(
        "held-out loss, 95% bootstrap interval (lower is better)" if errors else "held-out loss (lower is better)"
    )
    save_png(fig, path)
    return title


def plot_categories(results: list[dict], path: Path) -> None:
    """Exact match per category, one bar per model."""
    table = pd.DataFrame({r["model"]: r.get("exact_match_by_category", {}) for r in results})
    fig, ax = plt.subplots(figsize=(11, 4))
    if len(table):
        table.plot.bar(ax=ax, rot=0, color=[model_color(m) for m in table.columns])
    ax.set(title="Exact match per category", ylabel="exact match", ylim=(0, 1))
    ax.grid(alpha=0.3, axis="y")
    save_png(fig, path)


def task_panels(tasks: pd.DataFrame, leave_out: list[str] = ()) -> dict[str, pd.DataFrame]:
    """What tasks.png draws, one panel per task: the held-out set's 0-1 scores (its loss is in leaderboard.png;
    ``leave_out``: the scores within noise of zero for every model, verdict.noise_metrics), then every extra
    task's metrics; a panel only where some model has a value. Where every held-out score is within noise of
    zero, all are drawn (at zero, the title says so): an empty figure would read as no scores at all."""
    panels = {}
    for task, rows in tasks.groupby("task", sort=False):
        if task == HELDOUT:
            scores = rows[rows["metric"].isin(SCORES)]
            kept = scores[~scores["metric"].isin(leave_out)]
            rows = kept if kept["value"].notna().any() else scores
        if rows["value"].notna().any():
            panels[task] = rows
    return panels


def plot_tasks(tasks: pd.DataFrame, path: Path, leave_out: list[str] = ()) -> list[str]:
    """One panel per task, bars per model grouped by metric with stderr error bars; the base model's bars hatched
    and grey, its value a dashed line across the group (``leave_out``: task_panels'). Returns the tasks drawn."""
    panels = task_panels(tasks, leave_out)
    models = list(dict.fromkeys(tasks["model"]))
    fig, axes = plt.subplots(len(panels) or 1, 1, figsize=(11, 3.6 * max(len(panels), 1)), squeeze=False)
    if not panels:
        ax = axes[0, 0]
        ax.axis("off")
        ax.text(0.5, 0.5, "No evaluation scores in the results", ha="center", va="center", fontsize=14)
    color = {m: model_color(m) for m in models}
    width = 0.8 / max(len(models), 1)
    for ax, (task, rows) in zip(axes[:, 0], panels.items(), strict=False):
        metrics = list(dict.fromkeys(rows["metric"]))
        by = rows.set_index(["model", "metric"])
        for i, model in enumerate(models):
            values = [by["value"].get((model, m), math.nan) for m in metrics]
            errors = [by["stderr"].get((model, m), math.nan) for m in metrics]
            xs = [x + (i - (len(models) - 1) / 2) * width for x in range(len(metrics))]
            base = model == "base"
            ax.bar(xs, values, width, yerr=errors, capsize=3, label=model,
                   color=color[model], edgecolor="black" if base else None, hatch="//" if base else None)  # fmt: skip
            if base:
                for x, v in enumerate(values):
                    if not math.isnan(v):
                        ax.hlines(v, x - 0.45, x + 0.45, colors="black", linestyles="dashed", linewidth=1)
        title = "held-out set (0-1, higher is better)" if task == HELDOUT else task
        if task == HELDOUT and set(rows.dropna(subset=["value"])["metric"]) <= set(leave_out):
            title = "held-out set (0-1): every score within noise of zero for every model"
        ax.set_xticks(range(len(metrics)), metrics)
        ax.set(title=title, ylabel="score", xlim=(-0.5, len(metrics) - 0.5))
        if (rows["value"].dropna() >= 0).all():
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
    if panels:
        axes[0, 0].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_png(fig, path)
    return list(panels)
