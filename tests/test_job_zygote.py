"""The tests' workflow jobs forked from a zygote (site/job_zygote.py) run as their own Python would: the same
output, exit code, working directory, environment and arguments; signals sent to the job's process reach the
script; a job whose own process is killed takes its fork with it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import BIN, SITE, tool_env

sys.path.insert(0, str(SITE))
import job_zygote  # noqa: E402

SCRIPT = """
import os, signal, sys, time
print("pid", os.getpid(), "cwd", os.getcwd(), "argv", sys.argv[1:], "value", os.environ.get("ZYGOTE_TEST_VALUE"))
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)), "main", __name__, flush=True)
print("to stderr", file=sys.stderr)
if sys.argv[1:2] == ["wait"]:
    signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(7)))
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(120)
if sys.argv[1:2] == ["kill"]:
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1:2] == ["raise"]:
    raise ValueError("raised here")
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """A zygote (nothing preloaded) for tool_env's key in a folder of its own, and that environment."""
    root = tmp_path_factory.mktemp("zygote")
    folder = root / "zygotes"
    folder.mkdir()
    (folder / "owner").write_text(str(os.getpid()))
    env = tool_env() | {"JOB_ZYGOTES": str(folder), "ZYGOTE_TEST_VALUE": "a b"}
    sock = folder / f"{key(env)}.sock"
    server = subprocess.Popen([str(BIN / "python"), job_zygote.__file__, str(sock), "--no-preload"], env=env)
    for _ in range(300):
        if sock.exists():
            break
        time.sleep(0.1)
    script = root / "workflow_scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    yield env, script
    server.kill()
    server.wait()


def key(env: dict) -> str:
    """The key the job's Python computes (the venv's python is the pytest's)."""
    assert Path(sys.executable).parent == BIN
    return job_zygote.key_of(env)


def run(env, script, *args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "python"), str(script), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_a_forked_job_prints_and_exits_as_its_own_python(zygote, tmp_path):
    env, script = zygote
    forked = run(env, script, "3", "x y", cwd=tmp_path)
    alone = run(env | {"JOB_ZYGOTES": ""}, script, "3", "x y", cwd=tmp_path)
    assert forked.returncode == alone.returncode == 3
    drop_pid = lambda out: out.split(" ", 2)[2]  # noqa: E731
    assert drop_pid(forked.stdout) == drop_pid(alone.stdout)
    assert f"cwd {tmp_path} argv ['3', 'x y'] value a b\npath0 True main __main__" in forked.stdout
    assert forked.stderr == alone.stderr == "to stderr\n"
    # a traceback and exit code 1 as the interpreter's; a signal's death as the job's own
    raised = run(env, script, "raise", cwd=tmp_path)
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: raised here")
    assert run(env, script, "kill", cwd=tmp_path).returncode == -signal.SIGKILL


def test_the_job_runs_in_a_fork_and_gets_the_signals_its_process_gets(zygote, tmp_path):
    env, script = zygote
    started = tmp_path / "pid"
    proc = subprocess.Popen([str(BIN / "python"), str(script), "wait", str(started)], env=env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    child = wait_for_pid(started)
    assert child != proc.pid  # a fork of the zygote, not the process started
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7 and "terminated" in out


def test_a_killed_jobs_fork_is_killed_too(zygote, tmp_path):
    env, script = zygote
    started = tmp_path / "pid"
    proc = subprocess.Popen([str(BIN / "python"), str(script), "wait", str(started)], env=env)
    child = wait_for_pid(started)
    proc.kill()
    proc.wait()
    for _ in range(100):
        if not Path(f"/proc/{child}").exists() or " Z " in Path(f"/proc/{child}/stat").read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the forked job {child} outlived its process")


def test_the_workflow_scripts_and_one_nodes_launcher_are_forked(tmp_path):
    (tmp_path / "workflow_scripts" / "train").mkdir(parents=True)
    for name in ("evals/evaluation.py", "train/ranks.py", "train/train.py", "train/launch.py"):
        (tmp_path / "workflow_scripts" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "workflow_scripts" / name).touch()
    scripts = tmp_path / "workflow_scripts"
    evaluation, ranks = str(scripts / "evals" / "evaluation.py"), str(scripts / "train" / "ranks.py")
    assert job_zygote.script_of([evaluation, "--x"], {}) == evaluation
    # the trainer's launcher on one node (train_node's), unless the test asks for its own process tree
    one_node = [ranks, "--standalone", "--nproc_per_node", "2", "train.py", "--config", "{}"]
    assert job_zygote.script_of(one_node, {}) == ranks
    assert job_zygote.script_of(one_node, {"FORK_LAUNCHERS": "0"}) is None
    assert job_zygote.script_of([ranks, "--nnodes=2", "--node-rank=1", "train.py"], {}) is None  # a joint job's
    check = str(Path(job_zygote.__file__).with_name("check_ranks.py"))  # a test's own rank script's
    assert job_zygote.script_of([check, "torch", "--standalone", "x_check.py"], {}) == check
    for name in ("train/train.py", "train/launch.py"):  # a rank started as a new Python; the job's srun
        assert job_zygote.script_of([str(scripts / name)], {}) is None
    assert job_zygote.script_of(["-c"], {}) is None and job_zygote.script_of([str(tmp_path / "other.py")], {}) is None
    # the key leaves out what differs between the jobs of one run, and keeps what an import could read
    env = {"PATH": "/bin", "HF_HOME": "/h", "PYTHONPATH": "/c"}
    per_job = {
        "OMP_NUM_THREADS": "2",
        "SLURM_JOB_ID": "4",
        "TMPDIR": "/t",
        "PYTEST_CURRENT_TEST": "t",
        "MAKELEVEL": "1",
    }
    assert key(env | per_job) == key(env)
    for read in ("HF_HOME", "PYTHONPATH", "TRANSFORMERS_CACHE", "TORCH_HOME", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD"):
        assert key(env | {read: "/other"}) != key(env), read
    # a job in another network namespace (a host of the two-host cluster) has a zygote of its own
    code = f"import json, job_zygote; print(job_zygote.key_of(json.loads({json.dumps(json.dumps(env))})))"
    cmd = [str(BIN / "python"), "-c", code]
    here = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(job_zygote.__file__).parent, check=True)
    assert here.stdout.strip() == key(env)
    if shutil.which("unshare"):
        there = subprocess.run(["unshare", "--net", *cmd], capture_output=True, text=True,
                               cwd=Path(job_zygote.__file__).parent)  # fmt: skip
        assert there.returncode == 0, there.stderr
        assert there.stdout.strip() != key(env)


SNAKEFILE = """
rule a:
    output: "out/{x}.txt"
    shell: "echo $ZYGOTE_TEST_VALUE {wildcards.x} $PWD > {output}; test {wildcards.x} != bad"
"""


@pytest.mark.e2e
def test_a_jobs_snakemake_runs_in_a_fork_as_its_own_python(zygote, tmp_path):
    """`python -m snakemake --target-jobs ...` (SLURM's batch and step Snakemakes) through a zygote of the snakemake
    kind: the same files, exit code and console as alone; a failed job's exit code as Snakemake's."""
    env = zygote[0]
    folder = Path(env["JOB_ZYGOTES"])
    sock = folder / f"{job_zygote.key_of(env, 'snakemake')}.sock"
    server = subprocess.Popen([str(BIN / "python"), job_zygote.__file__, str(sock), "--snakemake"], env=env)
    try:
        wait_for(sock)
        (tmp_path / "Snakefile").write_text(SNAKEFILE)

        def snakemake(x: str, zygotes: str) -> subprocess.CompletedProcess:
            cmd = [str(BIN / "python"), "-m", "snakemake", "--target-jobs", f"a:x={x}", "--allowed-rules", "a",
                   "--cores", "1", "--force", "--nolock", f"out/{x}.txt"]  # fmt: skip
            return subprocess.run(cmd, env=env | {"JOB_ZYGOTES": zygotes}, cwd=tmp_path, capture_output=True,
                                  text=True, timeout=120)  # fmt: skip

        forked, alone = snakemake("f", str(folder)), snakemake("g", "")
        assert forked.returncode == alone.returncode == 0, forked.stderr + alone.stderr
        assert (tmp_path / "out/f.txt").read_text() == f"a b f {tmp_path}\n"
        assert (tmp_path / "out/g.txt").read_text() == f"a b g {tmp_path}\n"
        assert "1 of 1 steps (100%) done" in forked.stderr
        bad = snakemake("bad", str(folder))
        assert bad.returncode == 1 and "Error in rule a" in bad.stderr
        assert (folder / f"{sock.stem}.jobs").exists() is False  # every one of them went to the zygote
    finally:
        server.kill()
        server.wait()


def test_a_jobs_snakemake_is_forked_unless_it_trains():
    job = ["python", "-m", "snakemake", "--snakefile", "S", "--target-jobs", "evaluate_model:model=m",
           "--allowed-rules", "evaluate_model", "--cores", "2"]  # fmt: skip
    assert job_zygote.snakemake_job_of(job, {}) == job[3:]
    assert job_zygote.snakemake_job_of(job, {"FORK_LAUNCHERS": "0"}) is None  # a test that signals the job step
    for rule in job_zygote.NOT_FORKED_RULES:  # a training job's ranks get SLURM's signals as the step's processes
        training = [rule if a == "evaluate_model" else a for a in job]
        assert job_zygote.snakemake_job_of(training, {}) is None
    assert job_zygote.snakemake_job_of(["python", "-m", "snakemake", "--cores", "2"], {}) is None  # a user's own
    assert job_zygote.snakemake_job_of(["python", "-c", "--target-jobs"], {}) is None


def wait_for(path: Path) -> None:
    for _ in range(300):
        if path.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"no {path}")


def wait_for_pid(path: Path) -> int:
    for _ in range(300):
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.1)
    raise AssertionError("the job did not start")


def test_the_first_job_that_imports_torch_starts_a_zygote_and_light_jobs_do_not_count(tmp_path, monkeypatch):
    (tmp_path / "light.py").write_text("print('a page')\n")
    (tmp_path / "heavy.py").write_text("import torch\n")
    folder = tmp_path / "zygotes"
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda argv, **_: started.append(argv) or SimpleNamespace(pid=os.getpid()))
    for _ in range(5):
        assert not job_zygote.start_zygote(folder, "k", str(tmp_path / "light.py"))
    assert not (folder / "k.jobs").exists() and not started
    assert job_zygote.STARTED_BY == 1
    assert job_zygote.start_zygote(folder, "k", str(tmp_path / "heavy.py"))  # started: wait for it
    assert job_zygote.start_zygote(folder, "k", str(tmp_path / "heavy.py"))  # once (k.starting is there): wait
    assert started == [[sys.executable, job_zygote.__file__, str(folder / "k.sock")]]
    assert (folder / "k.starting").read_text() == str(os.getpid())
    # the launchers' modules are the zygote's too: a run's launchers fork from the zygote its data jobs started
    assert {"torch.distributed.run", "deepspeed", "peft"} <= set(job_zygote.PRELOAD)


def test_a_job_waits_for_its_keys_starting_zygote_and_not_for_a_dead_one(tmp_path):
    import socket
    import threading

    folder = tmp_path / "zygotes"
    folder.mkdir()
    assert job_zygote.connect(folder, "k", wait_s=30) is None  # none starting: at once
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / "k.starting").write_text(str(dead.pid))
    start = time.monotonic()
    assert job_zygote.connect(folder, "k", wait_s=30) is None and time.monotonic() - start < 5
    (folder / "k.starting").write_text("")  # made long ago, its pid never written (its job died in between)
    os.utime(folder / "k.starting", (time.time() - 60, time.time() - 60))
    assert not job_zygote.starting(folder, "k")
    (folder / "k.starting").write_text("")  # just made
    assert job_zygote.starting(folder, "k")
    (folder / "k.starting").write_text(str(os.getpid()))  # alive: its socket comes after its imports
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    timer = threading.Timer(0.5, lambda: (listener.bind(str(folder / "k.sock")), listener.listen(1)))
    timer.start()
    conn = job_zygote.connect(folder, "k", wait_s=30)
    assert conn is not None
    conn.close()
    listener.close()
