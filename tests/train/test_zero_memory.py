"""ZeRO's memory terms (parallel/zero_memory.py) against DeepSpeed 0.19's own code: its sub-groups, its partial
offload's split, torch's pinned rounding, and the bytes per parameter its source keeps where."""

import types

import pytest

GB = 2**30


def lay(numels, hidden=64, frozen=()):
    from workflow_scripts.train.parallel.zero_memory import Layout

    return Layout(tuple((n, 2) for n in numels), tuple(frozen), hidden, None, max([*numels, *frozen]))


def t(**kw):
    """The planner's typed config (settings.PlanConfig): these keys, the rest the schema's defaults."""
    from workflow_scripts.core.settings import PlanConfig

    return PlanConfig.build(
        {"precision": "bf16", "offload": "all", "offload_ratio": 1.0, "zero_stage": 3, "peft": "none"} | kw
    )


def test_sub_groups_are_deepspeeds():
    """stage3's own _create_fp16_sub_groups, on parameters that only answer partition_numel."""
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    from workflow_scripts.train.parallel.zero_memory import sub_groups

    sizes = [7, 300, 5, 120, 120, 64, 1, 999, 3]
    params = [types.SimpleNamespace(partition_numel=lambda n=n: n) for n in sizes]
    for size in (1, 50, 128, 400, 10_000):
        me = types.SimpleNamespace(sub_group_size=size)
        theirs = stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(me, params)
        assert sub_groups(sizes, size) == [sum(p.partition_numel() for p in g) for g in theirs], size


def test_pinned_blocks_round_up_to_a_power_of_two():
    from workflow_scripts.train.parallel.zero_memory import pinned

    assert [pinned(n) for n in (0, 1, 3, 4, 5, 2**30, 2**30 + 1)] == [0, 1, 4, 4, 8, 2**30, 2**31]


def test_zero3_offload_keeps_20_bytes_a_parameter_on_the_host():
    """offload: all, one rank: bf16 parameter and gradient partitions, fp32 master, pinned fp32 gradient and
    Adam's moments: 2 + 2 + 4 + 4 + 8 before rounding; offload: optimizer 18, the parameters on the GPU.
    Nothing of the optimizer or the gradients on the GPU."""
    from workflow_scripts.train.parallel.zero_memory import zero3

    n = [2**20] * 8  # sub-groups of 10 h² = 40960 elements: 8 blocks of 4 MiB, no rounding
    z = zero3(t(), lay(n), 1)
    assert sum(z["host"].values()) - z["host"]["pinned_rounding"] == 20 * sum(n)
    assert z["host"]["pinned_rounding"] == 0 and z["gpu"]["grads"] == z["gpu"]["optimizer"] == 0
    opt = zero3(t(offload="optimizer"), lay(n), 1)
    assert sum(opt["host"].values()) == 18 * sum(n) and opt["gpu"]["params"] == 2 * sum(n)
    none = zero3(t(offload="none"), lay(n), 1)
    assert none["host"] == {"pinned_rounding": 0}
    assert none["gpu"]["grads"] == 2 * sum(n) and none["gpu"]["optimizer"] == 12 * sum(n) + 4 * 2**20


def test_zero3_host_is_deepspeeds_estimate_corrected():
    """DeepSpeed's estimate_zero3_model_states_mem_needs (zero_init) counts 18 bytes a parameter × 1.5 on the
    host per node; its source keeps 20 (the bf16 gradient partition is on the host, not the GPU)."""
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    from workflow_scripts.train.parallel.zero_memory import zero3

    n, procs, nodes = [2**20] * 16, 4, 2
    ours = procs * (sum(zero3(t(), lay(n), procs * nodes)["host"].values()))
    cpu, _, _ = stage3.estimate_zero3_model_states_mem_needs(
        sum(n), 2**20, num_gpus_per_node=procs, num_nodes=nodes, cpu_offload=True, cpu_offload_params=True,
        zero_init=True,
    )  # fmt: skip
    assert ours == pytest.approx(cpu / 1.5 * 20 / 18)


def test_partial_offload_keeps_the_first_sub_groups_on_the_gpu():
    """offload_optimizer.ratio r: int((1 - r) × sub-groups) stay on the GPU at 16 bytes an element (stage3's
    subgroup_to_device); the rest on the host; one GPU sub-group's pinned block stays in torch's cache."""
    from workflow_scripts.train.parallel.zero_memory import zero3

    n = [2**20] * 8
    full = zero3(t(offload="optimizer"), lay(n), 1)
    half = zero3(t(offload="optimizer", offload_ratio=0.5), lay(n), 1)
    assert (half["sub_groups"], half["sub_groups_on_gpu"]) == (8, 4)
    assert half["gpu"]["optimizer"] == 16 * 4 * 2**20
    assert sum(full["host"].values()) - sum(half["host"].values()) == 16 * 4 * 2**20 - 4 * 2**20
    assert zero3(t(offload="optimizer", offload_ratio=0.3), lay(n), 1)["sub_groups_on_gpu"] == int(0.7 * 8)


def test_pinned_rounding_of_sub_groups_just_over_a_power_of_two():
    """A sub-group closes once it reaches sub_group_size: a block of 4 × (2^20 + 1) bytes takes 2^23."""
    from workflow_scripts.train.parallel.zero_memory import zero3

    z = zero3(t(offload="optimizer"), lay([2**20 + 1] * 2, hidden=512), 1)  # 10 h² = 2621440: one sub-group
    assert z["sub_groups"] == 1
    block = 4 * 2 * (2**20 + 1)
    assert z["host"]["pinned_rounding"] >= 2**24 - block


def test_best_ratio_leaves_the_most_room():
    from workflow_scripts.train.parallel.zero_memory import best_ratio

    # the GPU fits from 0.6 up, the host up to 0.8: the middle has the most room on both
    assert best_ratio(lambda r: min(r - 0.6, 0.8 - r) if 0.6 <= r <= 0.8 else None) == 0.7
    assert best_ratio(lambda r: None) is None


def test_offload_ratio_reaches_deepspeed_for_zero3_only():
    from transformers import Qwen3Config

    from workflow_scripts.core.pipeline_io import UserError
    from workflow_scripts.core.settings import training_config
    from workflow_scripts.train.parallel.zero import deepspeed_config

    shape = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

    def zero(**kw):
        cfg = training_config({"strategy": "deepspeed", "zero_stage": 3, "offload": "optimizer"} | kw)
        return deepspeed_config(cfg, 2, shape)["zero_optimization"]

    assert "ratio" not in zero()["offload_optimizer"]  # 1.0, the schema's default: DeepSpeed's own default
    assert zero(offload_ratio=0.5)["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.5}
    with pytest.raises(UserError, match="training.offload_ratio 0.5 needs training.zero_stage 3"):
        zero(offload_ratio=0.5, zero_stage=2)
    with pytest.raises(UserError, match="training.offload_ratio 0.5 needs"):
        zero(offload_ratio=0.5, offload="none")


@pytest.mark.torchrun
def test_zero3_partial_offload_trains_on_two_cpu_ranks(tmp_path, demo_assets):
    """DeepSpeed 0.19's partial optimizer offload (offload_optimizer.ratio 0.5) on the CPU accelerator: half the
    sub-groups stepped by torch's AdamW (DeepSpeed's backup optimizer), half by DeepSpeedCPUAdam."""
    import json

    from conftest import run_trainer

    cfg = {"strategy": "deepspeed", "zero_stage": 3, "offload": "optimizer", "offload_ratio": 0.5, "lr": 3e-3,
           "micro_batch_size": 2, "max_steps": 6, "log_every": 1, "checkpoint_every": 100}  # fmt: skip
    proc = run_trainer(tmp_path, demo_assets, cfg)
    assert "DeepSpeedCPUAdam (50% of the optimizer offloaded to cpu)" in proc.stdout + proc.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_offload_keys_enter_the_checkpoint_key_only_when_set():
    """training.offload_ratio and offload_pin_memory came after checkpoints existed: at their defaults the
    key is what it was before them (a run from before resumes), set otherwise it is another training."""
    import dataclasses

    from workflow_scripts.core.settings import for_world, training_config
    from workflow_scripts.train.checkpoint import KEYED_WHEN_SET, KEYED_WITH, run_key

    cfg = for_world(training_config({"strategy": "deepspeed", "zero_stage": 3, "offload": "optimizer"}), 2)
    key = run_key(cfg, 2, "data", "base", None)
    # the training config as it was: without the two keys, nor the ones that came after them (the objective's)
    before = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in {*KEYED_WHEN_SET, *KEYED_WITH}}

    @dataclasses.dataclass(frozen=True)
    class Before:
        __annotations__ = {k: object for k in before}

    assert run_key(Before(**before), 2, "data", "base", None) == key
    assert run_key(dataclasses.replace(cfg, offload_ratio=0.5), 2, "data", "base", None) != key
    assert run_key(dataclasses.replace(cfg, offload_pin_memory=False), 2, "data", "base", None) != key
