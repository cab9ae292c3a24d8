"""The tests' workflow jobs, each `python workflow_scripts/<...>.py` a fork of a Python that imported torch,
transformers and pandas once: the job zygote.

Why: most jobs of a tiny run (an evaluation, a consolidation, the planner, the demo model's build) spend ~9 of their
~10 s of CPU importing torch and transformers (the slow machine type), and the suite runs a few hundred of them.
What a forked child runs is the script itself (runpy, as `python script.py` runs it), in the job's working
directory, environment, standard streams and arguments, with the interpreter's exit code or signal passed back to
the job's own process, which stays the job (Snakemake, the shell and SLURM see and signal it; it forwards what it
gets to the child's process group, and the child is killed when that process dies). Only the imports are shared.

How it is wired: tests/site/ is on the tests' PYTHONPATH (conftest, for every command), JOB_ZYGOTES naming the suite's
folder; sitecustomize.py calls `delegate()` as a job's Python starts. A zygote is keyed by the Python
the environment a job's imports could read (READ_AT_IMPORT: not SLURM's variables, the thread counts, TMPDIR) and
the network namespace:
the first job with a key that imports torch or transformers starts one, and waits for it with every job of the key that
comes while it imports (its imports take what the job's own would); a job of a key without one (MAX_ZYGOTES), or whose
zygote did not answer within WAIT_S, runs in its own Python.
FORK_JOBS=0 when pytest starts (JOB_ZYGOTES unset) turns it off. The folder is the suite's (pytest's main process made
it; its workers share the zygotes). A zygote ends when the process that owns its folder has ended, or after 2 idle
minutes; there are at most MAX_ZYGOTES at once.

The trainer's launcher (ranks.py, torchrun, whose ranks it forks after importing what they import: ~11 s of CPU a
start), and check_ranks.py (the same for a test's own rank script), are forked too when they run one node's ranks
(`--standalone`), from the same zygote as the other jobs of their key, which imported what the ranks import as well (a
run's launchers are few, after its heavy data jobs have started the zygote): the launcher's and its ranks' processes are
then children of the zygote, not of the job's process, with the zygote's command line. A test that finds or signals the
ranks by their parent or command line (kill -9 of a rank, SLURM's signals to the ranks of a job step) sets
FORK_LAUNCHERS=0. launch.py, a joint job's launchers and the ranks a launcher starts as new Pythons (train.py) are not
forked.

A job's Snakemake (`python -m snakemake --target-jobs ...`: on SLURM, the batch job's and the job step's, two a job,
~1.9 s of CPU each on the fast machine type, of which ~1.4 s importing Snakemake and its plugins) is forked too, from a
zygote of its own kind that imported Snakemake (SNAKEMAKE_PRELOAD), except a training job's: its ranks get SLURM's
signals (the time limit's, scancel's) as processes of the job step, which a fork of the zygote is not
(NOT_FORKED_RULES). FORK_LAUNCHERS=0 leaves every job's Snakemake alone too.
"""

import contextlib
import os
import sys

# torchrun's launchers: the trainer's, and the tests' own rank scripts' (check_ranks.py)
LAUNCHERS = ("/workflow_scripts/train/ranks.py", "/tests/site/check_ranks.py")
NOT_FORKED = ("train/launch.py", "train/train.py")
# what the preloaded libraries (or the interpreter) could read as they are imported: a key is these variables' values
# (not SLURM's, make's, the thread counts (set_num_threads in run_job), TMPDIR (reset there), PATH)
READ_AT_IMPORT = (
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "KMP_",
    "NPY_", "NUMPY", "ARROW_", "PYARROW", "PANDAS", "PYTHON", "LD_", "XDG_", "HOME", "USE_", "ACCELERATE", "MPL",
)  # fmt: skip
PRELOAD = (
    "torch",
    "numpy",
    "pandas",
    "pyarrow",
    "pyarrow.parquet",
    "safetensors.torch",
    "huggingface_hub",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
    "tokenizers",
    "yaml",
    "jsonschema",
)  # (not the checkout's own modules: a test's copy of the checkout runs its own)
# and for the trainer's launcher, the third-party part of what its ranks import (ranks.RANK_IMPORTS, the strategies'
# rank_imports, PEFT): DeepSpeed as zero_runtime.import_deepspeed imports it, mlflow hidden
PRELOAD += (
    "torch.distributed.run", "torch.distributed.checkpoint", "torch.utils.tensorboard", "psutil", "peft",
    "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer",
)  # fmt: skip
# a job's Snakemake: what it imports before it reads the Snakefile (the CLI imports Snakemake and collects its plugins)
SNAKEMAKE_PRELOAD = ("snakemake.cli", "snakemake.api", "snakemake.dag", "yaml", "jsonschema")
NOT_FORKED_RULES = ("train_node", "train_joint")  # their Snakemake stays in the job step (the ranks get its signals)
# forwarded to the forked job (SIGURG: SLURM's warning before a time limit, which only the ranks handle)
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGURG")
IDLE_S = 120
MAX_ZYGOTES = 10  # at once (~500 MB resident each, ~350 of it its own; a Snakemake one ~150)
STARTED_BY = 1  # the job with a key that starts its zygote (~5 s of CPU on the fast machine type, a job alone ~4)
WAIT_S = 120  # a job waits for its key's starting zygote this long at most, then runs alone


def script_of(argv: list[str], environ: dict) -> str | None:
    """The workflow script ``argv`` (sys.argv of a starting Python) runs, if it is one a zygote runs."""
    if not argv or not argv[0].endswith(".py"):
        return None
    path = os.path.abspath(argv[0])
    if not os.path.isfile(path):
        return None
    if path.endswith(LAUNCHERS):  # one node's ranks, unless the test finds them by their parent
        return path if "--standalone" in argv and environ.get("FORK_LAUNCHERS", "1") != "0" else None
    if f"{os.sep}workflow_scripts{os.sep}" not in path or path.endswith(NOT_FORKED):
        return None
    return path


def snakemake_job_of(orig_argv: list[str], environ: dict) -> list[str] | None:
    """The arguments of the job's Snakemake ``orig_argv`` (sys.orig_argv of a starting Python) runs, if a zygote runs
    it: `python -m snakemake --target-jobs ...` for a rule not in NOT_FORKED_RULES."""
    if orig_argv[1:3] != ["-m", "snakemake"] or "--target-jobs" not in orig_argv:
        return None
    if environ.get("FORK_LAUNCHERS", "1") == "0":
        return None
    args = orig_argv[3:]
    rules = args[args.index("--allowed-rules") + 1 :] if "--allowed-rules" in args else []
    rules = rules[: next((i for i, a in enumerate(rules) if a.startswith("-")), len(rules))]
    if not rules or any(rule in NOT_FORKED_RULES for rule in rules):
        return None
    return args


def kept(environ: dict) -> list:
    """What a key is made of: the Python, the network namespace (a job of the two-host cluster's host runs in that
    host's network, tests/two_host_cluster.py) and the variables READ_AT_IMPORT."""
    try:
        network = os.readlink("/proc/self/ns/net")
    except OSError:
        network = ""
    return [sys.executable, network, sorted((k, v) for k, v in environ.items() if k.startswith(READ_AT_IMPORT))]


def key_of(environ: dict, kind: str = "jobs") -> str:
    """The zygote's key: what ``environ`` keeps, and the kind ("jobs": workflow scripts; "snakemake": a job's
    Snakemake)."""
    import hashlib
    import json

    made_of = kept(environ) + ([kind] if kind != "jobs" else [])
    return hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:16]


def delegate() -> None:
    """In a starting Python: if it runs a workflow script and a zygote for its key answers, have the script run in a
    fork of it and exit as that run did; else return (and maybe start a zygote for the next job)."""
    folder = os.environ.get("JOB_ZYGOTES")
    if not folder:
        return
    script = script_of(sys.argv, os.environ)
    snakemake_args = None if script else snakemake_job_of(sys.orig_argv, os.environ)
    if not script and snakemake_args is None:
        return
    import json
    import signal
    import socket
    from pathlib import Path

    kind = "jobs" if script else "snakemake"
    folder, key = Path(folder), key_of(dict(os.environ), kind)
    conn = connect(folder, key)
    if conn is None and start_zygote(folder, key, script or "-m snakemake"):
        conn = connect(folder, key, wait_s=WAIT_S)  # its imports take what this Python's would
    if conn is None:
        return
    request = {"cwd": os.getcwd(), "env": dict(os.environ)}
    request |= {"argv": [script, *sys.argv[1:]]} if script else {"module": "snakemake", "argv": snakemake_args}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = conn.makefile("r")
    child = int(json.loads(replies.readline())["pid"])

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signum)

    for name in SIGNALS:
        signal.signal(getattr(signal, name), forward)
    line = replies.readline()
    code = int(json.loads(line)["returncode"]) if line else 1
    if code < 0:  # ended by a signal: end this process the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def connect(folder, key: str, wait_s: float = 0):
    """A connection to ``key``'s zygote, or None: none answers (within ``wait_s``, while one is starting)."""
    import socket
    import time

    deadline = time.monotonic() + wait_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(folder / f"{key}.sock"))
            return conn
        except OSError:
            conn.close()
        if time.monotonic() >= deadline or not starting(folder, key):
            return None
        time.sleep(0.05)


def starting(folder, key: str) -> bool:
    """Whether ``key``'s zygote is alive (starting, or serving): the pid its .starting file names runs."""
    import time

    try:
        marker = folder / f"{key}.starting"
        text = marker.read_text()
        if not text:  # made, its pid not written yet (or never: its job died in between)
            return time.time() - marker.stat().st_mtime < 10
        pid = int(text)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


def start_zygote(folder, key: str, script: str) -> bool:
    """The STARTED_BY-th job with ``key`` whose script imports torch or transformers (a light job, a report page,
    say, runs as fast alone), or the STARTED_BY-th job's Snakemake (``script`` "-m snakemake"), starts its zygote,
    once: the .starting file is made exclusively. Whether a zygote for ``key`` is starting now, for this job to wait
    for."""
    import subprocess

    snakemake = script == "-m snakemake"
    if not snakemake:
        with open(script, "rb") as source:
            if not any(name in source.read() for name in (b"torch", b"transformers")):
                return False

    seen, marker = folder / f"{key}.seen", folder / f"{key}.starting"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not seen.exists():
            import json

            seen.write_text(json.dumps(kept(dict(os.environ)), indent=0))  # what made the key, to read
        with open(seen.with_suffix(".jobs"), "a") as jobs:
            jobs.write(f"{script}\n")
        if seen.with_suffix(".jobs").read_text().count("\n") < STARTED_BY:
            return False
        if len(list(folder.glob("*.sock"))) >= MAX_ZYGOTES:
            return False
        made = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another job of the key started it
        return True
    except OSError:
        return False
    with open(folder / f"{key}.log", "ab") as log:
        zygote = subprocess.Popen(
            [sys.executable, __file__, str(folder / f"{key}.sock"), *(["--snakemake"] if snakemake else [])],
            stdin=subprocess.DEVNULL, stdout=log,
            stderr=log, start_new_session=True, cwd="/",
        )  # fmt: skip
    os.write(made, str(zygote.pid).encode())
    os.close(made)
    return True


def serve(sock_path, preload: tuple[str, ...] = PRELOAD) -> None:
    """The zygote: import, then fork a handler per request (the handler forks the job and waits for it)."""
    import importlib
    import signal
    import socket

    for name in preload:
        hidden = name == "deepspeed" and "mlflow" not in sys.modules
        if hidden:
            sys.modules["mlflow"] = None  # as zero_runtime.import_deepspeed: the autotuner's has_mlflow = False
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (a job imports what it needs itself)
            print(f"preload {name}: {e!r}", flush=True)
        finally:
            if hidden:
                del sys.modules["mlflow"]
    owner = int((sock_path.parent / "owner").read_text())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path.with_suffix(f".{os.getpid()}.tmp")
    listener.bind(str(tmp))
    listener.listen(64)
    os.rename(tmp, sock_path)
    listener.settimeout(5)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers reaped by the kernel
    idle = 0.0
    while idle < IDLE_S:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            break
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            idle += 5
            continue
        idle = 0.0
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os._exit(handle(conn))
        conn.close()
    sock_path.unlink(missing_ok=True)
    sock_path.with_suffix(".starting").unlink(missing_ok=True)  # the key's next job starts another


def handle(conn) -> int:
    """A handler: read the request and the job's three streams, fork the job, report its pid and its exit code; kill
    the job's process group if the job's own process goes away first."""
    import json
    import select
    import signal
    import socket

    conn.settimeout(None)
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, got, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not msg:
            return 1
        data, fds = data + msg, fds + got
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        conn.close()
        os._exit(run_job(request, fds))
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # as the child does: a signal forwarded from now on reaches it
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    ended = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLHUP)
    poller.register(ended, select.POLLIN)
    while True:
        events = dict(poller.poll())
        if ended in events:
            _, status = os.waitpid(pid, 0)
            break
        if conn.fileno() in events:  # the job's own process is gone (it never sends more)
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 1
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    return 0


def run_job(request: dict, fds: list[int]) -> int:
    """The job: `python script args` as the interpreter would run it, in this fork; its exit code."""
    import atexit
    import random
    import runpy
    import signal
    import tempfile
    import threading
    import traceback

    os.setpgid(0, 0)  # its own group: its subprocesses get the signals forwarded to it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is the job's
    random.seed()  # a new Python's seeds, not the zygote's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules:  # OpenMP read the variable when the zygote imported torch; a fork's pool is rebuilt
        torch = sys.modules["torch"]  # by the thread that asks first: this one, before the job starts any (ranks.py)
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else torch.get_num_threads())
    module = request.get("module")  # `python -m module args`: the module's path first in sys.argv, cwd on sys.path
    if module:
        sys.argv = ["-m", *request["argv"]]
        sys.path[0] = os.getcwd()
    else:
        script, *args = request["argv"]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    with contextlib.suppress(OSError):
        threading._shutdown()  # as the interpreter's end: wait for non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":  # job_zygote.py SOCKET [--no-preload (tests/test_job_zygote.py) | --snakemake]
    from pathlib import Path

    preloads = {"--no-preload": (), "--snakemake": SNAKEMAKE_PRELOAD}
    serve(Path(sys.argv[1]), preloads.get(sys.argv[2] if sys.argv[2:] else "", PRELOAD))
