"""The tests' `snakemake` commands, each a fork of one Python that imported Snakemake once (per pytest worker).

Why: a `snakemake` command spends ~2.2 s of CPU importing Snakemake and its plugins (the slow machine type) before
it reads the Snakefile, more than a dry run's own work; the suite starts it a few hundred times. What a forked
child runs is what the `snakemake` console script runs, `snakemake.cli.main(argv)`, in its own session, working
directory, environment and output files, with the venv's python as sys.executable; only the import is shared. A
command whose environment changes how a Python starts (any PYTHON* variable: the SLURM tests' sitecustomize, say)
is not forked: conftest starts it as a process of its own. FORK_SNAKEMAKE=0 turns the forks off.

Run as a script, this file is the server: one JSON request a line on stdin ({argv, cwd, env, stdout, stderr}),
answered with {"pid"} once forked, then {"returncode"} once the child has exited.
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def serve() -> None:
    import snakemake.cli  # the import every command would pay

    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        replies.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(child(snakemake.cli.main, request))
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, wait_status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(wait_status)}) + "\n")
        replies.flush()


def child(main, request: dict) -> int:
    """Run ``main`` as the command ``request`` names would; its exit code."""
    code = 1
    try:
        os.setsid()  # its own process group, killed whole on a timeout
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = list(request["argv"])
        main(sys.argv[1:])
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # as the interpreter does with sys.exit("message")
            print(e.code, file=sys.stderr)
    except BaseException:  # as the interpreter prints an uncaught exception
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    return code


class ForkedSnakemake:
    """The client: one server for this process, started on first use and again if it died."""

    def __init__(self, python: Path):
        self.python, self.server, self.lock = python, None, threading.Lock()
        self.server_env: dict[str, str] = {}

    def startup_env(self, env: dict) -> dict:
        return {k: v for k, v in env.items() if k.startswith("PYTHON")}

    def forkable(self, env: dict) -> bool:
        if os.environ.get("FORK_SNAKEMAKE", "1") == "0":
            return False
        return self.server is None or self.startup_env(env) == self.startup_env(self.server_env)

    def _server(self, env: dict) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen(
                [str(self.python), __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=env, cwd="/",
            )  # fmt: skip
            self.server_env = dict(env)
        return self.server

    def run(self, argv: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(prefix="snakemake-fork-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            server = self._server(env)
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            pid = json.loads(server.stdout.readline())["pid"]
            killed = []

            def kill() -> None:
                with contextlib.suppress(ProcessLookupError):  # gone already: it ended at the deadline
                    os.killpg(pid, 9)
                    killed.append(True)

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                reply = server.stdout.readline()
            finally:
                timer.cancel()
            if not reply:
                raise RuntimeError(f"the forking Snakemake server died running {argv}")
            code = json.loads(reply)["returncode"]
            if killed and code == -9:
                raise subprocess.TimeoutExpired(argv, timeout)
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
            return subprocess.CompletedProcess(argv, code, stdout, stderr)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    sys.path[0] = os.path.dirname(sys.executable)  # as the console script's: the venv's bin, not tests/
    serve()
