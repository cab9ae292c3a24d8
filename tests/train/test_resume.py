"""Preemption-safe training: SIGTERM checkpoints and exits 75, the rerun resumes exactly; partial
checkpoints are ignored; a damaged one is set aside and the one before it resumed; a NaN stops the job
and keeps the good checkpoints; one dead rank ends the whole job."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    OWN_LAUNCHER,
    logged_losses,
    run_trainer,
    sigterm_then_rerun_equals_uninterrupted_run,
    start_trainer,
    train_command,
    trainer_env,
    wait_for,
)

from workflow_scripts.train.divergence import TEST_HOOK
from workflow_scripts.train.manifest import build_manifest, marker_text, verify

pytestmark = pytest.mark.torchrun

CONFIG = {"lr": 3e-3, "micro_batch_size": 2, "max_steps": 14, "log_every": 1, "checkpoint_every": 4, "seed": 3}
# the checkpoint-handling tests run on one rank (a rank's start less at each launch); the sharded resume, the
# rank-file (nan) and the dead-rank tests keep two
ONE_RANK = {"procs_per_node": 1}


# DDP's resume runs end to end in tests/test_crash.py (through Snakemake) and test_joint.py (SIGTERM, node
# groups); here the sharded checkpoints, whose resume has more to get wrong, are compared bit for bit.
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sigterm_then_rerun_equals_uninterrupted_run(tmp_path, demo_assets, strategy):
    sigterm_then_rerun_equals_uninterrupted_run(
        tmp_path, demo_assets, CONFIG | {"strategy": strategy, "zero_stage": 3}, strategy
    )


def test_partial_checkpoint_is_ignored_and_reported(tmp_path, demo_assets):
    cfg = CONFIG | ONE_RANK | {"max_steps": 8}
    run_trainer(tmp_path / "a", demo_assets, cfg, procs=1)
    b = tmp_path / "b"
    run_trainer(b, demo_assets, cfg, procs=1)
    (last,) = list((b / "ckpt").glob("*/step-8"))
    (last / "COMPLETE").unlink()  # as if killed -9 while saving
    (last / "state.pt").write_bytes(b"truncated")
    rerun = run_trainer(b, demo_assets, cfg, procs=1)
    assert "ignoring partial checkpoint" in rerun.stderr and "step-8" in rerun.stderr
    assert "at step 4" in rerun.stderr
    assert logged_losses(b) == logged_losses(tmp_path / "a")


def damage(path: Path, how: str) -> None:
    """The issue's cases: 4 KiB of flipped bytes, 64 KiB of zeroed bytes (both loaded silently before
    checkpoints were verified), a file cut in half."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    if how == "flipped":
        raw[middle : middle + 4096] = bytes(b ^ 0xFF for b in raw[middle : middle + 4096])
    elif how == "zeroed":
        raw[middle : middle + 65536] = bytes(len(raw[middle : middle + 65536]))
    else:
        del raw[middle:]
    path.write_bytes(bytes(raw))


def test_damaged_checkpoints_are_set_aside_and_the_newest_good_one_resumed(tmp_path, demo_assets):
    """One trained run, its four newest checkpoints damaged four ways: the rerun names each, sets it aside and
    resumes from the fifth; its losses are the undamaged run's."""
    cfg = CONFIG | ONE_RANK | {"max_steps": 10, "checkpoint_every": 2, "keep_checkpoints": 5}
    run_trainer(tmp_path, demo_assets, cfg, procs=1)
    expected = logged_losses(tmp_path)
    (key,) = [p for p in (tmp_path / "ckpt").iterdir() if p.is_dir()]
    cases = [(10, "flipped", r"state\.pt: sha256 differs"), (8, "zeroed", r"state\.pt: sha256 differs"),
             (6, "truncated", r"state\.pt has [0-9,]+ bytes"), (4, "unloadable", "could not be loaded")]  # fmt: skip
    for step, how, _ in cases[:3]:
        damage(key / f"step-{step}" / "state.pt", how)
    unloadable = key / "step-4"  # a checkpoint whose files match its marker but do not fit the model
    torch.save({"model": {}, "optimizer": {}}, unloadable / "state.pt")
    (unloadable / "COMPLETE").write_text(marker_text(4, build_manifest(unloadable, {})[0], 0.0))

    rerun = run_trainer(tmp_path, demo_assets, cfg, procs=1)
    for step, _, why in cases:  # each named, newest first, then the one before it tried
        assert re.search(
            rf"checkpoint {re.escape(str(key))}/step-{step} is damaged: {why}[^;]*; trying the one before", rerun.stderr
        )
    assert f"resumed from {key / 'step-2'} at step 2" in rerun.stderr
    assert (
        logged_losses(tmp_path) == expected
    )  # steps 3-10 trained again from good state, bit for bit, each logged once
    names = sorted((p.name for p in key.iterdir()), key=lambda n: (n.startswith("damaged"), int(n.split("-")[-1])))
    assert names == [f"step-{s}" for s in (2, 4, 6, 8, 10)] + [f"damaged-step-{s}" for s in (4, 6, 8, 10)]
    assert [verify(key / f"step-{s}") for s in (2, 4, 6, 8, 10)] == [None] * 5


def test_a_nan_stops_the_job_and_keeps_the_good_checkpoints(tmp_path, demo_assets):
    cfg = CONFIG | {"max_steps": 8, "checkpoint_every": 2}
    cmd, env = train_command(tmp_path, demo_assets, cfg), trainer_env()
    nan = subprocess.run(cmd, capture_output=True, text=True, env=env | {TEST_HOOK: "5"}, timeout=600)
    (key,) = [p for p in (tmp_path / "ckpt").iterdir() if p.is_dir()]
    errors = [line for line in nan.stderr.splitlines() if line.startswith("error: ")]
    assert nan.returncode != 0 and len(errors) == 1, nan.stderr[-3000:]
    step_4 = re.escape(str(key / "step-4"))
    assert re.fullmatch(rf"error: step 5: loss nan, gradient norm [0-9.e+-]+: not finite; stopped, nothing of it"
                        rf" saved; a rerun resumes from {step_4}", errors[0]), errors  # fmt: skip
    assert sorted(p.name for p in key.iterdir()) == ["step-2", "step-4"]  # nothing saved after it, nothing pruned
    assert verify(key / "step-2") is None and verify(key / "step-4") is None
    assert [s for s, _ in logged_losses(tmp_path)] == [1, 2, 3, 4] and not (
        tmp_path / "train" / "train_state.json"
    ).exists()

    # no good checkpoint left: one line, nothing trained, nothing deleted
    damage(key / "step-4" / "state.pt", "truncated")
    damage(key / "step-2" / "rng-1.safetensors", "flipped")
    none_good = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    errors = [line for line in none_good.stderr.splitlines() if line.startswith("error: ")]
    assert none_good.returncode != 0 and len(errors) == 1, none_good.stderr[-3000:]
    assert re.fullmatch(rf"error: {re.escape(str(key))}: no good checkpoint to resume from \(step-4: state\.pt has "
                        r"[0-9,]+ bytes, [0-9,]+ were written; step-2: rng-1\.safetensors: sha256 differs from the one"
                        r" written\); move or delete that folder to train again from step 0", errors[0])  # fmt: skip
    assert sorted(p.name for p in key.iterdir()) == ["step-2", "step-4"] and "step 1/" not in none_good.stderr


def test_one_dead_rank_ends_every_rank(tmp_path, demo_assets):
    cfg = CONFIG | {"max_steps": 100000, "checkpoint_every": 100000}
    proc = start_trainer(tmp_path, demo_assets, cfg, env=OWN_LAUNCHER)
    assert wait_for(lambda: (tmp_path / "train" / "metrics.jsonl").exists())
    out = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "train.py"], capture_output=True, text=True)
    workers = [int(x) for x in out.stdout.split()]
    assert len(workers) == 2
    start = time.time()
    os.kill(workers[-1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - start < 60
    assert wait_for(lambda: all(not os.path.exists(f"/proc/{w}") for w in workers), timeout=5)


def plan_of(tmp_path) -> dict:
    return json.loads((tmp_path / "train" / "plan.json").read_text())


def test_a_finished_run_trains_nothing_again_and_retrain_starts_from_step_0(tmp_path, demo_assets):
    """A rerun of a finished config (a re-made plan, --forcerun train_node, deleted outputs) trains nothing: it
    writes its outputs again from the last checkpoint, metrics.jsonl restored. make retrain moves the
    checkpoints aside (retrain.set_aside), and the same config trains again from step 0, to the same losses."""
    from workflow_scripts.ops.retrain import set_aside

    cfg = CONFIG | ONE_RANK | {"max_steps": 8}
    run_trainer(tmp_path, demo_assets, cfg, procs=1)
    first = logged_losses(tmp_path)
    (key,) = [p for p in (tmp_path / "ckpt").iterdir() if p.is_dir()]
    final = (
        (key / "step-8" / "model.safetensors").read_bytes() if (key / "step-8" / "model.safetensors").exists() else None
    )
    (tmp_path / "train" / "metrics.jsonl").unlink()  # as Snakemake deletes a job's outputs before it runs
    again = run_trainer(tmp_path, demo_assets, cfg, procs=1)
    assert "had finished training: nothing to train" in again.stderr and "step 1/8" not in again.stderr
    assert plan_of(tmp_path)["start_step"] == 8
    assert logged_losses(tmp_path) == first  # restored from the last checkpoint, each step once
    assert sorted(p.name for p in key.iterdir()) == ["step-4", "step-8"]
    if final is not None:
        assert (key / "step-8" / "model.safetensors").read_bytes() == final

    aside = set_aside(tmp_path / "ckpt", time.time())
    assert aside.name.startswith("ckpt.before-retrain-") and not (tmp_path / "ckpt").exists()
    retrained = run_trainer(tmp_path, demo_assets, cfg, procs=1)
    assert plan_of(tmp_path)["start_step"] == 0 and "resumed from" not in retrained.stderr
    assert logged_losses(tmp_path) == first  # all 8 steps trained again, each logged once


def test_a_base_model_changed_in_place_starts_fresh(tmp_path, demo_assets):
    """The resume key covers the base model's content, not its path."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(demo_assets["base"], base)
    assets = demo_assets | {"base": base}
    cfg = CONFIG | ONE_RANK | {"max_steps": 8}
    run = tmp_path / "run"
    run_trainer(run, assets, cfg, procs=1)
    (old_key,) = [p for p in (run / "ckpt").iterdir() if p.is_dir()]
    shutil.rmtree(old_key / "step-8")  # as if the job was killed after step 4's checkpoint
    weights = load_file(base / "model.safetensors")
    name = next(iter(weights))
    save_file({**weights, name: weights[name] + 0.01}, base / "model.safetensors", metadata={"format": "pt"})

    rerun = run_trainer(run, assets, cfg, procs=1)
    assert "resumed from" not in rerun.stderr and plan_of(run)["start_step"] == 0
    assert plan_of(run)["checkpoints"] != str(old_key)
    assert [(s["path"], s["newest_step"]) for s in plan_of(run)["superseded_checkpoints"]] == [(str(old_key), 4)]


def test_a_dead_model_stops_the_job_as_a_nan_does(tmp_path, demo_assets):
    """training.lr 1e6 (for 1e-6) collapses the demo model to a uniform prediction (loss ln(vocabulary),
    gradient norm 0): the job stops after training.dead_model_steps such steps, not at exit 0."""
    cfg = CONFIG | {"lr": 1e6, "max_steps": 60, "checkpoint_every": 100, "dead_model_steps": 5}
    proc = subprocess.run(train_command(tmp_path, demo_assets, cfg), capture_output=True, text=True,
                          env=trainer_env(), timeout=600)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert re.fullmatch(r"error: step (\d+): loss [0-9.]+ \(ln\(vocabulary \d+\) = [0-9.]+\), gradient norm [0-9.e+-]+:"
                        r" the model has learnt nothing for 5 steps in a row \(training.dead_model_steps; training.lr"
                        r" 1e\+06 too high\?\); stopped, nothing of it saved; no checkpoint yet: a rerun starts from"
                        r" step 0", errors[0]), errors  # fmt: skip
    step = int(re.search(r"step (\d+)", errors[0]).group(1))
    assert [s for s, _ in logged_losses(tmp_path)] == list(range(1, step)) and step < 60
