"""The workflow through profiles/slurm (+ the profiles/slurm-test overlay) on a throwaway SLURM cluster.

Every job goes through sbatch, runs Snakemake's jobstep executor under srun on the one node, and is
polled with squeue: the same path as on a real cluster, minus the GPUs and the accounting database.
Skipped when the SLURM binaries are missing (see the slurm_cluster fixture).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import (
    OWN_LAUNCHER,
    PROFILES,
    check_outputs,
    copy_of_run,
    job_logs,
    slurm_env,
    snakemake,
    snakemake_cmd,
    status,
    submissions,
    tiny_config,
    training_ranks,
)

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

# compared byte for byte with the local run: the data stages are deterministic
SAME_BYTES = ("data", "base_model")


def run_id(output: str) -> str:
    return re.search(r"SLURM run ID: (\S+)", output).group(1)


def status_check_running(pid: int) -> bool:
    """Whether a process under ``pid`` runs squeue (the SLURM plugin's status check)."""
    import psutil  # Snakemake's own dependency

    def squeue(child: psutil.Process) -> bool:
        try:
            return "squeue" in " ".join(child.cmdline())
        except psutil.Error:  # ended meanwhile
            return False

    try:
        return any(squeue(child) for child in psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return False


def files_under(root) -> set[str]:
    """Relative paths of every file, the TensorBoard event files' host/time/pid suffix dropped."""
    paths = (str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return {re.sub(r"(events\.out\.tfevents)\..*", r"\1", p) for p in paths}


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm-run")
    config = tiny_config("t")
    start = time.monotonic()
    proc = snakemake(workdir, config, *PROFILES, env=slurm_env(slurm_cluster))
    print(f"workflow through SLURM: {time.monotonic() - start:.0f} s")
    return workdir, config, proc


def test_slurm_run_matches_local_run(slurm_cluster, slurm_run, ddp_run):
    workdir, _, proc = slurm_run
    output = proc.stdout + proc.stderr
    root, local = workdir / "results" / "t", ddp_run[0] / "results" / "t"
    check_outputs(root)
    # every job went through sbatch, and SLURM saw each of them finish
    submitted = submissions(output)
    rules = sorted(rule for _, rule in submitted)
    assert rules == sorted(
        ["check_environment", "split_dataset", "decontaminate", "build_demo_model", "tokenize_eval"]
        + ["tokenize_shard", "train_node", "consolidate_node"] * 2
        + ["evaluate_model"] * 3
        + ["summarize", "data_report", "provenance"]  # plan_training is a local rule: it runs before any job
    ), output[-3000:]
    jobs = slurm_cluster.jobs(all_states=True, name=run_id(output))
    assert sorted(j["id"] for j in jobs) == sorted(job_id for job_id, _ in submitted)
    assert {j["state"] for j in jobs} == {"COMPLETED"}
    # one GPU count: each training job and the environment check asked SLURM for training.procs_per_node GPUs
    # (the cluster declares GPUs without devices), every other job for none
    for job_id, rule in submitted:
        tres = re.search(r"TresPerJob=(\S*)", slurm_cluster.cmd("scontrol", "show", "job", job_id).stdout)
        gpus = "gres:gpu:2" if rule in ("train_node", "check_environment") else None
        assert (tres.group(1) if tres else None) == gpus, (rule, tres)

    assert files_under(root) == files_under(local)
    for sub in SAME_BYTES:
        for path in sorted((local / sub).rglob("*")):
            if path.is_file():
                assert (root / path.relative_to(local)).read_bytes() == path.read_bytes(), path
    # same seeds, data and threads per job: the same losses and evaluation as the local run
    for node in ("node0", "node1"):
        losses = [
            [json.loads(line)["loss"] for line in (r / "train" / node / "metrics.jsonl").read_text().splitlines()]
            for r in (root, local)
        ]
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    summary = pd.read_csv(root / "eval" / "summary.csv").set_index("model")
    expected = pd.read_csv(local / "eval" / "summary.csv").set_index("model")
    pd.testing.assert_frame_equal(summary, expected, rtol=1e-6)


def test_rerunning_one_nodes_training_submits_one_job(slurm_cluster, slurm_run):
    workdir, config, _ = slurm_run
    train = workdir / "results" / "t" / "train"
    untouched = (train / "node0" / "train_state.json").stat().st_mtime_ns
    # the target before --forcerun: --forcerun takes any number of values and would swallow it
    proc = snakemake(
        workdir,
        config,
        "results/t/train/node1/train_state.json",
        "--forcerun",
        "train_node",
        *PROFILES,
        env=slurm_env(slurm_cluster),
    )
    output = proc.stdout + proc.stderr
    assert [rule for _, rule in submissions(output)] == ["train_node"], output[-3000:]
    jobs = slurm_cluster.jobs(all_states=True, name=run_id(output))
    assert [(j["comment"], j["state"]) for j in jobs] == [("rule_train_node_wildcards_node1", "COMPLETED")]
    # node1's finished config trains nothing again (make retrain trains from step 0: test_quickstart); its outputs
    # are written again from its last checkpoint; node0 was not touched
    plan = json.loads((train / "node1" / "train_state.json").read_text())["plan"]
    assert plan["start_step"] == config["training"]["max_steps"]
    assert (train / "node0" / "train_state.json").stat().st_mtime_ns == untouched


# A Ctrl-C that lands while the plugin's status check holds the submitted jobs out of the executor's list cancels
# none (the upstream race docs/slurm.md describes; a check just after submitting can take seconds, its rate limiter
# and its retries for jobs squeue does not list yet): such an attempt is made again, up to this many in all
SIGINT_ATTEMPTS = 3


def test_sigint_cancels_the_slurm_jobs(slurm_cluster, ddp_run, tmp_path):
    for attempt in range(SIGINT_ATTEMPTS):
        states, returncode, failure = sigint_once(slurm_cluster, ddp_run, tmp_path / f"attempt{attempt}")
        if "CANCELLED" in states:
            break
    assert "CANCELLED" in states, failure
    assert returncode != 0


def sigint_once(slurm_cluster, ddp_run, tmp_path) -> tuple[set, int, tuple]:
    """A SLURM run of the demo, its Ctrl-C once a training job runs: the states of its jobs, Snakemake's exit code,
    and what a failure shows."""
    # the finished local run without its training and what comes of it (Snakemake makes no missing file that no
    # target needs): the SLURM run submits the training jobs first
    tmp_path.mkdir(parents=True)
    workdir = copy_of_run(ddp_run[0], tmp_path / "work", drop=("train", "checkpoints", "models", "eval"))
    # training that lasts until it is cancelled (the demo's 12 steps can be done, job and all, between the check
    # below and the SIGINT)
    config = tiny_config("t", max_steps=100000, checkpoint_every=100000)
    cmd = snakemake_cmd(workdir, config, *PROFILES)
    log = tmp_path / "snakemake.log"
    with open(log, "w") as out:
        # SIGINT as a terminal's Ctrl-C would send it; restored to the default in case this
        # process inherited it ignored (as background jobs of a non-interactive shell do)
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=slurm_env(slurm_cluster),
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:

        def all_submitted_and_one_running():
            text = log.read_text()
            # after the local plan_training job: Snakemake 9's local executor crashes on a SIGINT that comes
            # while a local job runs, before it cancels the SLURM jobs (docs/slurm.md, "The profile")
            if "SLURM run ID" not in text or not (workdir / "results/t/plan/memory.json").exists():
                return None
            # a training job running (the demo's shortest jobs may be done and gone from squeue by then)
            jobs = slurm_cluster.jobs(name=run_id(text))
            if not any(j["state"] == "RUNNING" and j["comment"].startswith("rule_train") for j in jobs):
                return None
            # and no status check of Snakemake's in flight (its squeue: the race above)
            return None if status_check_running(proc.pid) else run_id(text)

        rid = slurm_cluster.wait_for(all_submitted_and_one_running, timeout=180, what="a running SLURM job")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        slurm_cluster.wait_for(lambda: not slurm_cluster.jobs(), timeout=60, what="an empty squeue after SIGINT")
        states = {j["state"] for j in slurm_cluster.jobs(all_states=True, name=rid)}
        return states, proc.returncode, (states, log.read_text()[-3000:], job_logs(workdir))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        slurm_cluster.cancel_all()


# The first attempt's limit (minutes) is long enough that no signal comes before the test freezes its ranks,
# however slow the machine (CI's slow machine took over 60 s to start two ranks, and a 2-minute limit's
# signal came before step 3); the frozen job's limit is then cut to end 150-210 s later (scontrol, as the
# cluster's admin), so that SLURM's warning, WARNING_S before the end, comes 30-120 s after the cut (its
# limits are checked every 30 s), with at least 60 s left to checkpoint before the kill.
RUNTIME_MIN, WARNING_S, RETRY_MIN = 8, 90, 10
PREEMPT_STEPS = 40
SIGURG_BIT = 1 << (signal.SIGURG - 1)


def stopped(pid: int) -> bool:
    """Whether a process is stopped (state T) or gone."""
    try:
        return bool(re.search(r"^State:\s*T", Path(f"/proc/{pid}/status").read_text(), re.M))
    except OSError:
        return True


def signalled(pid: int) -> bool:
    """Whether a rank we stopped got SIGURG: pending in /proc/<pid>/status, or already running again
    (slurmstepd sends SIGCONT with the signal) or gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    if not re.search(r"^State:\s*T", status, re.M):
        return True
    return bool(int(re.search(r"^ShdPnd:\s*(\w+)", status, re.M).group(1), 16) & SIGURG_BIT)


def elapsed_s(text: str) -> int:
    """squeue's elapsed time (%M: 'M:SS', 'H:MM:SS' or 'D-HH:MM:SS') in seconds."""
    days, _, clock = text.strip().rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def cut_time_limit(slurm_cluster, job: int, left_s: int) -> int:
    """Cut a running job's time limit (whole minutes, as SLURM keeps it) so that it ends left_s to left_s + 60 s
    from now; the new limit in minutes."""
    elapsed = elapsed_s(slurm_cluster.cmd("squeue", "-h", "-j", str(job), "-o", "%M").stdout)
    minutes = -(-(elapsed + left_s) // 60)
    slurm_cluster.cmd("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")
    return minutes


def test_time_limit_signal_checkpoints_and_the_retry_resumes(slurm_cluster, ddp_run, tmp_path):
    """A training job longer than its time limit gets SLURM's warning signal, checkpoints and ends;
    Snakemake's retry (a longer limit) resumes from that checkpoint and finishes.

    How long a step takes here varies fivefold with the machine's load, so the first job's ranks are
    frozen (SIGSTOP) after a few steps and its limit cut to end a few minutes later: its training then
    outlasts its limit on any machine, and the signal cannot come before the freeze. The
    signal SLURM sends them stays pending (/proc/<pid>/status) or comes with a SIGCONT; then they run
    again, handle it after the step they were in, and the job ends before the limit.
    """
    # one checkpoint only at the end: the one the retry resumes from can only be the signal's
    config = tiny_config("t", max_steps=PREEMPT_STEPS, log_every=1, checkpoint_every=10**6)
    target = "results/t/train/node0/train_state.json"
    # everything before training is the finished local run's (a copy, cp -a: its times and Snakemake's records
    # kept), so that the SLURM run submits only the training job; its training and checkpoints are dropped, so
    # that this one starts from step 0 (the plan, a local rule, is made again for the new steps)
    workdir = copy_of_run(ddp_run[0], tmp_path / "work", drop=("train", "checkpoints"))
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "profile.yaml").write_text(
        yaml.safe_dump(
            {
                "retries": 1,
                "set-resources": {
                    "train_node": {
                        "nodes": 1,
                        "cpus_per_task": 2,
                        "mem_mb": 4000,
                        # minutes, growing with the attempt as in profiles/slurm
                        "runtime": f"{RUNTIME_MIN} if attempt == 1 else {RETRY_MIN}",
                        "slurm_extra": f"'--signal=URG@{WARNING_S}'",
                    }
                },
            }
        )
    )
    metrics = workdir / "results" / "t" / "train" / "node0" / "metrics.jsonl"
    log = tmp_path / "snakemake.log"
    start = time.monotonic()
    with open(log, "w") as out:
        cmd = snakemake_cmd(workdir, config, target, *PROFILES, "--profile", str(overlay))
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=slurm_env(slurm_cluster) | OWN_LAUNCHER)
    try:
        slurm_cluster.wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 150, what="3 training steps"
        )
        ranks = training_ranks(workdir)
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        # SIGSTOP takes effect asynchronously: a rank still shown running would pass for one SLURM resumed
        slurm_cluster.wait_for(lambda: all(stopped(pid) for pid in ranks), 30, what="the ranks to stop")
        try:
            # make status while the job is in flight (frozen, so this costs it no steps): its id and state
            job = json.loads(metrics.read_text().splitlines()[0])["slurm_job_id"]
            shown = status(workdir, "t", env=slurm_env(slurm_cluster))
            assert re.search(rf"^node0 +{job} RUNNING +training +\d+/{PREEMPT_STEPS} ", shown, re.M), shown
            cut = cut_time_limit(slurm_cluster, job, left_s=150)
            slurm_cluster.wait_for(lambda: all(signalled(pid) for pid in ranks), timeout=240, what="SIGURG from SLURM")
        finally:
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"time-limited training through SLURM: {time.monotonic() - start:.0f} s")
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:] + job_logs(workdir)
    submitted = submissions(output)
    assert [rule for _, rule in submitted] == ["train_node", "train_node"], output[-3000:]
    (first, _), (second, _) = submitted
    jobs = {j["id"]: j for j in slurm_cluster.jobs(all_states=True, name=run_id(output))}
    # the first job ended itself before its limit (FAILED, not TIMEOUT); the retry got a longer one
    assert (jobs[first]["state"], jobs[first]["time_limit"]) == ("FAILED", f"{cut}:00"), jobs
    assert (jobs[second]["state"], jobs[second]["time_limit"]) == ("COMPLETED", f"{RETRY_MIN}:00"), jobs

    plan = json.loads((metrics.parent / "train_state.json").read_text())["plan"]
    resumed = plan["start_step"]
    assert 3 <= resumed < PREEMPT_STEPS
    # the second job resumed from the checkpoint the first one wrote on SLURM's signal
    assert plan["resumed_after"]["signal"] == "SIGURG" and plan["resumed_after"]["step"] == resumed, plan
    assert (plan["resumed_after"]["slurm_job_id"], plan["slurm_job_id"]) == (first, second)
    checkpoints = sorted(p.parent.name for p in (workdir / "results" / "t" / "checkpoints").rglob("COMPLETE"))
    assert checkpoints == sorted([f"step-{resumed}", f"step-{PREEMPT_STEPS}"])
    # every step once: the first job's up to the signal, the second's from there on
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, PREEMPT_STEPS + 1))
    assert [r["slurm_job_id"] for r in records] == [first] * resumed + [second] * (PREEMPT_STEPS - resumed)
