"""End to end: Snakemake runs every stage for each strategy; reruns touch only what is stale."""

import json
import re
import subprocess
from html import escape

import pytest
from conftest import (
    DEMO_CSV,
    TINY_GRID,
    check_outputs,
    planned_jobs,
    snakemake,
    snakemake_cmd,
    status,
    tiny_config,
    tool_env,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# the tests that take ddp_run are e2e (it runs the workflow); the dry runs of bad input are not
# the report's pages of what summarize and provenance write (rules/report_pages.smk)
SUMMARY_PAGES = {f"render_{p}_page" for p in ("summary", "leaderboard", "tasks", "samples", "consolidation")}
DOWNSTREAM_OF_TRAINING = {"train_node", "consolidate_node", "evaluate_model", "summarize", "provenance", "all"}
DOWNSTREAM_OF_TRAINING |= SUMMARY_PAGES | {"render_provenance_page"}


@pytest.mark.e2e
def test_ddp_end_to_end(ddp_run):
    workdir, _ = ddp_run
    root = workdir / "results" / "t"
    check_outputs(root)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(root / "models" / "node0")
    AutoTokenizer.from_pretrained(root / "models" / "node0")
    # TensorBoard events are readable
    events = EventAccumulator(str(root / "train" / "node0"))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"]


@pytest.mark.e2e
def test_finished_run_dry_runs_to_nothing(ddp_run):
    workdir, config = ddp_run
    assert planned_jobs(snakemake(workdir, config, "-n")) == {}


@pytest.mark.e2e
def test_status_of_a_finished_run_is_its_summary(ddp_run):
    workdir, _ = ddp_run
    shown = status(workdir, "t")
    assert shown.startswith("run t: finished")
    for node in ("node0", "node1"):
        # no job on any row: the job column is left out
        assert re.search(rf"^{node} +done +12/12 ", shown, re.M), shown
        assert re.search(rf"^{node}: done at step 12, final loss \d+\.\d{{4}}, trained \S+, eval loss ", shown, re.M)
    assert "evaluated base, node0, node1" in shown
    assert re.search(r"^Best model per metric", shown, re.M) and re.search(r"^ +eval_loss +node\d", shown, re.M), shown


@pytest.mark.e2e
def test_lr_change_reruns_only_training_and_downstream(ddp_run):
    workdir, config = ddp_run
    changed = json.loads(json.dumps(config))
    changed["training"]["lr"] /= 2
    jobs = planned_jobs(snakemake(workdir, changed, "-n"))
    assert set(jobs) == DOWNSTREAM_OF_TRAINING
    assert jobs["train_node"] == 2 and jobs["evaluate_model"] == 2  # the base model is not re-evaluated


@pytest.mark.e2e
def test_deleting_one_nodes_model_reruns_only_that_node(ddp_run):
    import shutil

    workdir, config = ddp_run
    shutil.rmtree(workdir / "results" / "t" / "models" / "node0")
    jobs = planned_jobs(snakemake(workdir, config, "-n"))
    assert jobs == {"consolidate_node": 1, "evaluate_model": 1, "summarize": 1, "all": 1} | dict.fromkeys(
        SUMMARY_PAGES, 1
    )
    snakemake(workdir, config)
    assert (workdir / "results" / "t" / "models" / "node0" / "config.json").exists()
    assert planned_jobs(snakemake(workdir, config, "-n")) == {}


@pytest.mark.e2e
def test_the_readmes_retrain_command_retrains_one_node_and_refreshes_what_depends_on_it(ddp_run):
    """README, "Rerunning and retraining": -R with one node's training output forces that job alone; the default
    target then reruns its consolidation and evaluation, the summary, provenance and the report's pages."""
    workdir, config = ddp_run
    proc = snakemake(workdir, config, "-n", "-R", "results/t/train/node1/train_state.json")
    assert planned_jobs(proc) == dict.fromkeys(DOWNSTREAM_OF_TRAINING, 1)
    assert "node=node0" not in proc.stdout and "model=node0" not in proc.stdout and "model=base" not in proc.stdout


@pytest.mark.e2e
def test_report_builds(ddp_run):
    workdir, config = ddp_run
    snakemake(workdir, config, "--report", str(workdir / "report.html"))
    html = (workdir / "report.html").read_text(errors="replace")
    for name in (
        "summary.html",
        "tasks.html",
        "samples.html",
        "tasks.png",
        "leaderboard.png",
        "leaderboard.html",
        "loss_curves.png",
        "throughput.png",
        "consolidation.html",
        "overview.png",
        "data_report.html",
        "check.html",
        "memory.html",
        "provenance.html",
    ):
        assert name in html
    # the first page: the leaderboard's text, wrapped, and the key plots, embedded
    page = json.loads(re.search(r"var workflow_desc = (\".*\");", html).group(1))
    board = (workdir / "results" / "t" / "eval" / "leaderboard.txt").read_text()
    assert "System Message" not in page and "white-space: pre-wrap" in page
    # it opens with the verdict (leaderboard.txt's first block, a sentence a bullet), then the leaderboard's lines
    assert board.startswith("Verdict:\n- Overall: ") and page.index("Verdict") < page.index("Fine-tuning run")
    first = board.split("\n- ")[1].split("\n- ")[0].replace("\n  ", " ")
    assert first in page, first
    best = next(line for line in board.splitlines() if line.startswith("Best model per metric"))
    assert escape(best) in page
    assert board.split("\n\n")[0] == verdict_of(workdir / "results" / "t")  # the sentences are the files'
    assert page.count('src="data:image/png;base64,') == 3


def verdict_of(root) -> str:
    """The verdict recomputed from what summarize read and wrote: summary.csv, tasks.csv, each node's
    metrics.jsonl, the eval results' exact match per category and the eval split's categories."""
    import pandas as pd

    from workflow_scripts.report.summarize import category_counts
    from workflow_scripts.report.summary_plots import read_curve
    from workflow_scripts.report.verdict import verdict_lines, verdict_text

    summary, tasks = pd.read_csv(root / "eval" / "summary.csv"), pd.read_csv(root / "eval" / "tasks.csv")
    curves = {p.parent.name: read_curve(p) for p in sorted((root / "train").glob("*/metrics.jsonl"))}
    results = [json.loads((root / "eval" / f"{m}.json").read_text()) for m in summary["model"]]
    by_category = {r["model"]: r["exact_match_by_category"] for r in results if r.get("exact_match_by_category")}
    counts = category_counts(root / "data" / "eval.parquet")
    return verdict_text(verdict_lines(summary, tasks, curves, by_category, counts))


def report_in_browser(ddp_run):
    """(workdir, report.html) of the shared run, its report built once, for the tests that open it in headless
    Chromium; skipped where no browser is installed."""
    from browser import find_browser

    if find_browser() is None:
        pytest.skip("no Chromium or Chrome on PATH (CI installs chromium: .ci/run; here: apt-get install chromium)")
    workdir, config = ddp_run
    report = workdir / "report.html"
    if not report.exists():
        snakemake(workdir, config, "--report", str(report))
    return workdir, report


@pytest.mark.e2e
def test_report_shows_the_summary_in_the_page(ddp_run, tmp_path):
    """In headless Chromium, the report's summary item opens as a page with every summary.csv row as text (its
    view button is no download link); summary.csv itself stays as it was written."""
    import pandas as pd
    from browser import open_report_item

    workdir, report = report_in_browser(ddp_run)
    download, text = open_report_item(report, "Evaluation", "1. Best model", "summary.html", tmp_path)
    assert download is None, f"the summary item is a download ({download})"
    root = workdir / "results" / "t" / "eval"
    rows = (root / "summary.csv").read_text().splitlines()
    summary = pd.read_csv(root / "summary.csv")
    assert {"eval_loss_lo", "eval_loss_hi", "exact_match_lo", "exact_match_hi", "chrf_stderr"} <= set(summary)
    # on its side (a column per model, a row per column of the CSV), each score with its interval in one cell
    header, *_ = rows
    assert text.splitlines()[1].split("\t")[1:] == summary["model"].tolist(), text[:2000]
    eval_loss = next(line.split("\t") for line in text.splitlines() if line.startswith("eval_loss\t"))
    for shown, (_, row) in zip(eval_loss[1:], summary.iterrows(), strict=True):
        assert shown == f"{row['eval_loss']:#.3g} [{row['eval_loss_lo']:#.3g}, {row['eval_loss_hi']:#.3g}]", shown
    assert "eval_loss_lo" in header and "eval_loss_lo" not in text  # in the CSV, not on the page
    download, _ = open_report_item(report, "Evaluation", "Other", "samples.html", tmp_path)  # no subcategory
    assert download is None


@pytest.mark.e2e
def test_no_report_page_is_wider_than_its_frame(ddp_run, tmp_path):
    """Headless Chromium at 1,400 px: the first page and every page the report shows in a frame (each row of
    core/pages.py) fit it, document.scrollWidth no wider than clientWidth (summary.html was 3,636 px in a frame
    of about 1,000); a screenshot of each under tmp_path."""
    from browser import report_widths

    from workflow_scripts.core.pages import made

    workdir, report = report_in_browser(ddp_run)
    pages = made(grid=False)
    split = {page.category for page in pages if page.subcategory}  # a category with subcategories: "Other"
    items = [(p.category, p.subcategory or ("Other" if p.category in split else None), p.path.split("/")[-1])
             for p in pages]  # fmt: skip
    widths = report_widths(report, items, tmp_path, width=1400, shots=tmp_path)
    assert len(widths) == len(items) + 1 and len(list(tmp_path.glob("*.png"))) == len(widths)
    wide = {name: w for name, w in widths.items() if w[0] > w[1]}
    assert not wide, f"wider than the frame (scrollWidth, clientWidth): {wide}"


@pytest.mark.parametrize(
    "override,needle",
    [
        ({"data": {"path": "/nonexistent/data.csv"}}, "/nonexistent/data.csv"),
        ({"data": {"path": str(DEMO_CSV), "columns": {"response": "answer"}}}, "'answer'"),
        ({"training": {"lr": "fast"}}, "training.lr"),
        ({"model": {"name_or_path": "/nonexistent/model"}}, "model.name_or_path /nonexistent/model: no such"),
        ({"model": {"name_or_path": str(DEMO_CSV.parent)}}, "folder has no config.json"),
        ({"model": {"name_or_path": "nobody/not-cached"}}, "not in the local Hugging Face cache"),
        ({"training": {"lr": float("nan")}}, "config key training.lr: nan is not a finite number"),
        ({"nodes": 10_000}, "rows (its line count) for nodes: 10000"),
    ],
    ids=["bad-path", "missing-column", "wrong-type", "no-model", "not-a-model", "hub-id-offline", "nan", "nodes"],
)
def test_bad_input_stops_with_one_line(tmp_path, override, needle):
    config = tiny_config("t")
    for key, value in override.items():
        config[key] = config[key] | value if isinstance(value, dict) else value
    proc = snakemake(tmp_path, config, "-n", check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0]
    assert "Traceback" not in proc.stderr


def test_config_files_as_written_stop_with_one_line(tmp_path):
    """A key given twice in a --configfile; an empty config/config.yaml (the default, loaded by the Snakefile's
    `configfile:`). An empty --configfile is Snakemake's to load before the workflow runs (README)."""
    cmd = snakemake_cmd(tmp_path, tiny_config("t"), "-n")
    config = tmp_path / "config.yaml"
    config.write_text(config.read_text() + "nodes: 3\n")
    twice = subprocess.run(cmd, capture_output=True, text=True, env=tool_env())
    (line,) = [x for x in twice.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {config}: key nodes is given twice, on lines ") and twice.returncode == 1
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("# nothing yet\n")
    default = [*cmd[: cmd.index("--configfile")], "-n"]
    empty = subprocess.run(default, capture_output=True, text=True, env=tool_env())
    assert "error: config/config.yaml: the config file is empty (or only comments)" in empty.stderr
    assert "Traceback" not in empty.stderr + twice.stderr


@pytest.mark.e2e
def test_evaluation_is_deterministic(ddp_run):
    import subprocess
    import sys

    from conftest import tool_env

    workdir, _ = ddp_run
    root = workdir / "results" / "t"
    again = workdir / "again.json"
    cmd = [
        sys.executable, "-m", "workflow_scripts.evals.evaluation", "--model", str(root / "models" / "node0"),
        "--name", "node0", "--eval", str(root / "data" / "tokenized" / "eval.parquet"),
        "--config", json.dumps({"batch_size": 32, "max_new_tokens": 8, "max_samples": 48}),
        "--output", str(again), "--lm-eval-output", str(workdir / "again.lm_eval.json"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads((root / "eval" / "node0.json").read_text())
    second = json.loads(again.read_text())
    for key in ("eval_loss", "perplexity", "exact_match", "rouge_l", "bleu", "chrf", "samples"):
        assert first[key] == second[key], key


def test_paths_reach_the_jobs_as_one_argument_each(tmp_path, demo_assets):
    """A model folder and a checkout path with a space and shell syntax in them reach every job's command as
    one argument, never run: each shell line splits (as the shell reads it) with the path whole."""
    import shlex
    import shutil

    from conftest import REPO

    model = tmp_path / "my models" / "m$(touch pwned) `touch pwned2`"
    shutil.copytree(demo_assets["base"], model)
    config = tiny_config("q") | {"model": {"name_or_path": str(model)}}
    proc = snakemake(tmp_path / "work", config, "-n", "-p")
    commands = [line for line in (proc.stdout + proc.stderr).splitlines() if "workflow_scripts/" in line]
    assert len(commands) >= 10, proc.stdout[-3000:]
    uses = 0
    for line in commands:
        words = shlex.split(line.split("Shell command:", 1)[-1])
        for word in (w for w in words if "pwned" in w):  # the folder whole, or inside one --config JSON
            assert word == str(model) or str(model) in json.dumps(json.loads(word), ensure_ascii=False), line
        uses += str(model) in words
    assert uses >= 4, commands  # the split, tokenization, the plan, training and the base evaluation
    assert not list(tmp_path.rglob("pwned*")) and not list(REPO.glob("pwned*"))


def test_a_config_file_replaces_the_demos(tmp_path):
    """A --configfile replaces config/config.yaml: a key it leaves out takes the schema's default, not the
    demo's (eval.tasks: [demo_mc]); without one, the demo's config is the config."""
    import shutil
    import subprocess

    from conftest import REPO, snakemake_cmd, tool_env

    work = tmp_path / "work"
    (work / "config").mkdir(parents=True)
    shutil.copy(REPO / "config" / "config.yaml", work / "config" / "config.yaml")
    (work / "resources").symlink_to(REPO / "resources")
    demo = subprocess.run(
        [*snakemake_cmd(work, {}, "-n", "-p")[:5], "--cores", "1", "-n", "-p"], capture_output=True, text=True,
        env=tool_env(),
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "demo_mc" in demo.stdout
    mine = subprocess.run(snakemake_cmd(work, tiny_config("mine"), "-n", "-p"), capture_output=True, text=True,
                          env=tool_env())  # fmt: skip
    assert mine.returncode == 0, mine.stderr[-2000:]
    assert "demo_mc" not in mine.stdout and "results/mine/" in mine.stdout


# The checkout with a space in its path and a model folder named like a command: a real run, shared with gsm8k's
# (tests/evals/test_gsm8k.py).


@pytest.mark.e2e  # runs split_dataset for real, which fails
def test_a_failed_jobs_reason_reaches_the_console(tmp_path, demo_assets):
    """A stage that stops with a one-line reason in its log (here the split: every row rejected) says it on
    Snakemake's console too, naming the rule and its log, not only `Error in rule ...`."""
    data = tmp_path / "empty-answers.csv"
    data.write_text("question,response\nhello,\nworld,\nagain,\n")
    config = tiny_config("t") | {"nodes": 1, "model": {"name_or_path": str(demo_assets["base"])}}
    config["data"] = {"path": str(data), "max_seq_len": 128}
    proc = snakemake(tmp_path / "work", config, "results/t/data/manifest.json", check=False)
    assert proc.returncode != 0
    reason = f"{data}: no usable rows left (3 read, 3 rejected: {{'empty_response': 3}})"
    assert reason in (tmp_path / "work/logs/t/split_dataset.log").read_text()
    kept = "the rejects are in logs/t/split_dataset.rejects.jsonl"  # kept outside the failed job's outputs
    assert f"error: split_dataset (logs/t/split_dataset.log): {reason}; {kept}" in proc.stderr.splitlines()


def train_jobs(text: str) -> list[str]:
    """The dry run's (-n -p) train_node / train_joint job blocks."""
    blocks = re.split(r"\n(?=(?:local)?rule \w+:)", text)
    return [b for b in blocks if re.match(r"(local)?rule train_(node|joint):", b)]


@pytest.mark.parametrize("mode", ["per_node", "joint"])
def test_training_takes_the_eval_set_as_input_only_with_eval_every(tmp_path, mode, request):
    """training.eval_every: the tokenized eval set is the train jobs' input and reaches the trainer; without it
    neither, so a change to the eval set reruns training only where training reads it."""
    on = snakemake(tmp_path / "on", tiny_config("e", mode=mode, eval_every=4), "-n", "-p").stdout
    # without eval_every: the session's dry run of tiny_config("t") in that mode (per_node is the default)
    off = request.getfixturevalue("joint_dry_run" if mode == "joint" else "tiny_dry_run").stdout
    jobs_on, jobs_off = train_jobs(on), train_jobs(off)
    assert len(jobs_on) == len(jobs_off) == (1 if mode == "joint" else 2), on[-3000:]
    for job in jobs_on:
        inputs = next(line for line in job.splitlines() if line.strip().startswith("input:"))
        assert "results/e/data/tokenized/eval.parquet" in inputs, job
        assert "--eval-data results/e/data/tokenized/eval.parquet" in job, job
    for job in jobs_off:
        assert "tokenized/eval.parquet" not in job and "--eval-data" not in job, job


@pytest.mark.parametrize("grid", [{}, TINY_GRID])
def test_the_report_pages_are_no_target_rules(tmp_path, grid, request):
    """`snakemake --list-target-rules` lists the rules without a wildcard; the pages' rules name the run as one
    (rules/common.smk's PAGES), so they are left out, and a dry run still renders every page at its path."""
    config = tiny_config("t") | {"grid": grid}
    listed = snakemake(tmp_path, config, "--list-target-rules").stdout.split()
    assert "data_report" in listed and "all" in listed
    assert not [rule for rule in listed if rule.startswith("render_")], listed
    dry = request.getfixturevalue("grid_dry_run" if grid else "tiny_dry_run").stdout  # the session's, of `config`
    assert "results/t/env/check.html" in dry and "results/t/data/data_report.html" in dry
    assert ("results/t/lr-0.001/eval/summary.html" if grid else "results/t/eval/summary.html") in dry
