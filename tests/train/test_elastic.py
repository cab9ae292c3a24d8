"""Resume on another world size: the global batch stays (training.global_batch_size, the accumulation
follows), the checkpoint key has no world size, and each strategy reshards its checkpoint on load (DDP's
state is world-size free, DCP reshards FSDP2's, DeepSpeed loads a universal copy made once and verified)."""

import json
import shutil

import pytest
from conftest import run_trainer

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import accumulation, for_world, job_ranks, training_config
from workflow_scripts.train.checkpoint import run_key, saved_world
from workflow_scripts.train.manifest import MARKER, marker_text, verify

# ---------------------------------------------------------------- fast: the batch and the key


def test_the_accumulation_keeps_the_global_batch_where_it_divides():
    assert [accumulation(2, 1, 8, world) for world in (1, 2, 4)] == [4, 2, 1]
    assert accumulation(2, 3, None, 4) == 3  # no global batch: grad_accum as configured
    with pytest.raises(UserError, match=r"global_batch_size 8 is not a multiple of .* 2 x 3 = 6.* use 6 or 12"):
        accumulation(2, 1, 8, 3)
    with pytest.raises(UserError, match=r"grad_accum is 2 and training.global_batch_size 8: set one"):
        accumulation(2, 2, 8, 2)
    assert job_ranks({"procs_per_node": 4, "mode": "joint"}, 3) == 12
    assert job_ranks({"procs_per_node": 4, "mode": "per_node"}, 3) == 4


def test_the_checkpoint_key_has_the_global_batch_not_the_world_size():
    cfg = training_config({"micro_batch_size": 2, "global_batch_size": 8, "procs_per_node": 2})
    key = {w: run_key(for_world(cfg, w), w, "data", "base", None) for w in (1, 2, 4)}
    assert key[1] == key[2] == key[4]
    assert for_world(cfg, 4).grad_accum == 1 and for_world(cfg, 1).grad_accum == 4
    # the same global batch written as grad_accum × ranks is the same training: the same key
    plain = training_config({"micro_batch_size": 2, "grad_accum": 2, "procs_per_node": 2})
    assert run_key(for_world(plain, 2), 2, "data", "base", None) == key[2]
    # another global batch is another training
    assert run_key(for_world(plain, 1), 1, "data", "base", None) != key[1]


def test_saved_world_counts_the_ranks_rng_files(tmp_path):
    entry = {"size": 1, "sha256": "x"}
    files = {f"rng-{r}.safetensors": entry for r in range(3)} | {"state.pt": entry}
    (tmp_path / MARKER).write_text(marker_text(4, files, 0.0))
    assert saved_world(tmp_path) == 3
    assert saved_world(tmp_path / "none") is None


def test_a_global_batch_that_does_not_divide_stops_before_any_job(tmp_path):
    from conftest import snakemake, tiny_config

    config = tiny_config("odd", procs_per_node=2, micro_batch_size=2, global_batch_size=6)
    proc = snakemake(tmp_path, config, "-n", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert "training.global_batch_size 6 is not a multiple of micro_batch_size x ranks = 2 x 2 = 4" in errors[0]


def test_plan_training_stops_on_a_global_batch_that_does_not_divide(tmp_path, capsys):
    """preflight.py's command line, its main in this process (a new one imports torch and transformers again)."""
    import dataclasses

    from workflow_scripts.core.settings import PlanConfig
    from workflow_scripts.plan.preflight import main

    t = {"procs_per_node": 3, "micro_batch_size": 2, "global_batch_size": 8, "max_seq_len": 128}
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "--model",
                "demo",
                "--config",
                json.dumps(dataclasses.asdict(PlanConfig.build(t))),
                "--output",
                str(tmp_path / "m.json"),
                "--table",
                str(tmp_path / "m.csv"),
                "--probe-timeout",
                "0",
            ]
        )
    assert stop.value.code != 0 and not (tmp_path / "m.json").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: training.global_batch_size 8 is not a multiple of micro_batch_size x ranks = 2 x 3 = 6, so no"
        " accumulation keeps it at 3 rank(s); use 6 or 12, or another micro_batch_size"
    )


# ---------------------------------------------------------------- torchrun: 2 ranks <-> 1 rank

STEPS, CUT = 12, 8
CONFIG = {"lr": 3e-3, "micro_batch_size": 2, "global_batch_size": 4, "max_steps": STEPS, "log_every": 1,
          "checkpoint_every": CUT, "seed": 3}  # fmt: skip
# fp32: the runs differ only in how the same micro-batches' gradients are summed (over ranks, or accumulated)
TOLERANCE = 1e-3


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def interrupted_at_cut(run) -> None:
    """As if the job was killed after step CUT's checkpoint: the final one goes."""
    (key,) = [p for p in (run / "ckpt").iterdir() if p.is_dir()]
    shutil.rmtree(key / f"step-{STEPS}")


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "training",
    [
        {"strategy": "ddp"},
        {"strategy": "fsdp"},
        {"strategy": "deepspeed", "zero_stage": 3},
        {"strategy": "fsdp", "peft": "lora"},
    ],
    ids=["ddp", "fsdp", "zero3", "fsdp-lora"],
)
def test_resume_on_another_world_size_continues_the_same_curve(tmp_path, demo_assets, training):
    from workflow_scripts.export.consolidate import consolidate
    from workflow_scripts.export.consolidate import verify as check_model

    cfg = CONFIG | training
    runs = {procs: tmp_path / f"{procs}-ranks" for procs in (2, 1)}
    full = {}
    for procs, run in runs.items():
        run_trainer(run, demo_assets, cfg | {"procs_per_node": procs}, procs=procs)
        full[procs] = losses(run)
    assert len(full[1]) == len(full[2]) == STEPS
    noise = gap(full[1], full[2])  # uninterrupted at 1 and 2 ranks: only the reduction order differs
    assert noise < TOLERANCE
    keys = {procs: [p.name for p in (run / "ckpt").iterdir() if p.is_dir()] for procs, run in runs.items()}
    assert keys[1] == keys[2]  # no world size in the key

    for saved, procs in ((2, 1), (1, 2)):  # resume each run's step-CUT checkpoint on the other world size
        run = runs[saved]
        interrupted_at_cut(run)
        resumed = run_trainer(run, demo_assets, cfg | {"procs_per_node": procs}, procs=procs)
        assert f"at step {CUT} (saved at {saved} ranks" in resumed.stderr
        plan = json.loads((run / "train" / "plan.json").read_text())
        (key,) = [p for p in (run / "ckpt").iterdir() if p.is_dir()]
        assert plan["start_step"] == CUT and plan["world_size"] == procs and plan["grad_accum"] == 2 // procs
        assert plan["resharded_from"]["world_size"] == saved and plan["resharded_from"]["grad_accum"] == 2 // saved
        assert plan["resharded_from"]["checkpoint"] == str(key / f"step-{CUT}")
        curve = losses(run)
        assert curve[:CUT] == full[saved][:CUT]  # the steps before the cut, as trained
        # after it, the uninterrupted curves within the reduction order's noise (the resumed run's steps
        # after the cut are summed as the other world size sums them)
        gaps = [gap(curve, full[w]) for w in (saved, procs)]
        print(f"{training} {saved}->{procs} ranks: max |loss - uninterrupted| {gaps[0]:.2e} at {saved}"
              f" ranks, {gaps[1]:.2e} at {procs}; uninterrupted 1 vs 2 ranks {noise:.2e}")  # fmt: skip
        assert max(gaps) <= max(2 * noise, 1e-6)
        if training["strategy"] == "deepspeed":  # the universal copy is kept beside the original, verified
            universal = key / f"step-{CUT}" / "universal"
            assert plan["resharded_from"]["universal"] == str(universal) and verify(universal) is None
            if saved == 2:  # damaged, it is checked before use and made again from the original
                (damaged,) = [n for n in json.loads((universal / MARKER).read_text())["files"] if "exp_avg_sq" in n][:1]
                (universal / damaged).write_bytes(b"\0" + (universal / damaged).read_bytes()[1:])
                interrupted_at_cut(run)
                again = run_trainer(run, demo_assets, cfg | {"procs_per_node": procs}, procs=procs)
                assert f"{universal}: {damaged}: sha256 differs from the one written; making it again" in again.stderr
                assert verify(universal) is None and losses(run) == curve
        state = json.loads((run / "train" / "train_state.json").read_text())
        report, ids, expected = consolidate(state, tmp_path / f"model-{saved}-{procs}")
        check_model(tmp_path / f"model-{saved}-{procs}", ids, expected, 1e-5)
