"""Evaluation and summary pieces the report shows: per-category exact match, throughput, consolidation."""

import json
import math
import os
import re

import pytest
from conftest import REPO


def score(predictions: list[str], references: list[str]) -> dict:
    """The held-out set's four scores, as its lm-eval task aggregates them."""
    from workflow_scripts.evals.heldout import GENERATION_METRICS

    pairs = list(zip(predictions, references, strict=True))
    return {k: f(pairs) for k, f in GENERATION_METRICS.items()}


def test_per_category_exact_match_normalizes_like_the_overall_one():
    from workflow_scripts.evals.evaluation import exact_match_by_category

    predictions = ["a  b", "x\ny", " c ", "no", "d"]
    references = ["a b", "x y", "c", "yes", "D"]
    categories = ["open_qa", "open_qa", "brainstorm", "brainstorm", "brainstorm"]
    by_category = exact_match_by_category(predictions, references, categories)
    # inner whitespace runs count as one space in both; case matters in both
    assert by_category == {"brainstorm": pytest.approx(1 / 3), "open_qa": 1.0}
    overall = score(predictions, references)["exact_match"]
    weighted = sum(by_category[c] * categories.count(c) for c in by_category) / len(categories)
    assert overall == pytest.approx(weighted) == pytest.approx(3 / 5)


def test_throughput_plot_has_every_node(tmp_path):
    from workflow_scripts.report.summary_plots import plot_throughput, read_curve

    curves = {}
    for node, rate in (("node0", 1000.0), ("node1", 3000.0)):
        path = tmp_path / node / "metrics.jsonl"
        path.parent.mkdir()
        rows = [{"step": s, "loss": 1.0, "lr": 1e-3, "tokens_per_s": rate * (0.5 if s == 4 else 1)} for s in (4, 8, 12)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        curves[node] = read_curve(path)
    medians = plot_throughput(curves, tmp_path / "throughput.png")
    assert medians == {"node0": 1000.0, "node1": 3000.0}
    assert (tmp_path / "throughput.png").stat().st_size > 10_000


def test_consolidation_table_reads_each_models_self_check(tmp_path):
    from workflow_scripts.report.summarize import consolidation_table

    for node, files in (("node0", 1), ("node1", 2)):
        folder = tmp_path / node
        folder.mkdir()
        report = {"dtype": "bfloat16"} if node == "node0" else {}
        report |= {"strategy": "fsdp", "peft": "none", "step": 12, "max_logit_diff": 0.0, "generation_ok": True,
                  "weight_files": [f"w{i}.safetensors" for i in range(files)],
                  "peak_rss_mb": {"reload_check": 510, "training_side_model": 500, "write": 480}}  # fmt: skip
        (folder / "consolidation.json").write_text(json.dumps(report))
        for i in range(files):
            (folder / f"w{i}.safetensors").write_bytes(b"x" * 2**20)
    (tmp_path / "node1" / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 3145728}}')
    table = consolidation_table([tmp_path / "node0", tmp_path / "node1"]).set_index("model")
    assert table["weights_mb"].tolist() == [1.0, 3.0]  # the index's total when there is one
    assert table["dtype"].tolist() == ["bfloat16", "float32"]  # a report without one: fp32, as all were
    assert table.loc["node1", "weight_files"] == 2 and table.loc["node0", "peak_rss_mb_reload_check"] == 510
    assert [c for c in table if c.startswith("peak")] == [
        "peak_rss_mb_training_side_model", "peak_rss_mb_write", "peak_rss_mb_reload_check"
    ]  # fmt: skip


def test_every_score_in_a_summary_is_on_0_1():
    from workflow_scripts.evals.metrics import SCORES
    from workflow_scripts.report.summarize import summary_table

    references = ["the cat sat on the mat today", "a quick brown fox jumps over it", "ten green bottles on the wall"]
    same = score(references, references)
    # tool_call scores turns that call tools: answers without calls have none (NaN, left out of a summary)
    assert math.isnan(same.get("tool_call", math.nan))
    SCORES = [k for k in SCORES if k != "tool_call"]  # noqa: N806
    assert {k: same[k] for k in SCORES} == {k: pytest.approx(1.0) for k in SCORES}  # chrF 1.0, not 100
    other = score(["the cat sat on a rug", "", "ten green bottles on the wall"], references)
    results = [{"model": "base", "eval_loss": 4.0, "perplexity": 54.6} | other,
               {"model": "node0", "eval_loss": 2.0, "perplexity": 7.39} | same]  # fmt: skip
    table = summary_table(results)
    assert table[SCORES].notna().all().all()
    assert ((table[SCORES] >= 0) & (table[SCORES] <= 1)).all().all()
    assert 0 < table.loc[0, "chrf"] < 1 and 0 < table.loc[0, "bleu"] < 1


def test_leaderboard_names_the_best_model_per_metric_against_base():
    from workflow_scripts.report.summarize import leaderboard_text, summary_table

    results = [
        {"model": "node0", "eval_loss": 1.5, "exact_match": 0.25, "rouge_l": 0.5, "bleu": 0.2, "chrf": 0.4},
        {"model": "base", "eval_loss": 6.0, "exact_match": 0.0, "rouge_l": 0.1, "bleu": 0.0, "chrf": 0.1},
        {"model": "node1", "eval_loss": 1.2, "exact_match": 0.375, "rouge_l": 0.6, "bleu": 0.3, "chrf": 0.5},
    ]
    lines = leaderboard_text(summary_table(results)).splitlines()
    assert lines[0].startswith("Best model per metric")
    assert lines[1].split() == "eval_loss node1 1.200, base 6.000 (lower is better)".split()
    assert lines[2].split() == "exact_match node1 0.375, base 0.000 (higher is better)".split()
    assert [line.split()[0] for line in lines[-4:]] == ["model", "base", "node0", "node1"]  # every model, base first

    only_base = leaderboard_text(summary_table(results[1:2])).splitlines()
    assert only_base[1].split()[:2] == ["eval_loss", "base"]


@pytest.mark.e2e  # a real Snakemake run (--cores 1) and its --report
def test_landing_page_shows_the_leaderboard_and_the_plots(tmp_path):
    """Snakemake's report renders report/workflow.rst with the leaderboard page's body in it: the text (wrapped,
    not in a fixed box) and the plots embedded."""
    from conftest import BIN, run_snakemake
    from yaml import safe_load

    from workflow_scripts.core.settings import validated

    config = validated(safe_load((REPO / "config" / "config.yaml").read_text()) | {"run": "t"})
    board = "Best model per metric (95% interval in brackets):\n  eval_loss  node1 1.200 [1.1, 1.3], base 6.000\n"
    (tmp_path / "Snakefile").write_text(
        f"report: {str(REPO / 'report' / 'workflow.rst')!r}\n"
        f"import json\nconfig.update(json.loads({json.dumps(config)!r}))\n"
        "rule all:\n"
        "    output: report('eval/leaderboard.html', category='Evaluation')\n"
        "    run:\n"
        "        import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt\n"
        "        plt.plot([1, 2]); plt.savefig('plot.png')\n"
        f"        open('eval/leaderboard.txt', 'w').write({board!r})\n"
        f"        shell('python {REPO / 'workflow_scripts' / 'report/report_page.py'} --input eval/leaderboard.txt"
        " --images plot.png --output {output} --title board')\n"
    )
    for args in (["--cores", "1"], ["--report", "report.html"]):
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        proc = run_snakemake([str(BIN / "snakemake"), *args], env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
    html = (tmp_path / "report.html").read_text()
    page = json.loads(re.search(r"var workflow_desc = (\".*\");", html).group(1))
    assert "Fine-tuning run <strong>t</strong>" in page and "System Message" not in page
    assert board.replace(">", "&gt;").splitlines()[1] in page and "white-space: pre-wrap" in page
    assert page.count('src="data:image/png;base64,') == 1


@pytest.mark.parametrize("by_reason", [{}, {"empty_response": 3, "invalid_json": 1}])
def test_reject_chart_is_not_drawn_empty(by_reason):
    import matplotlib.pyplot as plt

    from workflow_scripts.data.data_report import draw_rejects

    fig, ax = plt.subplots()
    draw_rejects(ax, {"rejects_by_reason": by_reason, "rejected": sum(by_reason.values()), "rows_in": 100})
    texts = " ".join(t.get_text() for t in ax.texts)
    if by_reason:
        assert [p.get_width() for p in ax.patches] == [3, 1] and not texts
    else:
        assert not ax.patches and not ax.axison and "No rejected rows" in texts
    plt.close(fig)


def test_every_report_page_has_a_caption_a_rule_name_and_a_place():
    """report_pages.py's rows: names and paths unique, each caption a file under report/, each page beside the file
    it renders (a variant's page where that file is a variant's), the grid's page only with a grid."""
    from workflow_scripts.core.layout import RUN_FILES, RUN_PAGES, VARIANT_FILES, VARIANT_PAGES
    from workflow_scripts.core.pages import PAGES, made

    assert len({p.name for p in PAGES}) == len({p.key for p in PAGES}) == len({p.path for p in PAGES}) == len(PAGES)
    for page in PAGES:
        assert (REPO / "report" / page.caption).is_file(), page
        assert page.path.endswith(".html") and page.key.endswith("_PAGE"), page
        assert (page.key in VARIANT_PAGES) == (page.source in VARIANT_FILES) != (page.key in RUN_PAGES), page
        assert (RUN_FILES | VARIANT_FILES)[page.key] == page.path
    assert "grid" not in {p.name for p in made(False)} and [p.name for p in made(True)] == [p.name for p in PAGES]


def test_a_page_of_no_layout_file_is_refused_naming_it():
    from workflow_scripts.core.layout import place_pages
    from workflow_scripts.core.pages import PAGES

    bad = PAGES[0]._replace(name="typo", source="SUMARY")
    with pytest.raises(ValueError, match=r"^report_pages.py: page 'typo': SUMARY is no file of layout.py$"):
        place_pages([bad])
