"""The stop-signal protocol: a time limit or a preemption ends in a checkpoint and exit 75.

SIGTERM, SIGUSR1 or SIGURG (SLURM's warning before the time limit, preemption) asks for a
checkpoint and a clean exit. The handler only sets a flag; the loop finishes its step, and
every rank agrees (an all-reduce of the flags) before all of them checkpoint together.
profiles/slurm asks SLURM for SIGURG (`--signal=URG@600`): its default action is to ignore
it, so Snakemake, the rule's shell and torchrun, which share the job step with the ranks and
receive it too, carry on, while SIGUSR1 would kill Snakemake and with it the job (docs/slurm.md,
"The profile").

Rank 0 writes `preempted.json` before the checkpoint: the rule maps torchrun's plain failure
back to 75 by it, and the job that resumes from that step records it as `resumed_after`.
"""

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.core.pipeline_io import write_json

log = logging.getLogger("train")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on a stop signal; a retry resumes


def die_with_parent() -> None:
    """SIGTERM this rank when its parent (torchrun) dies, even by SIGKILL.

    torchrun starts each rank in a session of its own, so killing the workflow's process group
    (kill -9 of a local Snakemake, say) ends torchrun but not the ranks, which would train on
    with no workflow alive. With this they checkpoint and exit like on any stop signal."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the parent was gone before the call
        os.kill(os.getpid(), signal.SIGTERM)


class StopSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGURG)

    def __init__(self, marker: Path):
        """Install the handlers first thing: a signal during start-up is honoured after the first step."""
        self.marker, self.received, self.previous = marker, None, None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        die_with_parent()

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agreed(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def take_over(self) -> None:
        """On rank 0, at the start, once it holds the trainer lock (trainer_lock.py): the previous job's
        marker is read and removed, so that a failure of this job is never taken for a preemption (the
        rule maps a failure with the marker to 75, which a SLURM retry would resume from forever)."""
        if dist.get_rank() != 0:
            return
        try:
            self.previous = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            self.previous = None
        self.marker.unlink(missing_ok=True)

    def resumed_after(self, start_step: int) -> dict | None:
        """On rank 0: the previous job's record (take_over) when this job resumes from the checkpoint it wrote."""
        record = self.previous if dist.get_rank() == 0 else None
        return record if record and start_step and record.get("step") == start_step else None

    def maybe_exit(self, step: int, last_step: int, device, checkpointer, on_exit) -> None:
        """After a step short of the last: when any rank got a signal, all checkpoint and exit 75."""
        if step >= last_step or not self.agreed(device):
            return
        rank = dist.get_rank()
        # the marker first: once save()'s last barrier lets any rank exit, srun (joint mode) or
        # torchrun may end the others, rank 0 included
        if rank == 0:
            write_json(self.marker, {"step": step, "signal": self.received, "time": time.time(),
                                     "slurm_job_id": os.environ.get("SLURM_JOB_ID")})  # fmt: skip
        checkpointer.save(step)  # nothing to do when this step's periodic checkpoint was just written
        if rank == 0:
            log.warning("%s: checkpointed at step %d; exiting %d so a retry resumes", self.received or "signal",
                        step, EXIT_PREEMPTED)  # fmt: skip
        on_exit()
        dist.destroy_process_group()
        sys.exit(EXIT_PREEMPTED)
