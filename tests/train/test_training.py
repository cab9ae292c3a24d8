"""train_node and consolidate_node: data plan, schedule, and every strategy with LoRA under torchrun."""

import dataclasses
import json

import pytest
import torch
from conftest import consolidate, run_trainer

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import PlanConfig, training_config
from workflow_scripts.train.batching import DataPlan, micro_batch_indices
from workflow_scripts.train.parallel.base import lr_lambda
from workflow_scripts.train.parallel.zero import deepspeed_config, hidden_size, layer_parameters


def test_steps_per_epoch_halve_when_ranks_double():
    one = DataPlan(examples=1024, world_size=2, micro_batch_size=4, grad_accum=2, epochs=1, max_steps=None)
    two = DataPlan(examples=1024, world_size=4, micro_batch_size=4, grad_accum=2, epochs=1, max_steps=None)
    assert one.steps_per_epoch == 64 and two.steps_per_epoch == 32


def test_an_epoch_visits_each_example_once_across_ranks():
    plan = DataPlan(examples=96, world_size=2, micro_batch_size=4, grad_accum=3, epochs=1, max_steps=None)
    seen = [
        i
        for step in range(plan.steps_per_epoch)
        for micro in range(3)
        for rank in range(2)
        for i in micro_batch_indices(plan, 0, step, micro, rank)
    ]
    assert sorted(seen) == list(range(96))
    # the next epoch uses another order
    assert micro_batch_indices(plan, 0, 0, 0, 0) != micro_batch_indices(plan, 0, plan.steps_per_epoch, 0, 0)


def test_cosine_schedule_warms_up_then_decays_to_min():
    cfg = training_config({"warmup_ratio": 0.1, "min_lr_ratio": 0.1, "schedule": "cosine"})
    f = lr_lambda(cfg, 100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


def test_warmup_steps_override_the_ratio():
    f = lr_lambda(
        training_config({"warmup_ratio": 0.5, "warmup_steps": 4, "schedule": "linear", "min_lr_ratio": 0.0}), 100
    )
    assert [f(s) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert f(52) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)


def test_deepspeed_buffer_sizes_follow_the_model_and_the_users_json_wins(tmp_path):
    from transformers import GPT2Config, LlavaConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

    qwen3 = Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128
    )  # fmt: skip  (Qwen3-0.6B's shape: 15.7M weights a layer)
    h, layer = 1024, 1024 * 128 * (2 * 16 + 2 * 8) + 3 * 1024 * 3072
    assert hidden_size(qwen3) == h and layer_parameters(qwen3) == layer == 15_728_640
    assert hidden_size(LlavaConfig(text_config={"model_type": "qwen3", "hidden_size": 512})) == 512
    assert layer_parameters(Qwen3MoeConfig()) is None and layer_parameters(GPT2Config()) is None
    assert hidden_size(GPT2Config()) == 768 and hidden_size(PretrainedConfig()) is None
    zero3 = deepspeed_config(training_config({"strategy": "deepspeed", "zero_stage": 3}), 2, qwen3)["zero_optimization"]
    assert zero3["reduce_bucket_size"] == h * h and zero3["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert zero3["stage3_param_persistence_threshold"] == 10 * h and zero3["sub_group_size"] == 10 * h * h
    assert zero3["stage3_max_live_parameters"] == zero3["stage3_max_reuse_distance"] == 2 * layer
    moe = deepspeed_config(training_config({"strategy": "deepspeed", "zero_stage": 3}), 2, Qwen3MoeConfig())
    assert "stage3_max_live_parameters" not in moe["zero_optimization"]  # DeepSpeed's default for another layout
    zero2 = deepspeed_config(training_config({"strategy": "deepspeed", "zero_stage": 2}), 2, qwen3)["zero_optimization"]
    assert zero2 == {"stage": 2, "reduce_bucket_size": h * h}  # the stage3_ keys are ZeRO-3's only
    bare = deepspeed_config(training_config({"strategy": "deepspeed", "zero_stage": 3}), 2, PretrainedConfig())
    assert bare["zero_optimization"] == {"stage": 3}  # no hidden_size: DeepSpeed's defaults

    user = tmp_path / "ds.json"  # a value wins, "auto" (transformers' placeholder) is filled, the JSON's stage counts
    zero = {"stage": 3, "reduce_bucket_size": 123, "sub_group_size": "auto"}
    user.write_text(json.dumps({"zero_optimization": zero}))
    cfg = training_config({"strategy": "deepspeed", "zero_stage": 2, "deepspeed_config": str(user)})
    zero = deepspeed_config(cfg, 2, qwen3)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 123 and zero["sub_group_size"] == 10 * h * h
    assert zero["stage3_param_persistence_threshold"] == 10 * h


def test_unknown_training_key_is_rejected():
    with pytest.raises(UserError, match="unknown key"):
        training_config({"learning_rate": 1})


def train_and_consolidate(tmp_path, demo_assets, max_shard_size="2GB", env=None, **overrides):
    cfg = {"lr": 3e-3, "micro_batch_size": 2, "max_steps": 8, "log_every": 2, "checkpoint_every": 4} | overrides
    log_dir, state = tmp_path / "train", tmp_path / "train" / "train_state.json"
    run_trainer(tmp_path, demo_assets, cfg, env=env)
    losses = [json.loads(line)["loss"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    out = tmp_path / "model"
    proc = consolidate(state, out, "--max-shard-size", max_shard_size)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses, out


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "strategy,extra",
    # LoRA + DDP runs end to end in the seed-004 twin (tests/test_examples.py)
    [("fsdp", {}), ("deepspeed", {"zero_stage": 3})],
    ids=["fsdp", "deepspeed-zero3"],
)
def test_lora_trains_and_consolidates(tmp_path, demo_assets, strategy, extra):
    # profiled at steps 3-4 (TRAIN_PROFILE_STEPS): every rank's report and timeline, the training unchanged by it
    env = {"TRAIN_PROFILE_STEPS": "3-4"}
    losses, out = train_and_consolidate(tmp_path, demo_assets, env=env, strategy=strategy, peft="lora", lora={"r": 4},
                                        **extra)  # fmt: skip
    assert losses[-1] < losses[0]
    for rank in (0, 1):
        report = (tmp_path / "train" / "profile" / f"rank{rank}.txt").read_text()
        assert report.startswith("steps 3-4 on cpu: ") and "| matrix products |" in report, report
        trace = json.loads((tmp_path / "train" / "profile" / f"rank{rank}.pt.trace.json").read_text())
        assert {"step 3", "step 4"} <= {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    report = json.loads((out / "consolidation.json").read_text())
    assert report["lora_b_tensors"] == 4 * 4  # 4 layers x q, k, v, o
    assert report["max_logit_diff"] <= 1e-5 and report["generation_ok"]
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    lora_b = {k: v for k, v in adapter.items() if "lora_B" in k}
    assert len(lora_b) == 16 and all(torch.count_nonzero(v) for v in lora_b.values())
    assert all(v.shape[1] == 4 for v in lora_b.values())


@pytest.mark.torchrun
@pytest.mark.parametrize("stage", [1, 2])  # seed 002's ZeRO-1 and ZeRO-2 (ZeRO-3: sharded-load and twin tests)
def test_deepspeed_full_finetune_consolidates_sharded_with_equal_logits(tmp_path, demo_assets, stage):
    """ZeRO-1/2 (one merged fp32 vector per group) through DeepSpeed's converter, written as 4 MB shards."""
    losses, out = train_and_consolidate(
        tmp_path, demo_assets, max_shard_size="4MB", strategy="deepspeed", zero_stage=stage, max_steps=4
    )
    assert losses[-1] < losses[0]
    report = json.loads((out / "consolidation.json").read_text())
    assert report["max_logit_diff"] <= 1e-5 and report["generation_ok"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == report["weight_files"] == sorted(p.name for p in out.glob("*.safetensors"))
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_assets["base"]).state_dict()
    tuned = {}
    for f in files:
        with safe_open(out / f, "pt") as shard:
            tuned |= {k: shard.get_tensor(k) for k in shard.keys()}  # noqa: SIM118
    assert set(tuned) == set(index["weight_map"]) and "lm_head.weight" not in tuned  # tied to the embeddings
    assert all(v.dtype == torch.float32 for v in tuned.values())
    assert any(not torch.equal(v, base[k]) for k, v in tuned.items())  # training changed the weights


def test_shard_plan_keeps_order_and_limit():
    from workflow_scripts.model.weights import parse_size, plan_shards, shard_files

    assert parse_size("2GB") == 2 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size("4mb") == 4 * 10**6
    with pytest.raises(Exception, match="max shard size"):
        parse_size("big")
    sizes = {"a": 3, "b": 3, "c": 5, "d": 1, "e": 9}
    assert plan_shards(sizes, 6) == [["a", "b"], ["c", "d"], ["e"]]  # e alone exceeds the limit
    assert plan_shards(sizes, 100) == [list(sizes)]
    assert shard_files(1) == ["model.safetensors"]
    assert shard_files(3)[1] == "model-00002-of-00003.safetensors"


def test_streamed_safetensors_are_what_save_file_would_hold(tmp_path):
    """write_safetensors writes the header first and then one tensor at a time; safetensors reads it back."""
    from safetensors import safe_open

    from workflow_scripts.export.consolidate import ModelSource
    from workflow_scripts.model.weights import stream, write_sharded

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    model[1].weight.data = model[1].weight.data.to(torch.bfloat16)  # written as fp32
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    files = write_sharded(ModelSource(model), shapes, tmp_path, max_bytes=150)
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"0.weight": files[0], "0.bias": files[1], "1.weight": files[1]}
    assert index["metadata"]["total_size"] == 4 * (35 + 5 + 15)
    read = {}
    for f in files:
        with safe_open(tmp_path / f, "pt") as shard:
            assert shard.metadata() == {"format": "pt"}
            read |= {k: shard.get_tensor(k) for k in shard.keys()}  # noqa: SIM118
    assert read.keys() == shapes.keys() and all(v.dtype == torch.float32 for v in read.values())
    assert all(torch.equal(read[k], v.float()) for k, v in model.state_dict().items())
    with pytest.raises(Exception, match="0.bias: checkpoint has shape"):
        list(stream(ModelSource(model), {"0.bias": torch.Size([4])}))


def test_training_side_model_uses_the_checkpoint_tensors_without_copying(demo_assets):
    """The rebuilt model's parameters are the checkpoint's tensors; tied weights stay tied; same logits."""
    from transformers import AutoModelForCausalLM

    from workflow_scripts.export.consolidate import ModelSource, assign, empty_model, hf_tensors, logits_on
    from workflow_scripts.model.weights import stream

    base = AutoModelForCausalLM.from_pretrained(demo_assets["base"], dtype=torch.float32)
    shapes, _ = hf_tensors(base.config)
    assert "lm_head.weight" not in shapes  # the demo ties it to the embeddings: written once
    source = ModelSource(base)
    model = empty_model(base.config)
    assign(model, stream(source, shapes))
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(params[n].data_ptr() == source.tensors[n].data_ptr() for n in shapes)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.arange(12).reshape(2, 6)
    assert torch.equal(logits_on(model, ids), logits_on(base, ids))
    with pytest.raises(Exception, match="without weights"):
        assign(empty_model(base.config), stream(source, dict(list(shapes.items())[:-1])))


@pytest.mark.parametrize("world", [2, 3])
def test_zero2_lazy_reader_matches_deepspeeds_merge(world):
    """ZeRO 1/2 parameters read from the partitions one at a time equal DeepSpeed's concatenating merge,
    with alignment paddings and parameters that straddle two ranks' partitions."""
    from collections import OrderedDict

    from deepspeed.utils.zero_to_fp32 import _get_fp32_state_dict_from_zero2_checkpoint, zero_model_state

    from workflow_scripts.train.parallel.zero import DeepSpeedSource, zero2_state_dict

    shapes = [
        {"a": torch.Size([3, 5]), "b": torch.Size([7]), "c": torch.Size([2, 2])},
        {"d": torch.Size([11]), "e": torch.Size([4, 3])},
    ]
    paddings = [[1, 0, 2], [0, 3]]
    flat_groups = [[] for _ in range(world)]
    for group, pads in zip(shapes, paddings, strict=True):
        used = sum(s.numel() + p for s, p in zip(group.values(), pads, strict=True))
        total = -(-used // (2 * world)) * 2 * world
        vector = torch.randn(total)
        for rank, part in enumerate(vector.chunk(world)):
            flat_groups[rank].append(part.clone())
    buffers = {"buf": torch.ones(3)}
    models = [zero_model_state(buffers, shapes, [["tied", "a"]], "0.19", None, None)]
    expected = _get_fp32_state_dict_from_zero2_checkpoint(world, flat_groups, models, False, paddings)
    lazy = zero2_state_dict(flat_groups, models, paddings, exclude_frozen=False)
    assert list(lazy) == list(expected)
    source = DeepSpeedSource.__new__(DeepSpeedSource)
    source.tensors, source.folder = lazy, "ckpt"
    read = source.read(list(lazy))
    assert all(torch.equal(read[k], v) for k, v in expected.items())
    assert isinstance(expected, OrderedDict) and set(read) == {"buf", "a", "b", "c", "d", "e", "tied"}
    with pytest.raises(Exception, match="partitions hold"):
        zero2_state_dict([g[:1] for g in flat_groups], [zero_model_state({}, shapes[:1], [], "0.19", None, None)],
                         [[p + 64 for p in paddings[0]]], exclude_frozen=False)  # fmt: skip


@pytest.mark.torchrun
def test_truncated_checkpoint_fails_consolidation_with_one_line(tmp_path, demo_assets):
    _, _ = train_and_consolidate(tmp_path, demo_assets, strategy="ddp", max_steps=4)
    state = json.loads((tmp_path / "train" / "train_state.json").read_text())
    weights = tmp_path / "ckpt"
    target = next(weights.rglob("state.pt"))
    assert str(target).startswith(state["checkpoint"])
    target.write_bytes(target.read_bytes()[:1000])
    proc = consolidate(tmp_path / "train" / "train_state.json", tmp_path / "again")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "state.pt" in last


@pytest.mark.parametrize(
    "size,billions", [("350m", 0.35), ("1b", 1), ("3b", 3), ("7b", 7), ("13b", 13), ("30b", 30), ("70b", 70)]
)
def test_from_scratch_presets_have_their_size(size, billions):
    from transformers import AutoModelForCausalLM

    from workflow_scripts.model.presets import PRESET_NAMES, PRESETS, preset_config

    assert set(PRESETS) == set(PRESET_NAMES)
    config = preset_config(size, 32000, 2048)
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.hidden_act == "silu" and config.rms_norm_eps  # SwiGLU, RMSNorm
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert 0.8 * billions <= n <= 1.2 * billions, n


def memory_config(**kw):
    base = {"strategy": "ddp", "zero_stage": 2, "offload": "none", "peft": "none",
            "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}, "procs_per_node": 8, "precision": "bf16",
            "micro_batch_size": 1, "gradient_checkpointing": False, "gpu_memory_gb": 80}  # fmt: skip
    return PlanConfig.build(base | kw)  # the planner's typed config


def test_preflight_estimate_orders_the_strategies():
    from workflow_scripts.model.presets import preset_config
    from workflow_scripts.plan.preflight import estimate, live_gb

    config = preset_config("7b", 32000, 4096)
    n = 6_500_000_000

    def total(**kw):
        return estimate(config, n, memory_config(**kw), 8, 4096)["total_gb"]

    ddp, zero2, zero3 = total(), total(strategy="deepspeed"), total(strategy="deepspeed", zero_stage=3)
    assert ddp > zero2 > zero3
    # FSDP2 and ZeRO-3 hold the same tensors; FSDP2's plan adds its measured allocator headroom (30%, not 10%)
    fsdp = estimate(config, n, memory_config(strategy="fsdp"), 8, 4096)
    zero3_plan = estimate(config, n, memory_config(strategy="deepspeed", zero_stage=3), 8, 4096)
    assert live_gb(fsdp) == pytest.approx(live_gb(zero3_plan), rel=0.01)
    assert fsdp["per_gpu_gb"]["allocator_headroom"] == pytest.approx(3 * zero3_plan["per_gpu_gb"]["allocator_headroom"])
    assert total(gradient_checkpointing=True) < ddp
    assert total(peft="lora") < ddp / 3
    assert total(strategy="deepspeed", zero_stage=3, offload="all") < zero3
    # 7B full fine-tune under DDP: 16 bytes per parameter does not fit in 80 GB
    assert ddp > 80 and zero3 < 80


def test_preflight_fails_with_advice(tmp_path):
    from conftest import run_main

    from workflow_scripts.plan.preflight import main

    t = memory_config(procs_per_node=1, max_seq_len=4096, demo_vocab_size=32000)
    argv = [
        "--model", "preset:7b",
        "--config", json.dumps(dataclasses.asdict(t)),
        "--output", str(tmp_path / "m.json"), "--table", str(tmp_path / "m.csv"), "--probe-timeout", "0",
    ]  # fmt: skip
    proc = run_main(main, argv)  # its command line, in this process
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "needs about" in last and "training.gpu_memory_gb is 80.0" in last and "fits with training." in last
    plan = json.loads((tmp_path / "m.json").read_text())
    assert plan["fits"] is False
    # every proposal re-planned: checkpointing alone leaves DDP's 16 bytes a parameter, over 80 GB
    first = plan["proposals"][0]
    assert first["change"] == {"gradient_checkpointing": True} and first["gpu_gb"] > 80 and not first["fits"]
    assert any(p["fits"] and p["gpu_gb"] <= 80 and p["proposal"] in last for p in plan["proposals"])


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp16_trains_with_dynamic_loss_scaling(tmp_path, demo_assets, strategy):
    """precision fp16 (GPUs without bf16): a GradScaler; an overflowing first step (scale 2^16 on a
    fresh model) is skipped and logged, not applied; training still learns."""
    cfg = {"precision": "fp16", "strategy": strategy, "lr": 3e-3, "micro_batch_size": 2, "max_steps": 8,
           "log_every": 1, "checkpoint_every": 4}  # fmt: skip
    run_trainer(tmp_path, demo_assets, cfg)
    rows = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all("loss_scale" in r and "skipped_steps" in r for r in rows)
    assert rows[-1]["skipped_steps"] < 8 and rows[-1]["loss"] < rows[0]["loss"]
    assert all(b["skipped_steps"] >= a["skipped_steps"] for a, b in zip(rows, rows[1:], strict=False))
