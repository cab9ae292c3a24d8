"""Shared fixtures: the demo model and tokenized shards built once, and a Snakemake runner."""

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


def snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the repo's Snakefile in ``workdir`` with ``config`` written to workdir/config.yaml."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    cmd = [
        str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(workdir),
        "--configfile", str(cfg), "--cores", "2", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), timeout=1200)
    if check and proc.returncode != 0:
        logs = "\n".join(
            f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((workdir / "logs").rglob("*.log"))
        )  # fmt: skip
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs}")
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


def split_files(tmp: Path, data, nodes: int = 2, **options) -> dict:
    """Run split.py's run_split on ``data`` into ``tmp``; returns the result and output paths."""
    from types import SimpleNamespace

    from split import run_split

    args = {
        "data": str(data), "eval_data": None, "format": "auto", "delimiter": None, "mapping": "columns",
        "columns": "{}", "category_column": "category", "nodes": nodes, "eval_fraction": 0.1, "seed": 0,
        "balance": "rows", "tokenizer": None, "chat_template": None, "max_seq_len": None,
        "overlength": "truncate", "max_reject_fraction": 1.0,
        "splits": [tmp / f"node{i}.parquet" for i in range(nodes)], "eval": tmp / "eval.parquet",
        "rejects": tmp / "rejects.parquet",
    } | options  # fmt: skip
    if isinstance(args["columns"], dict):
        args["columns"] = json.dumps(args["columns"])
    tmp.mkdir(parents=True, exist_ok=True)
    result = run_split(SimpleNamespace(**args))
    return result | {"splits": args["splits"], "eval": args["eval"], "rejects": args["rejects"]}


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """The demo base model, one node's tokenized shard and the tokenized eval set."""
    from demo_model import build_model, texts_from, train_tokenizer
    from tokenization import tokenize_shard

    root = tmp_path_factory.mktemp("assets")
    tokenizer = train_tokenizer(texts_from(str(DEMO_CSV)), 1024)
    model = build_model(tokenizer, 128, seed=0)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    out = split_files(root / "split", DEMO_CSV)
    tokenize_shard(tokenizer, out["splits"][0], root / "node0.parquet", 128, "truncate")
    tokenize_shard(tokenizer, out["eval"], root / "eval.parquet", 128, "truncate")
    return {"base": root / "base", "node0": root / "node0.parquet", "eval": root / "eval.parquet", "root": root}
