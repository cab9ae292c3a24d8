"""logging.trackers: the trainer's wandb and MLflow runs hold what metrics.jsonl holds (read back through each
library's own records), with the config and the plan and nothing secret; summarize attaches the eval summary and
the leaderboard to the same runs; a resumed job continues its run; a missing package stops with one line."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from conftest import ranks_command, trainer_args, trainer_env

from workflow_scripts.core.pipeline_io import UserError

SECRETS = {"HF_TOKEN": "hf_trackerSecret0123456789", "MY_SERVICE_TOKEN": "svc-trackers-secret-9876"}


def tracker_env(tmp: Path) -> dict:
    """The trainer's environment with secrets in it, wandb's own folders in ``tmp``, no tracker set from outside."""
    env = trainer_env() | SECRETS
    for key in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_PROJECT", "WANDB_DIR"):
        env.pop(key, None)
    return env | {f"WANDB_{k}_DIR": str(tmp / "wandb-home" / k.lower()) for k in ("CONFIG", "CACHE", "DATA")}


# ---------------------------------------------------------------- wandb's offline run file


def wandb_records(path: Path):
    """The records of a run's .wandb file: wandb's transaction log (a LevelDB-style log of 32 KiB blocks after a
    7-byte ':W&B' header, each chunk with a CRC-32, a length and a FULL/FIRST/MIDDLE/LAST type), each record
    parsed with wandb's own protobuf (wandb.proto.wandb_internal_pb2.Record). wandb 0.31 has no Python reader
    of its own: its Go core writes and syncs these files."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, head = path.read_bytes(), 32768, 7
    ident, magic, _version = struct.unpack("<4sHB", data[:head])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is no wandb transaction log"
    pos, parts = head, []
    while pos + head <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + head])
        if left < head or (kind == 0 and length == 0):  # the end of a block is padding
            pos += left
            continue
        chunk = data[pos + head : pos + head + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        pos += head + length
        parts.append(chunk)
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def item_key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def wandb_run(folder: Path, run_id: str) -> dict:
    """Every offline run folder of ``run_id`` (a resume adds one) read back: its history (step -> {key: value}),
    summary updates, config and saved files."""
    out = {"history": {}, "summary": {}, "config": {}, "files": [], "runs": []}
    for path in sorted(folder.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")):
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                values = {item_key(i): json.loads(i.value_json) for i in r.history.item}
                out["history"][values["_step"]] = {k: v for k, v in values.items() if not k.startswith("_")}
            elif kind == "summary":
                out["summary"] |= {item_key(i): json.loads(i.value_json) for i in r.summary.update}
            elif kind == "run":
                out["runs"].append(r.run)
                out["config"] |= {i.key: json.loads(i.value_json) for i in r.run.config.update}
            elif kind == "config":
                out["config"] |= {i.key: json.loads(i.value_json) for i in r.config.update}
            elif kind == "files":
                out["files"] += [f.path for f in r.files.files]
    return out


# ---------------------------------------------------------------- the trainer's runs


def numeric(records: list[dict]) -> dict[int, dict]:
    """metrics.jsonl's numbers by step, named as the trackers name them (train/<key>)."""
    return {
        r["step"]: {f"train/{k}": v for k, v in r.items() if k != "step" and isinstance(v, int | float)}
        for r in records
    }


def settings(tmp: Path, *trackers: str) -> dict:
    return {"trackers": list(trackers), "project": "trk", "group": "trk/lr-1", "name": "trk/lr-1/node0",
            "tags": {"run": "trk", "variant": "lr-1", "node": "node0"}, "dir": str(tmp / "trackers")}  # fmt: skip


def summarize_args(tmp: Path, metrics: Path, *trackers: str) -> list[str]:
    """summarize.py over synthetic eval results of base and node0 and the trained node0's metrics.jsonl."""
    (tmp / "eval").mkdir()
    held = {"eval_loss": 2.0, "perplexity": 7.4, "exact_match": 0.25, "rouge_l": 0.5, "bleu": 0.1, "chrf": 0.4}
    results = []
    for model, shift in (("base", 0.0), ("node0", 0.25)):
        results.append(tmp / "eval" / f"{model}.json")
        results[-1].write_text(json.dumps({"model": model, "samples": []} | {k: v + shift for k, v in held.items()}))
    models = tmp / "models" / "node0"
    models.mkdir(parents=True)
    (models / "consolidation.json").write_text(json.dumps({"strategy": "ddp", "peft": "none", "step": 6,
        "weight_files": [], "max_logit_diff": 0.0, "generation_ok": True}))  # fmt: skip
    e = tmp / "eval"
    return ["--results", *results, "--metrics", metrics, "--models", models, "--summary", e / "summary.csv",
            "--tasks", e / "tasks.csv", "--tasks-plot", e / "tasks.png", "--curves", e / "c.png",
            "--throughput", e / "t.png", "--categories", e / "k.png", "--leaderboard", e / "leaderboard.png",
            "--leaderboard-text", e / "leaderboard.txt", "--samples", e / "s.csv", "--consolidation", e / "n.csv",
            "--trackers", *trackers]  # fmt: skip


@pytest.mark.torchrun
def test_wandb_and_mlflow_runs_hold_metrics_jsonl_and_summarize_attaches(tmp_path, demo_assets):
    pytest.importorskip("wandb", reason="make install-trackers")
    pytest.importorskip("mlflow", reason="make install-trackers")
    from mlflow.tracking import MlflowClient

    config = {"max_steps": 6, "log_every": 2, "checkpoint_every": 100, "micro_batch_size": 2, "lr": 3e-3}
    args = trainer_args(tmp_path, demo_assets, config)
    train = tmp_path / "train" / "node0"  # as the workflow names it: summarize takes the model from the folder
    args[args.index("--log-dir") + 1] = str(train)
    args[args.index("--state") + 1] = str(train / "train_state.json")
    args += ["--trackers", json.dumps(settings(tmp_path, "tensorboard", "wandb", "mlflow"))]
    cmd = [*ranks_command(2), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=tracker_env(tmp_path), timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    expected = numeric([json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()])
    assert sorted(expected) == [2, 4, 6] and "train/loss" in expected[6]
    runs = json.loads((train / "trackers.json").read_text())
    assert list(train.glob("events.out.tfevents.*"))  # TensorBoard as before

    w = wandb_run(tmp_path / "trackers", runs["wandb"]["id"])
    assert w["history"] == expected  # every step, every number, equal
    first = w["runs"][0]
    assert (first.project, first.run_group, first.display_name) == ("trk", "trk/lr-1", "trk/lr-1/node0")
    assert w["config"]["training"]["lr"] == 3e-3 and w["config"]["plan"]["total_steps"] == 6
    assert runs["wandb"]["mode"] == "offline"

    client = MlflowClient(runs["mlflow"]["tracking_uri"])
    assert runs["mlflow"]["tracking_uri"] == f"sqlite:///{(tmp_path / 'trackers' / 'mlflow.db').resolve()}"
    run_id = runs["mlflow"]["run_id"]
    for key in expected[6]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(step, values[key]) for step, values in sorted(expected.items())], key
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "trk/lr-1/node0"
    assert run.data.params["training.lr"] == "0.003" and run.data.tags["variant"] == "lr-1"
    assert {a.path for a in client.list_artifacts(run_id)} >= {"plan.json", "training_config.json"}
    assert client.get_experiment(run.info.experiment_id).name == "trk"

    # summarize resumes both runs: node0's scores, the summary table and the leaderboard
    cmd = [sys.executable, "-m", "workflow_scripts.report.summarize"]
    cmd += map(str, summarize_args(tmp_path, train / "metrics.jsonl", "tensorboard", "wandb", "mlflow"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=tracker_env(tmp_path), timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "node0: eval summary and leaderboard attached to wandb run" in proc.stdout
    w = wandb_run(tmp_path / "trackers", runs["wandb"]["id"])
    assert w["summary"]["eval/exact_match"] == 0.5 and w["summary"]["eval/exact_match_delta"] == 0.25
    assert {"summary.csv", "leaderboard.txt", "leaderboard.png"} <= set(w["files"])
    assert w["history"] == expected  # the summary adds no training step
    assert client.get_run(run_id).data.metrics["eval/exact_match"] == 0.5
    assert {a.path for a in client.list_artifacts(run_id, "eval")} >= {"eval/summary.csv", "eval/leaderboard.txt"}

    # nothing secret: no environment variable's value in any file the trackers wrote
    for path in [p for p in (tmp_path / "trackers").rglob("*") if p.is_file()] + [train / "trackers.json"]:
        data = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in data, f"{name}'s value is in {path}"


@pytest.mark.torchrun
def test_a_preempted_job_stops_and_its_retry_continues_the_same_tracker_runs(tmp_path, demo_assets):
    pytest.importorskip("wandb", reason="make install-trackers")
    pytest.importorskip("mlflow", reason="make install-trackers")
    from mlflow.tracking import MlflowClient

    config = {"max_steps": 12, "log_every": 2, "checkpoint_every": 4, "micro_batch_size": 2}
    args = trainer_args(tmp_path, demo_assets, config)
    args += ["--trackers", json.dumps(settings(tmp_path, "tensorboard", "wandb", "mlflow"))]
    cmd = [*ranks_command(2), *args]
    env = tracker_env(tmp_path)
    job = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # fmt: skip
    end = time.time() + 300
    while not any((tmp_path / "ckpt").glob("*/step-4/COMPLETE")) and time.time() < end:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGTERM)  # as SLURM does: the whole job step, the trackers' services too
    _, err = job.communicate(timeout=120)
    assert "exiting 75" in err and "could not close" not in err, err[-3000:]
    runs = json.loads((tmp_path / "train" / "trackers.json").read_text())
    client = MlflowClient(runs["mlflow"]["tracking_uri"])
    assert client.get_run(runs["mlflow"]["run_id"]).info.status == "KILLED"

    retry = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert json.loads((tmp_path / "train" / "trackers.json").read_text()) == runs  # the same runs, continued
    expected = numeric([json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()])
    assert sorted(expected) == [2, 4, 6, 8, 10, 12]
    assert wandb_run(tmp_path / "trackers", runs["wandb"]["id"])["history"] == expected
    history = sorted((m.step, m.value) for m in client.get_metric_history(runs["mlflow"]["run_id"], "train/loss"))
    assert history == [(step, values["train/loss"]) for step, values in sorted(expected.items())]
    assert client.get_run(runs["mlflow"]["run_id"]).info.status == "FINISHED"


def test_a_resumed_job_continues_its_mlflow_run_and_a_new_training_starts_one(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="make install-trackers")
    from mlflow.tracking import MlflowClient

    from workflow_scripts.train.trackers import TrackerSettings, open_sinks

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    s = TrackerSettings(**settings(tmp_path, "mlflow"))
    plan = {"checkpoints": "ckpt/abc", "total_steps": 4}

    def job(start_step, steps, plan=plan, finished=True):
        (sink,) = open_sinks(s, tmp_path, start_step, {"lr": 0.1}, plan)
        for step in steps:
            sink.log({"step": step, "loss": 1.0 / step, "slurm_job_id": None})
        sink.close(finished)
        return json.loads((tmp_path / "trackers.json").read_text())["mlflow"]

    first = job(0, [1, 2], finished=False)
    client = MlflowClient(first["tracking_uri"])
    assert client.get_run(first["run_id"]).info.status == "KILLED"
    assert job(2, [3, 4])["run_id"] == first["run_id"]  # resumed from step 2's checkpoint: the same run
    assert [m.step for m in client.get_metric_history(first["run_id"], "train/loss")] == [1, 2, 3, 4]
    assert client.get_run(first["run_id"]).info.status == "FINISHED"
    assert job(0, [1])["run_id"] != first["run_id"]  # trained from the start again: a run of its own
    other = job(2, [3], plan=plan | {"checkpoints": "ckpt/def"})  # another training's checkpoint
    assert other["run_id"] != first["run_id"]
    open_sinks(TrackerSettings(trackers=[]), tmp_path, 0, {}, plan)  # trained again without wandb and mlflow
    assert not (tmp_path / "trackers.json").exists()  # so summarize attaches to no earlier training's run


def test_a_missing_tracker_package_stops_with_how_to_install(monkeypatch):
    import importlib.util

    from workflow_scripts.ops.environment import problems
    from workflow_scripts.train import trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    found = trackers.missing(["tensorboard", "wandb"])
    assert found == ["logging.trackers has wandb but wandb is not installed: " + trackers.INSTALL]
    assert "requirements-trackers.txt" in found[0]
    report = {"packages": {"torch": "2.13.0", "peft": "0.1"}, "gpu": {"cuda_available": False}}
    assert found[0] in problems(report, "ddp", "none", 2, "fp32", ["wandb"])
    assert problems(report, "ddp", "none", 2, "fp32", ["tensorboard"]) == []
    with pytest.raises(UserError, match="pip install -r requirements-trackers.txt"):
        trackers.require(["wandb"])


def test_logging_trackers_default_to_tensorboard_and_unknown_ones_stop():
    from workflow_scripts.core.settings import EnvironmentConfig, validated
    from workflow_scripts.train.trackers import TrackerSettings

    assert validated({})["logging"] == {"trackers": ["tensorboard"], "project": None}
    with pytest.raises(UserError, match="logging.trackers"):
        validated({"logging": {"trackers": ["neptune"]}})
    assert EnvironmentConfig.from_json('{"trackers": ["mlflow"]}').trackers == ["mlflow"]
    assert TrackerSettings.from_json(None).trackers == ["tensorboard"]
    with pytest.raises(UserError, match="unknown tracker"):
        TrackerSettings.from_json('{"trackers": ["neptune"]}')


def test_each_variant_s_training_jobs_are_runs_grouped_by_run_and_variant(tmp_path):
    import re
    import shlex

    from conftest import snakemake, tiny_config

    from workflow_scripts.core.variants import expand_grid

    grid = {"training.lr": [1e-3, 2e-3]}
    config = tiny_config("g") | {"grid": grid, "logging": {"trackers": ["tensorboard", "mlflow"], "project": "p"}}
    out = snakemake(tmp_path, config, "-n", "-p").stdout
    runs = [json.loads(shlex.split(q)[0]) for q in re.findall(r"--trackers ('[^']*')", out)]
    expected = [(f"g/{v}", f"g/{v}/{n}", {"run": "g", "variant": v, "node": n}) for v in expand_grid(grid)
                for n in ("node0", "node1")]  # fmt: skip
    assert sorted((r["group"], r["name"], r["tags"]) for r in runs) == sorted(expected, key=lambda e: e[1])
    assert {(r["project"], r["dir"], tuple(r["trackers"])) for r in runs} == {
        ("p", "results/g/trackers", ("tensorboard", "mlflow"))
    }
    assert out.count("--trackers tensorboard mlflow >") == len(expand_grid(grid))  # each variant's summarize
