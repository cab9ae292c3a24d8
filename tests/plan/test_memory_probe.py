"""The planner's memory probe (workflow_scripts/plan/memory_probe.py): the workflow's own training step on fake
tensors gives a rank's peak by category; held against the same step on real tensors under torchrun."""

import copy
import dataclasses
import functools
import json
import subprocess
import sys
import time

import pytest
from conftest import BIN, REPO, trainer_env
from transformers import Qwen3Config

from workflow_scripts.core.settings import PlanConfig
from workflow_scripts.plan.memory_probe import categories, probe

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip
# the tests of the probe's own terms: one layer (the fake-tensor step's dispatch is the cost, per layer; the
# torchrun check holds the probe to the real step at SHAPE's two)
ONE_LAYER = SHAPE | {"num_hidden_layers": 1}
LORA = {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}


def plan(**keys) -> PlanConfig:
    return PlanConfig.build({"max_seq_len": 64, "micro_batch_size": 2} | keys)


CASES = {
    "fsdp, grad_accum 2": plan(strategy="fsdp", grad_accum=2),
    "fsdp, grad_accum 2, no sync": plan(strategy="fsdp", grad_accum=2, fsdp_no_sync=True),
    "fsdp, LoRA, checkpointing": plan(strategy="fsdp", gradient_checkpointing=True, **LORA),
    "ddp, grad_accum 2": plan(strategy="ddp", grad_accum=2),
    "ddp, LoRA, fp32, padded": plan(strategy="ddp", precision="fp32", packing=False, **LORA),
    "ddp, fp16 (loss scaling)": plan(strategy="ddp", precision="fp16"),
    "fsdp, fp16 (sharded loss scaling)": plan(strategy="fsdp", precision="fp16"),
}


def tiny_probe(t: PlanConfig, world: int = 2, shape: dict = ONE_LAYER) -> dict:
    """The probe of the tiny model (``shape``) for ``t`` at ``world`` ranks, once per session (seconds each on
    2 cores; several tests ask for the same)."""
    key = json.dumps(dataclasses.asdict(t), sort_keys=True)
    return copy.deepcopy(_probed(key, world, json.dumps(shape, sort_keys=True)))


@functools.cache
def _probed(t: str, world: int, shape: str) -> dict:
    return probe(Qwen3Config(**json.loads(shape)), PlanConfig.from_json(t), world)


def test_probe_reports_the_peak_by_component():
    result = tiny_probe(CASES["fsdp, LoRA, checkpointing"])
    parts = result["components_bytes"]
    assert set(parts) == {"params", "grads", "optimizer", "activations", "buffers", "other"}
    assert sum(parts.values()) == result["peak_bytes"] == result["tracker_categories_bytes"]["Total"]
    assert parts["params"] > 0 and parts["activations"] > 0 and parts["optimizer"] > 0
    assert categories({"Parameter": 3, "Optstate": 4, "Total": 10}) == {
        "params": 3, "grads": 0, "optimizer": 4, "activations": 0, "buffers": 0, "other": 3,
    }  # fmt: skip


def test_fsdp_accumulation_holds_only_the_gradient_shard():
    """grad_accum 2 costs at most one sharded fp32 gradient over grad_accum 1 (reduce-scatter every
    micro-batch); training.fsdp_no_sync holds the unsharded one, and the probe prices it."""
    one = tiny_probe(plan(strategy="fsdp", grad_accum=1))
    two = tiny_probe(CASES["fsdp, grad_accum 2"])
    no_sync = tiny_probe(CASES["fsdp, grad_accum 2, no sync"])
    shard = one["tracker_categories_bytes"]["Sharded Param"]  # the fp32 shard: its gradient is as large
    assert two["peak_bytes"] - one["peak_bytes"] <= shard + 64  # and a few scalars (the summed loss)
    assert no_sync["peak_bytes"] - one["peak_bytes"] > shard


def test_probe_scales_with_the_world():
    small, large = tiny_probe(plan(strategy="fsdp"), 2), tiny_probe(plan(strategy="fsdp"), 8)
    assert large["tracker_categories_bytes"]["Sharded Param"] < small["tracker_categories_bytes"]["Sharded Param"]
    assert large["world_size"] == 8


def test_probe_refuses_deepspeed():
    with pytest.raises(ValueError, match="no fake-tensor path"):
        tiny_probe(plan(strategy="deepspeed"))


@pytest.mark.torchrun
def test_fake_probe_matches_the_real_step_within_one_percent(tmp_path):
    """The same training steps on real tensors, 2 ranks over gloo, measured the same way: within 1%."""
    out = tmp_path / "real.json"
    script = REPO / "tests" / "memory_probe_check.py"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(script), json.dumps(SHAPE),
           json.dumps([dataclasses.asdict(t) for t in CASES.values()]), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env(), timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for (name, t), real in zip(CASES.items(), json.loads(out.read_text()), strict=True):
        fake = tiny_probe(t, shape=SHAPE)["peak_bytes"]
        assert abs(fake - real["Total"]) <= 0.01 * real["Total"], (name, fake, real)


def run_plan(tmp_path, t: PlanConfig, *extra):
    """preflight.py on a folder holding only the tiny model's config.json (its command line, in this process:
    conftest.run_main; the probe runs in its own process either way)."""
    from conftest import run_main

    from workflow_scripts.plan.preflight import main

    folder = tmp_path / "model"
    if not folder.exists():
        Qwen3Config(**ONE_LAYER).save_pretrained(folder)
    argv = ["--model", str(folder), "--config", json.dumps(dataclasses.asdict(t) | {"procs_per_node": 2}),
            "--output", str(tmp_path / "m.json"), "--table", str(tmp_path / "m.csv"), *extra]  # fmt: skip
    proc = run_main(main, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = dict(line.split(",", 1) for line in (tmp_path / "m.csv").read_text().splitlines())
    return proc, json.loads((tmp_path / "m.json").read_text()), table


def test_plan_is_the_probe_with_the_formula_beside_it(tmp_path):
    from workflow_scripts.plan.memory_probe import GB, GPU_CONSTANTS_GB
    from workflow_scripts.train.parallel.fsdp import FSDPStrategy

    proc, est, table = run_plan(tmp_path, CASES["fsdp, grad_accum 2, no sync"])
    assert est["method"].startswith("by the fake-tensor probe") and est["method"] in proc.stdout
    gb = est["per_gpu_gb"]
    live = est["probe"]["peak_bytes"] / GB
    assert set(gb) == {"params", "grads", "optimizer", "activations", "buffers", "other", "allocator_headroom",
                       "cuda_context", "nccl_buffers"}  # fmt: skip
    assert sum(v for k, v in gb.items() if k not in ("allocator_headroom", *GPU_CONSTANTS_GB)) == pytest.approx(live)
    assert gb["allocator_headroom"] == pytest.approx(live * FSDPStrategy.allocator_headroom)  # 0.30: measured
    assert est["total_gb"] == pytest.approx(sum(gb.values()))
    assert est["probe"]["world_size"] == 2 and est["probe"]["tracker_categories_bytes"]["Total"] > 0
    formula = est["formula"]
    assert formula["total_gb"] == pytest.approx(sum(formula["per_gpu_gb"].values()))
    assert formula["per_gpu_gb"]["unsharded_gradients"] > 0  # fsdp_no_sync with grad_accum 2, priced
    assert float(table["total per GPU"]) == pytest.approx(est["total_gb"], abs=0.01)
    assert float(table["formula (cross-check): total per GPU"]) == pytest.approx(formula["total_gb"], abs=0.01)


def test_plan_falls_back_to_the_formula_and_says_why(tmp_path):
    proc, est, table = run_plan(tmp_path, plan(strategy="ddp"), "--probe-timeout", "0.01")
    assert "by the formula" in est["method"] and "took over 0 s" in est["method"], est["method"]
    assert est["method"] in proc.stdout and est["probe"] is None
    assert est["per_gpu_gb"] == est["formula"]["per_gpu_gb"] and est["total_gb"] == est["formula"]["total_gb"]
    _, est, table = run_plan(tmp_path, plan(strategy="deepspeed", zero_stage=3), "--probe-timeout", "0")
    assert est["method"].startswith("model states by ZeRO's terms") and "probe is off" in est["method"], est["method"]
    assert table["estimated by"] == est["method"].replace(",", ";")


def test_zero_plan_takes_the_activations_of_the_probe(tmp_path):
    """DeepSpeed has no fake-tensor path: ZeRO's model states are its own terms, and the activations are the
    peak of the activations alone in the probe's FSDP2 run of the same micro-batch (not the global peak's)."""
    from workflow_scripts.plan.memory_probe import GB

    _, est, _ = run_plan(tmp_path, plan(strategy="deepspeed", zero_stage=3, gradient_checkpointing=True))
    assert "activations by the fake-tensor probe" in est["method"], est["method"]
    probed = est["probe"]
    assert est["per_gpu_gb"]["activations"] == pytest.approx(probed["activations_peak_bytes"] / GB)
    assert probed["activations_peak_bytes"] >= probed["components_bytes"]["activations"] > 0
    assert est["model_states"]["gpu"]["optimizer"] > 0 and set(est["model_states"]["host"]) == {"pinned_rounding"}


def test_formula_prices_fsdp_no_sync():
    from workflow_scripts.plan.preflight import GB, estimate

    config = Qwen3Config(**SHAPE)
    t = plan(strategy="fsdp", grad_accum=2)
    n = 1_000_000
    default = estimate(config, n, t, 2, 64)["per_gpu_gb"]
    no_sync = estimate(config, n, dataclasses.replace(t, fsdp_no_sync=True), 2, 64)["per_gpu_gb"]
    assert default["unsharded_gradients"] == 0 and no_sync["unsharded_gradients"] == pytest.approx(4 * n / GB)


def test_plan_with_fsdp_offload_leaves_the_shards_on_the_host():
    """CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer states on the host: the
    probe (which runs without offload on a CPU) counts them, the plan takes them off the GPU."""
    from workflow_scripts.plan.memory_probe import GB
    from workflow_scripts.plan.preflight import planned

    cats = {"Sharded Param": 4 * GB, "Unsharded Param": GB, "Sharded Grad": 4 * GB, "OptState": 8 * GB}
    probed = {"components_bytes": categories(cats | {"Activation": 2 * GB, "Total": 19 * GB}),
              "tracker_categories_bytes": cats}  # fmt: skip
    formula = {"per_gpu_gb": {"weights": 1.0}, "total_gb": 1.0, "without_checkpointing_gb": None}
    on_gpu = planned(dict(formula), probed, "probe", plan(strategy="fsdp"))["per_gpu_gb"]
    offloaded = planned(dict(formula), probed, "probe", plan(strategy="fsdp", offload="optimizer"))
    assert (on_gpu["params"], on_gpu["grads"], on_gpu["optimizer"]) == (5, 4, 8)
    assert (offloaded["per_gpu_gb"]["params"], offloaded["per_gpu_gb"]["grads"]) == (1, 0)
    assert offloaded["per_gpu_gb"]["optimizer"] == 0 and offloaded["per_gpu_gb"]["activations"] == 2
    assert "on the host" in offloaded["method"] and offloaded["formula"]["total_gb"] == 1.0


def test_a_failed_probe_says_why_in_its_last_line_and_the_plan_goes_on(tmp_path, capfd):
    """The probe runs in a forked child (preflight.forked): its traceback's last line is the plan's reason, its
    output stays out of the planner's, and a child past the timeout is killed."""
    from workflow_scripts.plan.preflight import forked, probe_memory

    missing = tmp_path / "no-such-model"
    missing.mkdir()
    probed, note = probe_memory(str(missing), plan(strategy="ddp"), 2, 120)
    assert probed is None and note.startswith("by the formula (module docstring): the fake-tensor probe failed ("), note
    assert "no-such-model" in note and "Traceback" not in capfd.readouterr().err
    assert forked(functools.partial(time.sleep, 30), 0.5) is None  # killed, not waited for
    assert forked(functools.partial(sys.exit, 3), 30) == 3


def test_a_varlen_kernel_is_planned_without_sdpas_mask():
    """Where check_environment found a variable-length flash kernel (flash-attn's or torch_varlen), the probe runs
    torch_varlen's fake kernel: no mask, so per layer and row one sequence × sequence bf16 bias less than SDPA's
    (on an H200, 28 layers: 0.88 GB at 4,096 tokens, 14.0 at 16,384 measured, 0.94 and 15.0 by this term)."""
    seq = 512
    t = plan(strategy="ddp", precision="bf16", max_seq_len=seq, micro_batch_size=1)
    shape = Qwen3Config(**(ONE_LAYER | {"max_position_embeddings": seq}))
    sdpa, varlen = (probe(shape, t, 2, attention=a) for a in ("sdpa", "torch_varlen"))
    assert varlen["attention"] == "torch_varlen"
    mask_bias = ONE_LAYER["num_hidden_layers"] * seq * seq * 2
    saved = sdpa["activations_peak_bytes"] - varlen["activations_peak_bytes"]
    assert mask_bias <= saved <= 1.2 * mask_bias, (saved, mask_bias)
    assert varlen["components_bytes"]["params"] == sdpa["components_bytes"]["params"]


def test_the_planned_attention_is_what_check_environment_found(tmp_path):
    from workflow_scripts.plan.preflight import planned_attention

    report = tmp_path / "check.json"
    for found, planned in [("torch_varlen", "torch_varlen"), ("flash_attention_2", "torch_varlen"), ("sdpa", "sdpa")]:
        report.write_text(json.dumps({"attention": found}))
        assert planned_attention(report) == planned
    assert planned_attention(None) == "sdpa"  # training.gpu_memory_gb set: no report, SDPA's mask an upper bound
