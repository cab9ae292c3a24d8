"""summarize: one table of every evaluated model and the training curves of every node."""

import argparse
import json
import math
from pathlib import Path

import pandas as pd
from metrics import HELDOUT, LOSSES, SCORES, direction, number, task_scores
from pipeline_io import atomic_path, cli, read_metrics
from plotting import model_color, plt, save_png
from winners import best_model_lines, score_table, winner_lines

COLUMNS = ["model", *LOSSES, *SCORES]  # summary.csv's first columns; HELDOUT is the held-out set's task in tasks.csv
TASK_COLUMNS = [
    "model",
    "task",
    "metric",
    "value",
    "stderr",
    "documents",
    "of_documents",
    "base_value",
    "delta_to_base",
]


def model_rank(model: str) -> int:
    """The order every table uses: base first, then the trained models, then the soups."""
    return -1 if model == "base" else int(model.startswith("soup"))


def task_metrics(results: list[dict]) -> dict[str, list[str]]:
    """Every extra task and its metrics over all results (a task one model lacks still counts), first seen first."""
    seen: dict[str, dict[str, None]] = {}
    for result in results:
        for task, metrics in task_scores(result).items():
            seen.setdefault(task, {}).update(dict.fromkeys(metrics))
    return {task: list(metrics) for task, metrics in seen.items()}


def summary_table(results: list[dict]) -> pd.DataFrame:
    """One row per model, base first, with the change against base, then a `<task>.<metric>` column per extra
    task's metric (their stderr is in tasks.csv)."""
    frame = pd.DataFrame(results)
    frame = frame[[c for c in COLUMNS if c in frame.columns]]
    frame = frame.sort_values("model", key=lambda s: s.map(model_rank), kind="stable")
    base = frame[frame["model"] == "base"]
    if len(base):
        frame["eval_loss_vs_base"] = frame["eval_loss"] / base["eval_loss"].iloc[0]
        frame["exact_match_delta"] = frame["exact_match"] - base["exact_match"].iloc[0]
    scores = {r["model"]: task_scores(r) for r in results}
    for task, metrics in task_metrics(results).items():
        for metric in metrics:
            column = [scores[m].get(task, {}).get(metric, (math.nan,))[0] for m in frame["model"]]
            frame[f"{task}.{metric}"] = column
    return frame.reset_index(drop=True)


def with_intervals(table: pd.DataFrame, results: list[dict]) -> pd.DataFrame:
    """The summary with ``<metric>_lo``, ``_hi`` and ``_stderr`` of each held-out score at its end (evaluation's
    bootstrap, a result's ``intervals``; NaN for a result without them)."""
    intervals = {r["model"]: r.get("intervals") or {} for r in results}
    for metric in [c for c in COLUMNS[1:] if c in table]:
        if any(metric in i for i in intervals.values()):
            for end in ("lo", "hi", "stderr"):
                table[f"{metric}_{end}"] = [intervals[m].get(metric, {}).get(end, math.nan) for m in table["model"]]
    return table


def tasks_table(results: list[dict]) -> pd.DataFrame:
    """The long table of tasks.csv: one row per model x task x metric (base, trained models, soups; the held-out
    set first as task "heldout", then each extra task), its stderr where known, base's value and the delta to it.
    A model without a task has NaN there."""
    results = sorted(results, key=lambda r: model_rank(r["model"]))
    heldout = [c for c in COLUMNS[1:] if any(c in r for r in results)]
    tasks = {HELDOUT: heldout} | task_metrics(results)
    rows = []
    for r in results:
        scores = {HELDOUT: {c: (number(r.get(c)), number(r.get(f"{c}_stderr"))) for c in heldout}} | task_scores(r)
        # the documents each score is over (eval.limit scores a task's first ones), and of how many
        documents = {HELDOUT: {"scored": r.get("examples"), "of": r.get("examples")}} | r.get("tasks_documents", {})
        for task, metrics in tasks.items():
            count = documents.get(task) or {}
            for metric in metrics:
                value, stderr = scores.get(task, {}).get(metric, (math.nan, math.nan))
                scored, of = number(count.get("scored")), number(count.get("of"))
                rows.append({"model": r["model"], "task": task, "metric": metric, "value": value, "stderr": stderr,
                             "documents": scored, "of_documents": of})  # fmt: skip
    table = pd.DataFrame(rows, columns=TASK_COLUMNS[:7])
    base = table[table["model"] == "base"].set_index(["task", "metric"])["value"]
    table["base_value"] = [base.get((t, m), math.nan) for t, m in zip(table["task"], table["metric"], strict=True)]
    table["delta_to_base"] = table["value"] - table["base_value"]
    return table


def leaderboard_text(table: pd.DataFrame, tasks: pd.DataFrame | None = None, folders: dict | None = None) -> str:
    """What the end of a run says: the best model per metric with its interval, ties and forgetting flags
    (winners.py; the held-out metrics, then every extra task's of ``tasks``), every model's numbers, then
    where the model to use is and how to load it (``folders``: model -> its folder). `make run` prints it;
    the report's first page shows it."""
    scores = score_table(table, tasks)
    columns = [c for c in ("model", "eval_loss", *SCORES) if c in table]
    lines = [
        *winner_lines(scores),
        "",
        f"{LOSSES[0]}: {direction(LOSSES[0])}; {', '.join(SCORES)}: 0-1, {direction(SCORES[0])}",
        table[columns].to_string(index=False, float_format="{:.3f}".format),
    ]
    if tasks is not None:  # eval.limit: a task scored on its first documents only, said on its lines
        extra = tasks[(tasks["task"] != HELDOUT) & (tasks["documents"] < tasks["of_documents"])]
        for task, rows in extra.groupby("task", sort=False):
            note = f" [first {rows['documents'].max():.0f} of {rows['of_documents'].max():.0f} documents: eval.limit]"
            lines = [line + note if line.startswith(f"  {task}.") else line for line in lines]
    load = best_model_lines(scores, folders or {})
    return "\n".join(lines + ([""] + load if load else [])) + "\n"


def decontamination_line(decon: dict | None) -> str:
    """data/decontamination.json in one line for the leaderboard: the training rows sharing an n-gram with
    what the models are scored on, per evaluation set the documents involved; "" without the file."""
    if decon is None:
        return ""
    sets = ", ".join(f"{name} {s['docs_contaminated']} of {s['docs']} docs" for name, s in decon["sets"].items())
    left = "left out" if decon["policy"] == "drop" else "trained on (data.decontaminate: report)"
    return (
        f"decontamination: {decon['training_rows_contaminated']} of {decon['training_rows']} training rows share a"
        f" {decon['ngram']}-gram with an evaluation set ({sets}), {left}\n"
    )


def examples_trained(plan: dict) -> dict:
    """From a training job's plan.json: the examples its shard(s) hold after tokenization, and how many
    the planned steps draw (all for whole epochs; with max_steps short of an epoch, or the last partial
    global batch of an epoch, fewer; exact without packing, pro rata of the packed bins with it)."""
    units = plan.get("packed_bins") or plan["examples"]
    drawn = min(units, plan["total_steps"] * plan["global_batch"])
    trained = plan["examples"] if drawn >= units else round(plan["examples"] * drawn / units)
    return {"examples_tokenized": plan["examples"], "examples_trained": trained}


def with_examples_trained(table: pd.DataFrame, metrics: list[Path]) -> pd.DataFrame:
    """The summary with examples_tokenized and examples_trained for each trained model (train/<node>/plan.json,
    beside its metrics); empty for the base model and the soups."""
    counts = {p.parent.name: examples_trained(json.loads((p.parent / "plan.json").read_text()))
              for p in metrics if (p.parent / "plan.json").exists()}  # fmt: skip
    if not counts:
        return table
    for column in ("examples_tokenized", "examples_trained"):
        table[column] = table["model"].map(lambda m, c=column: counts.get(m, {}).get(c)).astype("Int64")
    return table


def read_curve(path: Path) -> pd.DataFrame:
    """A node's metrics.jsonl as a frame, a row per logged step (pipeline_io.read_metrics)."""
    return pd.DataFrame(read_metrics(path))


SMOOTH = 10  # logged training losses the smoothed curve averages (status.py's loss column takes the same)


def smoothed_loss(frame: pd.DataFrame, window: int = SMOOTH) -> pd.Series:
    """The training loss, each point the mean of the last ``window`` logged losses (fewer at the start)."""
    return frame["loss"].rolling(window, min_periods=1).mean()


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
    the epochs on the top axis; the learning rate beside. Returns the loss panel's legend labels."""
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    for name, frame in curves.items():
        colour = model_color(name)
        ax_loss.plot(frame["step"], frame["loss"], color=colour, alpha=0.25, lw=1)
        ax_loss.plot(frame["step"], smoothed_loss(frame), color=colour, label=f"{name} training (mean of {SMOOTH})")
        points = held_out_points(frame)
        if len(points):
            ax_loss.plot(points["step"], points["eval_loss"], color=colour, ls="--", marker="o", ms=4,
                         label=f"{name} held-out")  # fmt: skip
        ax_lr.plot(frame["step"], frame["lr"], color=colour, label=name)
    ax_loss.set(xlabel="step", ylabel="loss", title="Training and held-out loss per node", yscale="log")
    # 0.5, 2, not 5 x 10^-1; between the powers of ten, 2, 3 and 5 only
    ax_loss.yaxis.set_major_formatter(lambda y, _: f"{y:g}")
    ax_loss.yaxis.set_minor_formatter(
        lambda y, _: f"{y:g}" if round(y / 10 ** math.floor(math.log10(y))) in (2, 3, 5) else ""
    )
    ax_lr.set(xlabel="step", ylabel="learning rate", title="Learning rate")
    per_epoch = {steps_per_epoch(frame) for frame in curves.values()}
    if len(per_epoch) == 1 and None not in per_epoch:  # the epochs on top where every node has the same
        spe = per_epoch.pop()
        top = ax_loss.secondary_xaxis("top", functions=(lambda s: s / spe, lambda e: e * spe))
        top.set_xlabel("epoch")
    for ax in (ax_loss, ax_lr):
        ax.grid(alpha=0.3)
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


def plot_leaderboard(table: pd.DataFrame, path: Path) -> str:
    """Eval loss per model with its 95% interval (where summary.csv has one), the lowest outlined and named in
    the title with the model of highest exact match when that is another. Returns the lowest's name."""
    best = table.loc[table["eval_loss"].idxmin()]
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(table) + 1.6))
    errors = None
    if {"eval_loss_lo", "eval_loss_hi"} <= set(table):
        errors = [
            (table["eval_loss"] - table["eval_loss_lo"]).tolist(),
            (table["eval_loss_hi"] - table["eval_loss"]).tolist(),
        ]
    ax.barh(table["model"], table["eval_loss"], xerr=errors, capsize=4, color=[model_color(m) for m in table["model"]],
            edgecolor=["black" if m == best["model"] else "none" for m in table["model"]], linewidth=2)  # fmt: skip
    for y, (loss, em) in enumerate(zip(table["eval_loss"], table["exact_match"], strict=True)):
        ax.text(loss, y, f"  loss {loss:.3f}   exact match {em:.3f}", va="bottom")
    ax.invert_yaxis()
    ax.set_xlim(0, table["eval_loss"].max() * 1.45)
    vs_base = f", {best['eval_loss_vs_base']:.2f}x the base model's loss" if "eval_loss_vs_base" in best else ""
    title = f"Lowest eval loss: {best['model']} ({best['eval_loss']:.3f}{vs_base})"
    top_em = table.loc[table["exact_match"].idxmax(), "model"] if table["exact_match"].notna().any() else None
    if top_em is not None and top_em != best["model"]:
        title += f"\nhighest exact match: {top_em}"
    ax.set_title(title, fontweight="bold")
    ax.set_xlabel(
        "held-out loss, 95% bootstrap interval (lower is better)" if errors else "held-out loss (lower is better)"
    )
    save_png(fig, path)
    return str(best["model"])


def plot_categories(results: list[dict], path: Path) -> None:
    """Exact match per category, one bar per model."""
    table = pd.DataFrame({r["model"]: r.get("exact_match_by_category", {}) for r in results})
    fig, ax = plt.subplots(figsize=(11, 4))
    if len(table):
        table.plot.bar(ax=ax, rot=0, color=[model_color(m) for m in table.columns])
    ax.set(title="Exact match per category", ylabel="exact match", ylim=(0, 1))
    ax.grid(alpha=0.3, axis="y")
    save_png(fig, path)


def task_panels(tasks: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """What tasks.png draws, one panel per task: the held-out set's 0-1 scores (its loss is in leaderboard.png),
    then every extra task's metrics; a panel only where some model has a value."""
    panels = {}
    for task, rows in tasks.groupby("task", sort=False):
        if task == HELDOUT:
            rows = rows[rows["metric"].isin(SCORES)]
        if rows["value"].notna().any():
            panels[task] = rows
    return panels


def plot_tasks(tasks: pd.DataFrame, path: Path) -> list[str]:
    """One panel per task, bars per model grouped by metric with stderr error bars; the base model's bars hatched
    and grey, its value a dashed line across the group. Returns the tasks drawn."""
    panels = task_panels(tasks)
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
        ax.set_xticks(range(len(metrics)), metrics)
        ax.set(title=title, ylabel="score", xlim=(-0.5, len(metrics) - 0.5))
        if (rows["value"].dropna() >= 0).all():
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
    if panels:
        axes[0, 0].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_png(fig, path)
    return list(panels)


def consolidation_table(folders: list[Path]) -> pd.DataFrame:
    """One row per consolidated model: what was read, how the self-check went, peak memory per phase."""
    rows = []
    for folder in folders:
        report = json.loads((folder / "consolidation.json").read_text())
        index = folder / "model.safetensors.index.json"
        size = (
            json.loads(index.read_text())["metadata"]["total_size"]
            if index.exists()
            else sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        )
        row = {
            "model": folder.name,
            "strategy": report["strategy"],
            "peft": report["peft"],
            "step": report["step"],
            "weight_files": len(report["weight_files"]),
            "dtype": report.get("dtype", "float32"),  # written before consolidate.dtype: fp32
            "weights_mb": size / 2**20,
            "max_logit_diff": report["max_logit_diff"],
            "generation_ok": report["generation_ok"],
        }
        peaks = report.get("peak_rss_mb", {})  # in the order the phases run
        row |= {f"peak_rss_mb_{p}": peaks[p] for p in ("training_side_model", "write", "reload_check") if p in peaks}
        rows.append(row)
    return pd.DataFrame(rows)


def last_user_turns(split: Path) -> dict[str, str]:
    """The eval split's (data/eval.parquet) last user turn of each conversation by its content_hash: the prompt
    as written, without the chat template's markup."""
    frame = pd.read_parquet(split, columns=["messages", "content_hash"])
    turns = {}
    for messages, key in zip(frame["messages"], frame["content_hash"], strict=True):
        users = [m["content"] for m in json.loads(messages)[:-1] if m["role"] == "user"]
        turns[key] = users[-1] if users else ""
    return turns


def samples_table(results: list[dict], questions: dict[str, str] | None = None) -> pd.DataFrame:
    """Prompt (the last user turn where ``questions`` has the example, else the rendered prompt's end), reference,
    and every model's answer with ``<model>_correct`` beside it (its exact match: evaluation's per-example
    verdict)."""
    from heldout import exact_matches

    base = results[0]["samples"]
    questions = questions or {}
    rows = [{"prompt": questions.get(s.get("content_hash"), s.get("prompt", "")), "reference": s["reference"]}
            for s in base]  # fmt: skip
    for r in results:
        for row, sample in zip(rows, r["samples"], strict=False):
            row[r["model"]] = sample["prediction"]
            correct = sample.get("correct")
            if correct is None:  # a result written before evaluation kept its verdict: judged as it judges
                correct = exact_matches([(sample["prediction"], sample["reference"])])[0]
            row[f"{r['model']}_correct"] = bool(correct)
    return pd.DataFrame(rows)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", nargs="+", required=True, type=Path, help="eval/<model>.json files")
    p.add_argument("--metrics", nargs="+", required=True, type=Path, help="train/node<i>/metrics.jsonl files")
    p.add_argument("--summary", required=True, type=Path)
    p.add_argument("--tasks", required=True, type=Path, help="tasks.csv: one row per model x task x metric")
    p.add_argument("--tasks-plot", required=True, type=Path, help="tasks.png: one panel per task")
    p.add_argument("--curves", required=True, type=Path)
    p.add_argument("--throughput", required=True, type=Path)
    p.add_argument("--categories", required=True, type=Path)
    p.add_argument("--leaderboard", required=True, type=Path)
    p.add_argument("--leaderboard-text", required=True, type=Path)
    p.add_argument("--samples", required=True, type=Path)
    p.add_argument("--models", nargs="+", required=True, type=Path, help="models/<node> folders")
    p.add_argument("--consolidation", required=True, type=Path)
    p.add_argument("--eval-split", type=Path, help="data/eval.parquet: the samples' prompts without the template")
    p.add_argument("--decontamination", type=Path, help="data/decontamination.json: a line on the leaderboard")
    p.add_argument("--trackers", nargs="*", default=[], help="logging.trackers: their runs get the summary")
    a = p.parse_args(argv)
    results = [json.loads(p.read_text()) for p in a.results]
    table = with_intervals(with_examples_trained(summary_table(results), a.metrics), results)
    with atomic_path(a.summary) as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    tasks = tasks_table(results)
    with atomic_path(a.tasks) as tmp:
        tasks.to_csv(tmp, index=False, float_format="%.6g")
    plot_tasks(tasks, a.tasks_plot)
    curves = {p.parent.name: read_curve(p) for p in a.metrics}
    plot_curves(curves, a.curves)
    for node, tps in plot_throughput(curves, a.throughput).items():
        print(f"{node}: median {tps:,.0f} tokens/s")
    plot_categories(results, a.categories)
    plot_leaderboard(table, a.leaderboard)
    board = leaderboard_text(table, tasks, {r["model"]: r["path"] for r in results if r.get("path")})
    board += decontamination_line(json.loads(a.decontamination.read_text()) if a.decontamination else None)
    with atomic_path(a.leaderboard_text) as tmp:
        tmp.write_text(board)
    with atomic_path(a.samples) as tmp:
        questions = last_user_turns(a.eval_split) if a.eval_split else None
        samples_table(results, questions).to_csv(tmp, index=False)
    with atomic_path(a.consolidation) as tmp:
        consolidation_table(a.models).to_csv(tmp, index=False, float_format="%.6g")
    print(table.to_string(index=False))
    print(board, end="")
    attach_to_trackers(a, table)


def model_scores(table: pd.DataFrame, model: str) -> dict[str, float]:
    """The finite numbers of ``model``'s summary row, by column."""
    rows = table[table["model"] == model]
    if rows.empty:
        return {}
    row = rows.iloc[0].drop("model")
    numbers = {k: v for k, v in row.items() if pd.api.types.is_number(v) and not isinstance(v, bool)}
    return {k: float(v) for k, v in numbers.items() if math.isfinite(v)}


def attach_to_trackers(a: argparse.Namespace, table: pd.DataFrame) -> None:
    """Each trained model's tracker runs (trackers.json beside its metrics.jsonl) get its scores, the summary
    table and the leaderboard (logging.trackers wandb and mlflow)."""
    if not set(a.trackers) & {"wandb", "mlflow"}:
        return
    from trackers import RUN_FILE, attach

    files = [a.summary, a.tasks, a.leaderboard_text, a.leaderboard]
    for metrics in a.metrics:
        model = metrics.parent.name
        for line in attach(metrics.parent / RUN_FILE, a.trackers, model_scores(table, model), files, table):
            print(f"{model}: eval summary and leaderboard attached to {line}")


if __name__ == "__main__":
    main()
