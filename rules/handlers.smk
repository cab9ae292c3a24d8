"""What runs around the jobs: onstart's checks before any job starts, onerror's one line per failed job."""

from workflow_scripts.core.pipeline_io import log_stop_reason, slurm_log_folder, slurm_log_stop_reason
from workflow_scripts.train.trainer_lock import running_holder


def report_failed_jobs():
    """After a failed run, each job that failed for good, its log and why, one line each on the console (Snakemake
    itself shows only its `Error in rule` line): why SLURM ended it if its SLURM log says so (a time limit, preemption,
    memory), else the reason its log ends with (pipeline_io.stop_reason). Local and SLURM jobs alike: their logs
    are on the shared file system. Never fails itself."""
    try:
        failed = list(getattr(workflow.scheduler, "failed", None) or ())
        jobs = [sub for job in failed for sub in (getattr(job, "jobs", None) or [job])]  # a group's jobs
        for job in sorted(jobs, key=lambda j: str(j.rule.name)):
            logs = [str(f) for f in job.log]
            slurm_logs = slurm_log_folder(job.rule.name, list(job.wildcards or ()))
            reason = slurm_log_stop_reason(slurm_logs, since=RUN_STARTED)
            reason = reason or next(filter(None, map(log_stop_reason, logs)), None)
            where = f" ({', '.join(logs)})" if logs else ""
            why = reason or ("no reason in its log: killed from outside?" if logs else "no log")
            print(f"error: {job.rule.name}{where}: {why}", file=sys.stderr)
    except Exception as e:  # the report is a courtesy: Snakemake's own error stands without it
        print(f"(could not list the failed jobs' reasons: {e})", file=sys.stderr)


onerror:
    report_failed_jobs()


def refuse_running_trainers():
    """Before any job starts (onstart): a training job to run whose checkpoints a trainer still holds (an
    orphan of a Snakemake killed alone, trainer_lock.py) stops the workflow with one line naming it.
    Snakemake deletes a job's outputs and log before running it: the refused rerun would delete the live
    trainer's metrics.jsonl, as the trainer itself only refuses after that."""
    for job in workflow.dag.needrun_jobs():
        if job.rule.name not in ("train_node", "train_joint"):
            continue
        folder = job.params.checkpoints
        holder = running_holder(folder)
        if holder:
            print(
                f"error: {folder}: a trainer is still running on these checkpoints ({holder}), started by an"
                f" earlier run; rerunning {job.rule.name} would delete its {job.output.metrics}: wait for it to"
                ' end, or stop it (README, "After a crash"); nothing was changed',
                file=sys.stderr,
            )
            sys.exit(1)


onstart:
    refuse_running_trainers()
    hold_for_scoring()  # common_checkpoints.smk
