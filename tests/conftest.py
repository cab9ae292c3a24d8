"""Shared fixtures: the demo model and tokenized shards built once, a Snakemake runner, one local
end-to-end run, and the throwaway SLURM cluster."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEMO_CSV = REPO / "resources" / "demo" / "instructions.csv"


def tool_env() -> dict:
    """The environment the workflow's shell commands need: the venv first on PATH, no hub access."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return env


def tiny_config(run: str, strategy: str = "ddp", **training) -> dict:
    """A config that runs every stage in about a minute on 2 cores."""
    return {
        "run": run,
        "nodes": 2,
        "data": {"path": str(DEMO_CSV), "max_seq_len": 128},
        "model": {"name_or_path": "demo"},
        "training": {
            "strategy": strategy,
            "zero_stage": 2,
            "procs_per_node": 2,
            "precision": "fp32",
            "lr": 3e-3,
            "micro_batch_size": 8,
            "max_steps": 12,
            "log_every": 4,
            "checkpoint_every": 8,
        }
        | training,
        "eval": {"batch_size": 32, "max_new_tokens": 8, "max_samples": 48},
    }


def snakemake_cmd(workdir: Path, config: dict, *args: str) -> list[str]:
    """The command line running the repo's Snakefile in ``workdir``, ``config`` written to workdir/config.yaml."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    return [
        str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(workdir),
        "--configfile", str(cfg), "--cores", "2", *args,
    ]  # fmt: skip


def job_logs(workdir: Path) -> str:
    """The tails of the rules' logs and of the sbatch logs (SLURM runs), for failure messages."""
    paths = sorted((workdir / "logs").rglob("*.log")) + sorted((workdir / ".snakemake" / "slurm_logs").rglob("*.log"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in paths)


def snakemake(
    workdir: Path, config: dict, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the repo's Snakefile in ``workdir`` with ``config`` written to workdir/config.yaml."""
    cmd = snakemake_cmd(workdir, config, *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or tool_env(), timeout=1200)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{job_logs(workdir)}")
    return proc


def planned_jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts from a dry-run's 'Job stats' table."""
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    lines = out.split("Job stats:")[1].splitlines()
    counts = {}
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit() or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """The demo base model, one node's tokenized shard and the tokenized eval set."""
    from demo_model import build_model, texts_from, train_tokenizer
    from split import map_columns, read_table, split_rows
    from tokenization import tokenize_frame

    root = tmp_path_factory.mktemp("assets")
    tokenizer = train_tokenizer(texts_from(DEMO_CSV), 1024)
    model = build_model(tokenizer, 128, seed=0)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    mapped = map_columns(
        read_table(DEMO_CSV), {"prompt": "prompt", "question": "question", "response": "response"}, "x"
    )
    shards, evalset, _ = split_rows(mapped, 2, 0.1, 0)
    paths = {}
    for name, frame in (("node0", shards[0]), ("eval", evalset)):
        tokens, _ = tokenize_frame(tokenizer, frame, 128, "truncate")
        paths[name] = root / f"{name}.parquet"
        tokens.to_parquet(paths[name])
    return {"base": root / "base", "node0": paths["node0"], "eval": paths["eval"], "root": root}


def check_outputs(root, nodes=("node0", "node1")):
    """What every finished tiny_config run has: the summary, three logged steps, models that beat base."""
    import pandas as pd

    summary = pd.read_csv(root / "eval" / "summary.csv")
    assert summary["model"].tolist() == ["base", *nodes]
    assert set(summary.columns) >= {"model", "eval_loss", "perplexity", "exact_match"}
    base_loss = summary.set_index("model").loc["base", "eval_loss"]
    for node in nodes:
        metrics = [json.loads(x) for x in (root / "train" / node / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [4, 8, 12]
        assert {"step", "loss", "lr"} <= set(metrics[0])
        assert summary.set_index("model").loc[node, "eval_loss"] < base_loss
        model_dir = root / "models" / node
        assert (model_dir / "config.json").exists() and list(model_dir.glob("*.safetensors"))
        assert (model_dir / "tokenizer.json").exists()
    manifest = json.loads((root / "data" / "manifest.json").read_text())
    rows = sum(n["rows"] for n in manifest["nodes"]) + manifest["eval"]["rows"] + manifest["rejects"]["rows"]
    assert rows == manifest["source"]["rows"]
    assert json.loads((root / "env" / "check.json").read_text())["ok"]
    assert (root / "eval" / "loss_curves.png").stat().st_size > 10_000


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """One local run of tiny_config("t") (DDP), shared by the workflow tests and the SLURM comparison."""
    workdir = tmp_path_factory.mktemp("ddp")
    config = tiny_config("t")
    snakemake(workdir, config)
    return workdir, config


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """munged + slurmctld + slurmd on this machine (tests/slurm_cluster.py); skipped without SLURM."""
    from slurm_cluster import start_cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = start_cluster(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()
