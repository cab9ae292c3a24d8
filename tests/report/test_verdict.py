"""The verdict (report/verdict.py) against the files it reads, the plot titles that must agree with it, and the
pages that must fit the report's frame (report/page_layout.py through report_page.render)."""

import json

import pandas as pd
import pytest

from workflow_scripts.report.verdict import (
    category_differences,
    difference_interval,
    g3,
    noise_metrics,
    verdict_lines,
    wilson,
)
from workflow_scripts.report.winners import score_table


def summary_rows() -> pd.DataFrame:
    """summary.csv as the demo writes it: eval loss tied (node1 inside node0's interval), exact match won by
    node1, BLEU 0 for everyone."""
    rows = [
        {"model": "base", "eval_loss": 6.965, "eval_loss_lo": 6.939, "eval_loss_hi": 6.990, "exact_match": 0.0,
         "exact_match_lo": 0.0, "exact_match_hi": 0.0, "bleu": 0.000584, "bleu_lo": 0.0, "bleu_hi": 0.000806},
        {"model": "node0", "eval_loss": 1.464, "eval_loss_lo": 1.219, "eval_loss_hi": 1.701, "exact_match": 0.233,
         "exact_match_lo": 0.175, "exact_match_hi": 0.296, "bleu": 0.0, "bleu_lo": 0.0, "bleu_hi": 0.0},
        {"model": "node1", "eval_loss": 1.630, "eval_loss_lo": 1.295, "eval_loss_hi": 1.988, "exact_match": 0.376,
         "exact_match_lo": 0.307, "exact_match_hi": 0.439, "bleu": 0.0, "bleu_lo": 0.0, "bleu_hi": 0.0},
    ]  # fmt: skip
    return pd.DataFrame(rows)


def curve(held_out: dict[int, float], last: int = 560) -> pd.DataFrame:
    """metrics.jsonl's records: a training loss every 10 steps falling from 4 to 0.4, the held-out loss at
    ``held_out``'s steps."""
    rows = [{"step": s, "loss": 4.0 - 3.6 * s / last} for s in range(10, last + 1, 10)]
    for r in rows:
        if r["step"] in held_out:
            r["eval_loss"] = held_out[r["step"]]
    return pd.DataFrame(rows)


CATEGORIES = {
    "base": {"reverse": 0.0, "upper": 0.0, "sum": 0.0},
    "node0": {"reverse": 0.04, "upper": 0.5, "sum": 0.176},
    "node1": {"reverse": 1.0, "upper": 0.0, "sum": 0.176},
}
COUNTS = {"reverse": 27, "upper": 18, "sum": 17}


@pytest.fixture
def lines() -> list[str]:
    curves = {
        "node0": curve({100: 2.6, 300: 2.0, 560: 1.46}),  # still falling at its last evaluation
        "node1": curve({100: 2.6, 300: 1.2, 450: 1.3, 560: 1.63}),  # lowest at 300, rising since
    }
    return verdict_lines(summary_rows(), None, curves, CATEGORIES, COUNTS)


def test_the_verdict_names_the_winner_the_tie_and_the_ratio_to_base_from_summary_csv(lines):
    summary = summary_rows().set_index("model")
    assert lines[0] == "Overall: node1 is best or tied best on 2 of 2 ranked metrics (node0 on 1)."
    loss = next(line for line in lines if line.startswith("eval_loss"))
    assert "node0 and node1 are tied within the 95% interval" in loss
    for model in ("node0", "node1"):
        r = summary.loc[model]
        assert f"{model} {g3(r['eval_loss'])} [{g3(r['eval_loss_lo'])}, {g3(r['eval_loss_hi'])}]" in loss
    assert f"{summary.loc['node0', 'eval_loss'] / summary.loc['base', 'eval_loss']:.2g}x base's 6.96" in loss
    em = next(line for line in lines if line.startswith("exact_match"))
    margin = summary.loc["node1", "exact_match"] - summary.loc["node0", "exact_match"]
    assert em.startswith("exact_match (higher is better): node1 wins with 0.376 [0.307, 0.439]")
    assert f"{g3(margin)} above node0 (0.233 [0.175, 0.296])" in em and "base 0.00" in em


def test_a_metric_within_noise_of_zero_names_no_winner(lines):
    assert noise_metrics(score_table(summary_rows())) == ["bleu"]
    bleu = [line for line in lines if line.startswith("bleu")]
    assert len(bleu) == 1 and "within noise of zero" in bleu[0] and "wins" not in bleu[0]
    assert not any("bleu" in line for line in lines[0:1])  # not counted among the ranked metrics


def test_category_differences_carry_n_and_an_interval_that_leaves_out_zero(lines):
    diffs = category_differences(CATEGORIES, COUNTS)
    assert diffs["category"].tolist() == ["reverse", "upper"]  # sum: equal, not named
    reverse = diffs.iloc[0]
    assert (reverse["high"], reverse["low"], reverse["n"]) == ("node1", "node0", 27)
    assert reverse["difference"] == pytest.approx(0.96) and 0 < reverse["lo"] < 0.96 < reverse["hi"] <= 1
    text = next(line for line in lines if line.startswith("The models differ most by category"))
    assert "reverse (n=27): node1 1.00 against node0's 0.0400, a difference of 0.960 [" in text
    assert "upper (n=18): node0 0.500 against node1's 0.00" in text and "sum" not in text


def test_wilson_and_newcombe_intervals():
    lo, hi = wilson(0.0, 18)
    assert lo == 0 and hi == pytest.approx(0.1759, abs=1e-4)  # p = 0: not the empty interval of p +- z se
    lo, hi = difference_interval(0.5, 0.5, 40)
    assert lo < 0 < hi and lo == pytest.approx(-hi)


def test_training_dynamics_read_from_metrics_jsonl(lines):
    node0 = next(line for line in lines if line.startswith("node0:"))
    node1 = next(line for line in lines if line.startswith("node1:"))
    assert "at its minimum at the last evaluation, 1.46 at step 560 (from 2.00 at step 300): still improving" in node0
    assert "held-out minimum 1.20 at step 300, rising since to 1.63 at step 560: overfitting after step 300" in node1
    assert "held-out minus training loss" in node1 and "widening" in node1
    assert "Forgetting: no model is worse than base beyond the intervals on any metric." in lines


def test_a_preference_run_gets_no_gap_between_its_objective_and_the_held_out_loss():
    """DPO's training loss (~0.69 falling) is not the held-out loss's kind (the chosen answers' cross-entropy, ~5):
    a gap between them would read as overfitting by 5 nats."""
    frame = curve({300: 5.35, 560: 5.31})
    frame["loss"] = frame["loss"] / 8
    frame["rewards/accuracies"] = [min(1.0, s / 300) for s in frame["step"]]
    (line,) = [line for line in verdict_lines(summary_rows(), None, {"node0": frame}) if line.startswith("node0:")]
    assert "still improving" in line and "held-out minus training loss 5" not in line, line
    assert "the training loss is the preference objective's" in line
    assert "training reward accuracy 1.00 at step 560" in line


def test_forgetting_and_a_run_without_held_out_points():
    summary = summary_rows()
    summary.loc[summary["model"] == "node0", ["eval_loss", "eval_loss_lo", "eval_loss_hi"]] = [7.5, 7.2, 7.8]
    lines = verdict_lines(summary, None, {"node0": curve({})}, None, None)
    assert any(
        line.startswith("Forgetting: worse than base beyond the intervals: node0 on eval_loss") for line in lines
    )
    assert any("no held-out loss logged during training (training.eval_every)" in line for line in lines)
    assert not any(line.startswith("The models differ") for line in lines)  # no categories: no sentence


def test_leaderboard_title_says_the_tie_the_text_says(tmp_path):
    from workflow_scripts.report.summary_plots import leaderboard_title, plot_leaderboard

    summary = summary_rows()
    title, outlined = leaderboard_title(summary)
    assert title.startswith("Eval loss: node0 and node1 tied within the 95% interval") and outlined == [
        "node0",
        "node1",
    ]
    assert title.endswith("highest exact match: node1")
    apart = summary.copy()
    apart.loc[apart["model"] == "node1", ["eval_loss", "eval_loss_lo", "eval_loss_hi"]] = [2.5, 2.4, 2.6]
    title, outlined = leaderboard_title(apart)
    assert title.startswith("Lowest eval loss: node0 (1.464") and outlined == ["node0"]
    assert plot_leaderboard(summary, tmp_path / "l.png").startswith("Eval loss: node0 and node1 tied")


def test_summary_page_turns_and_merges_intervals(tmp_path):
    from workflow_scripts.report.report_page import render

    path = tmp_path / "summary.csv"
    extra = {c: 0.5 for c in ("rouge_l", "chrf", "perplexity", "eval_loss_vs_base", "exact_match_delta", "demo_mc.acc")}
    summary_rows().assign(bleu_stderr=0.0, **extra).to_csv(path, index=False)  # 10 columns on the page
    page = render(path, "summary")
    assert "<th></th><th>base</th><th>node0</th><th>node1</th>" in page  # a column per model
    assert '<td class="num">1.46 [1.22, 1.70]</td>' in page and "eval_loss_lo" not in page and "_stderr" not in page
    assert "<th>eval_loss</th>" in page and "3 models, a column each" in page


def test_samples_page_clips_long_answers_with_the_whole_text_one_click_away(tmp_path):
    from workflow_scripts.report.report_page import render

    path = tmp_path / "samples.csv"
    long = "Oslo" * 40
    pd.DataFrame({"prompt": ["q"], "reference": ["a"], "base": [long], "base_correct": [False]}).to_csv(
        path, index=False
    )
    page = render(path, "samples")
    assert f'<details><summary><span class="no">✗</span> {long[:79]}…</summary>{long}</details>' in page


def test_data_page_in_funnel_order_and_environment_page_says_not_installed(tmp_path):
    from workflow_scripts.report.report_page import render

    data = {"decontamination": {"ngram": 13}, "eval_rows": 189, "funnel": {"tokenized": 2003, "rows_in": 2003,
            "shards": {"node0": {"tokenized": 910, "split": 910, "left_out": 0}}}, "rows_in": 2003,
            "shards": {s: {"examples": n, "mean_length": 29.265934065934065, "tokens": 26632, "truncated": 0}
                       for s, n in (("eval", 189), ("node0", 910))}}  # fmt: skip
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data, sort_keys=True))
    page = render(path, "data")
    order = ["<th>rows_in</th>", "<th>eval_rows</th>", ">funnel</h2>", ">shards</h2>", ">decontamination</h2>"]
    assert [page.index(x) for x in order] == sorted(page.index(x) for x in order)
    inner = page[page.index(">funnel</h2>") :]
    assert inner.index("<th>split</th>") < inner.index("<th>left_out</th>") < inner.index("<th>tokenized</th>")
    assert "29.3" in page and "29.26" not in page and "26,632" in page
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"packages": {"mlflow": None, "torch": "2.13.0"}, "ok": True, "problems": []}))
    page = render(path, "env")
    assert "<th>mlflow</th><td>not installed</td>" in page and page.index("<th>ok</th>") < page.index("packages")


def test_one_model_alone_still_gets_its_sentences():
    summary = summary_rows()[lambda f: f["model"] == "node0"]
    lines = verdict_lines(summary, None, {}, None, None)
    assert lines[0] == "Overall: node0 is best or tied best on 2 of 2 ranked metrics."
    assert any(line.startswith("eval_loss (lower is better): node0 wins with 1.46 [1.22, 1.70]") for line in lines)


def test_leaderboard_page_opens_with_the_verdict_as_sentences(tmp_path):
    from workflow_scripts.report.report_page import render
    from workflow_scripts.report.verdict import verdict_text

    text = tmp_path / "leaderboard.txt"
    long = "eval_loss (lower is better): node0 and node1 are tied within the 95% interval " + "and so on " * 12
    text.write_text(verdict_text(["Overall: node1 is best.", long.strip() + "."]) + "\n\nBest model per metric:\n")
    png = tmp_path / "p.png"
    png.write_bytes(b"\x89PNG fake")
    page = render(text, "board", [png])
    body = page.split("<body>")[1]
    assert body.index("Verdict") < body.index("<h1") < body.index("Best model per metric")
    assert '<li style="margin: 0.2em 0">Overall: node1 is best.</li>' in page
    assert f">{long.strip()}.</li>" in page  # its wrapped lines joined again
    assert "- Overall" not in page


def test_a_grid_table_turns_with_variant_and_model_as_its_columns():
    from workflow_scripts.report.page_layout import sideways

    header = ["variant", "model", *(f"m{i}" for i in range(10))]
    rows = [["", "base", *"0123456789"], ["lr-1", "node0", *"0123456789"]]
    turned_header, turned = sideways(header, rows)
    assert turned_header == ["", "base", "lr-1/node0"] and turned[0] == ["m0", "0", "0"] and len(turned) == 10
    assert sideways(["task", *header], [["t", *r] for r in rows]) is None  # a long table of another kind
