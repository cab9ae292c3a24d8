"""summarize's per-task tables and plot: summary.csv columns, tasks.csv rows, tasks.png, leaderboard lines."""

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

HELDOUT = {"eval_loss": 2.0, "perplexity": 7.39, "exact_match": 0.25, "rouge_l": 0.5, "bleu": 0.1, "chrf": 0.4}


def results(tasks: bool = True) -> list[dict]:
    """Synthetic eval/<model>.json contents, in the order the rule lists them."""

    def result(model, shift, task=None):
        r = (
            {"model": model}
            | {k: v + (shift if k in ("eval_loss", "perplexity") else abs(shift) / 10) for k, v in HELDOUT.items()}
            | {"samples": []}
        )
        if tasks and task is not None:
            r["tasks"] = task
        return r

    return [
        result("soup_uniform", 0.05, {"demo_mc": {"acc": 0.5, "acc_stderr": 0.03, "acc_norm": 0.52}}),
        result("base", 0.0, {"demo_mc": {"acc": 0.4, "acc_stderr": 0.02, "acc_norm": 0.45, "acc_norm_stderr": 0.02,
                                         "alias": "demo_mc"}}),
        result("node0", -0.5, {"demo_mc": {"acc": 0.6, "acc_stderr": "N/A", "acc_norm": 0.55}, "other": {"f1": 0.7}}),
        result("node1", -0.4, {}),  # this model has no extra task: NaN there, no crash
    ]  # fmt: skip


def test_summary_has_a_column_per_task_metric_and_none_without_tasks():
    from workflow_scripts.report.summarize import summary_table

    table = summary_table(results())
    assert table["model"].tolist() == ["base", "node0", "node1", "soup_uniform"]
    assert [c for c in table if "." in c] == ["demo_mc.acc", "demo_mc.acc_norm", "other.f1"]  # no stderr, no alias
    assert table["demo_mc.acc"].tolist()[:2] == [0.4, 0.6] and math.isnan(table.loc[2, "demo_mc.acc"])
    assert table["other.f1"].isna().tolist() == [True, False, True, True]

    plain = summary_table(results(tasks=False))
    assert list(plain) == ["model", *HELDOUT, "eval_loss_vs_base", "exact_match_delta"]
    assert list(summary_table([r | {"tasks": {}} for r in results(tasks=False)])) == list(plain)


def test_tasks_table_rows_per_model_task_metric_with_delta_to_base():
    from workflow_scripts.report.summarize import TASK_COLUMNS, tasks_table

    table = tasks_table(results())
    assert list(table) == TASK_COLUMNS
    assert list(dict.fromkeys(table["model"])) == ["base", "node0", "node1", "soup_uniform"]
    assert list(dict.fromkeys(table["task"])) == ["heldout", "demo_mc", "other"]
    assert len(table) == 4 * (6 + 2 + 1)  # every model has every task's rows, NaN where it has no score
    t = table.set_index(["model", "task", "metric"])
    assert t.loc[("node0", "demo_mc", "acc"), "delta_to_base"] == pytest.approx(0.2)
    assert t.loc[("node0", "demo_mc", "acc"), "base_value"] == 0.4
    assert math.isnan(t.loc[("node0", "demo_mc", "acc"), "stderr"])  # "N/A" from lm-eval
    assert t.loc[("base", "demo_mc", "acc_norm"), "stderr"] == 0.02
    assert t.loc[("soup_uniform", "demo_mc", "acc"), "delta_to_base"] == pytest.approx(0.1)
    assert math.isnan(t.loc[("node1", "demo_mc", "acc"), "value"])
    assert math.isnan(t.loc[("node1", "demo_mc", "acc"), "delta_to_base"])
    assert math.isnan(t.loc[("node0", "other", "f1"), "delta_to_base"])  # base has no score there
    assert t.loc[("node0", "heldout", "eval_loss"), "delta_to_base"] == pytest.approx(-0.5)
    assert t.loc[("base", "heldout", "exact_match"), "delta_to_base"] == 0

    plain = tasks_table(results(tasks=False))
    assert set(plain["task"]) == {"heldout"} and len(plain) == 4 * 6
    no_base = tasks_table([r for r in results() if r["model"] != "base"])
    assert no_base["base_value"].isna().all() and no_base["delta_to_base"].isna().all()


def test_leaderboard_has_a_line_per_extra_task_only_when_there_are_tasks():
    from workflow_scripts.report.summarize import leaderboard_text, summary_table, tasks_table

    plain = results(tasks=False)
    assert leaderboard_text(summary_table(plain), tasks_table(plain)) == leaderboard_text(summary_table(plain))

    lines = leaderboard_text(summary_table(results()), tasks_table(results())).splitlines()
    assert lines[0].startswith("Best model per metric")
    assert lines[1].replace(",", "").split()[:5] == ["eval_loss", "node0", "1.500", "base", "2.000"]
    # a line per extra task metric: its best model (lm-eval's stderr gives the interval) and base's value
    assert lines[6].split() == "demo_mc.acc node0 0.600, base 0.400 (higher is better)".split()  # "N/A" stderr
    assert lines[8].split() == "other.f1 node0 0.700 (higher is better)".split()  # no base score
    assert lines[9].startswith("Forgetting: no model") and lines[10] == ""

    # the best model by eval loss is not the best on the task: the task's line names the task's best
    worse = [r | {"tasks": {"demo_mc": {"acc": 0.3}}} if r["model"] == "node0" else r for r in results()]
    lines = leaderboard_text(summary_table(worse), tasks_table(worse)).splitlines()
    assert lines[6].split()[:3] == ["demo_mc.acc", "soup_uniform", "0.500"], lines[6]
    assert lines[6].split()[3:6] == ["[0.441,", "0.559],", "base"]  # 0.5 ± 1.96 x 0.03
    # node0's 0.3 has no stderr, but lies below base's interval (0.4 ± 1.96 x 0.02): forgetting
    assert lines[8] == "Forgetting: node0 is worse than base on demo_mc.acc: 0.300 vs 0.400 [0.361, 0.439]"

    from workflow_scripts.report.summarize import decontamination_line

    sets = {"heldout": {"docs": 90, "docs_contaminated": 0}, "gsm8k": {"docs": 1319, "docs_contaminated": 2}}
    decon = {"ngram": 13, "policy": "report", "training_rows": 1000, "training_rows_contaminated": 3, "sets": sets}
    assert decontamination_line(decon) == (
        "decontamination: 3 of 1000 training rows share a 13-gram with an evaluation set (heldout 0 of 90 docs,"
        " gsm8k 2 of 1319 docs), trained on (data.decontaminate: report)\n"
    )
    assert decontamination_line(None) == ""

    # eval.limit: the documents each task's scores are over, in tasks.csv and on the leaderboard
    limited = [r | {"tasks_documents": {"demo_mc": {"scored": 20, "of": 1319}}} for r in results()]
    table = tasks_table(limited).set_index(["model", "task", "metric"])
    assert table.loc[("node0", "demo_mc", "acc"), ["documents", "of_documents"]].tolist() == [20, 1319]
    line = leaderboard_text(summary_table(limited), tasks_table(limited)).splitlines()[6]
    assert line.startswith("  demo_mc.acc") and line.endswith("[first 20 of 1319 documents: eval.limit]"), line
    assert "eval.limit" not in leaderboard_text(summary_table(results()), tasks_table(results()))

    # a long task and metric name keeps a space before its value (lm-eval's gsm8k metric names); all equal: a tie
    long = [r | {"tasks": {"gsm8k": {"exact_match,flexible-extract": 0.25}}} for r in results()]
    line = leaderboard_text(summary_table(long), tasks_table(long)).splitlines()[6]
    assert line.startswith("  gsm8k.exact_match/flexible-extract  base = node0 = node1 = soup_uniform (tie) 0.250"), (
        line
    )


def test_task_panels_never_empty():
    from workflow_scripts.report.summarize import tasks_table
    from workflow_scripts.report.summary_plots import task_panels

    assert list(task_panels(tasks_table(results()))) == ["heldout", "demo_mc", "other"]
    heldout = task_panels(tasks_table(results(tasks=False)))["heldout"]
    assert set(heldout["metric"]) == {"exact_match", "rouge_l", "bleu", "chrf"}  # the 0-1 scores, not the loss
    assert task_panels(tasks_table([{"model": "base"}])) == {}  # nothing to draw: plot_tasks says so on one panel


def test_plot_tasks_draws_a_panel_per_task(tmp_path):
    import matplotlib.pyplot as plt

    from workflow_scripts.report.summarize import tasks_table
    from workflow_scripts.report.summary_plots import plot_tasks

    drawn = []
    real = plt.subplots

    def spy(*args, **kwargs):
        fig, axes = real(*args, **kwargs)
        drawn.append(axes)
        return fig, axes

    plt.subplots = spy
    try:
        assert plot_tasks(tasks_table(results()), tmp_path / "tasks.png") == ["heldout", "demo_mc", "other"]
        assert plot_tasks(tasks_table([{"model": "base"}]), tmp_path / "empty.png") == []
    finally:
        plt.subplots = real
    heldout, demo_mc, _ = drawn[0][:, 0]
    assert demo_mc.get_title() == "demo_mc" and [t.get_text() for t in demo_mc.get_xticklabels()] == ["acc", "acc_norm"]
    assert len(demo_mc.patches) == 4 * 2  # a bar per model and metric (NaN for node1)
    assert "held-out" in heldout.get_title()
    assert "No evaluation scores" in drawn[1][0, 0].texts[0].get_text()
    assert (tmp_path / "tasks.png").stat().st_size > 10_000 and (tmp_path / "empty.png").exists()


def cli(tmp_path, res: list[dict]) -> dict:
    """Run summarize.py on synthetic result JSONs and one node's metrics; returns its outputs' paths."""
    (tmp_path / "eval").mkdir()
    paths = []
    for r in res:
        paths.append(tmp_path / "eval" / f"{r['model']}.json")
        paths[-1].write_text(json.dumps(r))
    metrics = tmp_path / "train" / "node0" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "lr": 1e-3}) + "\n" for s in (4, 8)))
    model = tmp_path / "models" / "node0"
    model.mkdir(parents=True)
    (model / "consolidation.json").write_text(json.dumps({"strategy": "ddp", "peft": "none", "step": 8,
        "weight_files": [], "max_logit_diff": 0.0, "generation_ok": True}))  # fmt: skip
    out = {name: tmp_path / "eval" / name for name in ("summary.csv", "tasks.csv", "tasks.png", "leaderboard.txt")}
    args = ["--results", *map(str, paths), "--metrics", str(metrics), "--models", str(model),
            "--summary", out["summary.csv"], "--tasks", out["tasks.csv"], "--tasks-plot", out["tasks.png"],
            "--curves", tmp_path / "c.png", "--throughput", tmp_path / "t.png", "--categories", tmp_path / "k.png",
            "--leaderboard", tmp_path / "l.png", "--leaderboard-text", out["leaderboard.txt"],
            "--samples", tmp_path / "s.csv", "--consolidation", tmp_path / "n.csv"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "workflow_scripts.report.summarize", *map(str, args)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.parametrize("tasks", [True, False])
def test_cli_writes_tasks_csv_and_plot(tmp_path, tasks):
    out = cli(tmp_path, results(tasks))
    summary = pd.read_csv(out["summary.csv"])
    table = pd.read_csv(out["tasks.csv"])
    assert list(dict.fromkeys(table["model"])) == ["base", "node0", "node1", "soup_uniform"]
    assert table["task"].iloc[0] == "heldout" and out["tasks.png"].stat().st_size > 10_000
    board = out["leaderboard.txt"].read_text()
    if tasks:
        assert "demo_mc.acc" in summary and "demo_mc" in set(table["task"]) and "demo_mc.acc" in board
    else:
        assert not [c for c in summary if "." in c] and set(table["task"]) == {"heldout"}
        assert "demo_mc" not in board


def test_lm_eval_keys_with_filters():
    from workflow_scripts.evals.metrics import task_scores

    raw = {"alias": "demo_mc", "acc,none": 0.41, "acc_stderr,none": 0.03, "exact_match,strict-match": 0.2,
           "exact_match_stderr,strict-match": "N/A"}  # fmt: skip
    scores = task_scores({"tasks": {"demo_mc": raw}})["demo_mc"]
    assert list(scores) == ["acc", "exact_match/strict-match"] and scores["acc"] == (0.41, 0.03)
    assert math.isnan(scores["exact_match/strict-match"][1])


def test_loss_curves_draw_the_smoothed_training_loss_and_the_held_out_points(tmp_path):
    from workflow_scripts.report.summary_plots import held_out_points, plot_curves, smoothed_loss, steps_per_epoch

    # 28 steps an epoch, logged every 10, the held-out loss every 100 and at the last step
    rows = [{"step": s, "loss": 3.0 - s / 1000 + (0.2 if s % 20 else 0.0), "lr": 1e-3, "epoch": (s - 1) / 28}
            for s in range(10, 301, 10)]  # fmt: skip
    for r in rows:
        if r["step"] % 100 == 0:
            r |= {"eval_loss": 3.5 - r["step"] / 1000, "eval_tokens": 4000}
    frame = pd.DataFrame(rows)
    assert held_out_points(frame)["step"].tolist() == [100, 200, 300]
    assert held_out_points(frame.drop(columns=["eval_loss"])).empty  # a run without eval_every
    smooth = smoothed_loss(frame)

    # centred: each point the geometric mean of the 5 logged losses around it (2 each side; fewer at the ends)
    def geometric(losses):
        return math.exp(sum(map(math.log, losses)) / len(losses))

    assert smooth.iloc[0] == pytest.approx(geometric(frame["loss"].iloc[:3]))
    assert smooth.iloc[15] == pytest.approx(geometric(frame["loss"].iloc[13:18]))
    assert smooth.iloc[-1] == pytest.approx(geometric(frame["loss"].iloc[-3:]))
    assert steps_per_epoch(frame) == pytest.approx(28) and steps_per_epoch(frame.drop(columns=["epoch"])) is None
    labels = plot_curves({"node0": frame, "node1": frame.drop(columns=["eval_loss"])}, tmp_path / "c.png")
    assert labels == ["node0 training (centred mean of 5)", "node0 held-out", "node1 training (centred mean of 5)"]
    assert (tmp_path / "c.png").stat().st_size > 10_000
