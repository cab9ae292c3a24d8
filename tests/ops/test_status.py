"""status.py: parsing the workflow's files and the scheduler's output, the ETA, the stall rule, rendering.
All on small synthetic files (the runs that check it on a live demo, SLURM job and finished run are in
test_crash.py, test_slurm.py and test_workflow.py)."""

import json
import os
import re
import time

import pytest
import yaml
from conftest import TINY_GRID, tiny_config

from workflow_scripts.core.pipeline_io import UserError, read_metrics
from workflow_scripts.ops.jobs import Job, job_comment_matches, local_job, parse_sacct, parse_squeue
from workflow_scripts.ops.status import (
    eta_seconds,
    is_stalled,
    last_checkpoint,
    main,
    run_status,
    train_folders,
)
from workflow_scripts.ops.status_view import headline, render_plain, stages

NOW = 1_800_000_000.0


def record(step, step_time=0.5, **extra):
    return {"step": step, "loss": 5.0 - step / 100, "lr": 1e-3, "tokens_per_s": 1000.0, "step_time_s": step_time,
            "mfu": None, "epoch": (step - 1) / 20, "slurm_job_id": None} | extra  # fmt: skip


def write_metrics(path, records, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def make_run(root, run="r", nodes=("node0", "node1"), steps=8, total=40, mtime=NOW, variant=""):
    """results/<run>/[<variant>/]train/<node>/ with metrics (every 4 steps), plan.json and a checkpoint."""
    prefix = root / "results" / run / variant if variant else root / "results" / run
    for node in nodes:
        folder = prefix / "train" / node
        metrics = write_metrics(folder / "metrics.jsonl", [record(s) for s in range(4, steps + 1, 4)])
        os.utime(metrics, (mtime, mtime))
        checkpoints = str(prefix.relative_to(root) / "checkpoints" / node / "key1")
        plan = {"total_steps": total, "steps_per_epoch": 20, "start_step": 0, "resumed_after": None,
                "checkpoints": checkpoints, "slurm_job_id": None}  # fmt: skip
        (folder / "plan.json").write_text(json.dumps(plan))
        marker = prefix / "checkpoints" / node / "key1" / "step-4" / "COMPLETE"
        marker.parent.mkdir(parents=True)
        marker.write_text(json.dumps({"step": 4, "time": mtime - 2}))
    return prefix


# ---------------------------------------------------------------- metrics.jsonl


def test_truncated_last_line_is_skipped(tmp_path):
    path = write_metrics(tmp_path / "m.jsonl", [record(1), record(2)], tail='{"step": 3, "loss": 4.')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_a_resumed_runs_repeated_steps_replace_the_old_ones(tmp_path):
    # a job logged steps 1-6, was killed, and the next resumed from the checkpoint at step 4
    old = [record(s, loss=9.0) for s in range(1, 7)]
    new = [record(s, loss=1.0) for s in range(5, 9)]
    records = read_metrics(write_metrics(tmp_path / "m.jsonl", old + new))
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == [9.0] * 4 + [1.0] * 4


# ---------------------------------------------------------------- ETA and stalls


def test_eta_is_the_median_recent_step_time_times_the_steps_left():
    records = [record(s, step_time=t) for s, t in [(10, 9.0), (20, 1.0), (30, 2.0), (40, 1.5), (50, 50.0)]]
    assert eta_seconds(records, total=100, recent=3) == pytest.approx(2.0 * 50)  # median of 2.0, 1.5, 50.0
    assert eta_seconds(records, total=50) == 0
    assert eta_seconds([], total=100) is None
    assert eta_seconds(records, total=None) is None


def test_stall_rule_counts_step_intervals_between_records():
    records = [record(s, step_time=1.0) for s in (4, 8, 12)]  # a record every 4 steps of 1 s
    assert not is_stalled(records, last_update=NOW - 19, now=NOW, factor=5, min_seconds=0)  # 5 x 4 s = 20 s
    assert is_stalled(records, last_update=NOW - 21, now=NOW, factor=5, min_seconds=0)
    assert not is_stalled(records, last_update=NOW - 21, now=NOW, factor=6, min_seconds=0)
    assert not is_stalled(records, last_update=NOW - 21, now=NOW, factor=5)  # and a minute at least
    assert is_stalled(records, last_update=NOW - 61, now=NOW, factor=5)
    assert not is_stalled([], last_update=None, now=NOW)


def processes(monkeypatch, pid, cwd, log_dir, started):
    """/proc as status.py sees it: one torchrun of ``log_dir`` started at ``started``."""
    argv = ["torchrun", "train.py", "--log-dir", str(log_dir)]
    monkeypatch.setattr("workflow_scripts.ops.status.local_processes", lambda: [(pid, cwd, argv, started)])


def test_running_job_without_a_step_is_starting_and_a_silent_one_stalled(tmp_path, monkeypatch):
    make_run(tmp_path, steps=8, mtime=NOW - 100)  # last record 100 s ago; 5 x 4 steps x 0.5 s = 10 s
    folder = tmp_path / "results/r/train/node0"
    monkeypatch.setattr("workflow_scripts.ops.status.slurm_jobs", lambda known: {})
    # torchrun started before the last record: stalled
    processes(monkeypatch, 42, tmp_path, "results/r/train/node0", NOW - 500)
    [node0, node1] = run_status(tmp_path, "r", now=NOW)
    assert (node0.state, node0.job, node1.state) == ("stalled", "pid 42", "stopped")
    assert node0.notes == ["no new step for 1m40s"]
    # unless a checkpoint is being written (its folder has no marker yet)
    (tmp_path / "results/r/checkpoints/node0/key1/step-8").mkdir()
    assert (run_status(tmp_path, "r", now=NOW)[0].notes) == ["saving checkpoint 8"]
    (tmp_path / "results/r/checkpoints/node0/key1/step-8").rmdir()
    # started after it (a retry loading its checkpoint): starting
    processes(monkeypatch, 43, tmp_path, folder, NOW - 50)
    assert run_status(tmp_path, "r", now=NOW)[0].state == "starting"
    # a fresh run with no metrics at all
    (folder / "metrics.jsonl").unlink()
    assert run_status(tmp_path, "r", now=NOW)[0].state == "starting"
    # and one logging on time
    make_run(tmp_path / "b", steps=8, mtime=NOW - 5)
    processes(monkeypatch, 44, tmp_path / "b", "results/r/train/node0", NOW - 60)
    node0 = run_status(tmp_path / "b", "r", now=NOW)[0]
    assert (node0.state, node0.step, node0.total, node0.eta_s) == ("running", 8, 40, 16.0)


# ---------------------------------------------------------------- checkpoints


def test_last_checkpoint_is_the_newest_with_its_marker(tmp_path):
    root = tmp_path / "checkpoints" / "node0" / "key"
    for step in (4, 8, 12):
        (root / f"step-{step}").mkdir(parents=True)
    (root / "step-4" / "COMPLETE").write_text(json.dumps({"step": 4, "time": NOW - 60}))
    (root / "step-8" / "COMPLETE").write_text(json.dumps({"step": 8, "time": NOW - 30}))
    # step-12 is being written (no marker): not a checkpoint
    assert last_checkpoint(root) == {"step": 8, "time": NOW - 30, "path": str(root / "step-8")}
    assert last_checkpoint(root.parent)["step"] == 8  # any key under checkpoints/<node>/
    assert last_checkpoint(tmp_path / "none") is None


# ---------------------------------------------------------------- the scheduler


def test_squeue_and_sacct_parsing():
    text = (
        "123|RUNNING|rule_train_node_wildcards_node0|/work/run|2026-11-23T10:00:00\n"
        "124|PENDING|rule_train_node_wildcards_node1|/work/run|N/A\n"
        "garbage\n"
    )
    jobs = parse_squeue(text)
    assert [(j.id, j.state, j.comment, j.workdir) for j in jobs] == [
        ("123", "RUNNING", "rule_train_node_wildcards_node0", "/work/run"),
        ("124", "PENDING", "rule_train_node_wildcards_node1", "/work/run"),
    ]
    assert jobs[0].started == time.mktime((2026, 11, 23, 10, 0, 0, 0, 0, -1)) and jobs[1].started is None
    assert parse_sacct("120|FAILED\n121|CANCELLED by 0\n") == {"120": "FAILED", "121": "CANCELLED"}


def test_job_comments_name_the_rule_and_the_wildcards():
    assert job_comment_matches("rule_train_node_wildcards_node1", "node1", "")
    assert not job_comment_matches("rule_train_node_wildcards_node10", "node1", "")
    assert not job_comment_matches("rule_consolidate_node_wildcards_node1", "node1", "")
    assert job_comment_matches("rule_train_node_wildcards_lr-1e-5_node1", "node1", "lr-1e-5")
    assert not job_comment_matches("rule_train_node_wildcards_lr-2e-5_node1", "node1", "lr-1e-5")
    assert job_comment_matches("rule_train_joint", "joint", "")


def test_slurm_job_from_squeue_or_from_the_id_the_metrics_name(tmp_path, monkeypatch):
    make_run(tmp_path, mtime=NOW - 1)
    monkeypatch.setattr("workflow_scripts.ops.status.local_processes", lambda: [])
    jobs = {
        "76": Job("76", "FAILED", "squeue", NOW - 90, "rule_train_node_wildcards_node1", str(tmp_path)),
        "77": Job("77", "RUNNING", "squeue", NOW - 60, "rule_train_node_wildcards_node1", str(tmp_path)),
        "78": Job("78", "RUNNING", "squeue", NOW - 60, "rule_train_node_wildcards_node0", "/another/workdir"),
    }
    monkeypatch.setattr("workflow_scripts.ops.status.slurm_jobs", lambda known: jobs)
    node0, node1 = run_status(tmp_path, "r", now=NOW)
    assert (node0.job, node1.job, node1.state) == ("", "77 RUNNING", "running")
    # no accounting: a finished job is known only while squeue keeps it; sacct's state otherwise
    jobs = {"70": Job("70", "FAILED", "sacct")}
    monkeypatch.setattr("workflow_scripts.ops.status.slurm_jobs", lambda known: jobs if "70" in known else {})
    folder = tmp_path / "results/r/train/node0"
    write_metrics(folder / "metrics.jsonl", [record(4, slurm_job_id="70")])
    assert [(n.job, n.state) for n in run_status(tmp_path, "r", now=NOW)] == [("70 FAILED", "failed"), ("", "stopped")]


def test_local_job_matches_the_log_dir_relative_to_the_process_cwd(tmp_path):
    folder = tmp_path / "results/r/train/node0"
    folder.mkdir(parents=True)
    procs = [(9, tmp_path, ["torchrun", "x/train.py", "--log-dir", "results/r/train/node0"], NOW),
             (8, tmp_path, ["python", "train.py", "--log-dir", "results/r/train/node1"], NOW),
             (10, tmp_path, ["python", "train.py", "--log-dir", "results/r/train/node0"], NOW + 1)]  # fmt: skip
    assert local_job(folder, procs) == Job("9", "RUNNING", "local", NOW)


# ---------------------------------------------------------------- folders, rendering, the CLI


def test_training_folders_at_any_depth_with_their_variant(tmp_path):
    make_run(tmp_path, nodes=("node0",))
    make_run(tmp_path, nodes=("node0", "node1"), variant="lr-1e-5")
    (tmp_path / "results/r/checkpoints/node0/key1/step-4/train/x").mkdir(parents=True)  # not walked
    results = tmp_path / "results" / "r"
    assert [str(p.relative_to(results)) for p in train_folders(results)] == [
        "train/node0", "lr-1e-5/train/node0", "lr-1e-5/train/node1"]  # fmt: skip
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False)
    assert [(n.variant, n.node, n.checkpoint["step"]) for n in nodes] == [
        ("", "node0", 4), ("lr-1e-5", "node0", 4), ("lr-1e-5", "node1", 4)]  # fmt: skip
    assert "lr-1e-5/node1" in render_plain("r", nodes, results, NOW)
    # finished: each variant's best model from its leaderboard
    for folder in train_folders(results):
        (folder / "train_state.json").write_text("{}")
    (results / "eval").mkdir()
    (results / "eval" / "grid.csv").write_text("variant,model\n")
    (results / "lr-1e-5" / "eval").mkdir()
    (results / "lr-1e-5" / "eval" / "leaderboard.txt").write_text("Best model: node1 (lowest eval loss)\n  more\n")
    text = render_plain("r", run_status(tmp_path, "r", now=NOW, scheduler=False), results, NOW)
    assert text.startswith("run r: finished")
    assert text.rstrip().endswith("lr-1e-5: Best model: node1 (lowest eval loss)")


def test_plain_rendering_of_a_running_and_a_finished_run(tmp_path):
    prefix = make_run(tmp_path, steps=8, total=40, mtime=NOW - 1)
    text = render_plain("r", run_status(tmp_path, "r", now=NOW, scheduler=False), prefix, NOW)
    lines = text.splitlines()
    assert lines[0].startswith("run r: 2 training job(s)")
    # columns that are "-" on every row (job, held-out, MFU, resumed) are left out; the loss is the recent mean
    assert lines[1].split() == ["node", "state", "step", "epoch", "loss", "tok/s", "ETA", "checkpoint", "eval"]
    # one vocabulary (status_view.PHASES), the training job's own word after it
    assert lines[2].split()[:8] == ["node0", "failed", "(stopped)", "8/40", "0.40", "4.9400", "1000", "16s"]
    assert "4, 3s ago" in lines[2]
    # resumed: after a signal, plan.json names it and the job before; after a crash, the start step
    plan = prefix / "train/node0/plan.json"
    plan.write_text(json.dumps(json.loads(plan.read_text()) | {"start_step": 4}))
    plan = prefix / "train/node1/plan.json"
    resumed = {"step": 4, "signal": "SIGURG", "time": NOW - 9, "slurm_job_id": "70"}
    plan.write_text(json.dumps(json.loads(plan.read_text()) | {"start_step": 4, "resumed_after": resumed}))
    text = render_plain("r", run_status(tmp_path, "r", now=NOW, scheduler=False), prefix, NOW)
    assert text.splitlines()[1].split()[-2:] == ["resumed", "eval"]
    after_checkpoint = [line.split("ago")[1].split() for line in text.splitlines()[2:4]]
    assert after_checkpoint == [["4", "-"], ["4", "SIGURG", "job", "70", "-"]]
    # finished: train_state.json, a consolidated and evaluated model, the leaderboard
    for node in ("node0", "node1"):
        (prefix / "train" / node / "train_state.json").write_text("{}")
        (prefix / "models" / node).mkdir(parents=True)
        (prefix / "models" / node / "config.json").write_text("{}")
        (prefix / "eval").mkdir(exist_ok=True)
        (prefix / "eval" / f"{node}.json").write_text(json.dumps({"eval_loss": 1.25}))
    (prefix / "eval" / "summary.csv").write_text("model,eval_loss\n")
    (prefix / "eval" / "leaderboard.txt").write_text("Best model: node0 (lowest eval loss)\n  eval loss 1.25\n\nrest\n")
    text = render_plain("r", run_status(tmp_path, "r", now=NOW, scheduler=False), prefix, NOW)
    assert text.splitlines()[0].startswith("run r: finished")
    assert "node1: done at step 8, final loss 4.9200, trained 4s, eval loss 1.250" in text
    assert "evaluated node0, node1" in text
    assert text.rstrip().endswith("Best model: node0 (lowest eval loss)\n  eval loss 1.25")


@pytest.mark.parametrize("grid", [{}, TINY_GRID])
def test_status_finds_what_the_rules_write(tmp_path, grid, request):
    """The rules and status.py take the results tree from one place (layout.py): every file a dry run's jobs
    would write, created empty, is where status looks for it (training folders, checkpoints, models, eval
    results, the stages), so a folder renamed for one side only fails here."""
    # the session's dry run of tiny_config("t") | {"grid": grid} (run "t")
    text = request.getfixturevalue("grid_dry_run" if grid else "tiny_dry_run").stdout
    outputs = [p.strip() for line in text.splitlines() if line.strip().startswith("output:")
               for p in line.split("output:", 1)[1].split(",")]  # fmt: skip
    for path in map(tmp_path.joinpath, outputs):
        if path.suffix:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record(12)) + "\n" if path.suffix == ".jsonl" else '{"eval_loss": 1.5}')
        else:  # directory() outputs: the models (and the demo base model)
            (path / "config.json").parent.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text("{}")
    for root in re.findall(r"--checkpoint-root (\S+)", text):
        (tmp_path / root / "key" / "step-12").mkdir(parents=True)
        (tmp_path / root / "key" / "step-12" / "COMPLETE").write_text(json.dumps({"step": 12, "time": NOW}))
    nodes = run_status(tmp_path, "t", now=NOW, scheduler=False)
    variants = [f"lr-{lr:g}" for lr in grid.get("training.lr", [])] or [""]
    assert [(n.variant, n.node) for n in nodes] == [(v, node) for v in variants for node in ("node0", "node1")]
    assert all(n.state == "done" and n.step == 12 and n.checkpoint["step"] == 12 for n in nodes)
    assert all(n.model and n.eval_loss == 1.5 for n in nodes)
    results = tmp_path / "results" / "t"
    picture = stages(results)
    assert picture["split"] and picture["tokenized"] == ["eval", "node0", "node1"]
    assert picture["evaluated"] == (["base"] if grid else ["base", "node0", "node1"])
    assert (picture["summary"], picture["grid"]) == (not grid, bool(grid))
    assert headline(nodes, results) == "finished"
    if grid:
        assert all(stages(results / v)["evaluated"] == ["base", "node0", "node1"] for v in variants)


def test_cli_errors_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--run", "nope", "-d", str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: no results/nope in {tmp_path}: nothing has run yet"
    (tmp_path / "config.yaml").write_text("run: mine\n")
    make_run(tmp_path, run="mine")
    main(["-d", str(tmp_path), "--config", "config.yaml", "--plain"])  # run: from the config in the work dir
    assert capsys.readouterr().out.startswith("run mine: 2 training job(s)")


def test_unreadable_run_errors(tmp_path):
    with pytest.raises(UserError, match="nothing has run yet"):
        run_status(tmp_path, "x")


def finish(prefix, nodes=("node0", "node1")):
    for node in nodes:
        (prefix / "train" / node / "train_state.json").write_text("{}")


def test_a_configured_node_not_started_keeps_the_run_unfinished(tmp_path, capsys):
    """`make status` counts the config's nodes, not the folders: two done of three is not "training finished"."""
    prefix = make_run(tmp_path, steps=40, total=40)
    finish(prefix)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config("r") | {"nodes": 3}))
    main(["-d", str(tmp_path), "--config", "config.yaml", "--plain"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("run r: 3 training job(s)"), lines
    assert lines[4].split()[:3] == ["node2", "queued", "-/-"]  # no job on any row: no job column
    # the folders alone (another run's config): two done is finished
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config("other") | {"nodes": 3}))
    main(["-d", str(tmp_path), "--config", "config.yaml", "--run", "r", "--plain"])
    assert capsys.readouterr().out.startswith("run r: training finished")


def test_without_the_runs_config_the_splits_nodes_count(tmp_path):
    prefix = make_run(tmp_path, nodes=("node0",), steps=40, total=40)
    finish(prefix, ["node0"])
    (prefix / "data").mkdir()
    (prefix / "data" / "manifest.json").write_text(json.dumps({"nodes": [{"rows": 5}, {"rows": 5}]}))
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False)
    assert [(n.node, n.state) for n in nodes] == [("node0", "done"), ("node1", "waiting")]
    assert headline(nodes, prefix) == "2 training job(s)"


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"training": {"mode": "joint"}}, [("", "joint")]),
        ({"grid": {"training.lr": [1e-3, 3e-3]}, "nodes": 1}, [("lr-0.001", "node0"), ("lr-0.003", "node0")]),
    ],
    ids=["joint", "grid"],
)
def test_the_configured_folders_of_joint_and_grid_runs(tmp_path, config, expected):
    (tmp_path / "results" / "r").mkdir(parents=True)
    base = tiny_config("r")
    config = base | config | {"training": base["training"] | config.get("training", {})}
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False, config=config)
    assert [(n.variant, n.node) for n in nodes] == expected and {n.state for n in nodes} == {"waiting"}


def test_a_finished_run_shows_whole_epochs_median_throughput_recent_loss_and_held_out(tmp_path):
    prefix = make_run(tmp_path, nodes=("node0",), steps=40, total=40)  # 20 steps an epoch: 2 epochs
    rows = [record(s, tokens_per_s=1000.0 + s) for s in range(4, 41, 4)]
    rows[-1]["tokens_per_s"] = 50.0  # the last interval ran beside an evaluation job
    rows[4] |= {"eval_loss": 2.5}
    rows[-1] |= {"eval_loss": 2.25}
    write_metrics(prefix / "train/node0/metrics.jsonl", rows)
    finish(prefix, ["node0"])
    [node] = run_status(tmp_path, "r", now=NOW, scheduler=False)
    assert node.epoch == 2.0 and node.held_out == 2.25 and node.last_loss == pytest.approx(4.6)
    assert node.loss == pytest.approx(5.0 - 22 / 100)  # the mean of the last 10 records' losses
    assert node.tokens_per_s == 1018.0  # the median of the recent intervals, not the last one's 50
    lines = render_plain("r", [node], prefix, NOW).splitlines()
    assert lines[1].split()[:7] == ["node", "state", "step", "epoch", "loss", "held-out", "tok/s"]
    # trained, not yet consolidated (no models/node0): queued for its next stage, in one vocabulary
    assert lines[2].split()[:8] == ["node0", "queued", "(consolidation", "next)", "40/40", "2", "4.7800", "2.2500"]


def running_at_80_columns(tmp_path):
    """A grid variant's two nodes in SLURM jobs, one stalled, with held-out losses, resumed after a signal."""
    prefix = make_run(tmp_path, steps=400, total=1000, mtime=NOW - 1, variant="lr-3e-05")
    for node in ("node0", "node1"):
        rows = [record(s, mfu=0.41, slurm_job_id="12345678") for s in range(4, 401, 4)]
        rows[-1] |= {"eval_loss": 1.9}
        write_metrics(prefix / "train" / node / "metrics.jsonl", rows)
        plan = prefix / "train" / node / "plan.json"
        resumed = {"step": 200, "signal": "SIGURG", "time": NOW - 900, "slurm_job_id": "12345000"}
        plan.write_text(json.dumps(json.loads(plan.read_text()) | {"start_step": 200, "resumed_after": resumed}))
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False)
    nodes[0].job, nodes[1].job = "12345678 RUNNING", "12345679 RUNNING"
    nodes[0].state, nodes[0].notes = "stalled", ["no new step for 12m30s"]
    return nodes, prefix


def test_status_fits_80_columns_with_the_model_step_and_eta(tmp_path):
    import io

    from rich.console import Console

    from workflow_scripts.ops.status_view import render_rich

    nodes, prefix = running_at_80_columns(tmp_path)
    wide = render_plain("r", nodes, tmp_path / "results" / "r", NOW).splitlines()
    assert max(map(len, wide)) > 80 and "resumed" in wide[1]  # what is left out at 80 columns
    lines = render_plain("r", nodes, tmp_path / "results" / "r", NOW, width=80).splitlines()
    table = lines[1:4]
    assert all(len(line) <= 80 for line in table), table
    header = table[0].split()
    assert header[:3] == ["node", "state", "step"] and {"ETA", "eval", "held-out", "loss"} <= set(header)
    eta = "5m00s"  # 600 steps left at 0.5 s
    assert table[1].split()[:4] == ["lr-3e-05/node0", "training", "(stalled)", "400/1000"] and eta in table[1].split()
    assert "lr-3e-05/node0: no new step for 12m30s" in lines  # the note, moved below the table
    assert any(line.startswith("(left out at 80 columns: resumed") for line in lines)
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    render_rich(console, "r", nodes, tmp_path / "results" / "r", NOW)
    shown = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in shown), shown
    assert any("eval" in line and "ETA" in line and "step" in line for line in shown), shown
    assert any("400/1000" in line and eta in line for line in shown), shown


def test_make_status_at_80_columns(tmp_path, capsys, monkeypatch):
    prefix = make_run(tmp_path, steps=8, total=40, variant="lr-3e-05")
    for node in ("node0", "node1"):
        plan = prefix / "train" / node / "plan.json"
        resumed = {"step": 4, "signal": "SIGTERM", "slurm_job_id": "12345000"}
        plan.write_text(json.dumps(json.loads(plan.read_text()) | {"start_step": 4, "resumed_after": resumed}))
    monkeypatch.delenv("COLUMNS", raising=False)  # as from a shell (a pytest-xdist worker has it set)
    main(["-d", str(tmp_path), "--run", "r", "--plain"])  # to a pipe: any width
    assert max(len(line) for line in capsys.readouterr().out.splitlines()[1:4]) > 80
    monkeypatch.setenv("COLUMNS", "80")
    main(["-d", str(tmp_path), "--run", "r", "--plain"])
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in out[1:4]) and "eval" in out[1] and "ETA" in out[1]
    assert out[2].split()[:4] == ["lr-3e-05/node0", "failed", "(stopped)", "8/40"] and "16s" in out[2]


def test_watch_ends_when_the_run_is_finished(tmp_path, capsys):
    import signal

    prefix = make_run(tmp_path, steps=40, total=40)
    finish(prefix)
    (prefix / "eval").mkdir()
    (prefix / "eval" / "summary.csv").write_text("model,eval_loss\n")

    def hang(*_):
        raise AssertionError("--watch kept polling a finished run")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)
    try:
        main(["-d", str(tmp_path), "--run", "r", "--plain", "--watch", "0.01"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out = capsys.readouterr().out
    assert out.startswith("run r: finished") and out.rstrip().endswith("the run is finished: --watch ends")


# ---------------------------------------------------------------- the whole run: running now, later stages, ETA


def snakemake_record(root, kind, path, record):
    """A record as Snakemake writes it: .snakemake/<kind>/<urlsafe base64 of the output path>."""
    import base64

    folder = root / ".snakemake" / kind
    folder.mkdir(parents=True, exist_ok=True)
    (folder / base64.urlsafe_b64encode(path.encode()).decode()).write_text(json.dumps(record))


def test_outputs_name_their_stage_and_job():
    from workflow_scripts.ops.status import output_job

    assert output_job("results/r/train/node1/train_state.json", "r") == ("training", "train node1")
    assert output_job("results/r/models/node0", "r") == ("consolidating", "consolidate node0")
    assert output_job("results/r/eval/base.json", "r") == ("evaluating", "evaluate base")
    assert output_job("results/r/lr-1e-05/eval/node0.json", "r") == ("evaluating", "evaluate lr-1e-05/node0")
    assert output_job("results/r/data/tokenized/node0.packing.parquet", "r") == ("preparing", "tokenize node0")
    assert output_job("results/r/eval/summary.csv", "r") == ("summarizing", "summarize")
    assert output_job("results/r/eval/summary.html", "r") == ("summarizing", "report page")
    assert output_job("results/other/eval/base.json", "r") is None


def test_evaluating_while_an_evaluation_runs_with_the_whole_runs_eta(tmp_path):
    from workflow_scripts.ops.status import run_progress

    prefix = make_run(tmp_path, steps=40, total=40)
    finish(prefix)
    (prefix / "models" / "node0").mkdir(parents=True)
    (prefix / "models" / "node0" / "config.json").write_text("{}")
    (prefix / "eval").mkdir()
    (prefix / "eval" / "base.json").write_text("{}")
    # finished: base's evaluation (90 s), node0's consolidation (40 s); running: node1's consolidation, node0's eval
    snakemake_record(tmp_path, "metadata", "results/r/eval/base.json",
                     {"rule": "evaluate_model", "starttime": NOW - 500, "endtime": NOW - 410})  # fmt: skip
    snakemake_record(tmp_path, "metadata", "results/r/models/node0",
                     {"rule": "consolidate_node", "starttime": NOW - 100, "endtime": NOW - 60})  # fmt: skip
    snakemake_record(tmp_path, "incomplete", "results/r/models/node1", {"external_jobid": "4242"})
    snakemake_record(tmp_path, "incomplete", "results/r/eval/node0.json", {"external_jobid": None})
    snakemake_record(tmp_path, "incomplete", "results/r/eval/lm_eval/node0.json", {"external_jobid": None})
    (tmp_path / ".snakemake" / "locks").mkdir()
    (tmp_path / ".snakemake" / "locks" / "0.input.lock").write_text("")
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False)
    progress = run_progress(tmp_path, "r", nodes, NOW)
    assert progress.running == ["consolidate node1 (slurm 4242)", "evaluate node0"]
    assert progress.stage == "evaluating"
    text = render_plain("r", nodes, prefix, NOW, progress=progress)
    assert text.splitlines()[0].startswith("run r: training finished; evaluating")
    assert "running now: consolidate node1 (slurm 4242), evaluate node0" in text
    # each node in one vocabulary: node0 consolidated and being evaluated, node1 being consolidated
    from workflow_scripts.ops.status import assign_phases

    assign_phases(nodes, tmp_path, "r")
    assert [(n.node, n.phase) for n in nodes] == [("node0", "evaluating"), ("node1", "consolidating")]
    rows = render_plain("r", nodes, prefix, NOW, progress=progress).splitlines()[2:4]
    assert [row.split()[:2] for row in rows] == [["node0", "evaluating"], ["node1", "consolidating"]]
    # consolidation and evaluation measured; the summary not yet: unknown, with what is known
    assert "whole run: ETA unknown (consolidation 40s, evaluation 1m30s; not yet measured: summary" in text
    snakemake_record(tmp_path, "metadata", "results/r/eval/summary.csv",
                     {"rule": "summarize", "starttime": NOW - 700, "endtime": NOW - 690})  # fmt: skip
    text = render_plain("r", nodes, prefix, NOW, progress=run_progress(tmp_path, "r", nodes, NOW))
    assert "whole run: ETA 2m20s (consolidation 40s, evaluation 1m30s, summary 10s;" in text


def test_no_job_running_says_what_comes_next_and_a_training_run_adds_its_eta(tmp_path):
    from workflow_scripts.ops.status import run_progress

    prefix = make_run(tmp_path, steps=40, total=40)
    finish(prefix)
    # incomplete markers without a Snakemake holding the lock: left by one that died
    snakemake_record(tmp_path, "incomplete", "results/r/models/node0", {"external_jobid": None})
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False)
    progress = run_progress(tmp_path, "r", nodes, NOW)
    text = render_plain("r", nodes, prefix, NOW, progress=progress)
    assert text.splitlines()[0].startswith("run r: training finished; consolidation next, no job running")
    assert "left unfinished by a Snakemake that is not running (a rerun redoes them): consolidate node0" in text
    # still training: the longest training ETA first; a job with no ETA yet makes the whole ETA unknown
    prefix = make_run(tmp_path / "t", steps=8, total=40, mtime=NOW - 1)
    nodes = run_status(tmp_path / "t", "r", now=NOW, scheduler=False)
    progress = run_progress(tmp_path / "t", "r", nodes, NOW)
    assert progress.eta_parts == ["training 16s"] and progress.eta_s is None
    assert "consolidation (no job of it finished yet)" in progress.eta_unknown
    assert headline(nodes, prefix, progress) == "2 training job(s)"


def test_a_retrained_node_counts_the_later_stages_again(tmp_path):
    """A node retrained (-R its train_state.json) still has its older model, evaluation and summary until their
    jobs rerun: while it trains, the whole run's ETA counts every later stage, as measured before."""
    from workflow_scripts.ops.status import run_progress

    prefix = make_run(tmp_path, steps=8, total=40, mtime=NOW - 1)
    for node in ("node0", "node1"):
        (prefix / "models" / node).mkdir(parents=True)
        (prefix / "models" / node / "config.json").write_text("{}")
    (prefix / "eval").mkdir()
    for name in ("base.json", "node0.json", "node1.json", "summary.csv"):
        (prefix / "eval" / name).write_text("{}")
    finish(prefix, ["node0"])
    for path, rule, seconds in [("models/node1", "consolidate_node", 30), ("eval/node1.json", "evaluate_model", 60),
                                ("eval/summary.csv", "summarize", 5)]:  # fmt: skip
        snakemake_record(tmp_path, "metadata", f"results/r/{path}",
                         {"rule": rule, "starttime": NOW - 900, "endtime": NOW - 900 + seconds})  # fmt: skip
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False)
    progress = run_progress(tmp_path, "r", nodes, NOW)
    assert progress.eta_parts == ["training 16s", "consolidation 30s", "evaluation 1m00s", "summary 5s"]
    assert progress.eta_s == 16 + 30 + 60 + 5
    # its training done, its evaluation running: not finished, whatever the older summary.csv says
    finish(prefix, ["node1"])
    (prefix / "eval" / "node1.json").unlink()
    snakemake_record(tmp_path, "incomplete", "results/r/eval/node1.json", {"external_jobid": None})
    (tmp_path / ".snakemake" / "locks").mkdir()
    (tmp_path / ".snakemake" / "locks" / "0.input.lock").write_text("")
    nodes = run_status(tmp_path, "r", now=NOW, scheduler=False)
    progress = run_progress(tmp_path, "r", nodes, NOW)
    assert headline(nodes, prefix, progress) == "training finished; evaluating"
    assert progress.eta_parts == ["evaluation 1m00s", "summary 5s"]
