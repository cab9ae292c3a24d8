"""Honest winners and a report that shows everything: bootstrap intervals, the best model per metric with ties,
the forgetting flag, the load snippet, the report's pages, the samples' prompts and the first page."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from conftest import REPO


def test_bootstrap_is_seeded_and_brackets_the_point_estimate():
    from workflow_scripts.evals.intervals import bootstrap, resample_indices

    assert (resample_indices(50) == resample_indices(50)).all()
    assert not (resample_indices(50) == resample_indices(50, seed=1)).all()
    values = np.array([1.0] * 30 + [0.0] * 70)
    first, again = bootstrap(np.mean, values), bootstrap(np.mean, values)
    assert first == again
    assert first["lo"] < 0.3 < first["hi"] and first["lo"] > 0.2 and first["hi"] < 0.4
    assert first["stderr"] == pytest.approx(math.sqrt(0.3 * 0.7 / 100), rel=0.15)  # a proportion's stderr
    constant = bootstrap(np.mean, np.full(20, 0.5))
    assert constant["lo"] == constant["hi"] == 0.5 and constant["stderr"] == 0
    assert math.isnan(bootstrap(np.mean, np.array([]))["lo"])


def test_example_losses_group_spans_and_check_their_count():
    from workflow_scripts.evals.intervals import example_losses
    from workflow_scripts.evals.metrics import token_loss

    losses = example_losses([(2.0, 2), (1.0, 1), (3.0, 1)], [2, 0, 1])
    assert losses.tolist() == [[3.0, 3.0], [0.0, 0.0], [3.0, 1.0]]
    assert token_loss(losses) == pytest.approx(6 / 4)  # token-weighted, as heldout's token_mean
    with pytest.raises(ValueError, match="3 scored spans, but the examples have 2"):
        example_losses([(2.0, 2), (1.0, 1), (3.0, 1)], [1, 1])


def test_heldout_intervals_bracket_every_held_out_score():
    from workflow_scripts.evals.heldout import GENERATION_METRICS
    from workflow_scripts.evals.intervals import heldout_intervals
    from workflow_scripts.evals.metrics import token_loss

    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'  # tool_call: over these two only
    pairs = [("the cat sat", "the cat sat on"), ("a b c d e", "a b c d e"), ("x", "y z"), ("one two", "one three"),
             (call, call), (call.replace("1", "2"), call)]  # fmt: skip
    pairs *= 10
    losses = np.array([[2.0, 3], [1.0, 1], [4.0, 2], [0.5, 1], [1.0, 2], [2.0, 2]] * 10)
    out = heldout_intervals(pairs, losses)
    points = {k: f(pairs) for k, f in GENERATION_METRICS.items()} | {"eval_loss": token_loss(losses)}
    points["perplexity"] = math.exp(points["eval_loss"])
    assert set(out) == set(points)
    for metric, value in points.items():
        assert out[metric]["lo"] <= value <= out[metric]["hi"], metric
        assert out[metric]["stderr"] > 0, metric


def scores(rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["model", "metric", "value", "lo", "hi"])


def test_best_per_metric_ties_within_the_interval():
    from workflow_scripts.report.winners import winners

    table = scores([
        ("base", "eval_loss", 3.0, 2.9, 3.1), ("node0", "eval_loss", 1.46, 1.40, 1.52),
        ("node1", "eval_loss", 1.63, 1.56, 1.70),
        ("base", "exact_match", 0.0, 0.0, 0.0), ("node0", "exact_match", 0.233, 0.175, 0.296),
        ("node1", "exact_match", 0.376, 0.307, 0.444),
        ("base", "rouge_l", 0.1, 0.08, 0.12), ("node0", "rouge_l", 0.50, 0.45, 0.55),
        ("node1", "rouge_l", 0.52, 0.47, 0.57),
    ])  # fmt: skip
    w = winners(table).set_index("metric")
    assert w.loc["eval_loss", "best"] == "node0" and w.loc["eval_loss", "ties"] == []  # lower is better
    assert w.loc["exact_match", "best"] == "node1" and w.loc["exact_match", "ties"] == []
    assert w.loc["rouge_l", "best"] == "node1" and w.loc["rouge_l", "ties"] == ["node0"]  # 0.50 in [0.47, 0.57]
    # without intervals only an equal value ties
    bare = winners(scores([("a", "x.acc", 0.5, math.nan, math.nan), ("b", "x.acc", 0.5, math.nan, math.nan),
                           ("c", "x.acc", 0.49, math.nan, math.nan)])).iloc[0]  # fmt: skip
    assert (bare["best"], bare["ties"]) == ("a", ["b"])


def test_forgetting_is_flagged_only_beyond_the_interval():
    from workflow_scripts.report.winners import forgetting, winner_lines

    table = scores([
        ("base", "demo_mc.acc", 0.60, 0.50, 0.70), ("node0", "demo_mc.acc", 0.40, 0.32, 0.48),
        ("node1", "demo_mc.acc", 0.55, 0.45, 0.65), ("node2", "demo_mc.acc", 0.47, 0.42, 0.52),
        ("base", "eval_loss", 1.0, 0.9, 1.1), ("node0", "eval_loss", 1.3, 1.2, 1.4),
        ("node1", "eval_loss", 1.05, 0.95, 1.15),
    ])  # fmt: skip
    flagged = forgetting(table)
    assert list(zip(flagged["model"], flagged["metric"], strict=True)) == [
        ("node0", "demo_mc.acc"),
        ("node0", "eval_loss"),
    ]
    lines = winner_lines(table)
    assert "Forgetting: node0 is worse than base on demo_mc.acc: 0.400 [0.320, 0.480] vs 0.600 [0.500, 0.700]" in lines
    assert not any("node1 is worse" in line or "node2 is worse" in line for line in lines)  # the intervals overlap
    calm = winner_lines(table[table["model"] != "node0"])
    assert calm[-1] == "Forgetting: no model is worse than base beyond the intervals on any metric"
    # a degenerate interval at 0 (a BLEU of short answers) inside base's is no forgetting
    bleu = forgetting(scores([("base", "bleu", 0.0006, 0.0, 0.0008), ("node0", "bleu", 0.0, 0.0, 0.0)]))
    assert bleu.empty
    assert forgetting(
        scores([("base", "x.f1", 0.6, math.nan, math.nan), ("node0", "x.f1", 0.1, math.nan, math.nan)])
    ).empty
    assert calm[2].split()[:4] == ["eval_loss", "base", "=", "node1"]  # base best, node1 tied with it


def test_score_table_reads_intervals_and_task_stderr():
    from workflow_scripts.report.summarize import summary_table, tasks_table, with_intervals
    from workflow_scripts.report.winners import Z95, score_table

    base = {"model": "base", "eval_loss": 3.0, "exact_match": 0.1, "tasks": {"mc": {"acc": 0.5, "acc_stderr": 0.05}},
            "intervals": {"eval_loss": {"lo": 2.8, "hi": 3.2, "stderr": 0.1}}}  # fmt: skip
    node = {"model": "node0", "eval_loss": 2.0, "exact_match": 0.3, "tasks": {"mc": {"acc": 0.6, "acc_stderr": "N/A"}}}
    results = [base, node]
    table = score_table(with_intervals(summary_table(results), results), tasks_table(results)).set_index(
        ["model", "metric"]
    )
    assert table.loc[("base", "eval_loss"), ["lo", "hi"]].tolist() == [2.8, 3.2]
    assert math.isnan(table.loc[("node0", "eval_loss"), "lo"])  # a result without intervals: none
    assert table.loc[("base", "mc.acc"), "hi"] == pytest.approx(0.5 + Z95 * 0.05)
    assert math.isnan(table.loc[("node0", "mc.acc"), "hi"])  # lm-eval's "N/A" stderr


def test_summary_keeps_its_columns_and_adds_the_intervals():
    from workflow_scripts.report.summarize import summary_table, with_intervals

    interval = {"lo": 0.2, "hi": 0.3, "stderr": 0.025}
    heldout = ["eval_loss", "perplexity", "exact_match", "rouge_l", "bleu", "chrf"]
    scores = {"eval_loss": 1.5, "perplexity": 4.48, "exact_match": 0.25, "rouge_l": 0.5, "bleu": 0.1, "chrf": 0.4}
    results = [{"model": m, **scores, "intervals": dict.fromkeys(heldout, interval)} for m in ("base", "node0")]
    table = with_intervals(summary_table(results), results)
    assert list(table.columns[:9]) == ["model", *heldout, "eval_loss_vs_base", "exact_match_delta"]
    for metric in heldout:
        assert table[[f"{metric}_lo", f"{metric}_hi", f"{metric}_stderr"]].iloc[0].tolist() == [0.2, 0.3, 0.025]


def test_leaderboard_ends_with_the_folder_and_two_lines_that_load_it():
    from workflow_scripts.report.summarize import leaderboard_text, summary_table, with_intervals

    def result(model, loss, em, lo, hi):
        return {"model": model, "eval_loss": loss, "exact_match": em, "rouge_l": em, "bleu": 0.0, "chrf": em,
                "intervals": {"eval_loss": {"lo": loss - 0.05, "hi": loss + 0.05},
                              "exact_match": {"lo": lo, "hi": hi}}}  # fmt: skip

    results = [result("base", 5.0, 0.0, 0.0, 0.0), result("node0", 1.46, 0.233, 0.18, 0.29),
               result("node1", 1.63, 0.376, 0.31, 0.44)]  # fmt: skip
    folders = {"base": "results/demo/base_model", "node0": "results/demo/models/node0",
               "node1": "results/demo/models/node1"}  # fmt: skip
    lines = leaderboard_text(with_intervals(summary_table(results), results), None, folders).splitlines()
    assert lines[0].startswith("Best model per metric")
    assert lines[1].split()[:3] == ["eval_loss", "node0", "1.460"] and "[1.410, 1.510]" in lines[1]
    assert lines[2].split()[:3] == ["exact_match", "node1", "0.376"] and "base 0.000" in lines[2]
    # node1 is best on exact match, ROUGE-L and chrF: it is the one to load (bleu, 0 for every model, is noise:
    # no line of its own, no column, no win)
    assert (
        lines[-3] == "Load node1 (best or tied best on exact_match, rouge_l, chrf), folder results/demo/models/node1:"
    )
    assert not any(line.lstrip().startswith("bleu") for line in lines) and "bleu" not in lines[lines.index("") + 2]
    assert lines[-2] == "  from transformers import AutoModelForCausalLM, AutoTokenizer"
    assert lines[-1].count('from_pretrained("results/demo/models/node1")') == 2


def test_report_page_shows_a_csv_as_an_escaped_table_with_marks(tmp_path):
    from workflow_scripts.core.pipeline_io import UserError
    from workflow_scripts.report.report_page import render

    path = tmp_path / "samples.csv"
    pd.DataFrame({"prompt": ["What is <b>2+2</b>?\nSay it.", "x"], "reference": ["4", "y"], "node0": ["4", "z"],
                  "node0_correct": [True, False]}).to_csv(path, index=False)  # fmt: skip
    page = render(path, "samples & more")
    assert "<title>samples &amp; more</title>" in page and "<script" not in page
    assert "What is &lt;b&gt;2+2&lt;/b&gt;?\nSay it." in page  # escaped, its line break kept (pre-wrap)
    # the verdict before each answer, in its cell (a column of marks per model made the page twice as wide)
    assert '<td><span class="yes">✓</span> 4</td>' in page and '<td><span class="no">✗</span> z</td>' in page
    assert "<th>node0_correct</th>" not in page
    assert "white-space: pre-wrap" in page and "http" not in page  # no external asset
    path.write_text("a,b\n1,2\n3\n")
    with pytest.raises(UserError, match=r"samples.csv: row 3 has 1 cells, its header 2"):
        render(path, "t")


def test_report_page_shows_json_as_nested_tables_and_text_with_images(tmp_path):
    from workflow_scripts.report.report_page import render

    path = tmp_path / "check.json"
    path.write_text(json.dumps({"ok": True, "gpus": [{"name": "H100", "memory_gb": 80}], "versions": ["a", "b"],
                                "note": "<i>"}))  # fmt: skip
    page = render(path, "env")
    assert "<th>ok</th><td>yes</td>" in page and "<th>name</th>" in page and "<td>H100</td>" in page
    assert "a, b" in page and "&lt;i&gt;" in page
    text, png = tmp_path / "leaderboard.txt", tmp_path / "plot.png"
    text.write_text("Best model per metric:\n  eval_loss  node0 1.464\n")
    png.write_bytes(b"\x89PNG fake")
    page = render(text, "board", [png])
    assert "  eval_loss  node0 1.464" in page and 'src="data:image/png;base64,iVBORy' in page
    png.write_bytes(bytes(range(256)) * 100)  # a line per 76 characters of base64: docutils takes no longer one
    assert max(map(len, render(text, "board", [png]).splitlines())) < 200


def test_samples_have_the_user_turn_and_a_verdict_per_model(tmp_path):
    from workflow_scripts.report.summarize import last_user_turns, samples_table

    split = tmp_path / "eval.parquet"
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                    {"role": "assistant", "content": "Paris"}]  # fmt: skip
    pd.DataFrame({"messages": [json.dumps(conversation)], "content_hash": ["h1"]}).to_parquet(split)
    turns = last_user_turns(split)
    assert turns == {"h1": "Capital of France?"}
    sample = {"prompt": "<|im_start|>user\nCapital of France?<|im_end|>", "reference": "Paris", "content_hash": "h1"}
    results = [
        {"model": "base", "samples": [sample | {"prediction": "Lyon", "correct": False}]},
        {"model": "node0", "samples": [sample | {"prediction": " Paris "}]},
    ]  # no verdict: judged here
    table = samples_table(results, turns)
    assert table.iloc[0].to_dict() == {"prompt": "Capital of France?", "reference": "Paris", "base": "Lyon",
                                       "base_correct": False, "node0": " Paris ", "node0_correct": True}  # fmt: skip


def test_one_colour_per_model_in_every_plot():
    from workflow_scripts.core.plotting import model_color

    assert model_color("base") == "tab:gray"
    nodes = [model_color(f"node{i}") for i in range(9)]
    assert len(set(nodes)) == 9 and "tab:gray" not in nodes
    assert model_color("soup_greedy") not in nodes[:2] and model_color("soup_uniform") != model_color("soup_greedy")
    assert model_color("lr-1e-05/node0") == model_color("lr-1e-05/node0")


SHAPES = {
    "per_node": ({}, ["per-node shards", "full fine-tuning", "randomly initialised"]),
    "lora": ({"training": {"peft": "lora"}, "model": {"name_or_path": "results/demo/models/node0"}},
             ["<strong>LoRA</strong> adapters (rank 8)", "results/demo/models/node0", "earlier stage"]),
    "joint": ({"training": {"mode": "joint"}}, ["<strong>one model</strong>", "over all 2 nodes"]),
    "soups": ({"eval": {"soup": True}}, ["soup_uniform"]),
    "grid": ({"grid": {"training.lr": [1e-5, 2e-5]}}, ["The grid repeats the training", "training.lr", "Variant lr-1"]),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(SHAPES))
def test_first_page_fits_every_run_shape_and_shows_the_leaderboard(tmp_path, shape):
    """report/workflow.rst as Snakemake renders it (its Jinja settings, docutils): the words for the run's shape,
    then the leaderboard page's body (text and plots), no docutils warning."""
    from docutils.core import publish_parts
    from jinja2 import Environment
    from yaml import safe_load

    from workflow_scripts.core.settings import validated

    override, needles = SHAPES[shape]
    config = safe_load((REPO / "config" / "config.yaml").read_text())
    for key, value in override.items():
        config[key] = (config.get(key) or {}) | value
    config = validated(config)

    class Snakemake:
        pass

    Snakemake.config = config
    boards = [tmp_path / v / "eval" / "leaderboard.html" for v in (["lr-1e-05", "lr-2e-05"] if "grid" in override
                                                                   else ["."])]  # fmt: skip
    for board in boards:
        board.parent.mkdir(parents=True, exist_ok=True)
        board.write_text(
            '<html><head></head>\n<body><h1 style="x">Best</h1>\n<pre>  eval_loss  node0 1.464\n  a &lt; b</pre>\n'
            '<p><img src="data:image/png;base64,AAAA"></p>\n</body></html>\n'
        )
    files = [type("Item", (), {"target": b.name, "path": b}) for b in boards]
    template = Environment(trim_blocks=True, lstrip_blocks=True).from_string((REPO / "report/workflow.rst").read_text())
    rst = template.render(snakemake=Snakemake, files=files, categories={})
    parts = publish_parts(rst, writer="html", settings_overrides={"report_level": 5, "halt_level": 2})
    page = parts["html_body"]
    for needle in needles:
        assert needle in page, (needle, page)
    assert page.count("<pre>  eval_loss  node0 1.464\n  a &lt; b</pre>") == len(boards)
    assert page.count('src="data:image/png;base64,AAAA"') == len(boards)
    plain = template.render(snakemake=Snakemake, files=[], categories={})
    assert "leaderboard" not in publish_parts(plain, writer="html")["html_body"]
