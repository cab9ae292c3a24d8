"""summarize: one table of every evaluated model and the training curves of every node.

This module makes the tables (summary.csv, tasks.csv, samples.csv, consolidation.csv, leaderboard.txt) and
runs the stage; summary_plots.py draws the figures from them. The held-out metrics' columns come from
metrics.py's registry (a new metric is added there, not here)."""

import argparse
import json
import math
from pathlib import Path

import pandas as pd

from workflow_scripts.core.pipeline_io import atomic_path, cli
from workflow_scripts.evals.checkpoint_select import selection_lines, selection_text
from workflow_scripts.evals.metrics import HELDOUT, LOSSES, SCORES, direction, number, task_scores
from workflow_scripts.report.summary_plots import (
    plot_categories,
    plot_curves,
    plot_leaderboard,
    plot_tasks,
    plot_throughput,
    read_curve,
)
from workflow_scripts.report.verdict import noise_metrics, verdict_lines, verdict_text
from workflow_scripts.report.winners import best_model_lines, score_table, winner_lines

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


def leaderboard_text(table: pd.DataFrame, tasks: pd.DataFrame | None = None, folders: dict | None = None,
                     verdict: list[str] | None = None) -> str:  # fmt: skip
    """What the end of a run says: the verdict's sentences (verdict.py) where given, the best model per metric with
    its interval, ties and forgetting flags (winners.py; the held-out metrics, then every extra task's of
    ``tasks``; a metric within noise of zero for every model is left out, the verdict says so), every model's
    numbers, then where the model to use is and how to load it (``folders``: model -> its folder). `make run`
    prints it; the report's first page shows it."""
    scores = score_table(table, tasks)
    noise = noise_metrics(scores)
    scores = scores[~scores["metric"].isin(noise)]
    columns = [c for c in ("model", "eval_loss", *SCORES) if c in table and c not in noise]
    lines = [
        *([verdict_text(verdict), ""] if verdict else []),
        *winner_lines(scores),
        "",
        f"{LOSSES[0]}: {direction(LOSSES[0])}; {', '.join(c for c in SCORES if c in columns)}: 0-1,"
        f" {direction(SCORES[0])}",
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
        if report.get("selected"):  # consolidate.select best:<metric>: which checkpoint, why
            row["selected"] = selection_text(folder.name, report["selected"])
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


def category_counts(split: Path | None) -> dict[str, int]:
    """The eval split's examples per category (the n of each per-category exact match); {} without one."""
    if split is None:
        return {}
    frame = pd.read_parquet(split)
    if "category" not in frame:
        return {}
    return {str(c): int(n) for c, n in frame["category"].value_counts(sort=False).items() if c}


def samples_table(results: list[dict], questions: dict[str, str] | None = None) -> pd.DataFrame:
    """Prompt (the last user turn where ``questions`` has the example, else the rendered prompt's end), reference,
    and every model's answer with ``<model>_correct`` beside it (its exact match: evaluation's per-example
    verdict)."""
    from workflow_scripts.evals.metrics import exact_matches

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
def with_tasks(results: list[dict], extra: list[dict]) -> list[dict]:
    """``results`` with the tasks of ``extra`` (files of the same form: model, tasks, tasks_documents) by model:
    the held-out preference accuracy (evals/preference_eval.py) beside lm-eval's tasks."""
    by_model = {e["model"]: e for e in extra}
    return [
        r | {key: (r.get(key) or {}) | by_model[r["model"]].get(key, {}) for key in ("tasks", "tasks_documents")}
        if r["model"] in by_model else r
        for r in results
    ]  # fmt: skip


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
    p.add_argument("--preference", nargs="*", default=[], type=Path,
                   help="eval/preference/<model>.json (objective dpo): a task of each model's")  # fmt: skip
    a = p.parse_args(argv)
    results = with_tasks(
        [json.loads(p.read_text()) for p in a.results], [json.loads(p.read_text()) for p in a.preference]
    )
    table = with_intervals(with_examples_trained(summary_table(results), a.metrics), results)
    with atomic_path(a.summary) as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    tasks = tasks_table(results)
    with atomic_path(a.tasks) as tmp:
        tasks.to_csv(tmp, index=False, float_format="%.6g")
    noise = noise_metrics(score_table(table, tasks))
    plot_tasks(tasks, a.tasks_plot, leave_out=noise)
    curves = {p.parent.name: read_curve(p) for p in a.metrics}
    plot_curves(curves, a.curves)
    for node, tps in plot_throughput(curves, a.throughput).items():
        print(f"{node}: median {tps:,.0f} tokens/s")
    plot_categories(results, a.categories)
    plot_leaderboard(table, a.leaderboard)
    by_category = {r["model"]: r["exact_match_by_category"] for r in results if r.get("exact_match_by_category")}
    verdict = verdict_lines(table, tasks, curves, by_category, category_counts(a.eval_split))
    board = leaderboard_text(table, tasks, {r["model"]: r["path"] for r in results if r.get("path")}, verdict)
    board += selection_lines(a.models)  # consolidate.select best: the exported step
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
    from workflow_scripts.train.trackers import RUN_FILE, attach

    files = [a.summary, a.tasks, a.leaderboard_text, a.leaderboard]
    for metrics in a.metrics:
        model = metrics.parent.name
        for line in attach(metrics.parent / RUN_FILE, a.trackers, model_scores(table, model), files, table):
            print(f"{model}: eval summary and leaderboard attached to {line}")


if __name__ == "__main__":
    main()
