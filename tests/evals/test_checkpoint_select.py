"""Per-checkpoint evaluation's pure pieces: which kept checkpoints are scored, consolidate.select's metric, the best
step by the registry's direction, checkpoints.csv's rows (an old checkpoint's scores reused) and the leaderboard's
line. The workflow's own run of them is in tests/workflow/test_checkpoint_eval.py."""

import json
import math

import pytest

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.evals.checkpoint_scores import plot, table
from workflow_scripts.evals.checkpoint_select import (
    best_step,
    kept_steps,
    score_row,
    select_metric,
    selection_lines,
    selection_text,
    steps_to_score,
    tokens_seen,
)


def result(loss: float, em: float, acc: float | None = None) -> dict:
    """An evaluation.py result with the fields checkpoints.csv reads."""
    out = {"eval_loss": loss, "exact_match": em, "intervals": {"eval_loss": {"lo": loss - 0.1, "hi": loss + 0.1}}}
    if acc is not None:
        out["tasks"] = {"demo_mc": {"acc": acc, "acc_stderr": 0.01, "alias": "demo_mc"}}
    return out


def test_which_kept_checkpoints_are_scored():
    assert steps_to_score([500, 560], "last", 1000) == []
    assert steps_to_score([560, 500], "all", 1000) == [500, 560]
    assert steps_to_score([100, 200, 300, 350], "every_n", 200) == [200, 350]  # and the newest, the run's end
    assert steps_to_score([], "all", None) == []


def test_kept_steps_are_the_complete_folders(tmp_path):
    for step, complete in ((8, True), (12, True), (16, False)):
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / "COMPLETE").write_text("{}")
    (tmp_path / "damaged-step-4").mkdir()
    assert kept_steps(tmp_path) == [8, 12]
    assert kept_steps(tmp_path / "missing") == []


def test_select_metric_is_checked_at_parse_time():
    assert select_metric("last", [], "last") is None
    assert select_metric("best:eval_loss", [], "all") == "eval_loss"
    assert select_metric("best:demo_mc.acc", ["demo_mc"], "every_n") == "demo_mc.acc"
    for select, message in [
        ("best:accuracy", "'accuracy' is no held-out metric"),
        ("best:gsm8k.exact_match", "'gsm8k' is not a task of eval.tasks"),
        ("first", "neither last nor best"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            select_metric(select, ["demo_mc"], "all")
        assert str(e.value).startswith("consolidate.select") and "\n" not in str(e.value)
    with pytest.raises(UserError, match="needs eval.checkpoints all or every_n"):
        select_metric("best:eval_loss", [], "last")


def test_the_best_step_follows_the_metrics_direction():
    scores = {300: result(1.2, 0.4, 0.70), 500: result(1.5, 0.5, 0.75), 560: result(1.6, 0.5, 0.72)}
    assert best_step(scores, "eval_loss") == (300, 1.2)  # lower is better
    assert best_step(scores, "exact_match") == (560, 0.5)  # higher; a tie goes to the later step
    assert best_step(scores, "demo_mc.acc") == (500, 0.75)
    with pytest.raises(UserError, match="no scored checkpoint has rouge_l"):
        best_step(scores, "rouge_l")


def test_a_row_holds_every_metric_with_its_interval():
    row = score_row("node0", 500, 1234, result(1.5, 0.25, 0.7))
    assert row["model"] == "node0" and row["step"] == 500 and row["tokens_seen"] == 1234
    assert (row["eval_loss"], row["eval_loss_lo"], row["eval_loss_hi"]) == (1.5, 1.4, 1.6)
    assert math.isnan(row["exact_match_lo"])  # no interval in the result: NaN, not a made-up one
    assert row["demo_mc.acc_lo"] == pytest.approx(0.7 - 1.959964 * 0.01)
    assert "demo_mc.alias" not in row
    assert tokens_seen(14, {"tokens": 2800, "steps_per_epoch": 28}) == 1400
    assert tokens_seen(14, {}) is None


def test_the_table_reuses_scores_of_checkpoints_pruned_since(tmp_path):
    states = []
    for node, key in (("node0", "aaa"), ("node1", "bbb")):
        state = tmp_path / "train" / node / "train_state.json"
        state.parent.mkdir(parents=True)
        plan = {"checkpoints": f"results/t/checkpoints/{node}/{key}", "tokens": 100, "steps_per_epoch": 10}
        state.write_text(json.dumps({"plan": plan}))
        states.append(state)
        for step in (8, 12):
            path = tmp_path / "eval" / "checkpoints" / node / key / f"step-{step}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result(2.0 - step / 10, step / 100)))
    stale = tmp_path / "eval" / "checkpoints" / "node0" / "old" / "step-4.json"  # another run key's: left out
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps(result(9.0, 0.0)))
    asked = [tmp_path / "eval" / "checkpoints" / "node0" / "aaa" / "step-12.json"]  # step-8 pruned since
    frame = table(states, asked, tmp_path / "eval" / "checkpoints", "all", None)
    assert list(zip(frame["model"], frame["step"], strict=True)) == [("node0", 8), ("node0", 12), ("node1", 8),
                                                                     ("node1", 12)]  # fmt: skip
    assert list(frame["tokens_seen"]) == [80, 120, 80, 120]
    every = table(states, asked, tmp_path / "eval" / "checkpoints", "every_n", 8)
    assert list(zip(every["model"], every["step"], strict=True)) == [("node0", 8), ("node0", 12), ("node1", 8)]
    plot(frame, tmp_path / "checkpoints.png")
    assert (tmp_path / "checkpoints.png").stat().st_size > 0


def test_the_leaderboard_says_which_step_was_exported(tmp_path):
    selected = {"step": 300, "last_step": 560, "candidates": 2, "metric": "eval_loss", "value": 1.2345678}
    assert selection_text("node0", selected).startswith("node0 at step 300 of 560, best held-out loss (1.235")
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "consolidation.json").write_text(json.dumps({"selected": selected}))
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "consolidation.json").write_text(json.dumps({"step": 560}))
    assert (
        selection_lines([tmp_path / "node0", tmp_path / "node1"]) == f"Exported: {selection_text('node0', selected)}\n"
    )
