"""One trainer per checkpoint folder (trainer_lock.py): a live holder stops a second one with one line naming
it; a dead holder's lock never blocks. The trainers themselves: tests/test_resume.py."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import REPO

HOLDER = """
import sys, time
sys.path.insert(0, {scripts!r})
from pathlib import Path
from workflow_scripts.train.trainer_lock import hold
hold(Path({folder!r}))
print("held", flush=True)
time.sleep(600)
"""


def start_holder(folder):
    code = HOLDER.format(scripts=str(REPO / "workflow_scripts"), folder=str(folder))
    env = dict(os.environ) | {"SLURM_JOB_ID": "4242"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_stops_a_second_trainer_with_one_line_naming_it(tmp_path):
    from workflow_scripts.core.pipeline_io import UserError
    from workflow_scripts.train.trainer_lock import hold

    holder = start_holder(tmp_path / "ckpt")
    try:
        with pytest.raises(UserError) as e:
            hold(tmp_path / "ckpt")
    finally:
        holder.kill()
        holder.wait()
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'ckpt'}: another trainer is running on these checkpoints (")
    assert f"host {socket.gethostname()}, pid {holder.pid}, SLURM job 4242, since " in message
    assert "\n" not in message


def test_a_dead_holders_lock_does_not_block(tmp_path):
    """kill -9 of the holder: its record stays in the file, its lock goes with it."""
    from workflow_scripts.train.trainer_lock import LOCK_FILE, hold

    holder = start_holder(tmp_path / "ckpt")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())["pid"] == holder.pid
    hold(tmp_path / "ckpt")  # no error
    record = json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()


def read_steps(log_dir):
    return [json.loads(line)["step"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.torchrun
def test_a_second_trainer_on_live_checkpoints_stops_at_once(tmp_path, demo_assets):
    """A relaunch while the first trainer runs (after `snakemake --unlock`, or a SLURM retry that starts
    early) stops before it loads anything, with one line naming the first; the first trains on, and its
    metrics.jsonl, though the second job's Snakemake deleted it, has every step once."""
    import time

    import psutil  # Snakemake's own dependency
    from conftest import OWN_LAUNCHER, start_trainer, train_command, trainer_env

    # the first trains on while the second starts torchrun and imports torch (a loaded machine: long); its ranks,
    # forked after the imports (ranks.py), train 80 steps in about the time the second takes to start
    steps = 160
    cfg = {"lr": 3e-3, "micro_batch_size": 2, "max_steps": steps, "log_every": 1, "checkpoint_every": 8, "seed": 3}
    first = start_trainer(tmp_path, demo_assets, cfg, env=OWN_LAUNCHER)
    try:
        metrics = tmp_path / "train" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.2)
        # Snakemake deletes a job's outputs before it starts it: metrics.jsonl, under the first, mid-training
        metrics.unlink()
        first_ranks = {p.pid for p in psutil.Process(first.pid).children() if p.cmdline() == first.args}
        second = subprocess.run(train_command(tmp_path, demo_assets, cfg), capture_output=True, text=True,
                                env=trainer_env(), timeout=300)  # fmt: skip
        assert first.poll() is None, "the first trainer ended before the second was refused"
        holder = json.loads((tmp_path / "ckpt" / "trainer.lock").read_text())
        assert holder["pid"] in first_ranks  # the first's rank 0 (ranks.py's fork: its command line)
    finally:
        _, err = first.communicate(timeout=600)
    assert second.returncode != 0
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, second.stderr[-3000:]
    assert "another trainer is running on these checkpoints" in errors[0]
    assert f"host {socket.gethostname()}, pid {holder['pid']}, since " in errors[0]
    # "at once": before loading the data and the model, while the first still trains (no wall-clock bound: a
    # loaded machine takes its seconds to start torchrun and import torch)
    assert "plan:" not in second.stderr
    assert first.returncode == 0, err[-3000:]
    assert read_steps(tmp_path / "train") == list(range(1, steps + 1))


@pytest.mark.torchrun
def test_a_stale_preemption_marker_is_cleared_at_the_start(tmp_path, demo_assets):
    """preempted.json of an earlier job is removed as the trainer starts: a failure after that (here: the data)
    is the failure it is, not a preemption (the rule exits 75 where the marker is, and SLURM retries)."""
    from conftest import train_command, trainer_env

    (tmp_path / "train").mkdir()
    marker = tmp_path / "train" / "preempted.json"
    marker.write_text(json.dumps({"step": 8, "signal": "SIGTERM"}))
    assets = demo_assets | {"node0": tmp_path / "not-parquet.parquet"}
    assets["node0"].write_text("not parquet")
    proc = subprocess.run(train_command(tmp_path, assets, {"max_steps": 8}), capture_output=True, text=True,
                          env=trainer_env(), timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert not marker.exists(), proc.stderr[-3000:]


@pytest.mark.e2e  # a real (not -n) Snakemake run, refused at onstart
def test_a_rerun_beside_an_orphaned_trainer_touches_nothing(tmp_path):
    """Snakemake killed alone leaves its trainer running; a rerun (after --unlock) would delete the job's outputs
    and log before the trainer's own lock refuses it. The workflow refuses first (onstart): one line naming the
    holder, nothing deleted, no job run. The probe itself takes nothing (running_holder)."""
    from conftest import snakemake, tiny_config

    from workflow_scripts.train.trainer_lock import running_holder

    work, run = tmp_path / "work", "orphan"
    checkpoints = work / "results" / run / "checkpoints" / "node0"
    assert running_holder(checkpoints) is None  # no lock file: none made
    assert not checkpoints.exists()
    metrics = work / "results" / run / "train" / "node0" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"step": 1, "loss": 2.0}\n')
    log = work / "logs" / run / "train_node" / "node0.log"
    log.parent.mkdir(parents=True)
    log.write_text("the live trainer's log\n")
    holder = start_holder(checkpoints)
    try:
        assert f"pid {holder.pid}, SLURM job 4242" in running_holder(checkpoints)
        proc = snakemake(work, tiny_config(run), check=False)
    finally:
        holder.kill()
        holder.wait()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {checkpoints.relative_to(work)}: a trainer is still running on these")
    assert f"pid {holder.pid}" in errors[0] and "nothing was changed" in errors[0]
    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n' and log.read_text() == "the live trainer's log\n"
    assert not (work / "results" / run / "data").exists()  # no job ran
    assert running_holder(checkpoints) is None  # the holder gone, the lock is free
