"""status: where each training job of a run is, how fast it goes, when it ends, and whether it is stuck.

Reads only what the workflow writes (train/<node>/metrics.jsonl, plan.json, train_state.json, the
checkpoints' COMPLETE markers, models/, eval/; where layout.py puts them, as the rules do) plus the
scheduler: squeue (sacct when the cluster keeps accounting) or, outside SLURM, the local torchrun/train.py
processes. A finished run gets a summary. The table (status_view.py) shows the mean of the recent logged losses,
the latest held-out loss logged during training (training.eval_every) and the median tok/s of the recent
intervals, fitted to the terminal's width (COLUMNS, or --width). Below it: what runs now (the outputs Snakemake
marked incomplete in .snakemake/incomplete/, which it does for every job it starts or submits), the stage after
training that runs (consolidating, evaluating, summarizing), and an ETA of the whole run: training's ETA plus,
for each later stage with jobs left, the longest duration of that stage's jobs finished so far in this run
(.snakemake/metadata/'s start and end times); "unknown" where a stage has no finished job to go by.

    python -m workflow_scripts.ops.status --run demo [--root DIR] [--watch [SECONDS]] [--plain] [--width N]
"""

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from workflow_scripts.core.layout import (
    RUN_FILES,
    RUN_PAGES,
    VARIANT_FILES,
    VARIANT_PAGES,
    expected_train_dirs,
    file,
    matching,
)
from workflow_scripts.core.pipeline_io import UserError, cli, duration, read_metrics
from workflow_scripts.ops.jobs import SLURM_ACTIVE, Job, job_comment_matches, local_job, local_processes, slurm_jobs
from workflow_scripts.ops.status_view import RunProgress, headline, phase, render_plain, render_rich

RECENT = 10  # step intervals the ETA, the stall rule and tok/s take the median of, and the loss the mean of
STALL_FACTOR = 5.0  # no new step for this many expected intervals: stalled
STALL_MIN_S = 60.0  # and for at least this long: fast steps logged every step would flag any hiccup


# ---------------------------------------------------------------- the workflow's files


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def step_seconds(records: list[dict], recent: int = RECENT) -> float | None:
    """The median time of one optimizer step over the last ``recent`` logged intervals
    (each record's step_time_s is its interval's mean)."""
    times = [r["step_time_s"] for r in records[-recent:] if isinstance(r.get("step_time_s"), int | float)]
    return statistics.median(times) if times else None


def recent_median(records: list[dict], key: str, recent: int = RECENT) -> float | None:
    """The median of ``key`` over the last ``recent`` records that have it."""
    values = [r[key] for r in records[-recent:] if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else None


def recent_loss(records: list[dict], recent: int = RECENT) -> float | None:
    """The mean training loss of the last ``recent`` records."""
    values = [r["loss"] for r in records[-recent:] if isinstance(r.get("loss"), int | float)]
    return statistics.fmean(values) if values else None


def latest_held_out(records: list[dict]) -> float | None:
    """The newest held-out loss logged during training (training.eval_every)."""
    return next((r["eval_loss"] for r in reversed(records) if isinstance(r.get("eval_loss"), int | float)), None)


def epochs_trained(step: int | None, plan: dict, last: dict) -> float | None:
    """Epochs after ``step``: step / plan.json's steps per epoch (a finished run's whole number); else the
    record's epoch (where its step began)."""
    per_epoch = plan.get("steps_per_epoch")
    if step is not None and isinstance(per_epoch, int) and per_epoch > 0:
        return step / per_epoch
    return last.get("epoch")


def log_interval(records: list[dict], recent: int = RECENT) -> int:
    """Steps between two records (training.log_every), the median of the recent ones."""
    steps = [r["step"] for r in records[-recent - 1 :]]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False) if b > a]
    return int(statistics.median(gaps)) if gaps else 1


def eta_seconds(records: list[dict], total: int | None, recent: int = RECENT) -> float | None:
    """The median recent step time x the steps left."""
    per_step = step_seconds(records, recent)
    if per_step is None or not total or not records:
        return None
    return per_step * max(0, total - records[-1]["step"])


def is_stalled(records: list[dict], last_update: float | None, now: float, factor: float = STALL_FACTOR,
               recent: int = RECENT, min_seconds: float = STALL_MIN_S) -> bool:  # fmt: skip
    """No new record for ``factor`` x the expected time between two records (the median step time x
    the log interval), and for at least ``min_seconds``. Without a step time yet there is nothing to
    compare with: not stalled."""
    per_step = step_seconds(records, recent)
    if per_step is None or last_update is None:
        return False
    return now - last_update > max(min_seconds, factor * per_step * log_interval(records, recent))


def last_checkpoint(root: Path) -> dict | None:
    """The newest complete checkpoint (its COMPLETE marker, written last, holds the step and time)
    under ``root``: checkpoints/<node>/<key>/, or checkpoints/<node>/ to look in every key."""
    markers = list(root.glob("step-*/COMPLETE")) or list(root.glob("*/step-*/COMPLETE"))
    best = None
    for marker in markers:
        if not re.fullmatch(r"step-\d+", marker.parent.name):
            continue
        record = read_json(marker) or {}
        step = record.get("step", int(marker.parent.name.split("-")[1]))
        when = record.get("time") or marker.stat().st_mtime
        if best is None or (step, when) > (best["step"], best["time"]):
            best = {"step": step, "time": when, "path": str(marker.parent)}
    return best


def checkpoint_in_progress(root: Path) -> int | None:
    """The step of a checkpoint being written (a step folder without its marker yet), if any."""
    partial = [p for p in [*root.glob("step-*"), *root.glob("*/step-*")]
               if re.fullmatch(r"step-\d+", p.name) and not (p / "COMPLETE").exists()]  # fmt: skip
    return max((int(p.name.split("-")[1]) for p in partial), default=None)


def train_folders(results: Path) -> list[Path]:
    """Every training folder of a run (layout's TRAIN_DIR): results/<run>/train/<node>/, or with a grid
    results/<run>/<variant>/train/<node>/ for each variant."""
    prefixes = [results, *sorted(p for p in results.iterdir() if p.is_dir())]
    return [p for prefix in prefixes for p in matching(prefix, "TRAIN_DIR", node="*") if p.is_dir()]


def variant_folder(folder: Path) -> Path:
    """The results/<run>/ or results/<run>/<variant>/ that holds training folder ``folder``."""
    return folder.parents[len(Path(VARIANT_FILES["TRAIN_DIR"]).parts) - 1]


# ---------------------------------------------------------------- the scheduler and local processes


# ---------------------------------------------------------------- one training job's status


@dataclass
class NodeStatus:
    variant: str
    node: str
    state: str  # the training job's: done, running, starting, stalled, pending, stopped, failed, ...
    phase: str = ""  # the node's in status_view.PHASES (queued ... done, failed), set by assign_phases
    job: str = ""  # "slurm 123 RUNNING", "pid 456", ""
    step: int | None = None
    total: int | None = None
    epoch: float | None = None
    loss: float | None = None  # the mean of the recent records' (recent_loss)
    last_loss: float | None = None  # the last record's
    held_out: float | None = None  # the latest held-out loss logged during training
    tokens_per_s: float | None = None
    mfu: float | None = None
    eta_s: float | None = None
    checkpoint: dict | None = None
    resumed_after: dict | None = None
    last_update: float | None = None
    train_seconds: float | None = None  # the logged steps' time, over every job that trained them
    model: bool = False  # consolidated
    eval_loss: float | None = None
    notes: list[str] = field(default_factory=list)


def train_seconds(records: list[dict]) -> float | None:
    """Sum of step time x steps over the records: the time spent training, start-up and restarts not counted."""
    total, previous = 0.0, 0
    for r in records:
        if isinstance(r.get("step_time_s"), int | float):
            total += r["step_time_s"] * (r["step"] - previous)
        previous = r["step"]
    return total if records else None


def find_job(folder: Path, node: str, variant: str, root: Path, known: list[str], jobs: dict[str, Job], processes):
    """This training folder's job: a squeue job of its rule in this work dir (a queued or running one
    first, then the newest), else the newest job id the folder names (metrics, plan) that the scheduler
    still knows, else a local process."""
    mine = [
        job for job in jobs.values()
        if job.source == "squeue" and (not job.workdir or Path(job.workdir).resolve() == root.resolve())
        and job_comment_matches(job.comment, node, variant)
    ]  # fmt: skip
    if mine:
        return max(mine, key=lambda j: (j.state in SLURM_ACTIVE, int(j.id) if j.id.isdigit() else 0))
    for job_id in reversed(known):
        if job_id in jobs:
            return jobs[job_id]
    return local_job(folder, processes)


def node_status(folder: Path, results: Path, root: Path, jobs: dict[str, Job], processes, now: float,
                factor: float = STALL_FACTOR, recent: int = RECENT) -> NodeStatus:  # fmt: skip
    """Everything `status` says about one training folder (train/<node>/)."""
    prefix, node = variant_folder(folder), folder.name  # prefix: results/<run>/ or results/<run>/<variant>/
    variant = "/".join(prefix.relative_to(results).parts)  # '' without a grid
    metrics_path = file(prefix, "TRAIN_METRICS", node=node)
    records = read_metrics(metrics_path)
    plan = read_json(file(prefix, "TRAIN_PLAN", node=node)) or {}
    state_file = read_json(file(prefix, "TRAIN_STATE", node=node))
    last = records[-1] if records else {}
    total = plan.get("total_steps") or (state_file or {}).get("step")
    ckpt_root = Path(plan["checkpoints"]) if plan.get("checkpoints") else file(prefix, "CHECKPOINTS", node=node)
    if not ckpt_root.is_absolute():
        ckpt_root = root / ckpt_root
    if not ckpt_root.exists():
        ckpt_root = file(prefix, "CHECKPOINTS", node=node)
    eval_record = read_json(file(prefix, "EVAL_RESULT", model=node)) or {}
    last_update = last.get("time") or (metrics_path.stat().st_mtime if records else None)
    s = NodeStatus(
        variant=variant, node=node, state="waiting", step=last.get("step"), total=total,
        epoch=epochs_trained(last.get("step"), plan, last), loss=recent_loss(records, recent),
        last_loss=last.get("loss"), held_out=latest_held_out(records),
        tokens_per_s=recent_median(records, "tokens_per_s", recent), mfu=last.get("mfu"),
        eta_s=eta_seconds(records, total, recent), checkpoint=last_checkpoint(ckpt_root),
        # plan.json's record of the job before (signal, step, job id) when it checkpointed on a signal;
        # the start step alone when it did not (a crash: the newest periodic checkpoint)
        resumed_after=plan.get("resumed_after") or ({"step": plan["start_step"]} if plan.get("start_step") else None),
        last_update=last_update, train_seconds=train_seconds(records),
        model=(file(prefix, "MODEL_DIR", model=node) / "config.json").exists(), eval_loss=eval_record.get("eval_loss"),
    )  # fmt: skip
    known = [str(x) for x in (*(r.get("slurm_job_id") for r in records), plan.get("slurm_job_id")) if x]
    known = list(dict.fromkeys(known))
    job = find_job(folder, node, variant, root, known, jobs, processes)
    if job:
        s.job = f"pid {job.id}" if job.source == "local" else f"{job.id} {job.state}"
    active = job is not None and (job.source == "local" or job.state in SLURM_ACTIVE)
    if active and job.state == "PENDING":
        s.state = "pending"
    elif active:
        # a job that has not logged a step of its own yet (loading, resuming) is starting, not stalled
        mine = records and (job.started is None or (s.last_update or 0) >= job.started)
        if job.source != "local" and plan.get("slurm_job_id") and str(plan["slurm_job_id"]) != job.id:
            mine = False
        if not mine or (plan.get("start_step") is not None and s.step is not None and s.step <= plan["start_step"]):
            s.state = "starting"
        elif is_stalled(records, s.last_update, now, factor, recent):
            saving = checkpoint_in_progress(ckpt_root)
            if saving is not None and saving >= (s.step or 0):
                s.state = "running"
                s.notes.append(f"saving checkpoint {saving}")
            else:
                s.state = "stalled"
                s.notes.append(f"no new step for {duration(now - s.last_update)}")
        else:
            s.state = "running"
    elif state_file is not None:
        s.state = "done"
        s.eta_s = None
    elif job is not None:
        s.state = job.state.lower()  # a finished SLURM job without train_state.json: FAILED, TIMEOUT, ...
    elif records:
        s.state = "stopped"  # metrics but no job and no train_state.json: killed, or waiting for a retry
    if s.state == "done" and s.total and s.step is not None and s.step < s.total:
        s.notes.append(f"metrics end at step {s.step}")
    return s


def run_status(root: Path, run: str, now: float | None = None, factor: float = STALL_FACTOR, recent: int = RECENT,
               scheduler: bool = True, config: dict | None = None) -> list[NodeStatus]:  # fmt: skip
    """Every training folder of results/<run>/ under ``root``, made or not yet (layout.expected_train_dirs)."""
    results = root / "results" / run
    if not results.is_dir():
        where = "" if root == Path(".") else f" in {root}"
        raise UserError(f"no results/{run}{where}: nothing has run yet")
    now = time.time() if now is None else now
    folders = train_folders(results)
    expected = expected_train_dirs(results, config)
    folders = [*expected, *(f for f in folders if f not in expected)]
    known = set()
    for folder in folders:
        prefix, node = variant_folder(folder), folder.name
        plan = read_json(file(prefix, "TRAIN_PLAN", node=node)) or {}
        records = read_metrics(file(prefix, "TRAIN_METRICS", node=node))
        known |= {str(r["slurm_job_id"]) for r in records if r.get("slurm_job_id")}
        if plan.get("slurm_job_id"):
            known.add(str(plan["slurm_job_id"]))
    jobs = slurm_jobs(known) if scheduler else {}
    processes = local_processes() if scheduler and Path("/proc").is_dir() else []
    return [node_status(f, results, root, jobs, processes, now, factor, recent) for f in folders]


# ---------------------------------------------------------------- the whole run: what runs now, the later stages

# the stages of a run in order, and what each output of layout.py is the job of: (stage, the job's short name)
STAGES = ("preparing", "training", "consolidating", "evaluating", "summarizing")
STAGE_NAME = {"training": "training", "consolidating": "consolidation", "evaluating": "evaluation",
              "summarizing": "summary"}  # fmt: skip
OUTPUT_JOB = {
    **dict.fromkeys(["DEMO_MODEL"], ("preparing", "build base model")),
    **dict.fromkeys(["ENV_CHECK"], ("preparing", "check environment")),
    **dict.fromkeys(["MANIFEST", "SPLIT", "EVAL_SPLIT", "REJECTS"], ("preparing", "split")),
    **dict.fromkeys(["TOKENIZED", "PACKING", "TOKEN_STATS", "TOKEN_REJECTS"], ("preparing", "tokenize")),
    **dict.fromkeys(["DECONTAMINATION", "DECONTAMINATED", "CONTAMINATED"], ("preparing", "decontaminate")),
    **dict.fromkeys(["DATA_REPORT", "DATA_PLOT"], ("preparing", "data report")),
    **dict.fromkeys(["PLAN", "PLAN_TABLE"], ("preparing", "plan")),
    **dict.fromkeys(["TRAIN_METRICS", "TRAIN_STATE", "TRAIN_PLAN"], ("training", "train")),
    **dict.fromkeys(["MODEL_DIR"], ("consolidating", "consolidate")),
    **dict.fromkeys(["EVAL_RESULT", "LM_EVAL_RESULT", "BASE_EVAL", "BASE_LM_EVAL"], ("evaluating", "evaluate")),
}


def _output_regex(pattern: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/.]+)", re.escape(pattern)))


OUTPUT_PATTERNS = [(name, _output_regex(path)) for name, path in (RUN_FILES | VARIANT_FILES).items()]


def output_job(path: str, run: str) -> tuple[str, str] | None:
    """The stage and job of an output path under results/<run>/ (layout.py's names): ("evaluating", "evaluate
    node0"), ("training", "train lr-1e-05/node1"), ("summarizing", "report page"); None for any other path."""
    prefix = f"results/{run}/"
    if not path.startswith(prefix):
        return None
    rest = path[len(prefix) :]
    candidates = [("", rest)] + ([tuple(rest.split("/", 1))] if "/" in rest else [])
    for variant, rel in candidates:
        for name, regex in OUTPUT_PATTERNS:
            match = regex.fullmatch(rel)
            if not match:
                continue
            if name in RUN_PAGES or name in VARIANT_PAGES:  # report_pages.py
                stage, what = "summarizing", "report page"
            else:
                stage, what = OUTPUT_JOB.get(name, ("summarizing", "summarize"))
            value = next(iter(match.groupdict().values()), "")
            where = "/".join(x for x in (variant, value) if x)
            return stage, f"{what} {where}".strip()
    return None


def snakemake_records(root: Path, kind: str, prefix: str = "") -> dict[str, dict]:
    """Snakemake's own records under .snakemake/<kind>/, by the output path each is named after (urlsafe base64,
    long names cut into folders starting with '@'): `incomplete` (the outputs of every job started or submitted
    and not finished, with its SLURM job id), `metadata` (every output made: its rule, start and end time).
    Only the paths starting with ``prefix`` are read."""
    base = root / ".snakemake" / kind
    records: dict[str, dict] = {}
    if not base.is_dir():
        return records
    for path in base.rglob("*"):
        if not path.is_file() or path.name == "migration_underway":
            continue
        try:
            name = base64.urlsafe_b64decode("".join(p.removeprefix("@") for p in path.relative_to(base).parts))
            key = name.decode()
        except (ValueError, UnicodeDecodeError):
            continue
        if Path(key).is_absolute():  # Snakemake names outputs under its work dir relative to it
            with contextlib.suppress(ValueError):
                key = str(Path(key).relative_to(root.resolve()))
        if key.startswith(prefix):
            records[key] = read_json(path) or {}
    return records


def running_jobs(root: Path, run: str) -> list[tuple[str, str, str]]:
    """(stage, job, SLURM job id or "") of every job of the run Snakemake started and has not finished, from its
    incomplete markers; one entry per job (a job's outputs share it), by stage."""
    jobs: dict[str, tuple[str, str, str]] = {}
    for path, record in sorted(snakemake_records(root, "incomplete", f"results/{run}/").items()):
        found = output_job(path, run)
        if found:
            jobs.setdefault(found[1], (*found, str(record.get("external_jobid") or "")))
    return sorted(jobs.values(), key=lambda job: (STAGES.index(job[0]), job[1]))  # in the run's order


# the rules whose finished jobs measure a later stage (their durations from Snakemake's metadata)
RULE_STAGE = {"consolidate_node": "consolidating", "make_soup": "consolidating", "evaluate_model": "evaluating",
              "copy_base_eval": "evaluating", "consolidate_checkpoint": "evaluating",
              "evaluate_checkpoint": "evaluating", "checkpoint_scores": "evaluating",
              "summarize": "summarizing", "compare_grid": "summarizing"}  # fmt: skip


def stage_durations(root: Path, run: str) -> dict[str, float]:
    """The longest duration (end - start, as Snakemake recorded them) of each later stage's finished jobs of the
    run (RULE_STAGE's rules)."""
    longest: dict[str, float] = {}
    for path, record in snakemake_records(root, "metadata", f"results/{run}/").items():
        stage = RULE_STAGE.get(record.get("rule", ""))
        start, end = record.get("starttime"), record.get("endtime")
        if not stage or not output_job(path, run) or record.get("incomplete"):
            continue
        if all(isinstance(t, int | float) for t in (start, end)):
            longest[stage] = max(longest.get(stage, 0.0), end - start)
    return longest


def stages_left(nodes: list[NodeStatus], results: Path) -> list[str]:
    """The stages after training that still have jobs: all of them while a training job is not done (a retrained
    node's model, evaluation and summary are redone after it, even where the older ones are still there); else
    from the files: a trained model not consolidated, a model (base included) not evaluated, a summary not
    written (each variant's; a grid's comparison)."""
    if not nodes or any(s.state != "done" for s in nodes):
        return ["consolidating", "evaluating", "summarizing"]
    left = []
    prefixes = {s.variant: results / s.variant if s.variant else results for s in nodes}
    if any(not s.model for s in nodes):
        left.append("consolidating")
    evaluated = [file(results, "BASE_EVAL", model="base").exists()]  # shared by a grid's variants
    evaluated += [file(prefixes[s.variant], "EVAL_RESULT", model=s.node).exists() for s in nodes]
    if not all(evaluated):
        left.append("evaluating")
    summaries = [file(p, "SUMMARY").exists() for p in prefixes.values()]
    if any(s.variant for s in nodes):  # a grid: its comparison too
        summaries.append(file(results, "GRID_TABLE").exists())
    if not all(summaries):
        left.append("summarizing")
    return left


def run_progress(root: Path, run: str, nodes: list[NodeStatus], now: float | None = None) -> RunProgress:
    """What runs now, the stage after training that runs (or comes next), and the whole run's ETA: the training
    jobs' longest ETA, then each later stage with jobs left as long as its longest finished job in this run (the
    stage's jobs side by side, as on SLURM); unknown where a training job has no ETA yet or a stage no finished job."""
    results = root / "results" / run
    running = running_jobs(root, run)
    locks = root / ".snakemake" / "locks"
    alive = locks.is_dir() and any(locks.iterdir())
    left = stages_left(nodes, results)
    after = [stage for stage, _, _ in running if STAGES.index(stage) > STAGES.index("training")]
    if after and alive:  # a later stage runs: it and every stage after it are ahead, older outputs or not
        first = STAGES.index(min(after, key=STAGES.index))
        left = sorted({*left, *STAGES[first:]}, key=STAGES.index)
    measured = stage_durations(root, run)
    parts, unknown, total = [], [], 0.0
    training = [s for s in nodes if s.state != "done"]
    if training:
        etas = [s.eta_s for s in training]
        if any(e is None for e in etas):
            unknown.append("training (a job without an ETA yet)")
        else:
            total += max(etas)
            parts.append(f"training {duration(max(etas))}")
    for stage in left:
        if stage in measured:
            total += measured[stage]
            parts.append(f"{STAGE_NAME[stage]} {duration(measured[stage])}")
        else:
            unknown.append(f"{STAGE_NAME[stage]} (no job of it finished yet)")
    return RunProgress(
        running=[f"{job} (slurm {job_id})" if job_id else job for _, job, job_id in running],
        alive=alive,
        stage=max(after, key=STAGES.index) if after and alive else None,
        next_stage=left[0] if left else None,
        eta_s=None if unknown or not (training or left) else total,
        eta_parts=parts,
        eta_unknown=unknown,
    )


# ---------------------------------------------------------------- main


def assign_phases(nodes: list[NodeStatus], root: Path, run: str) -> None:
    """Each node's phase (status_view.phase) from its training state, the jobs Snakemake runs now (where one holds
    the work dir's lock) and its files."""
    locks = root / ".snakemake" / "locks"
    alive = locks.is_dir() and any(locks.iterdir())
    running = {job for _, job, _ in running_jobs(root, run)} if alive else set()
    for s in nodes:
        s.phase = phase(s, running)


def run_and_config(path: Path, run: str | None) -> tuple[str, dict | None]:
    """The run to show (``run``, else the `run:` of config file ``path``) and the config when it is that run's."""
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        if run:
            return run, None
        raise UserError(f"cannot read the run name from {path}: {e}; pass --run") from e
    config = config if isinstance(config, dict) else {}
    if not (run or config.get("run")):
        raise UserError(f"{path} has no run:; pass --run")
    run = run or str(config["run"])
    return run, config if str(config.get("run")) == run else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", help="results/<run>/ to show (default: the config's run:)")
    p.add_argument("--config", type=Path, default=Path("config/config.yaml"), help="where --run is read from")
    p.add_argument("-d", "--root", type=Path, default=Path("."), help="the workflow's work dir (holds results/)")
    p.add_argument("--watch", nargs="?", type=float, const=10.0, metavar="SECONDS", help="refresh every SECONDS (10)")
    p.add_argument("--plain", action="store_true", help="plain text, no table (the default when not a terminal)")
    p.add_argument("--width", type=int, help="fit the table to this many columns (default: the terminal's, COLUMNS)")
    p.add_argument("--stall-factor", type=float, default=STALL_FACTOR,
                   help="stalled: no new step for this many median step intervals (5), a minute at least")  # fmt: skip
    return p.parse_args(argv)


def table_width(a: argparse.Namespace) -> int | None:
    """--width, else COLUMNS or the terminal's width; None (any width) for plain text to a file or pipe."""
    if a.width:
        return a.width
    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def show(a: argparse.Namespace, run: str, console, config: dict | None = None) -> bool:
    """Print the status once; whether the run is finished (trained, and its models compared)."""
    now = time.time()
    nodes = run_status(a.root, run, now, a.stall_factor, config=config)
    assign_phases(nodes, a.root, run)
    results = a.root / "results" / run
    progress = run_progress(a.root, run, nodes, now)
    if console is None:
        print(render_plain(run, nodes, results, now, table_width(a), progress), flush=True)
    else:
        render_rich(console, run, nodes, results, now, progress)
    return headline(nodes, results, progress) == "finished"


HOME, CLEAR_LINE, CLEAR_BELOW, CLEAR_SCREEN = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"


def frame(text: str, first: bool) -> str:
    """One --watch frame: the cursor home, each line cleared to its end after its text, the screen below the last
    line cleared: the old frame is overwritten in place, never blanked first (clearing the screen and then
    drawing flashed an empty terminal each refresh). The first frame clears the screen once."""
    body = "".join(line + CLEAR_LINE + "\n" for line in text.rstrip("\n").split("\n"))
    return (CLEAR_SCREEN if first else "") + HOME + body + CLEAR_BELOW


def redraw(console, draw, first: bool) -> bool:
    """``draw()`` (show, printing to ``console``) captured, then written as one frame; returns draw's value."""
    with console.capture() as captured:
        value = draw()
    console.file.write(frame(captured.get(), first))
    console.file.flush()
    return value


@cli
def main(argv=None) -> None:
    a = parse_args(argv)
    config = a.config if a.config.is_absolute() or a.config.exists() else a.root / a.config
    run, settings = run_and_config(config, a.run)  # settings: the configured nodes and variants, if this run's
    console = None
    if not a.plain and sys.stdout.isatty():
        from rich.console import Console

        console = Console(width=a.width)
    try:
        first = True
        while True:
            if a.watch and console is not None:
                finished = redraw(console, lambda: show(a, run, console, settings), first)
                first = False
            else:
                finished = show(a, run, console, settings)
            if not a.watch:
                return
            if finished:
                print("the run is finished: --watch ends", flush=True)
                return
            if console is None:
                print(flush=True)
            time.sleep(a.watch)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `status.py | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    main()
