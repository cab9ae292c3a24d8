"""After a crash: kill -9 of a local Snakemake ends its training ranks, and the README's rerun resumes."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from conftest import OWN_LAUNCHER, copy_of_run, job_logs, snakemake_cmd, status, tiny_config, tool_env, training_ranks

pytestmark = pytest.mark.e2e


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


# long enough that the run is still training when it is killed (status shows it at step 8, 16 or 24), and no longer:
# the rerun trains every step after the checkpoint it resumes from
STEPS = 48


def test_kill_9_ends_the_ranks_and_the_rerun_resumes(tmp_path, ddp_run):
    """From a copy of the shared demo run (ddp_run, cp -a: as finished) without its plan and training: the command
    makes node0's training (its plan first), the one job a crash can leave half done with ranks of its own."""
    config = tiny_config("t", max_steps=STEPS, checkpoint_every=8, log_every=8)
    work = copy_of_run(ddp_run[0], tmp_path / "work", drop=("plan", "train", "checkpoints", "models"))
    cmd = snakemake_cmd(work, config, "results/t/train/node0/train_state.json")
    with open(tmp_path / "first.log", "w") as out:
        env = tool_env() | OWN_LAUNCHER
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    checkpoints = work / "results" / "t" / "checkpoints"
    try:
        wait_for(lambda: list(checkpoints.glob("node*/*/step-*/COMPLETE")), 600, "a training checkpoint")
        assert training_ranks(work), "no training rank is running"
        # make status while it trains: the node with a checkpoint (8 of STEPS steps) runs, with an ETA
        shown = status(work, "t")
        node = next(checkpoints.glob("node*/*/step-*/COMPLETE")).parts[-4]
        assert re.search(rf"^{node} +pid \d+ +training +(8|16|24)/{STEPS} .* (\d+m)?\d+s +\d+, ", shown, re.M), shown
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # Snakemake and everything in its process group
        proc.wait()
    # the ranks run in sessions of their own; they end with their torchrun (parent-death signal)
    wait_for(lambda: not training_ranks(work), 30, "the training ranks to end after kill -9")

    # README, "After a crash": unlock once, then the same command (the default profile reruns incomplete jobs)
    unlock = subprocess.run([*cmd, "--unlock"], capture_output=True, text=True, env=tool_env(), timeout=120)
    assert unlock.returncode == 0, unlock.stderr[-2000:]
    rerun = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=tool_env(),
                             start_new_session=True)  # fmt: skip
    try:
        _, stderr = rerun.communicate(timeout=600)
    except subprocess.TimeoutExpired:  # a hung rank (CI once, a fork's thread pool): say where, end it
        os.killpg(rerun.pid, signal.SIGKILL)
        _, stderr = rerun.communicate()
        pytest.fail(f"the rerun did not end in 600 s\n{stderr[-3000:]}{job_logs(work)}")
    assert rerun.returncode == 0, stderr[-3000:] + job_logs(work)
    plan = json.loads((work / "results/t/train/node0/plan.json").read_text())
    assert plan["start_step"] >= 8  # resumed from its checkpoint
    lines = (work / "results/t/train/node0/metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(8, STEPS + 1, 8))  # every logged step once
