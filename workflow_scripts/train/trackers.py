"""Experiment trackers (logging.trackers): the sinks a training job's metric records go to besides metrics.jsonl,
and how summarize attaches the eval summary and the leaderboard to the same tracker runs.

tensorboard: event files beside metrics.jsonl. wandb: an offline run (WANDB_MODE may say otherwise) under
results/<run>/trackers/wandb/. mlflow: a run in the SQLite store results/<run>/trackers/mlflow.db (artifacts in
trackers/mlflow-artifacts/), or in MLFLOW_TRACKING_URI's. One tracker run per trained model, grouped by the
workflow's run and grid variant; rank 0 only. Each run's id is kept in trackers.json beside metrics.jsonl: a
resumed job continues its run, and summarize resumes it to attach what it makes. Nothing from the environment
is logged (no environment variables, command lines, git or host metadata, console output or system stats).
"""

import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError, locked, write_json

log = logging.getLogger("train")

TRACKERS = ("tensorboard", "wandb", "mlflow")
# what each optional tracker imports (mlflow's SQLite store needs alembic and SQLAlchemy)
MODULES = {"wandb": ("wandb",), "mlflow": ("mlflow", "alembic", "sqlalchemy")}
INSTALL = "pip install -r requirements-trackers.txt (make install-trackers)"
RUN_FILE = "trackers.json"  # beside metrics.jsonl: each tracker's run, for a resumed job and for summarize


def missing(trackers: list[str]) -> list[str]:
    """A line naming the enabled trackers whose packages are not installed, and how to install them; [] if none."""
    import importlib.util

    names = [name for name in trackers if any(importlib.util.find_spec(m) is None for m in MODULES.get(name, ()))]
    if not names:
        return []
    absent = [m for name in names for m in MODULES[name] if importlib.util.find_spec(m) is None]
    verb = "is" if len(absent) == 1 else "are"
    return [f"logging.trackers has {', '.join(names)} but {', '.join(absent)} {verb} not installed: {INSTALL}"]


def require(trackers: list[str]) -> None:
    problems = missing(trackers)
    if problems:
        raise UserError("; ".join(problems))


@dataclasses.dataclass(frozen=True)
class TrackerSettings:
    """What the workflow tells a training job (train.py --trackers, as JSON): the trackers, and the run's
    identity: the project (wandb project, MLflow experiment), the group (run, or run/variant), the tracker
    run's name, its tags, and the folder of the local stores (results/<run>/trackers)."""

    trackers: list
    project: str = "finetune"
    group: str = "finetune"
    name: str = "node0"
    tags: dict = dataclasses.field(default_factory=dict)
    dir: str = "trackers"

    @classmethod
    def from_json(cls, text: str | None) -> "TrackerSettings":
        if not text:
            return cls(trackers=["tensorboard"])
        try:
            values = json.loads(text)
            settings = cls(**values)
        except (ValueError, TypeError) as e:
            raise UserError(f"--trackers: not a tracker settings object ({e})") from None
        unknown = sorted(set(settings.trackers) - set(TRACKERS))
        if unknown:
            raise UserError(f"logging.trackers: unknown tracker(s) {unknown} (known: {', '.join(TRACKERS)})")
        return settings


def numbers(record: dict, prefix: str) -> dict[str, float]:
    """A metric record's numeric values, as ``prefix/key`` (the step, None and strings are left out); the
    held-out fields a step with an evaluation carries (evaluator.py: eval_loss, ...) as ``eval/loss``, ..."""
    return {
        f"eval/{k.removeprefix('eval_')}" if k.startswith("eval_") else f"{prefix}/{k}": float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def mlflow_uri(folder: Path) -> str:
    """MLFLOW_TRACKING_URI, else the SQLite store in ``folder`` (results/<run>/trackers)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{folder.resolve() / 'mlflow.db'}"


def wandb_mode() -> str:
    """offline, unless WANDB_MODE says otherwise (online, disabled...)."""
    return os.environ.get("WANDB_MODE") or "offline"


def wandb_settings():
    """wandb collects none of the machine's metadata, console, code, git state or system stats."""
    import wandb

    return wandb.Settings(
        console="off", x_disable_meta=True, x_disable_stats=True, x_disable_machine_info=True, disable_git=True,
        disable_code=True, save_code=False, x_save_requirements=False, silent=True,
    )  # fmt: skip


@functools.cache
def mlflow_client(uri: str):
    """One client per store and process: opening a SQLite store checks its schema (seconds)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


# ---------------------------------------------------------------- sinks (rank 0 of a training job)


class TensorBoardSink:
    def __init__(self, folder: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed job drops what an earlier one logged after its checkpoint
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=start_step + 1)

    def log(self, record: dict) -> None:
        for key, value in numbers(record, "train").items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self, finished: bool) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, s: TrackerSettings, config: dict, plan: dict, resume: dict | None):
        import wandb

        folder = Path(s.dir)
        folder.mkdir(parents=True, exist_ok=True)
        tags = s.tags.items()
        self.run = wandb.init(
            project=s.project, group=s.group, name=s.name, job_type="train", tags=[f"{k}:{v}" for k, v in tags if v],
            dir=str(folder), mode=wandb_mode(), id=(resume or {}).get("id"), resume="allow" if resume else None,
            config={"training": config, "plan": plan}, settings=wandb_settings(),
        )  # fmt: skip
        if resume:  # the plan of this job (its start step, hosts) replaces the earlier job's
            self.run.config.update({"plan": plan}, allow_val_change=True)
        self.record = {"id": self.run.id, "project": s.project, "dir": str(folder.resolve()), "mode": wandb_mode()}

    def log(self, record: dict) -> None:
        self.run.log(numbers(record, "train"), step=record["step"])

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class MlflowSink:
    def __init__(self, s: TrackerSettings, config: dict, plan: dict, resume: dict | None):
        from mlflow.entities import Param

        folder = Path(s.dir)
        uri = mlflow_uri(folder)
        if resume and resume.get("tracking_uri") != uri:  # another store now: a run of its own there
            resume = None
        with locked(folder / "mlflow"):  # parallel jobs: one creates the store and the experiment
            self.client = mlflow_client(uri)
            if resume:
                self.run_id = resume["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                experiment = self.client.get_experiment_by_name(s.project)
                if experiment is not None:
                    experiment_id = experiment.experiment_id
                else:
                    local = None if "MLFLOW_TRACKING_URI" in os.environ else (folder / "mlflow-artifacts").resolve()
                    experiment_id = self.client.create_experiment(s.project, local and local.as_uri())
                tags = {"group": s.group, **{k: str(v) for k, v in s.tags.items()}}
                self.run_id = self.client.create_run(experiment_id, run_name=s.name, tags=tags).info.run_id
        if not resume:  # parameters are set once: a resumed job's are the same
            params = [Param(f"training.{k}", str(v)[:6000]) for k, v in config.items()]
            self.client.log_batch(self.run_id, params=params)
        self.client.log_dict(self.run_id, config, "training_config.json")
        self.client.log_dict(self.run_id, plan, "plan.json")
        self.record = {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, record["step"]) for k, v in numbers(record, "train").items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


def open_sinks(settings: TrackerSettings, folder: Path, start_step: int, config: dict, plan: dict) -> list:
    """The sinks of a training job's rank 0; the wandb and MLflow runs are recorded in folder/trackers.json.
    A job resuming from a checkpoint (``start_step`` > 0) of the same checkpoints folder continues their runs."""
    require(settings.trackers)
    path = folder / RUN_FILE
    saved = json.loads(path.read_text()) if path.exists() else {}
    same = start_step > 0 and saved.get("checkpoints") == plan.get("checkpoints")
    sinks, record = [], {"checkpoints": plan.get("checkpoints")}
    for name in settings.trackers:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(folder, start_step))
            continue
        sink = {"wandb": WandbSink, "mlflow": MlflowSink}[name](
            settings, config, plan, saved.get(name) if same else None
        )
        sinks.append(sink)
        record[name] = sink.record
        log.info("tracker %s: %s", name, sink.record)
    if len(record) > 1:
        write_json(path, record)
    else:  # an earlier training's runs are not this one's: summarize attaches to none
        path.unlink(missing_ok=True)
    return sinks


# ---------------------------------------------------------------- summarize: the eval summary and the leaderboard


def attach(run_file: Path, trackers: list[str], scores: dict[str, float], files: list[Path], table=None) -> list[str]:
    """Resume the tracker runs of ``run_file`` (a training folder's trackers.json) among ``trackers`` and attach
    the model's eval ``scores`` (as eval/<name>), the summary ``table`` (a DataFrame) and ``files`` (summary.csv,
    leaderboard.txt...). Returns what was attached, a line per tracker."""
    if not run_file.exists():
        return []
    saved = json.loads(run_file.read_text())
    scores = {f"eval/{k}": float(v) for k, v in scores.items()}
    done = []
    if "wandb" in trackers and "wandb" in saved:
        require(["wandb"])
        import wandb

        w = saved["wandb"]
        run = wandb.init(
            project=w["project"], id=w["id"], resume="allow", dir=w["dir"], mode=w["mode"], settings=wandb_settings()
        )
        run.summary.update(scores)
        if table is not None:
            rows = json.loads(table.to_json(orient="values"))  # plain numbers, None for a missing one
            run.summary["eval/summary"] = wandb.Table(columns=[str(c) for c in table.columns], data=rows)
        for f in files:  # copied into the run's folder: synced with it
            shutil.copyfile(f, Path(run.dir) / f.name)
            run.save(str(Path(run.dir) / f.name), base_path=run.dir, policy="now")
        run.finish()
        done.append(f"wandb run {w['id']} ({w['mode']})")
    if "mlflow" in trackers and "mlflow" in saved:
        require(["mlflow"])
        from mlflow.entities import Metric

        m = saved["mlflow"]
        client = mlflow_client(m["tracking_uri"])
        now = int(time.time() * 1000)
        client.log_batch(m["run_id"], metrics=[Metric(k, v, now, 0) for k, v in scores.items()])
        for f in files:
            client.log_artifact(m["run_id"], str(f), "eval")
        done.append(f"mlflow run {m['run_id']} ({m['tracking_uri']})")
    return done
