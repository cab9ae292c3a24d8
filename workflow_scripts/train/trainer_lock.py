"""One trainer per checkpoint folder: a lock its rank 0 holds for the job's life.

Two trainers on one folder (a relaunch after `snakemake --unlock` while the first still runs, a SLURM
retry that starts before the old attempt has ended) would resume from, save and prune the same
checkpoints and append to the same metrics.jsonl. The lock is an flock(2) on ``<checkpoint root>/trainer.lock``:
the kernel releases it when its holder dies, however it dies (kill -9 included), so a lock left
behind never blocks; the file only records the last holder (host, pid, SLURM job, since when) for the
message a second trainer stops with. The checkpoint root is the node's folder of checkpoint keys
(results/<run>/checkpoints/<node>/): known before anything loads, so the second trainer stops at once,
and shared with the log folder (metrics.jsonl, preempted.json), which two keys of one node share too.

On NFS, Linux turns flock into a POSIX lock the server arbitrates, so the trainers of two hosts
exclude each other (not with the `local_lock=flock` or `nolock` mount options); a file system
without locks (Lustre mounted without `-o flock`) gets a warning and no lock.
"""

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError

log = logging.getLogger("train")
LOCK_FILE = "trainer.lock"
_held: dict[Path, int] = {}  # lock file -> its descriptor, open (and the lock held) until the process ends


def holder_record() -> dict:
    return {
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def describe(text: str) -> str:
    """The holder as the lock file records it: 'host h, pid 12, SLURM job 34, since ...'."""
    try:
        r = json.loads(text)
    except ValueError:
        return "a process that has not written its name yet"
    job = f", SLURM job {r['slurm_job_id']}" if r.get("slurm_job_id") else ""
    return f"host {r.get('host')}, pid {r.get('pid')}{job}, since {r.get('since')}"


def running_holder(folder: Path) -> str | None:
    """The trainer that holds ``folder``'s lock now (``describe``), or None: a probe that creates and changes
    nothing (a shared lock, released at once), for the workflow to refuse a rerun before Snakemake deletes the
    outputs (metrics.jsonl, the log) of a trainer still running, an orphan of a killed Snakemake."""
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None  # no lock file: no trainer has run here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return describe(os.pread(fd, 4096, 0).decode(errors="replace"))
    except OSError:
        return None  # a file system without locks: the trainer's own lock cannot stop a second one either
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def hold(folder: Path) -> None:
    """Take ``folder``'s trainer lock for the rest of this process's life, or stop with one line naming
    the trainer that holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    if path in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        raise UserError(
            f"{folder}: another trainer is running on these checkpoints ({describe(holder)}); two at once "
            "would mix their checkpoints and metrics: wait for it to end, or stop it"
        ) from None
    except OSError as e:  # ENOSYS, EOPNOTSUPP, ENOLCK: a file system without locks
        log.warning("%s: cannot lock (%s); a second trainer on these checkpoints would not be stopped", path, e)
    record = (json.dumps(holder_record()) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)  # the fd stays open: on NFS the record reaches the server (and another host's reader) now
    _held[path] = fd


def one_trainer(folder: Path, device) -> None:
    """Every rank, once the process group is up: rank 0 takes ``folder``'s lock (hold) and tells the others
    whether it has it; a second trainer then ends on every rank, with rank 0's one line, exit code 2."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            hold(folder)
        except UserError as e:
            error = e
    refused = torch.tensor([1.0 if error else 0.0], device=device)
    dist.broadcast(refused, src=0)
    if refused.item():
        dist.destroy_process_group()
        if error:
            raise error
        sys.exit(2)  # the others, silently: rank 0 says why
