"""plan_training's host side: RAM per node at load and in training against the training job's mem_mb,
DeepSpeed's own estimators as the reference, and the mem_mb Snakemake will submit read at parse time."""

import dataclasses
import json
import math

import pytest
from conftest import REPO, copy_of_run, planned_jobs, run_main, snakemake, tiny_config, tool_env

from workflow_scripts.core.settings import PlanConfig

GB = 2**30


def training(**kw):
    base = {"mode": "per_node", "nodes": 1, "strategy": "deepspeed", "zero_stage": 3, "offload": "all",
            "peft": "none", "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}, "procs_per_node": 4,
            "precision": "bf16", "micro_batch_size": 1, "gradient_checkpointing": True,
            "gpu_memory_gb": 80}  # fmt: skip
    return PlanConfig.build(base | kw)  # the planner's typed config


N, LARGEST = 1_000_000_000, 50_000_000  # parameters of the model and of its largest module


@pytest.mark.parametrize("procs", [1, 4, 8])
@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize("offload", ["none", "optimizer", "all"])
def test_zero3_in_training_is_deepspeeds_estimate(offload, nodes, procs):
    """ZeRO-3 under zero.Init: the host bytes per node are DeepSpeed's own (zero_init=True)."""
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    from workflow_scripts.plan.preflight import offloaded_bytes

    t = training(offload=offload, procs_per_node=procs)
    ours = offloaded_bytes(N, N, LARGEST, t, nodes * procs)
    cpu, _, _ = stage3.estimate_zero3_model_states_mem_needs(
        N, LARGEST, num_gpus_per_node=procs, num_nodes=nodes, cpu_offload=offload != "none",
        cpu_offload_params=offload == "all", zero_init=True,
    )  # fmt: skip
    assert ours == pytest.approx(cpu, abs=1)


@pytest.mark.parametrize("procs", [1, 2, 4])
def test_zero2_offload_on_one_node_is_deepspeeds_estimate(procs):
    """One node of up to 4 GPUs, where DeepSpeed's max(4 x GPUs, 16) is its 16 bytes of offloaded states."""
    stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    from workflow_scripts.plan.preflight import offloaded_bytes

    t = training(zero_stage=2, offload="optimizer", procs_per_node=procs)
    cpu, _ = stage2.estimate_zero2_model_states_mem_needs(N, num_gpus_per_node=procs, num_nodes=1, cpu_offload=True)
    assert offloaded_bytes(N, N, LARGEST, t, procs) == pytest.approx(cpu, abs=1)


def host(t, world=None, trainable=N, largest_file=4 * 10**9):
    from workflow_scripts.plan.preflight import host_estimate

    return host_estimate(N, trainable, LARGEST, t, world or t.procs_per_node, largest_file)


def test_host_at_load_follows_how_each_strategy_builds_the_model():
    overhead = 4 * 1.5  # 4 ranks
    # DDP: a replica per rank, fp32 (autocast's master weights); ZeRO-1/2: a replica per rank in bf16
    assert host(training(strategy="ddp", offload="none"))["at_load_gb"] == pytest.approx(4 * 4 * N / GB + overhead)
    zero1 = host(training(zero_stage=1, offload="none"))
    assert zero1["at_load_gb"] == pytest.approx(4 * 2 * N / GB + overhead)
    assert zero1["in_training_gb"] == pytest.approx(overhead)  # nothing offloaded
    # fp16 is 2 bytes like bf16, fp32 4
    assert host(training(zero_stage=1, offload="none", precision="fp16"))["at_load_gb"] == zero1["at_load_gb"]
    assert host(training(zero_stage=1, offload="none", precision="fp32"))["at_load_gb"] == pytest.approx(
        4 * 4 * N / GB + overhead
    )
    # ZeRO-3 under zero.Init: one checkpoint file, plus the node's bf16 partitions when they live on the host
    assert host(training(offload="optimizer"))["at_load_gb"] == pytest.approx(4e9 / GB + overhead)
    assert host(training(offload="all"))["at_load_gb"] == pytest.approx((4e9 + 2 * N) / GB + overhead)
    # FSDP2 on meta: one file plus every rank's fp32 shard
    fsdp = host(training(strategy="fsdp", offload="none"))
    assert fsdp["at_load_gb"] == pytest.approx((4e9 + 4 * N) / GB + overhead)
    # joint mode over 2 nodes: each node's ranks hold half as much
    assert host(training(strategy="fsdp", offload="none"), world=8)["at_load_gb"] == pytest.approx(
        (4e9 + 2 * N) / GB + overhead
    )


def test_host_in_training_counts_what_offload_keeps_there():
    overhead = 4 * 1.5
    zero3 = host(training(offload="all"))
    assert zero3["in_training_gb"] == pytest.approx(18 * N * 1.5 / GB + overhead)
    assert zero3["peak_gb"] == zero3["in_training_gb"]
    assert host(training(offload="all"), world=16)["in_training_gb"] == pytest.approx(18 * N * 1.5 / 4 / GB + overhead)
    assert host(training(offload="optimizer"))["in_training_gb"] == pytest.approx(16 * N * 1.5 / GB + overhead)
    # FSDP2's CPUOffloadPolicy: fp32 parameters, gradients and Adam's moments of the node's shards
    fsdp = host(training(strategy="fsdp", offload="optimizer"))
    assert fsdp["in_training_gb"] == pytest.approx(16 * N / GB + overhead)
    # LoRA: DeepSpeed's accounting for the adapters only, the frozen base's bf16 partitions besides
    lora = host(training(offload="all", peft="lora"), trainable=N // 100)
    assert lora["in_training_gb"] == pytest.approx((18 * N / 100 + 2 * N * 99 / 100) * 1.5 / GB + overhead)
    assert host(training(strategy="ddp", offload="none"))["in_training_gb"] == pytest.approx(overhead)


def test_fp16_weighs_like_bf16_on_the_gpu():
    from workflow_scripts.model.presets import preset_config
    from workflow_scripts.plan.preflight import estimate

    config = preset_config("1b", 32000, 2048)
    t = training(strategy="ddp", offload="none", gradient_checkpointing=False)

    def total(precision):
        return estimate(config, N, dataclasses.replace(t, precision=precision), 4, 2048)["total_gb"]

    assert total("fp16") == total("bf16") < total("fp32")
    # full fine-tuning in 16-bit: 2 (weights) + 4 (fp32 master) + 8 (Adam) + 2 (gradients) per parameter
    gb = estimate(config, N, dataclasses.replace(t, precision="fp16"), 4, 2048)["per_gpu_gb"]
    assert gb["weights"] + gb["optimizer_states"] + gb["gradients"] == pytest.approx(16 * N / GB)


def preflight(tmp_path, t, *extra):
    """preflight.py's command line (its main, in this process: conftest.run_main)."""
    from workflow_scripts.plan.preflight import main

    argv = [
        "--model", "preset:1b",
        "--config", json.dumps(dataclasses.asdict(t) | {"max_seq_len": 2048, "demo_vocab_size": 32000}),
        "--output", str(tmp_path / "m.json"), "--table", str(tmp_path / "m.csv"),
        "--probe-timeout", "0", *extra,  # the host plan is the formula's; the probe has its own tests
    ]  # fmt: skip
    proc = run_main(main, argv)
    table = dict(line.split(",", 1) for line in (tmp_path / "m.csv").read_text().splitlines())
    return proc, json.loads((tmp_path / "m.json").read_text()), table


def test_preflight_stops_when_the_host_memory_is_short(tmp_path):
    t = training()  # 1b, ZeRO-3 offloading everything: about 18 x 1.5 bytes per parameter on the host
    proc, plan, table = preflight(tmp_path, t, "--host-memory-mb", "16000")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training needs about") and "of host memory per node (in training)" in last
    assert "TRAIN_MEM_MB" in last and "mem_mb 16000" in last and "fits with training." in last, last
    # the named proposal was planned again and fits the 16 GB
    chosen = next(p for p in plan["proposals"] if p["fits"])
    assert chosen["proposal"] in last and chosen["host_gb"] <= 16000 / 1024 and chosen["gpu_gb"] <= 80
    assert any(p["change"].get("mode") == "joint" for p in plan["proposals"]), plan["proposals"]
    need = plan["host"]["peak_gb"]
    assert f"TRAIN_MEM_MB={math.ceil(need * 1024)} or more" in last, last
    assert plan["gpu_fits"] is True and plan["host"]["fits"] is False and plan["fits"] is False
    assert float(table["host RAM per node in training"]) == pytest.approx(need, abs=0.01)
    assert table["host memory (TRAIN_MEM_MB)"] == "16 (mem_mb 16000)"

    # the advice's number is enough
    proc, plan, _ = preflight(tmp_path, t, "--host-memory-mb", str(math.ceil(need * 1024)))
    assert proc.returncode == 0 and plan["host"]["fits"] is True and plan["fits"] is True, proc.stderr


def test_preflight_without_a_memory_limit_reports_the_estimate(tmp_path):
    proc, plan, table = preflight(tmp_path, training(strategy="ddp", offload="none", peft="lora"))
    assert proc.returncode == 0, proc.stderr
    assert plan["host"]["fits"] is None and plan["host"]["memory_mb"] is None and plan["fits"] is True
    assert table["host memory (TRAIN_MEM_MB)"] == "no mem_mb set"
    assert float(table["host RAM per node at load"]) == pytest.approx(plan["host"]["at_load_gb"], abs=0.01)
    assert "host" in proc.stdout and "no mem_mb set" in proc.stdout


def planned_host_memory(tmp_path, config, *args) -> str | None:
    """The --host-memory-mb plan_training is given in a dry run with ``args``."""
    proc = snakemake(tmp_path, config, "-n", "-p", "--until", "plan_training", *args)
    command = next(line for line in (proc.stdout + proc.stderr).splitlines() if "preflight.py" in line)
    return command.split("--host-memory-mb ", 1)[1].split()[0] if "--host-memory-mb" in command else None


def test_plan_gets_the_training_jobs_mem_mb(tmp_path):
    config = tiny_config("h")
    assert planned_host_memory(tmp_path / "a", config) is None  # no profile: no limit
    assert planned_host_memory(tmp_path / "b", config, "--default-resources", "mem_mb=3000") == "3000"
    # --set-resources wins over the defaults; "mem" in other units becomes mem_mb
    args = ("--default-resources", "mem_mb=3000", "--set-resources", "train_node:mem=5GB")
    assert planned_host_memory(tmp_path / "c", config, *args) == "5000"
    # joint mode: the train_joint job's (per node)
    joint = tiny_config("h", mode="joint")
    args = ("--set-resources", "train_node:mem_mb=1000", "train_joint:mem_mb=7000")
    assert planned_host_memory(tmp_path / "d", joint, *args) == "7000"
    # the SLURM profile: TRAIN_MEM_MB
    env = tool_env() | {"TRAIN_MEM_MB": "123456", "SLURM_ACCOUNT": "x"}
    proc = snakemake(tmp_path / "e", config, "-n", "-p", "--until", "plan_training", "--profile",
                     str(REPO / "profiles" / "slurm"), env=env)  # fmt: skip
    assert "--host-memory-mb 123456" in proc.stdout + proc.stderr


@pytest.mark.e2e
def test_a_new_host_memory_replans_nothing_and_keeps_training_in_the_dag(ddp_run, tmp_path):
    """The training job's host memory is no rerun trigger (plan_training's params hold it Untracked): a finished
    run with more of it plans and trains nothing again. A plan made without a mem_mb, then a run with one: the
    plan stands and training stays in the DAG (with training's plan input ancient(), Snakemake 9.27 dropped a
    not-yet-trained train_node from the DAG)."""
    workdir, config = ddp_run
    assert planned_jobs(snakemake(workdir, config, "-n", "--set-resources", "train_node:mem_mb=64000")) == {}
    # the finished run's stages before the plan (a copy), then a plan made without a mem_mb, nothing trained
    fresh = copy_of_run(workdir, tmp_path / "fresh", drop=("plan", "train", "checkpoints"))
    snakemake(fresh, config, f"results/{config['run']}/plan/memory.json")  # planned without a mem_mb
    target = f"results/{config['run']}/train/node0/train_state.json"
    jobs = planned_jobs(snakemake(fresh, config, "-n", target, "--set-resources", "train_node:mem_mb=64000"))
    assert "plan_training" not in jobs and jobs["train_node"] == 1, jobs


def test_proposals_share_one_probe_timeout():
    """Once the proposals' one --probe-timeout is spent, a proposal is planned by the formula and says why."""
    import time

    from workflow_scripts.plan.preflight import Planner

    t = training(strategy="ddp", offload="none", max_seq_len=2048, demo_vocab_size=32000)
    planner = Planner("preset:1b", t, 600, None)
    planner.set_budget()
    assert 590 < planner.deadline - time.monotonic() <= 600
    planner.deadline = time.monotonic() - 1
    probed, note = planner.probe(t, 4)
    assert probed is None and note.endswith("the proposals' --probe-timeout is spent")
    plan = Planner("preset:1b", t, 0, None)
    assert plan.probe(t, 4)[1].endswith("the fake-tensor probe is off (--probe-timeout 0)")


def test_the_plans_gpu_memory_is_the_configs_else_the_smallest_gpu_measured(tmp_path):
    from workflow_scripts.plan.preflight import gpu_memory

    report = tmp_path / "check.json"
    gpus = [{"name": "NVIDIA H100 80GB HBM3", "memory_gb": 79.1}, {"name": "NVIDIA H100 NVL", "memory_gb": 93.1}]
    report.write_text(json.dumps({"gpu": {"gpus": gpus}}))
    assert gpu_memory(40.0, report) == (40.0, "training.gpu_memory_gb")
    assert gpu_memory(None, report) == (79.1, "measured by check_environment: NVIDIA H100 80GB HBM3")
    report.write_text(json.dumps({"gpu": {"gpus": []}}))  # a CPU run
    assert gpu_memory(None, report)[0] == 80 and gpu_memory(None, report)[1].startswith("assumed")
