"""End to end: Snakemake runs every stage for each strategy; reruns touch only what is stale."""

import json

import pytest
from conftest import DEMO_CSV, check_outputs, planned_jobs, snakemake, tiny_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.e2e
DOWNSTREAM_OF_TRAINING = {"train_node", "consolidate_node", "evaluate_model", "summarize", "all"}


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


def test_finished_run_dry_runs_to_nothing(ddp_run):
    workdir, config = ddp_run
    assert planned_jobs(snakemake(workdir, config, "-n")) == {}


def test_lr_change_reruns_only_training_and_downstream(ddp_run):
    workdir, config = ddp_run
    changed = json.loads(json.dumps(config))
    changed["training"]["lr"] /= 2
    jobs = planned_jobs(snakemake(workdir, changed, "-n"))
    assert set(jobs) == DOWNSTREAM_OF_TRAINING
    assert jobs["train_node"] == 2 and jobs["evaluate_model"] == 2  # the base model is not re-evaluated


def test_deleting_one_nodes_model_reruns_only_that_node(ddp_run):
    import shutil

    workdir, config = ddp_run
    shutil.rmtree(workdir / "results" / "t" / "models" / "node0")
    jobs = planned_jobs(snakemake(workdir, config, "-n"))
    assert jobs == {"consolidate_node": 1, "evaluate_model": 1, "summarize": 1, "all": 1}
    snakemake(workdir, config)
    assert (workdir / "results" / "t" / "models" / "node0" / "config.json").exists()
    assert planned_jobs(snakemake(workdir, config, "-n")) == {}


def test_report_builds(ddp_run):
    workdir, config = ddp_run
    snakemake(workdir, config, "--report", str(workdir / "report.html"))
    html = (workdir / "report.html").read_text(errors="replace")
    assert "summary.csv" in html and "loss_curves.png" in html


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_other_strategies_end_to_end(tmp_path, strategy):
    snakemake(tmp_path, tiny_config("t", strategy, zero_stage=3))
    check_outputs(tmp_path / "results" / "t")


@pytest.mark.parametrize(
    "override,needle",
    [
        ({"data": {"path": "/nonexistent/data.csv"}}, "/nonexistent/data.csv"),
        ({"data": {"path": str(DEMO_CSV), "columns": {"response": "answer"}}}, "'answer'"),
        ({"training": {"lr": "fast"}}, "training.lr"),
    ],
    ids=["bad-path", "missing-column", "wrong-type"],
)
def test_bad_input_stops_with_one_line(tmp_path, override, needle):
    config = tiny_config("t")
    for key, value in override.items():
        config[key] = config[key] | value
    proc = snakemake(tmp_path, config, "-n", check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0]
    assert "Traceback" not in proc.stderr
