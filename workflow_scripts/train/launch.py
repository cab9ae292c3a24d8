"""train_joint: start the trainer on every node of a joint job (one model over N nodes).

Inside a SLURM job (SLURM_JOB_ID set) this process becomes

    srun --kill-on-bad-exit=1 --nodes=N --ntasks=N --ntasks-per-node=1 --cpus-per-task=C \\
        sh -c 'script="$1"; shift; exec "$0" "$script" --node-rank="$SLURM_NODEID" "$@"' \\
        python ranks.py --nnodes=N --nproc-per-node=P --master-addr=<first node's NodeAddr> --master-port=<port> \\
        --max-restarts=0 --rdzv-conf=timeout=<training.collective_timeout_s> train.py ...

one torchrun per node (ranks.py: torchrun, whose ranks fork from it after the imports on a machine without
GPUs) with a static rendezvous on the first node's address (c10d rendezvous needs distinct hostnames; the
node's NodeAddr works wherever slurmd does). If one node's processes die, srun ends the others. Outside SLURM
it starts the N node groups on this machine, rendezvous on 127.0.0.1, for testing on a CPU; when one group
fails, the others are killed, as srun would.

    python launch.py --nodes 2 --procs-per-node 2 --threads 8 -- train.py --config ...
"""

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError, cli

log = logging.getLogger("launch")
NODE_RANK_FROM_SLURM = 'script="$1"; shift; exec "$0" "$script" --node-rank="$SLURM_NODEID" "$@"'
RANKS = str(Path(__file__).with_name("ranks.py"))
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def torchrun_args(nodes: int, procs: int, master_addr: str, master_port: int, timeout_s: int = 600) -> list[str]:
    """torchrun (ranks.py) with a static rendezvous that waits ``timeout_s`` for every node, then fails saying how
    many came (torchrun's own default, 900 s, is as long as a short job's whole time limit: a node that never came
    would end in SLURM's TIMEOUT, silent); the node rank is added per node."""
    return [
        "python", RANKS, f"--nnodes={nodes}", f"--nproc-per-node={procs}", f"--master-addr={master_addr}",
        f"--master-port={master_port}", "--max-restarts=0", f"--rdzv-conf=timeout={timeout_s}",
    ]  # fmt: skip


def collective_timeout(train: list[str]) -> int:
    """training.collective_timeout_s of the trainer's ``--config`` in ``train`` (600 without one): how long a node
    waits for the others."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", default="{}")
    a, _ = p.parse_known_args(train[1:])
    try:
        cfg = json.loads(a.config)
        return int(cfg.get("collective_timeout_s") or 600) if isinstance(cfg, dict) else 600
    except (ValueError, TypeError):
        return 600  # the trainer says what is wrong with its --config


def srun_command(nodes: int, cpus_per_task: int, torchrun: list[str], train: list[str]) -> list[str]:
    """One task per node, each running torchrun (``python ranks.py``) with --node-rank=$SLURM_NODEID (expanded on its
    node) after the script."""
    srun = ["srun", "--kill-on-bad-exit=1", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={cpus_per_task}"]  # fmt: skip
    return [*srun, "sh", "-c", NODE_RANK_FROM_SLURM, *torchrun, *train]


def local_commands(nodes: int, torchrun: list[str], train: list[str]) -> list[list[str]]:
    """The N node groups of a run outside SLURM, all on this machine."""
    return [[*torchrun, f"--node-rank={i}", *train] for i in range(nodes)]


def threads_per_rank(cpus: int, ranks: int) -> int:
    return max(1, cpus // ranks)


def job_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job: two jobs sharing a first node get different ones."""
    return 29500 + int(re.sub(r"\D", "", job_id) or 0) % 20000


def scontrol_fields(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show -o`` record."""
    return dict(m.groups() for m in re.finditer(r"(\S+?)=(\S*)", text))


def slurm_job(job_id: str) -> tuple[int, int, str]:
    """(nodes, CPUs per task, the first node's address) of the job, from scontrol."""

    def scontrol(*args: str) -> str:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True)
        if proc.returncode:
            raise UserError(f"scontrol {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    job = scontrol_fields(scontrol("show", "job", "-o", job_id))
    first = scontrol("show", "hostnames", job["NodeList"]).split()[0]
    node = scontrol_fields(scontrol("show", "node", "-o", first))
    cpus = int(job["CPUs/Task"]) if job.get("CPUs/Task", "").isdigit() else 1
    return int(job["NumNodes"]), cpus, node.get("NodeAddr") or first


def run_groups(commands: list[list[str]], env: dict) -> int:
    """Run the node groups side by side; the first failure kills the rest. Returns the exit code."""
    procs = [subprocess.Popen(cmd, env=env, start_new_session=True) for cmd in commands]
    signalled = []

    def forward(signum, frame):
        signalled.append(signum)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed and not code and not signalled:  # after a signal every group checkpoints and exits by itself
            code = failed[0].returncode
            log.error("node group %d exited %d; ending the others", procs.index(failed[0]), code)
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    return code or next((p.returncode for p in procs if p.returncode), 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", required=True, type=int, help="nodes of the joint job (training.nodes)")
    p.add_argument("--procs-per-node", required=True, type=int)
    p.add_argument("--threads", required=True, type=int, help="cores for all ranks outside SLURM")
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- train.py and its arguments")
    a = p.parse_args(argv)
    train = a.train[1:] if a.train[:1] == ["--"] else a.train
    if not train:
        raise UserError("launch.py: nothing to launch after --")
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        nodes, cpus, addr = slurm_job(job_id)
        if nodes != a.nodes:
            raise UserError(
                f"SLURM job {job_id} has {nodes} node(s) but training.mode joint needs nodes={a.nodes}: "
                "leave `nodes` of train_joint to the workflow (no nodes in the profile's set-resources)"
            )
        threads = threads_per_rank(cpus, a.procs_per_node)
        os.environ.update(dict.fromkeys(THREAD_VARS, str(threads)))
        timeout = collective_timeout(train)
        cmd = srun_command(nodes, cpus, torchrun_args(nodes, a.procs_per_node, addr, job_port(job_id), timeout), train)
        log.info("%s", shlex.join(cmd))
        log.info(
            "%d nodes meet at %s:%d; a node not there within %d s fails the job", nodes, addr, job_port(job_id), timeout
        )
        os.execvp(cmd[0], cmd)  # srun gets the signals SLURM sends this job step
    threads = threads_per_rank(a.threads, a.nodes * a.procs_per_node)
    torchrun = torchrun_args(a.nodes, a.procs_per_node, "127.0.0.1", free_port(), collective_timeout(train))
    commands = local_commands(a.nodes, torchrun, train)
    log.info("no SLURM job: %d node groups on this machine, %d thread(s) per rank", a.nodes, threads)
    sys.exit(run_groups(commands, os.environ | dict.fromkeys(THREAD_VARS, str(threads))))


if __name__ == "__main__":
    main()
