"""The seed setups in config/examples/: valid, self-contained configs that fit their GPUs, submitted
through profiles/slurm with the sbatch resources their seeds describe, and CPU-scaled twins that run
end to end.

The submission test runs the command written in each example's header (its exports and its
`snakemake --profile profiles/slurm --configfile ...` line) against fake SLURM commands: a `sbatch`
that records its arguments and prints a job id, a `squeue` that reports every recorded job
COMPLETED, and the `scontrol` and `sacctmgr` answers the executor plugin asks for. The outputs of
every job are created beforehand (from a dry run), so Snakemake walks the whole DAG and each rule
is submitted once, through the plugin's real sbatch command line.
"""

import copy
import csv
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    BIN,
    DEMO_CSV,
    REPO,
    check_outputs,
    copy_of_run,
    job_logs,
    planned_jobs,
    run_snakemake,
    snakemake,
    tiny_config,
    tool_env,
)

from workflow_scripts.core.settings import PlanConfig

EXAMPLES_DIR = REPO / "config" / "examples"
EXAMPLES = sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml"))
TRAIN_RULES = {"train_node", "train_joint"}
GPU_RULES = {*TRAIN_RULES, "check_environment", "evaluate_model"}
# jobs that hold a whole model in host memory: their memory comes from MODEL_MEM_MB
MODEL_RULES = {"consolidate_node", "evaluate_model", "build_demo_model", "make_soup"}
LOCAL_RULES = {"plan_training", "fetch_model", "all"}  # and the report's pages, render_*_page (rules/report_pages.smk)


def load(name: str) -> dict:
    return yaml.safe_load((EXAMPLES_DIR / name).read_text())


def header_command(name: str) -> tuple[dict, list[str]]:
    """The environment variables and the snakemake command line written in an example's header."""
    env, argv = {}, None
    for line in (EXAMPLES_DIR / name).read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("export "):
            env |= dict(item.split("=", 1) for item in shlex.split(text)[1:])
        elif text.startswith("snakemake "):
            assert argv is None, f"{name}: two snakemake commands in the header"
            argv = shlex.split(text)
    assert argv, f"{name}: no snakemake command in the header"
    return env, argv


def with_defaults(config: dict) -> dict:
    from snakemake.utils import validate

    config = copy.deepcopy(config)
    validate(config, str(REPO / "config" / "schema.yaml"))
    return config


# --- The configs ------------------------------------------------------------------------------------


def test_every_seed_has_an_example():
    assert {name[:3] for name in EXAMPLES} == {"000", "001", "002", "003", "004"}
    table = (EXAMPLES_DIR / "README.md").read_text()
    for name in EXAMPLES:
        assert f"config/examples/{name}" in table, name


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_is_valid_and_independent_of_the_demo_config(name):
    """Valid against the schema, and run as the header says: --configfile replaces config/config.yaml (the
    Snakefile loads the demo's file only without one; test_workflow checks that no demo key leaks in)."""
    alone = with_defaults(load(name))
    env, argv = header_command(name)
    assert argv[:3] == ["snakemake", "--profile", "profiles/slurm"]
    assert argv[argv.index("--configfile") + 1] == f"config/examples/{name}"
    # one GPU count: the rules ask for training.procs_per_node GPUs; the header sets no other
    assert "TRAIN_GPUS" not in env
    assert {"SLURM_PARTITION", "SLURM_CPU_PARTITION", "SLURM_ACCOUNT"} <= set(env)
    if alone["data"]["chat_template"]:
        assert (REPO / alone["data"]["chat_template"]).exists()


def test_seed_002_variants_are_the_same_job():
    variants = {name: with_defaults(load(name)) for name in EXAMPLES if name.startswith("002-")}
    assert set(variants) == {"002-zero1.yaml", "002-zero2.yaml", "002-zero3.yaml", "002-fsdp.yaml"}
    loaded = {name: load(name)["training"] for name in variants}
    assert {(t["strategy"], t.get("zero_stage")) for t in loaded.values()} == {
        ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3), ("fsdp", None)
    }  # fmt: skip
    for config in variants.values():
        config.pop("run")
        for key in ("strategy", "zero_stage", "offload"):
            config["training"].pop(key)
    first = next(iter(variants.values()))
    assert all(config == first for config in variants.values())
    # and the same sbatch resources
    assert len({json.dumps(header_command(name)[0], sort_keys=True) for name in variants}) == 1


def plan(name: str, tmp_path, mem_mb: int | None = None, **training) -> tuple[dict, dict]:
    """plan_training's plan of an example (its model from config.json only, the formula's activations: the
    probe's own tests cover it, and docs/benchmarks/planner.md has its numbers) against its header's TRAIN_MEM_MB, and
    the count by hand (model_shapes.by_hand)."""
    from model_shapes import by_hand, config_folder

    from workflow_scripts.plan.preflight import Planner

    config = with_defaults(load(name))
    config["nodes"] = training.pop("nodes", config["nodes"])
    config["training"] |= training
    mem_mb = mem_mb or int(header_command(name)[0].get("TRAIN_MEM_MB", 200000))  # profiles/slurm's default
    model = config_folder(config["model"]["name_or_path"], config, tmp_path / "model")
    t = PlanConfig.from_json(PlanConfig.to_json(config))
    est = Planner(model, t, 0, mem_mb).plan(t)
    return est, by_hand(config, est["parameters"])


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_fits_by_the_planner_and_by_hand(name, tmp_path):
    """Each example fits its stated GPUs (gpu_memory_gb: the GiB CUDA can use) and host memory by the planner,
    and a byte count by hand agrees with the plan within 20% (GPU; host where offload keeps states there)."""
    from model_shapes import PARAMETERS_B

    from workflow_scripts.plan.preflight import live_gb

    est, hand = plan(name, tmp_path)
    model = load(name)["model"]["name_or_path"]
    if model in PARAMETERS_B:
        assert est["parameters"] / 1e9 == pytest.approx(PARAMETERS_B[model], rel=0.02)
    assert est["gpu_fits"] and est["host"]["fits"] and est["fits"], (name, est["total_gb"], est["host"])
    assert live_gb(est) == pytest.approx(hand["tensors_gb"], rel=0.2), (name, est["per_gpu_gb"], hand)
    if hand["host_gb"]:
        offloaded = est["host"]["in_training_gb"] - est["host"]["ranks_per_node"] * 1.5
        assert offloaded == pytest.approx(hand["host_gb"], rel=0.2), (name, est["host"], hand)


def test_planner_refuses_what_does_not_fit_and_re_plans_its_proposals(tmp_path):
    """Llama-3-70B on 16 x 80 GB (the 70B example on 2 nodes) and 001's 8B as it was (no checkpointing) do not
    fit; each proposal is planned again, and the best one fits by its own plan."""
    from workflow_scripts.plan.preflight import Planner
    from workflow_scripts.plan.proposals import best, propose

    est, _ = plan("001-llama3-70b-fsdp.yaml", tmp_path / "a", nodes=2)
    assert not est["gpu_fits"] and est["total_gb"] > 79.3, est["total_gb"]
    est, _ = plan("001-llama3-8b-fsdp.yaml", tmp_path / "b", gradient_checkpointing=False)
    assert not est["gpu_fits"] and est["total_gb"] > 79.3, est["total_gb"]
    config = with_defaults(load("001-llama3-8b-fsdp.yaml"))
    config["training"]["gradient_checkpointing"] = False
    from model_shapes import config_folder

    t = PlanConfig.from_json(PlanConfig.to_json(config))
    planner = Planner(config_folder(config["model"]["name_or_path"], config, tmp_path / "c"), t, 0, None)
    proposals = propose(t, planner.plan)
    chosen = best(proposals)
    assert chosen["change"] == {"gradient_checkpointing": True}, proposals
    assert planner.plan(dataclasses.replace(t, **chosen["change"]))["total_gb"] == pytest.approx(
        chosen["gpu_gb"], abs=0.01
    )
    assert {"micro_batch_size", "grad_accum"} <= set(proposals[1]["change"]), proposals[1]
    assert all(p["gpu_gb"] is not None for p in proposals)


def test_seed_000_fits_500_gb_per_node_with_its_stated_choice(tmp_path):
    """Seed 000 (Qwen3-32B, full fine-tuning, one model per node of 4 x A100 80GB) at the seed's 500 GB
    (465 GiB, TRAIN_MEM_MB=476000) fits with the example's partial offload; fully offloaded it is refused with
    the partial offload named as the fix, planned."""
    name = "000-qwen3-32b-zero3-offload.yaml"
    env = header_command(name)[0]
    assert int(env["TRAIN_MEM_MB"]) <= 476837  # 500 GB
    example = load(name)["training"]
    assert example["offload_ratio"] < 1 and example["peft"] == "none" and load(name)["training"]["mode"] == "per_node"
    est, _ = plan(name, tmp_path / "a")
    assert est["fits"] and est["host"]["peak_gb"] <= 465.5
    config = with_defaults(load(name))
    folder = tmp_path / "cli"
    from model_shapes import config_folder

    config["training"]["offload_ratio"] = 1.0
    from conftest import run_main

    from workflow_scripts.plan.preflight import main

    argv = [
        "--model", config_folder(config["model"]["name_or_path"], config, folder),
        "--config", PlanConfig.to_json(config), "--host-memory-mb", env["TRAIN_MEM_MB"], "--probe-timeout", "0",
        "--output", str(tmp_path / "plan.json"), "--table", str(tmp_path / "plan.csv"),
    ]  # fmt: skip
    proc = run_main(main, argv)  # its command line, in this process
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "of host memory per node (in training)" in last and "fits with training.strategy: deepspeed" in last, last
    assert "training.offload_ratio: " in last and "TRAIN_MEM_MB=" in last, last
    saved = json.loads((tmp_path / "plan.json").read_text())
    fitting = [p for p in saved["proposals"] if p["fits"]]
    assert fitting and all(p["host_gb"] <= 465.5 and p["gpu_gb"] <= 79.3 for p in fitting), saved["proposals"]


# --- Submission through profiles/slurm ----------------------------------------------------------------

FAKE_SBATCH = """#!{python}
import fcntl, json, os, sys
with open(os.environ["FAKE_SLURM_LOG"], "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    n = sum(1 for _ in f)
    f.write(json.dumps(sys.argv[1:]) + "\\n")
print(1000 + n)
"""
FAKE_SQUEUE = """#!{python}
import os
with open(os.environ["FAKE_SLURM_LOG"]) as f:
    for n, _ in enumerate(f):
        print(f"{{1000 + n}}|COMPLETED")
"""
FAKE_SCONTROL = """#!/bin/sh
echo "MinJobAge               = 300 sec"
echo "MaxArraySize            = 1001"
"""
FAKE_SACCTMGR = """#!/bin/sh
echo "$SLURM_ACCOUNT"
"""
FAKE_FAIL = """#!/bin/sh
echo "$0: not on this fake cluster" >&2
exit 1
"""


def fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True)
    scripts = {
        "sbatch": FAKE_SBATCH.format(python=sys.executable),
        "squeue": FAKE_SQUEUE.format(python=sys.executable),
        "scontrol": FAKE_SCONTROL,
        "sacctmgr": FAKE_SACCTMGR,
        "sinfo": "#!/bin/sh\nexit 0\n",
        "sacct": FAKE_FAIL,
        "sshare": FAKE_FAIL,
        "scancel": "#!/bin/sh\nexit 0\n",
        "srun": FAKE_FAIL,
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def demo_rows(n: int = 300) -> list[dict]:
    with open(DEMO_CSV, newline="") as f:
        return list(csv.DictReader(f))[:n]


def write_example_data(config: dict, workdir: Path) -> None:
    """The example's data files (data.path, data.eval_path) in its format and mapping, from demo rows."""
    data = config["data"]
    rows = demo_rows()
    for spec, part in ((data["path"], rows[:250]), (data["eval_path"], rows[250:])):
        if not spec:
            continue
        path = workdir / spec
        path.parent.mkdir(parents=True, exist_ok=True)
        cols = data["columns"]
        if data["mapping"] == "chat":
            records = [
                {
                    cols.get("messages", "messages"): [
                        {"role": "system", "content": r["prompt"]},
                        {"role": "user", "content": r["question"]},
                        {"role": "assistant", "content": r["response"]},
                    ]
                }
                for r in part
            ]
        else:
            assert data["mapping"] == "columns", data["mapping"]
            fields = {"prompt": "prompt", "question": "question", "response": "response"}
            records = [{cols[k]: r[v] for k, v in fields.items() if cols.get(k)} for r in part]
        if path.suffix == ".csv":
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(records[0]))
                writer.writeheader()
                writer.writerows(records)
        else:
            assert path.suffix == ".jsonl", path
            path.write_text("".join(json.dumps(r) + "\n" for r in records))


def planned_outputs(text: str) -> dict[str, list[str]]:
    """Rule name -> output paths of every job in a dry run's listing."""
    outputs: dict[str, list[str]] = {}
    rule = None
    for line in text.splitlines():
        m = re.match(r"(?:local)?rule (\w+):$", line.strip())
        if m:
            rule = m.group(1)
            outputs.setdefault(rule, [])
        elif rule and line.strip().startswith("output:"):
            outputs[rule] += [p.strip() for p in line.split("output:", 1)[1].split(",")]
    return outputs


def sbatch_options(argv: list[str]) -> dict[str, str]:
    """The sbatch options of a recorded call as {option: value}; the --wrap command is left out."""
    opts, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--wrap"):
            break
        if "=" in arg and arg.startswith("--"):
            key, value = arg.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            key, value = arg, argv[i + 1]
            i += 1
        else:
            key, value = arg, ""
        assert key not in opts, (key, argv)
        opts[key] = value
        i += 1
    return opts


def submit_example(
    name: str, tmp_path: Path, request
) -> tuple[dict, list[tuple[str, dict]], subprocess.CompletedProcess]:
    """Run the example's header command with fake SLURM commands; returns the exports and (rule, sbatch
    options) for every submission."""
    from hub_server import HubServer, folder_files
    from model_shapes import PARAMETERS_B, config_folder

    exports, argv = header_command(name)
    config = with_defaults(load(name))
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "config").symlink_to(REPO / "config")  # data.chat_template paths are relative to the repo
    write_example_data(config, workdir)
    fake_slurm(tmp_path / "fakebin")
    log = tmp_path / "sbatch.jsonl"
    log.touch()
    # HF_HUB_OFFLINE=0, as on a login node: the examples name hub models, which the parse resolves to a commit
    # (main's sha) and fetch_model would download; the hub is a local one (tests/hub_server.py) serving the
    # model's config.json, and the cache a fresh one (nothing is downloaded: the dry run's outputs are made)
    hub = HubServer()
    request.addfinalizer(hub.stop)
    name_or_path = config["model"]["name_or_path"]
    if name_or_path in PARAMETERS_B:
        folder = Path(config_folder(name_or_path, config, tmp_path / "hub-model"))
        hub.repo(name_or_path).commit(folder_files(folder))
    env = tool_env() | exports | {"FAKE_SLURM_LOG": str(log), "HF_HUB_OFFLINE": "0"}
    env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env["PATH"] = f"{tmp_path / 'fakebin'}{os.pathsep}{env['PATH']}"
    for var in [v for v in env if v.startswith("SLURM_") and v not in exports]:
        env.pop(var)  # a test run from inside a SLURM job must not leak its job's settings
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(workdir)]
    cmd += [str(REPO / a) if a.startswith(("profiles/", "config/")) else a for a in argv[1:]]

    dry = run_snakemake([*cmd, "-n"], env, cwd=REPO, timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    outputs = planned_outputs(dry.stdout + dry.stderr)
    assert TRAIN_RULES & set(outputs), (dry.stdout + dry.stderr)[-3000:]
    for path in (p for paths in outputs.values() for p in paths):
        target = workdir / path
        if not target.suffix:  # directory() outputs: models/<node>, base_model
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("{}\n")
    submitted_rules = sorted(r for r in set(outputs) - LOCAL_RULES if not re.fullmatch(r"render_\w+_page", r))
    fast = ["--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "1"]
    fast += ["--seconds-between-status-checks", "1", "--latency-wait", "1", "--retries", "0"]
    start = time.monotonic()
    proc = run_snakemake([*cmd, *fast, "--forcerun", *submitted_rules], env, cwd=REPO, timeout=600)
    print(f"{name}: {time.monotonic() - start:.0f} s through the fake SLURM")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:] + job_logs(workdir)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    submissions = []
    for argv_ in calls:
        opts = sbatch_options(argv_)
        rule = re.match(r"rule_(\w+?)(?:_wildcards_.*)?$", opts["--comment"]).group(1)
        submissions.append((rule, opts))
    # every job of the DAG but the local ones went through sbatch, once
    counts = {}
    for rule, _ in submissions:
        counts[rule] = counts.get(rule, 0) + 1
    lines = [line.strip() for line in (dry.stdout + dry.stderr).splitlines()]
    assert counts == {r: lines.count(f"rule {r}:") for r in submitted_rules}, counts
    return exports, submissions, proc


def check_submissions(name: str, exports: dict, submissions: list[tuple[str, dict]]) -> None:
    config = with_defaults(load(name))
    gpus = config["training"]["procs_per_node"]  # the one GPU count (rules/common.smk GPUS_PER_NODE)
    cpus = int(exports.get("TRAIN_CPUS", 32))
    mem = int(exports.get("TRAIN_MEM_MB", 200000))
    hours = int(exports.get("TRAIN_HOURS", 24))
    model_mem = exports.get("MODEL_MEM_MB")
    joint = config["training"]["mode"] == "joint"
    train = [opts for rule, opts in submissions if rule == ("train_joint" if joint else "train_node")]
    assert len(train) == (1 if joint else config["nodes"])
    for rule, opts in submissions:
        assert opts["-A"] == exports["SLURM_ACCOUNT"], (rule, opts)
        assert "--ntasks-per-gpu" not in opts, (rule, opts)
        assert int(opts["--mem"]) > 0 and int(opts["-t"]) > 0, (rule, opts)
        if rule in GPU_RULES:
            assert opts["-p"] == exports["SLURM_PARTITION"], (rule, opts)
            gres = opts.get("--gres", "")
            per_node = int(opts.get("--gpus-per-node", 0)) or int(gres.rsplit(":", 1)[-1] if gres else 0)
            total = int(opts.get("--gpus", 0)) or per_node * int(opts["--nodes"])
            if rule in TRAIN_RULES:
                nodes = config["nodes"] if joint else 1
                assert opts["--nodes"] == str(nodes), opts
                assert total == nodes * gpus, opts
                assert opts["--cpus-per-task"] == str(cpus), opts
                assert opts["--mem"] == str(mem), opts
                assert opts["-t"] == str(hours * 60), opts
            elif rule == "evaluate_model":  # EVAL_GPUS (default 1) on one node
                assert opts["--nodes"] == "1" and total == int(exports.get("EVAL_GPUS", 1)), opts
            else:
                assert opts["--nodes"] == "1" and total == gpus, opts
        else:
            # CPU stages: the CPU partition, no GPU, one task
            assert opts["-p"] == exports["SLURM_CPU_PARTITION"], (rule, opts)
            assert not {"--gpus", "--gres", "--gpus-per-node", "--gpus-per-task"} & set(opts), (rule, opts)
            assert opts["--ntasks"] == "1", (rule, opts)
        if rule in MODEL_RULES and model_mem:
            assert opts["--mem"] == model_mem, (rule, opts)


# The 002 variants differ only in their strategy keys and share their exports (tested above), so their
# sbatch lines are those of 002-zero1; the 2-node joint example's are the 8-node one's with fewer nodes, and
# the 70B example's are a joint job's as well.
# Submitting each costs ~10 s of CI for no new line.
SKIPPED = ("002-zero2", "002-zero3", "002-fsdp", "003-joint-2nodes", "001-llama3-70b")
SUBMITTED_EXAMPLES = [name for name in EXAMPLES if not name.startswith(SKIPPED)]


@pytest.mark.e2e  # Snakemake walks the whole DAG, submitting through a fake sbatch
@pytest.mark.parametrize("name", SUBMITTED_EXAMPLES)
def test_example_submits_the_seeds_sbatch_resources(name, tmp_path, request):
    exports, submissions, _ = submit_example(name, tmp_path, request)
    check_submissions(name, exports, submissions)
    if name.startswith("000-"):
        check_seed_000_lines(submissions)


def check_seed_000_lines(submissions):
    """The literal numbers of seed 000: 4 nodes x 4 GPUs, 36 h, and the seed's 500 GB of host memory
    (476000 MB: what ZeRO-3's partial offload fits in, by plan_training)."""
    train = [opts for rule, opts in submissions if rule == "train_node"]
    assert len(train) == 4
    assert {(o["-p"], o["--nodes"], o["--gpus"], o["--cpus-per-task"], o["--mem"], o["-t"]) for o in train} == {
        ("gpu", "1", "4", "32", "476000", "2160")
    }
    comments = sorted(o["--comment"] for o in train)
    assert comments == [f"rule_train_node_wildcards_node{i}" for i in range(4)]
    evals = [opts for rule, opts in submissions if rule == "evaluate_model"]
    assert len(evals) == 5 and {(o["-p"], o["--nodes"], o["--gpus"], o["--mem"]) for o in evals} == {
        ("gpu", "1", "1", "400000")
    }


# --- CPU-scaled twins, end to end ----------------------------------------------------------------------

# what a twin keeps of its example: how it trains, not how big or how long
KEPT_TRAINING = ("strategy", "zero_stage", "offload", "peft", "lora", "mode", "gradient_checkpointing", "schedule",
                 "min_lr_ratio", "weight_decay", "max_grad_norm", "adam_betas", "warmup_ratio")  # fmt: skip


def cpu_twin(name: str, run: str = "t") -> dict:
    """The example scaled to a CPU: the demo model and data, 128 tokens, 12 steps, fp32, 2 nodes x 2
    processes; the strategy, ZeRO stage, offload, PEFT/LoRA, mode and schedule shape are the example's."""
    example = with_defaults(load(name))
    t = example["training"]
    twin = tiny_config(run, **{k: t[k] for k in KEPT_TRAINING})
    twin["data"]["chat_template"] = example["data"]["chat_template"] and str(REPO / example["data"]["chat_template"])
    return twin


def test_cpu_twin_keeps_the_examples_training_setup():
    twin = with_defaults(cpu_twin("004-lora-ddp-2gpu.yaml"))
    t = twin["training"]
    assert (t["strategy"], t["peft"], t["lora"]["r"], t["lora"]["target_modules"]) == (
        "ddp", "lora", 32, ["q_proj", "k_proj", "v_proj", "o_proj"]
    )  # fmt: skip
    assert (t["precision"], t["procs_per_node"], t["max_steps"], twin["nodes"]) == ("fp32", 2, 12, 2)
    assert twin["model"]["name_or_path"] == "demo" and twin["data"]["max_seq_len"] == 128
    t0 = with_defaults(cpu_twin("000-qwen3-32b-zero3-offload.yaml"))["training"]
    assert (t0["strategy"], t0["zero_stage"], t0["offload"], t0["gradient_checkpointing"]) == (
        "deepspeed", 3, "all", True
    )  # fmt: skip


# ZeRO-3 + offload and FSDP2 run end to end here, with soups. The other examples' setups run end to end
# elsewhere, which keeps CI in its time: ZeRO-1 (002) is trained and consolidated in
# tests/test_training.py, joint mode (003) through the two-host SLURM cluster in tests/test_joint.py,
# LoRA with DDP (004) as the demo's LoRA stage in tests/test_lora_stage.py.
TWINS = [
    "000-qwen3-32b-zero3-offload.yaml",
    "001-llama3-8b-fsdp.yaml",
]


# 000 also averages its node models (the soups end to end; a soup reads consolidated HF folders, whatever
# trained them); 001 trains one node (FSDP2 end to end; the second node would repeat it)
SOUP_TWINS = {"000-qwen3-32b-zero3-offload.yaml"}
ONE_NODE_TWINS = {"001-llama3-8b-fsdp.yaml"}


@pytest.mark.e2e
@pytest.mark.parametrize("name", TWINS)
def test_cpu_twin_runs_end_to_end(name, tmp_path, ddp_run):
    """From a copy of the shared demo run (ddp_run: tiny_config "t", as the twins): Snakemake reruns what the
    twin's keys change (its training, plan, environment check and all after them; with 001's template or one
    node, its data stages too) and keeps the rest, as identical (the demo model, the data stages of 000, its base
    evaluation): the twin's own stages run end to end, the shared ones once in the session."""
    twin = cpu_twin(name)
    twin["eval"]["soup"] = name in SOUP_TWINS
    if name in ONE_NODE_TWINS:
        twin["nodes"] = 1
    workdir = copy_of_run(ddp_run[0], tmp_path / "work", drop=("plan", "train", "checkpoints", "models"))
    start = time.monotonic()
    proc = snakemake(workdir, twin)
    print(f"{name} twin: {time.monotonic() - start:.0f} s")
    print("rerun:", planned_jobs(proc))
    root = workdir / "results" / "t"
    models = tuple(f"node{i}" for i in range(twin["nodes"]))
    check_outputs(root, nodes=models, soups=name in SOUP_TWINS, shards=models)
    # the trainer ran with the example's setup
    state = json.loads(next((root / "train").glob("*/train_state.json")).read_text())
    for key in ("strategy", "zero_stage", "offload", "peft", "gradient_checkpointing", "mode", "lora_r"):
        expected = twin["training"]["lora"]["r"] if key == "lora_r" else twin["training"][key]
        assert state["config"][key] == expected, (key, state["config"])
    if twin["training"]["peft"] == "lora":
        adapter = root / "models" / models[0] / "adapter"
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == twin["training"]["lora"]["r"]
        assert sorted(config["target_modules"]) == sorted(twin["training"]["lora"]["target_modules"])
