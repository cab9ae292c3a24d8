"""The scheduler's side of status: a run's training jobs as SLURM (squeue, sacct where the cluster keeps
accounting) or the local machine (its torchrun/train.py processes, from /proc) sees them.
"""

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SLURM_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


@dataclass
class Job:
    """A training job as the scheduler (or /proc) sees it."""

    id: str
    state: str  # RUNNING, PENDING, ... ; "local" for a process outside SLURM
    source: str  # squeue, sacct or local
    started: float | None = None  # epoch seconds
    comment: str = ""
    workdir: str = ""


SQUEUE_FORMAT = "%i|%T|%k|%Z|%S"


def parse_squeue(text: str) -> list[Job]:
    """Rows of `squeue -h -o '%i|%T|%k|%Z|%S'`: id, state, comment (the slurm executor's
    rule_<rule>_wildcards_<values>), work dir, start time (local time; N/A while pending)."""
    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 5 or not parts[0]:
            continue
        job_id, state, comment, workdir, start = parts[:5]
        jobs.append(Job(job_id, state.upper(), "squeue", parse_slurm_time(start), comment, workdir))
    return jobs


def parse_sacct(text: str) -> dict[str, str]:
    """`sacct -n -P -X -o JobID,State`: id → state ("CANCELLED by 0" → CANCELLED)."""
    states = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0]:
            states[parts[0]] = parts[1].split()[0].upper() if parts[1].strip() else "UNKNOWN"
    return states


def parse_slurm_time(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def run_tool(args: list[str]) -> str | None:
    """A scheduler command's stdout, or None where it is missing or fails (no SLURM here, no accounting)."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def slurm_jobs(known_ids: set[str]) -> dict[str, Job]:
    """The jobs squeue shows (all of this user's), and sacct's states of the run's other known ids."""
    out = run_tool(["squeue", "-h", "-u", str(os.getuid()), "-o", SQUEUE_FORMAT])
    jobs = {j.id: j for j in parse_squeue(out)} if out is not None else {}
    missing = sorted(known_ids - set(jobs))
    if missing:
        out = run_tool(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(missing)])
        for job_id, state in parse_sacct(out or "").items():
            jobs[job_id] = Job(job_id, state, "sacct")
    return jobs


def job_comment_matches(comment: str, node: str, variant: str) -> bool:
    """The slurm executor's comment for this node's training job: rule_train_node_wildcards_<...>_<node>
    (the wildcard values joined by '_'), rule_train_joint[...] for joint."""
    if node == "joint":
        return comment.startswith("rule_train_joint") and (not variant or variant.replace("/", "_") in comment)
    if not comment.startswith("rule_train_node_wildcards_"):
        return False
    values = comment.removeprefix("rule_train_node_wildcards_")
    return (values == node or values.endswith(f"_{node}") or values.startswith(f"{node}_")) and (
        not variant or variant.replace("/", "_") in values
    )


def boot_time() -> float:
    with contextlib.suppress(OSError):
        return next((float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x[:6] == "btime "), 0)
    return 0.0


def local_processes(proc_root: Path = Path("/proc")) -> list[tuple[int, Path, list[str], float | None]]:
    """(pid, cwd, argv, start time) of every process running train.py (torchrun, launch.py, the ranks)."""
    out = []
    ticks, booted = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100, boot_time()
    for proc in proc_root.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            if not any(a.endswith("train.py") for a in argv):
                continue
            cwd = Path(os.readlink(proc / "cwd"))
            stat = (proc / "stat").read_text()
            started = booted + int(stat.rsplit(")", 1)[1].split()[19]) / ticks if booted else None
        except (OSError, IndexError, ValueError):
            continue
        out.append((int(proc.name), cwd, argv, started))
    return out


def local_job(folder: Path, processes) -> Job | None:
    """The local training job whose --log-dir is ``folder``: its first (oldest) process, torchrun or launch.py."""
    matching = []
    for pid, cwd, argv, started in processes:
        for flag, value in zip(argv, argv[1:], strict=False):
            if flag == "--log-dir" and (cwd / value).resolve() == folder.resolve():
                matching.append((started or 0, pid))
    if not matching:
        return None
    started, pid = min(matching)
    return Job(str(pid), "RUNNING", "local", started or None)
