"""Rerun truth: a finished run reruns only what is stale, wherever the checkout lives and however it is
submitted. Tracked params hold no absolute path and no profile resource (rules/common.smk: Untracked); a
finished plan is checked against the training job's host memory at parse time; one GPU count,
training.procs_per_node, is what the rules ask SLURM for.

The e2e tests work on a copy of the shared finished local run (ddp_run), made with its checkout beside it."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, REPO, planned_jobs, run_snakemake, snakemake, tiny_config, tool_env

# what a checkout is, for the copy (no results, no venv)
CHECKOUT = ("Snakefile", "rules", "workflow_scripts", "config", "profiles", "report", "envs", "resources")
SLURM = ("--profile", str(REPO / "profiles" / "slurm"))


def dry_run(snakefile: Path, workdir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``snakemake -n`` of ``snakefile`` in ``workdir`` with the config the run was made with (workdir/config.yaml)."""
    cmd = [str(BIN / "snakemake"), "-s", str(snakefile), "-d", str(workdir), "--configfile",
           str(workdir / "config.yaml"), "--cores", "2", "-n", *args]  # fmt: skip
    return run_snakemake(cmd, env, timeout=600)


@pytest.fixture(scope="module")
def moved(ddp_run, tmp_path_factory):
    """The finished ddp_run's results and a copy of the checkout, both in another folder (cp -a: the times kept,
    as rsync -a or a move keeps them)."""
    workdir, config = ddp_run
    root = tmp_path_factory.mktemp("moved")
    (root / "checkout").mkdir()
    for name in CHECKOUT:
        src = REPO / name
        (shutil.copytree(src, root / "checkout" / name, symlinks=True) if src.is_dir()
         else shutil.copy2(src, root / "checkout" / name))  # fmt: skip
    subprocess.run(["cp", "-a", str(workdir), str(root / "work")], check=True)
    return root / "checkout" / "Snakefile", root / "work", config


@pytest.mark.e2e
def test_a_moved_checkout_and_its_results_rerun_nothing(moved):
    snakefile, workdir, _ = moved
    proc = dry_run(snakefile, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert planned_jobs(proc) == {}, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.e2e
def test_the_slurm_profile_on_a_finished_local_run_schedules_nothing(moved):
    """Submitting a finished workstation run through profiles/slurm, with more host memory after an
    out-of-memory failure: no plan, no training. Less than the finished plan needs: one line, before any job."""
    snakefile, workdir, _ = moved
    for mem in ("200000", "400000"):
        env = tool_env() | {"TRAIN_MEM_MB": mem, "SLURM_ACCOUNT": "x"}
        proc = dry_run(snakefile, workdir, *SLURM, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert planned_jobs(proc) == {}, (proc.stdout + proc.stderr)[-3000:]
    need = json.loads((workdir / "results" / "t" / "plan" / "memory.json").read_text())["host"]["peak_gb"]
    short = str(int(need * 1024 / 2))
    proc = dry_run(snakefile, workdir, *SLURM, env=tool_env() | {"TRAIN_MEM_MB": short, "SLURM_ACCOUNT": "x"})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: results/t/plan/memory.json: training needs about"), last
    assert f"mem_mb {short}" in last and "set TRAIN_MEM_MB=" in last, last


@pytest.mark.e2e
def test_a_rewritten_plan_resumes_training_from_its_checkpoint(moved):
    """A change the plan reads (here the GPU's memory) re-plans and reruns training, which resumes from its last
    checkpoint: the GPU's description is no part of the checkpoints' key (checkpoint.NOT_KEYED)."""
    snakefile, workdir, config = moved
    config = json.loads(json.dumps(config))
    config["training"]["gpu_memory_gb"] = 40
    (workdir / "config.yaml").write_text(json.dumps(config))
    jobs = planned_jobs(dry_run(snakefile, workdir))
    assert jobs["plan_training"] == 1 and jobs["train_node"] == 2, jobs
    assert "split_dataset" not in jobs and "tokenize_shard" not in jobs, jobs
    target = "results/t/train/node0/train_state.json"
    cmd = [str(BIN / "snakemake"), "-s", str(snakefile), "-d", str(workdir), "--configfile",
           str(workdir / "config.yaml"), "--cores", "2", target]  # fmt: skip
    proc = run_snakemake(cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((workdir / "results" / "t" / "plan" / "memory.json").read_text())
    assert plan["gpu_memory_gb"] == 40 and plan["gpu_memory_source"] == "training.gpu_memory_gb"
    state = json.loads((workdir / "results" / "t" / "train" / "node0" / "train_state.json").read_text())
    assert state["plan"]["start_step"] == config["training"]["max_steps"], state["plan"]


def test_the_gpu_count_is_training_procs_per_node_alone(tmp_path):
    """The rules ask for procs_per_node GPUs; a profile's other count or a TRAIN_GPUS that disagrees stops at
    parse time with one line."""
    config = tiny_config("g")
    proc = snakemake(tmp_path / "a", config, "-n", "--set-resources", "train_node:gpu=4", check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "error: the profile's set-resources train_node: gpu: 4 but training.procs_per_node is 2: the rules ask"
        " SLURM for training.procs_per_node GPUs; remove gpu there"
    ), last
    proc = snakemake(tmp_path / "b", config, "-n", env=tool_env() | {"TRAIN_GPUS": "4"}, check=False)
    assert proc.returncode != 0 and "TRAIN_GPUS=4 but training.procs_per_node is 2" in proc.stderr, proc.stderr
    # the SLURM profile's train_node and check_environment jobs ask for the config's GPUs; a TRAIN_GPUS equal to
    # it does not stop
    env = tool_env() | {"SLURM_ACCOUNT": "x", "TRAIN_GPUS": "2"}
    proc = snakemake(tmp_path / "c", config, "-n", *SLURM, env=env)
    out = proc.stdout + proc.stderr
    for rule in ("train_node", "check_environment"):
        block = out.split(f"rule {rule}:")[1].split("\n\n")[0]
        assert "gpu=2" in block, block
