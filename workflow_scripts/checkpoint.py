"""Per-node checkpoints: one ``step-<N>`` folder each, committed last by a marker file.

A folder without the marker (a save cut short) is never loaded. The newest K
complete ones are kept. Each holds the strategy's own state (model, optimizer,
scheduler), every rank's RNG states and a copy of metrics.jsonl up to that step,
so a resumed job continues the metrics without repeating a step.
"""

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("checkpoint")
MARKER = "COMPLETE"


def list_checkpoints(root: Path) -> tuple[list[Path], list[Path]]:
    """Return (complete, partial) step folders under ``root``, oldest first."""
    if not root.is_dir():
        return [], []
    steps = sorted((p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step-\d+", p.name)), key=step_of)
    complete = [p for p in steps if (p / MARKER).is_file()]
    return complete, [p for p in steps if p not in complete]


def step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def superseded(root: Path) -> list[dict]:
    """The other run keys' checkpoint folders beside ``root`` (older configs, data or base models):
    listed in plan.json and the log, never resumed, deleted only by the user."""
    out = []
    for other in sorted(p for p in root.parent.glob("*") if p.is_dir() and p != root):
        complete, _ = list_checkpoints(other)
        size = sum(f.stat().st_size for f in other.rglob("*") if f.is_file())
        out.append({"path": str(other), "newest_step": step_of(complete[-1]) if complete else None, "bytes": size})
    return out


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def run_key(cfg, data_sha: str, base_fingerprint: str, deepspeed_json_sha: str | None) -> str:
    """Checkpoints are only resumed by a job that trains the same thing: the same training config,
    data (shards and packing plans), base model content (weights, config, tokenizer, template) and
    DeepSpeed JSON content."""
    text = json.dumps([dataclasses.asdict(cfg), data_sha, base_fingerprint, deepspeed_json_sha], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Checkpointer:
    """Saves every `every` steps and at the last one, keeps the newest `keep`, resumes the newest."""

    def __init__(self, root: Path, strategy, rank: int, keep: int, every: int, metrics_path: Path):
        self.root, self.strategy, self.rank, self.keep = Path(root), strategy, rank, max(2, keep)
        self.every, self.metrics_path = every, metrics_path

    def maybe_save(self, step: int, last_step: int) -> None:
        """The periodic checkpoint (the last step's is the final save)."""
        if step % self.every == 0 and step < last_step:
            self.save(step)

    def resume(self, last_step: int) -> int:
        """Load the newest complete checkpoint of an interrupted run; return its step (0 for a fresh start).

        A run whose newest checkpoint is its last step had finished: this job was forced (or its
        outputs deleted), so it trains again from step 0 and that run's checkpoints are deleted.
        """
        metrics_path = self.metrics_path
        complete, partial = list_checkpoints(self.root)
        if self.rank == 0:
            for p in partial:
                log.warning("ignoring partial checkpoint %s (no %s marker)", p, MARKER)
        if complete and step_of(complete[-1]) >= last_step:
            if self.rank == 0:
                log.warning("%s: this config had finished training; starting again from step 0", complete[-1])
            dist.barrier()  # every rank has listed the folders before rank 0 deletes them
            if self.rank == 0:
                for p in complete + partial:
                    shutil.rmtree(p)
            complete = []
        if not complete:
            if self.rank == 0 and metrics_path.exists():
                metrics_path.unlink()
            return 0
        folder = complete[-1]
        self.strategy.load(folder)
        rng_file = folder / f"rng-{self.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        step = json.loads((folder / MARKER).read_text())["step"]
        if self.rank == 0:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            if (folder / "metrics.jsonl").exists():
                shutil.copyfile(folder / "metrics.jsonl", metrics_path)
            elif metrics_path.exists():
                metrics_path.unlink()
            log.info("resumed from %s at step %d", folder, step)
        return step

    def save(self, step: int) -> Path:
        """Every rank saves its part; rank 0 commits the folder with the marker, then prunes."""
        folder = self.root / f"step-{step}"
        if (folder / MARKER).is_file():
            return folder  # already saved (at this step's interval, or by a job that had finished its steps)
        if self.rank == 0:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        dist.barrier()
        self.strategy.save(folder)
        torch.save(rng_state(), folder / f"rng-{self.rank}.pt")
        if self.rank == 0 and self.metrics_path.exists():
            shutil.copyfile(self.metrics_path, folder / "metrics.jsonl")
        dist.barrier()
        if self.rank == 0:
            self._commit(folder, step)
            self._prune()
        dist.barrier()
        return folder

    def _commit(self, folder: Path, step: int) -> None:
        """Write the marker last, after everything else is flushed to disk."""
        for path in folder.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        tmp = folder / f".{MARKER}.tmp"
        tmp.write_text(json.dumps({"step": step, "time": time.time()}) + "\n")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, folder / MARKER)
        log.info("checkpoint %s committed", folder)

    def _prune(self) -> None:
        complete, partial = list_checkpoints(self.root)
        newest = step_of(complete[-1])
        for p in complete[: -self.keep] + [p for p in partial if step_of(p) < newest]:
            shutil.rmtree(p, ignore_errors=True)
