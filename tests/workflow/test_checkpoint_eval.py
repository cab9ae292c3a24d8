"""eval.checkpoints all on a copy of the shared finished run (ddp_run): each kept checkpoint of both nodes is
consolidated and scored as its own job into eval/checkpoints.csv; a new checkpoint adds only its own jobs (the dry
run shows them); consolidate.select best:eval_loss exports again from the scores, none scored twice. The pure
pieces are in tests/evals/test_checkpoint_select.py."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from conftest import copy_of_run, planned_jobs, snakemake

from workflow_scripts.evals.checkpoint_select import kept_steps
from workflow_scripts.train.checkpoint import HOLD_FILE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def scored(ddp_run, tmp_path_factory):
    """The copy with eval.checkpoints all, only checkpoints.csv's new jobs run (nothing else is stale)."""
    workdir, config = ddp_run
    dest = copy_of_run(workdir, tmp_path_factory.mktemp("checkpoint_eval") / "work")
    config = config | {"eval": config["eval"] | {"checkpoints": "all"}}
    snakemake(dest, config, f"results/{config['run']}/eval/checkpoints.csv")
    return dest, config


def checkpoint_root(workdir: Path, run: str, node: str) -> Path:
    state = json.loads((workdir / f"results/{run}/train/{node}/train_state.json").read_text())
    return workdir / state["plan"]["checkpoints"]


def test_every_kept_checkpoint_of_both_nodes_is_scored(scored):
    workdir, config = scored
    run = config["run"]
    frame = pd.read_csv(workdir / f"results/{run}/eval/checkpoints.csv")
    kept = [(node, step) for node in ("node0", "node1") for step in kept_steps(checkpoint_root(workdir, run, node))]
    assert len(kept) == 4  # max_steps 12, checkpoint_every 8, two kept: 8 and 12
    assert list(zip(frame["model"], frame["step"], strict=True)) == kept
    assert {"tokens_seen", "eval_loss_lo", "eval_loss_hi", "exact_match", "exact_match_hi"} <= set(frame.columns)
    assert (frame["eval_loss_lo"] <= frame["eval_loss"]).all() and (frame["eval_loss"] <= frame["eval_loss_hi"]).all()
    assert all(part["tokens_seen"].is_monotonic_increasing for _, part in frame.groupby("model"))
    # the last step's checkpoint is the exported model: the same held-out loss as evaluate_model's
    final = json.loads((workdir / f"results/{run}/eval/node0.json").read_text())
    assert frame.query("model == 'node0'")["eval_loss"].iloc[-1] == pytest.approx(final["eval_loss"], rel=1e-4)
    assert (workdir / f"results/{run}/eval/checkpoints.png").stat().st_size > 0
    assert not list((workdir / f"results/{run}/eval/checkpoints").rglob("*.model"))  # temp(): gone once scored
    hold = json.loads((checkpoint_root(workdir, run, "node0").parent / HOLD_FILE).read_text())
    assert hold["mode"] == "all"


def test_a_new_checkpoint_adds_only_its_own_jobs(scored):
    workdir, config = scored
    root = checkpoint_root(workdir, config["run"], "node0")
    added = root / "step-20"
    shutil.copytree(root / "step-12", added)  # as training on would leave one more
    try:
        proc = snakemake(workdir, config, f"results/{config['run']}/eval/checkpoints.csv", "-n")
        assert planned_jobs(proc) == {"consolidate_checkpoint": 1, "evaluate_checkpoint": 1, "checkpoint_scores": 1}
        assert "step-20.json" in proc.stdout
    finally:
        shutil.rmtree(added)
    proc = snakemake(workdir, config, f"results/{config['run']}/eval/checkpoints.csv", "-n")
    assert planned_jobs(proc) == {}


def test_best_select_exports_from_the_scores_without_scoring_again(scored):
    workdir, config = scored
    best = config | {"consolidate": {"select": "best:eval_loss"}}
    proc = snakemake(workdir, best, f"results/{config['run']}/models/node0", "-n")
    jobs = planned_jobs(proc)
    assert jobs.get("consolidate_node") == 1 and "evaluate_checkpoint" not in jobs, jobs
    bad = config | {"consolidate": {"select": "best:no_such_metric"}}
    proc = snakemake(workdir, bad, "-n", check=False)
    assert proc.returncode != 0
    assert "consolidate.select: 'no_such_metric' is no held-out metric" in proc.stdout + proc.stderr
