"""pipeline_io: progress lines (rate, ETA and cadence, with a fake clock), atomic writes (mode, a full disk)."""

import pytest


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def progress(**kwargs):
    from workflow_scripts.core.pipeline_io import Progress

    clock, lines = Clock(), []
    return Progress("split", emit=lines.append, clock=clock, **kwargs), clock, lines


def test_a_line_every_tenth_of_the_total_with_rate_and_eta():
    bar, clock, lines = progress(total=1000, every=60, least=2)
    clock.now += 10
    bar.update(50)  # 5%: nothing yet
    assert lines == []
    clock.now += 10
    bar.update(150)  # 20% after 20 s: 10 rows/s, 800 left
    assert lines == ["split: 200/1,000 rows (20%), 10 rows/s, ETA 1m20s, elapsed 20s"]
    clock.now += 1
    bar.update(100)  # 30%, but 1 s after the last line: not yet
    clock.now += 1
    bar.update(1)  # 2 s after: the 30% line
    assert len(lines) == 2 and lines[1].startswith("split: 301/1,000 rows (30%)")
    clock.now += 78
    bar.done()
    assert lines[-1] == "split: done, 301/1,000 rows (30%), 3 rows/s, elapsed 1m40s"


def test_a_line_every_so_many_seconds_without_a_total_and_other_counts():
    bar, clock, lines = progress(every=30, unit="rows")
    for _ in range(10):
        clock.now += 10
        bar.update(100, tokens=4000)
    assert len(lines) == 3  # at 30, 60, 90 s; never per update
    assert lines[0] == "split: 300 rows, 10 rows/s, 12,000 tokens (400 tokens/s), elapsed 30s"
    assert "ETA" not in lines[0] and "%" not in lines[0]


def test_an_estimated_total_is_marked_and_dropped_at_the_end():
    bar, clock, lines = progress(total=100_000, exact=False, every=30)
    clock.now += 30
    bar.update(25_000)
    assert lines == ["split: 25,000/~100,000 rows (25%), 833 rows/s, ETA 1m30s, elapsed 30s"]
    clock.now += 100
    bar.update(80_000)  # more than estimated: no ETA
    assert "ETA" not in lines[-1] and "(105%)" in lines[-1]
    bar.done()
    assert lines[-1] == "split: done, 105,000 rows, 808 rows/s, elapsed 2m10s"


@pytest.mark.parametrize("seconds,text", [(0.4, "0s"), (59.6, "1m00s"), (61, "1m01s"), (7260, "2h01m")])
def test_duration(seconds, text):
    from workflow_scripts.core.pipeline_io import duration

    assert duration(seconds) == text


def test_the_interpreters_folder_goes_first_on_path_when_it_holds_torchrun(tmp_path):
    from workflow_scripts.core.pipeline_io import interpreter_first_on_path

    venv, other = tmp_path / "venv" / "bin", tmp_path / "other"
    venv.mkdir(parents=True)
    (venv / "torchrun").touch()
    env = {"PATH": f"{other}:/usr/bin"}
    interpreter_first_on_path(env, str(venv / "python"))
    assert env["PATH"] == f"{venv}:{other}:/usr/bin"
    interpreter_first_on_path(env, str(venv / "python"))  # once only
    assert env["PATH"].count(str(venv)) == 1
    # an interpreter without the training stack (a system Snakemake) leaves an activated env first
    env = {"PATH": f"{other}:/usr/bin"}
    interpreter_first_on_path(env, str(other / "python3"))
    assert env["PATH"] == f"{other}:/usr/bin"


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_outputs_keep_the_users_umask(tmp_path, umask, mode):
    """Atomic writes give an output the mode any new file gets (not mkstemp's 0600): a group reads a
    model's weights as it reads its config.json."""
    import os

    from workflow_scripts.core.pipeline_io import atomic_path, write_json

    old = os.umask(umask)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        with atomic_path(tmp_path / "b.bin") as tmp, open(tmp, "wb") as f:
            f.write(b"weights")
        (tmp_path / "c.json").write_text("{}")  # a plain new file, for comparison
    finally:
        os.umask(old)
    for name in ("a.json", "b.bin", "c.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin", "c.json"]  # no temporary left


def test_a_full_disk_names_the_path_and_the_free_space(tmp_path):
    """ENOSPC inside an atomic write (a real one: /dev/full) is one line naming the output and the space
    left; the partial file is gone and the output not written."""
    from workflow_scripts.core.pipeline_io import UserError, atomic_path

    out = tmp_path / "tokens" / "node0.parquet"
    with pytest.raises(UserError) as e, atomic_path(out) as tmp:
        tmp.write_bytes(b"partial")
        with open("/dev/full", "wb") as full:
            full.write(b"x" * 4096)
            full.flush()
    message = str(e.value)
    assert message.startswith(f"{out}: disk full while writing it (") and "\n" not in message
    assert " free in " in message and "No space left on device" in message
    assert list(tmp_path.rglob("*")) == [out.parent]


def test_other_errors_in_an_atomic_write_pass_through(tmp_path):
    from workflow_scripts.core.pipeline_io import atomic_path

    with pytest.raises(ValueError), atomic_path(tmp_path / "x.json"):
        raise ValueError("not a disk problem")
    assert list(tmp_path.iterdir()) == []


TORCHRUN_LOG = """\
2026-11-25 09:40:01,123 INFO plan: {...}
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 3, in <module>
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
E1125 09:40:02 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1)
Traceback (most recent call last):
  File "torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
"""


# a joint job's log after node1's ranks were killed (SIGKILL): srun's line, then node0's torchrun ended by srun
JOINT_NODE_KILLED_LOG = """\
2026-11-29 14:50:09,320 INFO plan: {'shards': ['node0.parquet', 'node1.parquet']}
srun: error: node1: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=4.0
slurmstepd-node0: error: *** STEP 4.0 ON node0 CANCELLED AT 2026-11-29T14:50:09 ***
W1129 14:50:09.644000 25018 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal
Traceback (most recent call last):
  File "/work/main/workflow_scripts/train/ranks.py", line 122, in <module>
torch.distributed.elastic.multiprocessing.api.SignalException: Process 25018 got signal: 15
srun: error: node0: task 0: Exited with exit code 1
"""


@pytest.mark.parametrize(
    "log,reason",
    [
        ("x INFO start\nerror: data.csv: no usable rows left\n", "data.csv: no usable rows left"),
        ("error: first\nTraceback (most recent call last):\nValueError: later\n", "first"),  # ours first
        ("Traceback (most recent call last):\n  File x\nKeyError: 'question'\n", "KeyError: 'question'"),
        (TORCHRUN_LOG, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        (
            "Traceback (most recent call last):\n  File x\n    ^^^^\npyarrow.lib.ArrowInvalid: not Parquet\n",
            "pyarrow.lib.ArrowInvalid: not Parquet",
        ),
        (
            "2026-11-25 09:40:01,123 ERROR node group 1 exited 1; ending the others\n",
            "node group 1 exited 1; ending the others",
        ),
        (
            "2026-11-25 09:40:01,123 WARNING SIGTERM: checkpointed at step 8; exiting 75 so a retry resumes\n",
            "SIGTERM: checkpointed at step 8; exiting 75 so a retry resumes",
        ),
        (
            "2026-11-25 09:40:01,123 WARNING ignoring partial checkpoint x\n2026-11-25 09:40:01,123 INFO step 4/12\n",
            None,
        ),
        (JOINT_NODE_KILLED_LOG, "node1's task 1 killed (srun then ended the other nodes' tasks)"),
        ("2026-11-25 09:40:01,123 INFO step 4/12 loss 2.1\n", None),  # killed from outside: nothing to say
        ("", None),
    ],
    ids=[
        "user-error",
        "user-error-first",
        "traceback",
        "torchrun",
        "no-error-suffix",
        "logged-error",
        "preempted",
        "warning",
        "joint-node-killed",
        "nothing",
        "empty",
    ],
)
def test_stop_reason_is_the_logs_last_error_line(tmp_path, log, reason):
    from workflow_scripts.core.pipeline_io import log_stop_reason, stop_reason

    assert stop_reason(log) == reason
    (tmp_path / "job.log").write_text(log)
    assert log_stop_reason(tmp_path / "job.log") == reason
    assert log_stop_reason(tmp_path / "missing.log") is None


# a SLURM log's tail as slurmstepd writes it (the scancel line as this suite's test cluster wrote it; the others in
# Slurm's own words, src/slurmd/slurmstepd/req.c and task/cgroup)
INNER_SNAKEMAKE = "[Sun Nov 29 14:24:54 2026]\nError in rule train_joint:\n    jobid: 0\nShutting down\n"


@pytest.mark.parametrize(
    "log, reason",
    [
        (
            "Building DAG\nslurmstepd-node0: error: *** JOB 1 ON node0 CANCELLED AT 2026-11-29T14:24:50 DUE TO TIME"
            " LIMIT ***\n" + INNER_SNAKEMAKE,
            "SLURM cancelled job 1 on node0 at 2026-11-29T14:24:50: its time limit (the rule's resources.runtime,"
            " minutes)",
        ),
        (
            "slurmstepd: error: *** STEP 12.0 ON gpu7 CANCELLED AT 2026-11-29T02:00:01 DUE TO PREEMPTION ***\n",
            "SLURM cancelled step 12.0 on gpu7 at 2026-11-29T02:00:01: preemption",
        ),
        (
            "slurmstepd-node0: error: *** STEP 4.0 ON node0 CANCELLED AT 2026-11-29T14:50:09 ***\n" + INNER_SNAKEMAKE,
            "SLURM cancelled step 4.0 on node0 at 2026-11-29T14:50:09: scancel or an administrator",
        ),
        (
            "slurmstepd: error: Detected 1 oom_kill event in StepId=4411.batch. Some of the step tasks have been OOM"
            " Killed.\n",
            "SLURM killed StepId=4411.batch for memory: out of its memory (the rule's resources.mem_mb)",
        ),
        (
            "slurmstepd: error: Detected 2 oom-kill event(s) in step 4411.0 cgroup.\n",
            "SLURM killed 4411.0 for memory: out of its memory (the rule's resources.mem_mb)",
        ),
        (
            "slurmstepd: error: *** JOB 88 CANCELLED AT 2019-03-01T10:00:00 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR"
            " DETAILS ***\n",
            "SLURM cancelled job 88 at 2019-03-01T10:00:00: node failure, see slurmctld log for details",
        ),
        (INNER_SNAKEMAKE, None),
    ],
    ids=["time-limit", "preempted", "scancel", "oom", "oom-older-slurm", "node-failure-older-slurm", "the-job-itself"],
)
def test_slurm_stop_reason_is_what_slurmstepd_wrote(tmp_path, log, reason):
    """The one line a failed SLURM job gets on the console (handlers.smk) when SLURM ended it: its newest SLURM log
    in the executor's folder for the rule, not one older than the run."""
    import os

    from workflow_scripts.core.pipeline_io import slurm_log_stop_reason, slurm_stop_reason

    assert slurm_stop_reason(log) == reason
    folder = tmp_path / "rule_train_joint"
    folder.mkdir()
    (folder / "6.log").write_text("slurmstepd: error: *** JOB 6 ON node0 CANCELLED AT 2026-11-28T10:00:00 ***\n")
    os.utime(folder / "6.log", (1e9, 1e9))
    (folder / "7.log").write_text(log)
    assert slurm_log_stop_reason(folder) == reason
    assert slurm_log_stop_reason(folder, since=2e9) is None  # both older than the run
    assert slurm_log_stop_reason(tmp_path / "missing") is None


def test_the_demo_models_weights_keep_the_users_umask(tmp_path):
    """save_pretrained writes model.safetensors 0600 (safetensors' own temporary file): build_demo_model gives
    every file of the folder the umask's mode, as the README promises."""
    import json
    import os

    from workflow_scripts.model.demo_model import main

    data = tmp_path / "d.csv"
    data.write_text("question,response\n" + "".join(f"what is {i}?,it is {i}\n" for i in range(30)))
    config = {"path": str(data), "demo_vocab_size": 300, "max_seq_len": 64}
    old = os.umask(0o027)
    try:
        main(["--config", json.dumps(config), "--output", str(tmp_path / "base")])
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "base").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes
