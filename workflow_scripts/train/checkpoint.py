"""Per-node checkpoints: one ``step-<N>`` folder each, committed last by a marker file.

A folder without the marker (a save cut short) is never loaded; the marker lists every file's size
and sha256 (manifest.py), checked before a resume loads it. The newest K complete ones are kept.
Each holds the strategy's own state (model, optimizer, scheduler), every rank's RNG states
(safetensors: no pickle) and a copy of metrics.jsonl up to that step, so a resumed job continues
the metrics without repeating a step.
"""

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.train.manifest import (
    MARKER,
    Writes,
    build_manifest,
    check_files,
    marker_text,
    read_marker,
    shares,
    space_message,
)

log = logging.getLogger("checkpoint")
# eval.checkpoints all/every_n: the workflow writes this beside a node's checkpoint keys (rules/checkpoint_eval.smk):
# the checkpoints to be scored, and where their scores go; pruning keeps each until its score is there
HOLD_FILE = "hold-for-scoring.json"


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


def rng_files(rank: int) -> tuple[str, dict, dict]:
    """This rank's RNG states as a safetensors file: (name, tensors, metadata). No pickle: torch's and
    CUDA's states are byte tensors, numpy's key a tensor, the rest JSON in the metadata."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.uint32).view(np.int32))}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    numpy_rest = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    metadata = {"python": json.dumps(random.getstate()), "numpy": json.dumps(numpy_rest)}
    return f"rng-{rank}.safetensors", tensors, metadata


def set_rng_state(path: Path) -> None:
    """Restore the RNG states ``rng_files`` saved (read with safetensors: tensors and JSON only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    torch.set_rng_state(tensors["torch"])
    version, state, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(state), gauss))
    n = json.loads(metadata["numpy"])
    keys = tensors["numpy_keys"].numpy().view(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


# What a job's world size decides, not what it trains: the ranks, and how the global batch is split
# into accumulated micro-batches over them (the data order is a function of the global batch: batching.py).
WORLD_KEYS = ("procs_per_node", "grad_accum", "global_batch_size")
# Keys that decide when a job stops, not what it trains: a rerun with another value resumes the same checkpoints
STOP_KEYS = ("dead_model_steps",)
# Keys added after checkpoints were written, at the value every earlier run had: keyed only when set
# otherwise, so a run from before them still resumes its own checkpoints.
KEYED_WHEN_SET = {"offload_ratio": 1.0, "offload_pin_memory": True, "objective": "sft"}
# Keys read only with another key's value (training.dpo with objective dpo): keyed only then
KEYED_WITH = {"dpo": ("objective", "dpo")}
# What describes the GPU, not the training: a plan re-made for another GPU resumes the same checkpoints. Keyed
# before (at the schema's defaults then, 80 and 989, when unset): checkpoint_folder takes such a run's folder over.
NOT_KEYED = {"gpu_memory_gb": 80, "peak_tflops": 989}


def run_key(
    cfg, world: int, data_sha: str, base_fingerprint: str, deepspeed_json_sha: str | None, legacy: bool = False
) -> str:
    """Checkpoints are only resumed by a job that trains the same thing: the same training config,
    data (shards and packing plans), base model content (weights, config, tokenizer, template) and
    DeepSpeed JSON content. ``cfg`` is the job's (settings.for_world at ``world`` ranks); the key has
    its global batch, not its world size or accumulation, so a job on another world size with the same
    global batch resumes (resharding the checkpoint: Strategy.load). Nor the GPU's description (NOT_KEYED);
    ``legacy``: the key as it was when it had them."""
    keyed = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in WORLD_KEYS + STOP_KEYS
        and not (k in KEYED_WHEN_SET and v == KEYED_WHEN_SET[k])
        and k not in NOT_KEYED
        and (k not in KEYED_WITH or getattr(cfg, KEYED_WITH[k][0]) == KEYED_WITH[k][1])
    }
    if legacy:
        keyed |= {k: default if getattr(cfg, k) is None else getattr(cfg, k) for k, default in NOT_KEYED.items()}
    keyed["global_batch"] = cfg.micro_batch_size * cfg.grad_accum * world
    text = json.dumps([keyed, data_sha, base_fingerprint, deepspeed_json_sha], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def saved_world(folder: Path) -> int | None:
    """The world size ``folder`` was saved with: its ranks' RNG files (every rank writes one), as its
    marker lists them; None without a readable marker."""
    marker, problem = read_marker(folder)
    if problem:
        return None
    return sum(1 for name in marker["files"] if re.fullmatch(r"rng-\d+\.safetensors", name)) or None


def choose(folders: list[Path], check) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest of ``folders`` (oldest first) that ``check`` passes (``check(folder)``: None, or why
    not), and the newer ones it failed with their reasons, newest first."""
    bad = []
    for folder in reversed(folders):
        problem = check(folder)
        if problem is None:
            return folder, bad
        bad.append((folder, problem))
    return None, bad


def to_prune(
    complete: list[Path], partial: list[Path], keep: int, protect: Path | None, held: tuple[Path, ...] = ()
) -> list[Path]:
    """What pruning deletes: complete checkpoints beyond the newest ``keep`` and partial ones older than the
    newest complete one, never ``protect`` (the newest verified checkpoint) nor one ``held`` for scoring."""
    if not complete:
        return []
    newest = step_of(complete[-1])
    old = [p for p in complete[:-keep] if p not in held]
    return [p for p in old + [p for p in partial if step_of(p) < newest] if p != protect]


def held_for_scoring(root: Path, complete: list[Path]) -> tuple[Path, ...]:
    """The complete checkpoints of ``root`` that eval.checkpoints will score and that have no score yet (the
    hold file beside the run keys: its mode, every_n's interval and the scores' folder, whose <key>/step-<N>.json
    is a checkpoint's score). None without the file (eval.checkpoints last) or with one that cannot be read."""
    try:
        hold = json.loads((Path(root).parent / HOLD_FILE).read_text())
        scores, mode, every = Path(hold["scores"]) / Path(root).name, hold["mode"], hold.get("every") or 1
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    wanted = [p for p in complete if mode == "all" or step_of(p) % every == 0]
    return tuple(p for p in wanted if not (scores / f"{p.name}.json").exists())


def stop_job(message: str | None, code: int = 2) -> None:
    """End every rank now: ``message`` (given on one rank only) as one line on stderr, then exit ``code``.
    os._exit: DeepSpeed's CPU backend can abort in interpreter teardown and hide the reason."""
    if message:
        print(f"error: {message}", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    dist.destroy_process_group()
    os._exit(code)


def agree(problem: str | None, group=None) -> str | None:
    """Every rank's problem (None: fine) gathered: the first one, the same on every rank."""
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p), None)


def verify_shared(folder: Path, rank: int) -> str | None:
    """Why ``folder`` cannot be trusted, or None; each rank checks its share of the files."""
    marker, problem = read_marker(folder)
    if problem is None:
        names = shares(marker["files"], dist.get_world_size())[rank]
        problem = check_files(folder, marker["files"], names)
    return agree(problem)


def commit(folder: Path, step: int, written: dict) -> tuple[dict, int]:
    """Write the marker last, after everything else is flushed to disk: every file's size and sha256
    (``written``: what was hashed while written; the rest is read back). Returns (files, bytes read back)."""
    files, read_back = build_manifest(folder, written)
    for name in files:
        with open(folder / name, "rb") as f:
            os.fsync(f.fileno())
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(marker_text(step, files, time.time()))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    return files, read_back


class Checkpointer:
    """Saves every `every` steps and at the last one, keeps the newest `keep`, resumes the newest good one.

    Each file is hashed as it is written (manifest.py) and the marker holds every file's size and
    sha256. A resume checks a checkpoint before loading it, the ranks each checking a share of its
    files; a damaged or unloadable one is named in a warning and set aside as ``damaged-step-<N>``,
    and the next older one is tried. When none is good the job stops with one line."""

    def __init__(self, root: Path, strategy, rank: int, keep: int, every: int, metrics_path: Path):
        self.root, self.strategy, self.rank, self.keep = Path(root), strategy, rank, max(2, keep)
        self.every, self.metrics_path = every, metrics_path
        self.newest_good: Path | None = None  # the checkpoint a rerun resumes from
        self.resharded: dict | None = None  # the resumed checkpoint's world size etc., saved at another one

    def maybe_save(self, step: int, last_step: int) -> None:
        """The periodic checkpoint (the last step's is the final save)."""
        if step % self.every == 0 and step < last_step:
            self.save(step)

    def agree(self, problem: str | None) -> str | None:
        return agree(problem)

    def verify(self, folder: Path) -> str | None:
        return verify_shared(folder, self.rank)

    def _load(self, folder: Path) -> str | None:
        """Load ``folder`` on every rank; None, or why it failed (on any rank). A checkpoint of another
        world size is resharded by the strategy's loader, and ``resharded`` says from what (plan.json)."""
        world, cfg = dist.get_world_size(), self.strategy.cfg
        saved = saved_world(folder) or world
        try:
            how = self.strategy.load(folder, saved)
            rng = folder / rng_files(self.rank)[0]
            if rng.exists():  # none when this rank did not exist in the run that saved it
                set_rng_state(rng)
            problem = None
        except Exception as e:  # the strategies' loaders raise what their libraries raise
            problem = f"could not be loaded ({type(e).__name__}: {str(e).strip()[:160]})"
        problem = self.agree(problem)
        if problem is None and saved != world:
            global_batch = cfg.micro_batch_size * cfg.grad_accum * world
            self.resharded = {"checkpoint": str(folder), "step": step_of(folder), "world_size": saved,
                              "grad_accum": global_batch // (cfg.micro_batch_size * saved), **how}  # fmt: skip
        return problem

    def resume(self, last_step: int) -> int:
        """Load the newest good checkpoint of an interrupted run; return its step (0 for a fresh start).

        A run whose newest good checkpoint is its last step had finished: this job reran for something that
        does not change what it trains (a re-made plan, a new environment check, its outputs deleted or
        forced), so it trains nothing and writes its outputs again from that checkpoint: the last step is
        returned and its metrics.jsonl restored. Training a node again from step 0 is `make retrain`, which
        moves its checkpoints aside (workflow_scripts/ops/retrain.py).
        """
        metrics_path = self.metrics_path
        complete, partial = list_checkpoints(self.root)
        if self.rank == 0:
            for p in partial:
                log.warning("ignoring partial checkpoint %s (no %s marker)", p, MARKER)

        def check(folder: Path) -> str | None:
            problem = self.verify(folder)
            if problem is None and step_of(folder) < last_step:
                problem = self._load(folder)
            if problem and self.rank == 0:
                log.warning("checkpoint %s is damaged: %s; trying the one before it", folder, problem)
            return problem

        folder, bad = choose(complete, check)
        if folder is None and bad:
            stop_job(self._none_good(bad) if self.rank == 0 else None)
        dist.barrier()  # every rank has read the folders before rank 0 moves or deletes any
        if self.rank == 0:
            for damaged, _ in bad:  # newer than the one resumed: their steps are trained and saved again
                aside = damaged.with_name(f"damaged-{damaged.name}")
                damaged.rename(aside if not aside.exists() else aside.with_name(f"{aside.name}-{time.time():.0f}"))
        if folder is None:
            if self.rank == 0 and metrics_path.exists():
                metrics_path.unlink()
            return 0
        self.newest_good = folder
        step = step_of(folder)
        if self.rank == 0:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            if (folder / "metrics.jsonl").exists():
                shutil.copyfile(folder / "metrics.jsonl", metrics_path)
            elif metrics_path.exists():
                metrics_path.unlink()
            was = self.resharded
            how = f" (saved at {was['world_size']} ranks, grad_accum {was['grad_accum']}: resharded)" if was else ""
            if step >= last_step:
                again = "make retrain NODE=<node> trains from step 0"
                log.warning("%s: this config had finished training: nothing to train, its outputs are written "
                            "again from it (%s)", folder, again)  # fmt: skip
            else:
                log.info("resumed from %s at step %d%s", folder, step, how)
        return step

    def _none_good(self, bad: list[tuple[Path, str]]) -> str:
        reasons = "; ".join(f"{p.name}: {why}" for p, why in bad)
        return (f"{self.root}: no good checkpoint to resume from ({reasons}); move or delete that folder"
                " to train again from step 0")  # fmt: skip

    def save(self, step: int) -> Path:
        """Every rank saves its part, hashing what it writes; rank 0 commits the folder with the marker
        (the manifest), then prunes. A failed write (a full disk) stops with the folder and the free space."""
        folder = self.root / f"step-{step}"
        if (folder / MARKER).is_file():
            return folder  # already saved (at this step's interval, or by a job that had finished its steps)
        if self.rank == 0:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        dist.barrier()
        writes = Writes(folder)
        try:
            self.strategy.save(folder, writes)
            name, tensors, metadata = rng_files(self.rank)
            writes.write_bytes(folder / name, safetensors_bytes(tensors, metadata))
            if self.rank == 0 and self.metrics_path.exists():
                writes.copy(self.metrics_path, folder / "metrics.jsonl")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise UserError(space_message(folder, writes.error or e)) from e
        written = [None] * dist.get_world_size()
        dist.all_gather_object(written, writes.files)  # also the barrier: every rank has written
        if self.rank == 0:
            try:
                self._commit(folder, step, {k: v for files in written for k, v in files.items()})
            except OSError as e:
                raise UserError(space_message(folder, e)) from e
            self._prune(protect=folder)
        self.newest_good = folder
        dist.barrier()
        return folder

    def _commit(self, folder: Path, step: int, written: dict) -> None:
        start = time.monotonic()
        files, read_back = commit(folder, step, written)
        total = sum(f["size"] for f in files.values())
        log.info("checkpoint %s committed: %d files, %.1f MB (%.1f MB read back to hash), commit %.2f s", folder,
                 len(files), total / 1e6, read_back / 1e6, time.monotonic() - start)  # fmt: skip

    def _prune(self, protect: Path) -> None:
        complete, partial = list_checkpoints(self.root)
        for p in to_prune(complete, partial, self.keep, protect, held_for_scoring(self.root, complete)):
            shutil.rmtree(p, ignore_errors=True)


def safetensors_bytes(tensors: dict, metadata: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata=metadata)
