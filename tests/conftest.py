"""Shared fixtures: the demo model and tokenized shards built once, and a Snakemake runner."""

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
