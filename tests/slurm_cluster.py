"""A throwaway single-machine SLURM cluster for the tests: munged, slurmctld and slurmd in a temp dir.

Everything the daemons write (config, key, socket, state, spool, logs, pid files) lives under one
directory; they listen on free ports, so a system SLURM installation, if any, is neither used nor
disturbed. Accounting is off (no slurmdbd), so job states come from ``squeue`` and finished jobs stay
visible there for ``MinJobAge`` seconds. Only the processes started here are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "scancel", "scontrol")
# daemons live in sbin, which is not always on a non-root PATH
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
PARTITION = "throwaway"
# seconds a finished job stays in squeue: the plugin's squeue status needs >= 3 polls, and a test reads every job of
# its run there at the end (the demo through SLURM took 405 s at load 12: its first jobs had gone after 300)
MIN_JOB_AGE = 1800
# GPUs each node declares, "devices" that are links to /dev/null (Slurm 22.05 reports no GPU without a File=),
# so sbatch --gpus and --gres=gpu:<n> are accepted and scheduled as on a GPU cluster while the jobs run on the
# CPU; the workflow asks for training.procs_per_node of them
GPUS = 4


def which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def unavailable_reason() -> str | None:
    """Why a cluster cannot be started here, or None."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if which(name) is None]
    if missing:
        return (
            f"SLURM binaries not found: {', '.join(missing)} "
            "(apt-get install slurmctld slurmd slurm-client munge, as .ci/run does)"
        )
    if os.geteuid() != 0:
        return "the throwaway SLURM cluster runs slurmd as root (SlurmdUser=root); not running as root"
    return None


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free now (all held open while choosing)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def available_memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 4096


def slurm_conf(root: Path, socket_path: Path, host: str, cpus: int, memory_mb: int, partition: str) -> str:
    """slurm.conf for one node that is also the controller, every path under ``root``."""
    ctld_port, slurmd_port = free_ports(2)
    return f"""\
ClusterName=throwaway
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups, no accounting: squeue is the only source of job states
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
# the node takes the CPUs and memory below, whatever it detects (containers report odd topologies)
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge={MIN_JOB_AGE}
KillWait=5
InactiveLimit=0
MailProg=/bin/true
GresTypes=gpu
NodeName={host} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} Gres=gpu:{GPUS} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    # the client commands a job runs that must find this cluster's slurm.conf (see _prepare)
    WRAPPED: ClassVar[tuple[str, ...]] = ("srun",)

    root: Path
    partition: str
    cpus: int
    memory_mb: int
    env: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)  # name -> Popen
    short_dir: Path | None = None  # holds munged's socket when root is too deep for a unix socket path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def nodes(self) -> list[str]:
        """The compute nodes' names, as slurm.conf lists them."""
        lines = self.conf.read_text().splitlines()
        return [line.split()[0].split("=", 1)[1] for line in lines if line.startswith("NodeName=")]

    def client_env(self, base: dict | None = None) -> dict:
        """``base`` (default os.environ) without inherited SLURM_* settings, plus this cluster's:
        SLURM_CONF, and the srun wrapper first on PATH."""
        env = dict(os.environ if base is None else base)
        for key in list(env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_")):
                del env[key]
        env["PATH"] = os.pathsep.join([str(self.root / "bin"), env.get("PATH", ""), "/usr/sbin", "/sbin"])
        return env | self.env

    def cmd(self, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run a SLURM client command (squeue, scontrol, ...) against this cluster."""
        exe = which(args[0]) or args[0]
        return subprocess.run(
            [exe, *args[1:]], env=self.client_env(), capture_output=True, text=True, timeout=timeout, check=check
        )

    def jobs(self, all_states: bool = False, name: str | None = None) -> list[dict]:
        """Jobs squeue knows: id, state, name, time_limit, comment (all_states: finished ones within
        MinJobAge too)."""
        args = ["squeue", "-h", "-o", "%i|%T|%j|%l|%k"]
        if all_states:
            args += ["--states=all"]
        if name:
            args += ["--name", name]
        out = self.cmd(*args).stdout
        keys = ("id", "state", "name", "time_limit", "comment")
        return [dict(zip(keys, line.split("|", 4), strict=True)) for line in out.splitlines() if line.strip()]

    def wait_for(self, predicate, timeout: float, interval: float = 0.5, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_tail()}")
            time.sleep(interval)

    def wait_until_queue_empty(self, timeout: float = 60) -> None:
        self.wait_for(lambda: not self.jobs(), timeout, what="an empty squeue")

    def cancel_all(self) -> None:
        self.cmd("scancel", "-p", self.partition, check=False)

    def log_tail(self, chars: int = 3000) -> str:
        names = ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out", "munged.out")
        # per-node slurmd files where there are several nodes (slurmd-%n.log, the slurmd-<node> processes' .out)
        paths = [self.root / name for name in names] + sorted(self.root.glob("slurmd-*.log"))
        paths += sorted(self.root.glob("slurmd-*.out"))
        parts = []
        for path in paths:
            if path.exists() and path.stat().st_size:
                parts.append(f"--- {path}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def _spawn(self, name: str, args: list[str]) -> None:
        out = open(self.root / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
        # a session of its own: a Ctrl-C meant for pytest or snakemake does not reach the daemons
        proc = subprocess.Popen(
            [which(args[0]), *args[1:]],
            env=self.client_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.procs[name] = proc

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} during startup\n{self.log_tail()}")

    def start(self, timeout: float = 60) -> None:
        """Start munged, slurmctld and slurmd; stop what was started if they are not up in ``timeout`` s."""
        try:
            self._start(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, deadline: float) -> None:
        host = socket.gethostname().split(".")[0]
        self._prepare(host)
        self._start_controller(deadline)
        for name, args in self._slurmd_commands(host).items():
            self._spawn(name, args)
        self._wait_started(self._nodes_idle, deadline, "every node idle in sinfo")

    def _slurmd_commands(self, host: str) -> dict[str, list[str]]:
        """Process name -> command line of each slurmd: here one, the node named after this host."""
        return {"slurmd": ["slurmd", "-D", "-f", str(self.conf), "-N", host]}

    def _nodes_idle(self) -> bool:
        lines = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.splitlines()
        idle = {line.split()[0] for line in lines if line.strip() and line.split()[1].rstrip("*~#") == "idle"}
        return idle == set(self.nodes)

    def _prepare(self, host: str) -> None:
        """The munge key, slurm.conf and the client wrappers (WRAPPED) under ``root``."""
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses group/world-accessible key files and socket directories
        os.chmod(self.root, 0o700)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # unix socket paths are limited to 107 bytes; a deep basetemp gets a short directory of its own
        socket_path = self.root / "munge" / "munge.socket"
        if len(str(socket_path)) > 100:
            self.short_dir = Path(tempfile.mkdtemp(prefix="munge-"))
            socket_path = self.short_dir / "munge.socket"
        self.conf.write_text(slurm_conf(self.root, socket_path, host, self.cpus, self.memory_mb, self.partition))
        for i in range(GPUS):
            with contextlib.suppress(FileExistsError):
                (self.root / f"gpu{i}").symlink_to("/dev/null")
        # read from slurm.conf's folder, by every slurmd of the cluster
        (self.conf.parent / "gres.conf").write_text(f"Name=gpu File={self.root}/gpu[0-{GPUS - 1}]\n")
        self.env = {"SLURM_CONF": str(self.conf)}
        # The jobstep executor runs each job as `srun ... snakemake ...` with every SLURM_* variable
        # but the job's ids removed from srun's environment, SLURM_CONF included; without it srun
        # looks for /etc/slurm/slurm.conf. This srun (and any other WRAPPED client), first on the
        # jobs' PATH, puts it back.
        (self.root / "bin").mkdir(exist_ok=True)
        for name in self.WRAPPED:
            wrapper = self.root / "bin" / name
            wrapper.write_text(f'#!/bin/sh\nexport SLURM_CONF={shlex.quote(str(self.conf))}\nexec {which(name)} "$@"\n')
            wrapper.chmod(0o755)

    def _start_controller(self, deadline: float) -> None:
        """munged, then slurmctld; returns once slurmctld answers a ping."""
        key = self.root / "munge" / "munge.key"
        socket_path = Path(self.conf_value("AuthInfo").split("=", 1)[1])
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
        )  # fmt: skip
        self._wait_started(lambda: socket_path.exists(), deadline, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait_started(lambda: "UP" in self.cmd("scontrol", "ping", check=False).stdout, deadline, "slurmctld")

    def conf_value(self, key: str) -> str:
        """The value of ``key`` in slurm.conf."""
        for line in self.conf.read_text().splitlines():
            if line.startswith(f"{key}="):
                return line.split("=", 1)[1]
        raise KeyError(key)

    def _wait_started(self, predicate, deadline: float, what: str) -> None:
        while True:
            self._check_alive()
            try:
                if predicate():
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM cluster did not start: no {what}\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel what is left in the partition, then stop the daemons (slurmd first), each by its pid."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.cancel_all()
            with contextlib.suppress(TimeoutError, subprocess.SubprocessError):
                self.wait_until_queue_empty(timeout=30)
        slurmds = [name for name in self.procs if name.startswith("slurmd")]
        for name in (*slurmds, "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.short_dir:
            shutil.rmtree(self.short_dir, ignore_errors=True)


def start_cluster(root: Path, partition: str = PARTITION, timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``root``; the node has every CPU (at least 2)."""
    cpus = max(2, len(os.sched_getaffinity(0)))
    memory_mb = max(2048, int(available_memory_mb() * 0.8))
    cluster = SlurmCluster(root=root, partition=partition, cpus=cpus, memory_mb=memory_mb)
    cluster.start(timeout=timeout)
    return cluster
