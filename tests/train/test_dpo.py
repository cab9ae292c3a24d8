"""training.objective dpo: pairs in the batch, the keys it adds, and DPO training under torchrun (2 CPU ranks)."""

import dataclasses
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import run_trainer, sigterm_then_rerun_equals_uninterrupted_run

from workflow_scripts.core.contracts import IGNORE, TOKENIZED_SCHEMA
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import recorded_config, training_config
from workflow_scripts.train.batching import pair_rows
from workflow_scripts.train.checkpoint import run_key
from workflow_scripts.train.objective import DPO, objective_for, pairs


def test_a_batch_holds_every_chosen_row_then_every_rejected():
    assert pair_rows([3, 0, 5]) == [6, 0, 10, 7, 1, 11]


def test_sft_keeps_its_checkpoint_key_and_train_state_and_dpo_keys_its_settings():
    sft = training_config({})
    assert sft.objective == "sft" and not pairs(sft)
    before = {k: v for k, v in dataclasses.asdict(sft).items() if k not in ("objective", "dpo")}
    assert recorded_config(sft) == before
    key = run_key(sft, 2, "data", "base", None)
    assert run_key(dataclasses.replace(sft, dpo={**sft.dpo, "beta": 0.3}), 2, "data", "base", None) == key
    dpo = training_config({"objective": "dpo", "peft": "lora", "packing": False})
    assert pairs(dpo) and recorded_config(dpo)["dpo"]["loss"] == "sigmoid"
    other_beta = dataclasses.replace(dpo, dpo={**dpo.dpo, "beta": 0.3})
    assert len({key, run_key(dpo, 2, "data", "base", None), run_key(other_beta, 2, "data", "base", None)}) == 3


def test_dpo_settings_are_checked_before_any_work():
    with pytest.raises(UserError, match="adapters_off needs training.peft lora"):
        objective_for(training_config({"objective": "dpo", "packing": False}))
    with pytest.raises(UserError, match="packing false"):
        objective_for(training_config({"objective": "dpo", "peft": "lora"}))
    reference_free = training_config({"objective": "dpo", "packing": False, "dpo": {"loss": "simpo"}})
    assert objective_for(reference_free).reference is None
    with pytest.raises(UserError, match="training.dpo.loss"):
        training_config({"objective": "dpo", "dpo": {"loss": "kto"}})
    assert isinstance(objective_for(reference_free), DPO)


def pairs_from(tokenized, out, most: int = 128) -> int:
    """Preference pairs from an SFT shard's first ``most`` examples: each chosen as it is, rejected with its answer
    reversed."""
    rows = pq.read_table(tokenized).to_pylist()[:most]
    pairs = []
    for row in rows:
        ids, labels = row["input_ids"], row["labels"]
        answer = [i for i, label in enumerate(labels) if label != IGNORE]
        if len(answer) < 4:
            continue
        worse = list(ids)
        for at, token in zip(answer, reversed([ids[i] for i in answer]), strict=True):
            worse[at] = token
        if worse == ids:
            continue
        rejected = [worse[i] if labels[i] != IGNORE else IGNORE for i in range(len(ids))]
        pairs += [row, row | {"input_ids": worse, "labels": rejected}]
    pq.write_table(pa.Table.from_pylist(pairs, schema=TOKENIZED_SCHEMA), out)
    return len(pairs) // 2


@pytest.fixture(scope="module")
def pair_assets(tmp_path_factory, demo_assets):
    """demo_assets with a node0 shard of pairs (pairs_from) and its reference log-probabilities, cached."""
    from workflow_scripts.train.reference_logps import compute_file

    root = tmp_path_factory.mktemp("pairs")
    assets = dict(demo_assets) | {"node0": root / "pairs.parquet", "reference": root / "reference.parquet"}
    assert pairs_from(demo_assets["node0"], assets["node0"]) >= 16
    first = compute_file(assets["node0"], str(demo_assets["base"]), assets["reference"], root / "cache")
    again = compute_file(assets["node0"], str(demo_assets["base"]), root / "again.parquet", root / "cache")
    assert (first["cache"], again["cache"]) == ("miss", "hit") and first["key"] == again["key"]
    assert (root / "again.parquet").read_bytes() == assets["reference"].read_bytes()
    return assets


# adapters_off on DDP; the cached reference on every strategy below (ZeRO-3, FSDP2), full and LoRA
@pytest.mark.torchrun
def test_dpo_with_lora_trains_on_ddp_and_the_loss_falls(tmp_path, pair_assets):
    """Two CPU ranks, DPO's sigmoid loss against the model with its adapters off: log 2 at the first step (the
    adapters start at zero, so policy = reference), then falling, with TRL's metrics in metrics.jsonl."""
    config = {
        "objective": "dpo", "dpo": {"beta": 0.5}, "peft": "lora", "lora": {"r": 4}, "strategy": "ddp",
        "packing": False, "micro_batch_size": 4, "max_steps": 8, "log_every": 1, "lr": 1e-2, "warmup_ratio": 0.0,
    }  # fmt: skip
    run_trainer(tmp_path, pair_assets, config)
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    last = records[-1]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert math.isfinite(last[name])
    assert last["rewards/margins"] > 0 and last["rewards/accuracies"] > 0.5
    state = json.loads((tmp_path / "train" / "train_state.json").read_text())
    assert state["config"]["objective"] == "dpo" and state["plan"]["pairs"] >= 16


def test_reference_logps_are_each_rows_answer_under_the_base_model(pair_assets):
    from transformers import AutoModelForCausalLM

    from workflow_scripts.core.pipeline_io import file_sha256
    from workflow_scripts.train.batching import collate
    from workflow_scripts.train.preference import answer_logps
    from workflow_scripts.train.reference_file import read_logps

    rows = pq.read_table(pair_assets["node0"]).to_pylist()
    logps = read_logps(pair_assets["reference"], pair_assets["node0"], file_sha256(pair_assets["node0"]), len(rows))
    model = AutoModelForCausalLM.from_pretrained(pair_assets["base"]).eval()
    batch = collate([(r["input_ids"], r["labels"]) for r in rows[:3]], 0)
    with torch.no_grad():
        want, _ = answer_logps(model(input_ids=batch["input_ids"]).logits, batch["labels"])
    np.testing.assert_allclose(logps[:3], want.double().numpy(), rtol=1e-4)
    with pytest.raises(UserError, match="another tokenized shard"):
        read_logps(pair_assets["reference"], pair_assets["node0"], "0" * 64, len(rows))


def falls_from_log_2(tmp, tolerance: float) -> None:
    """The policy starts as the reference (log 2 at the first step: the cached reference read for the right rows),
    then the loss falls."""
    losses = [json.loads(line)["loss"] for line in (tmp / "train" / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] == pytest.approx(math.log(2), abs=tolerance)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses


@pytest.mark.torchrun
def test_dpo_full_finetuning_with_the_cached_reference_trains_on_fsdp(tmp_path, pair_assets):
    """Full fine-tuning on FSDP2 (2 CPU ranks) against the reference_logps file: log 2 at the first step (the policy
    is the reference), then falling."""
    config = {
        "objective": "dpo", "dpo": {"beta": 0.5, "reference": "cached"}, "strategy": "fsdp", "packing": False,
        "micro_batch_size": 4, "max_steps": 8, "log_every": 1, "lr": 1e-3, "warmup_ratio": 0.0,
    }  # fmt: skip
    run_trainer(tmp_path, pair_assets, config)  # with --reference-logps: pair_assets has its reference
    falls_from_log_2(tmp_path, 1e-3)


# The strategies and fine-tunings the two tests above leave out, each with the cached reference: ZeRO-3 full and
# LoRA (its parameters partitioned: the step gathers them), FSDP2 with LoRA; DDP's full fine-tuning runs in the
# resume test below and through the workflow (tests/workflow/test_dpo_stage.py). Fewer steps than above, a higher
# learning rate: each start of DeepSpeed is the most of its time.
@pytest.mark.torchrun
@pytest.mark.parametrize(
    "strategy,peft,lr",
    [("deepspeed", "none", 2e-3), ("deepspeed", "lora", 5e-3), ("fsdp", "lora", 5e-3)],
    ids=["zero3-full", "zero3-lora", "fsdp-lora"],
)
def test_dpo_trains_with_the_cached_reference(tmp_path, pair_assets, strategy, peft, lr):
    config = {
        "objective": "dpo", "dpo": {"beta": 0.5, "reference": "cached"}, "strategy": strategy, "zero_stage": 3,
        "peft": peft, "lora": {"r": 4}, "packing": False, "micro_batch_size": 4, "max_steps": 6, "log_every": 1,
        "lr": lr, "warmup_ratio": 0.0,
    }  # fmt: skip
    run_trainer(tmp_path, pair_assets, config)
    falls_from_log_2(tmp_path, 1e-3)


@pytest.mark.torchrun
def test_dpo_sigterm_then_rerun_equals_uninterrupted_run(tmp_path, pair_assets):
    """Preemption as SFT's (tests/train/test_resume.py), with pairs: the resumed run's pair batches, their cached
    reference rows and its weights are the uninterrupted run's, bit for bit (DDP with LoRA: the cheapest start;
    the pairs' order and reference rows are the objective's part of the resume, the same on every strategy)."""
    cfg = {
        "objective": "dpo", "dpo": {"beta": 0.5, "reference": "cached"}, "strategy": "ddp", "peft": "lora",
        "lora": {"r": 4}, "packing": False, "micro_batch_size": 2, "max_steps": 10, "log_every": 1,
        "checkpoint_every": 4, "lr": 1e-2, "seed": 3,
    }  # fmt: skip
    sigterm_then_rerun_equals_uninterrupted_run(tmp_path, pair_assets, cfg, "ddp")


def test_the_cached_reference_is_required_and_read_for_the_shard(tmp_path, pair_assets):
    from workflow_scripts.train.batching import TrainingData

    cfg = training_config({"objective": "dpo", "dpo": {"reference": "cached"}, "packing": False})
    with pytest.raises(UserError, match="needs a --reference-logps file for each of its 1 shard"):
        TrainingData(cfg, [pair_assets["node0"]], None, 2, 0, tmp_path / "store")
    data = TrainingData(cfg, [pair_assets["node0"]], None, 2, 0, tmp_path / "store", [pair_assets["reference"]])
    data.bind(pad_id=0, one_row=False)
    batch, _ = next(data.micro_batches(0))
    assert (
        batch["ref_logps"].shape == (2 * cfg.micro_batch_size,)
        and batch["input_ids"].shape[0] == 2 * cfg.micro_batch_size
    )


@pytest.mark.parametrize(
    "dpo", [{"reference": "adapters_off"}, {"reference": "cached"}], ids=["adapters_off", "cached"]
)
def test_the_planners_probe_runs_the_dpo_step(dpo):
    """The fake-tensor probe runs train_step with the objective: a DPO micro-batch is micro_batch_size pairs, two
    sequences each, so its activations outgrow SFT's at the same micro_batch_size."""
    from transformers import Qwen3Config

    from workflow_scripts.core.settings import PlanConfig
    from workflow_scripts.plan.memory_probe import probe

    shape = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, head_dim=16,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    keys = {"max_seq_len": 64, "micro_batch_size": 2, "strategy": "ddp", "packing": False, "peft": "lora",
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}  # fmt: skip
    sft = probe(shape, PlanConfig.build(keys), 2)
    pairs = probe(shape, PlanConfig.build(keys | {"objective": "dpo", "dpo": dpo}), 2)
    assert pairs["activations_peak_bytes"] > 1.5 * sft["activations_peak_bytes"]
    assert pairs["components_bytes"]["params"] == sft["components_bytes"]["params"]


def test_held_out_preference_accuracy_is_trls_reward_accuracy(tmp_path, pair_assets):
    """preference_eval's metrics: against the base model itself every margin is 0 (accuracy 0, as TRL's
    rewards/accuracies at step 0); the shares are over pairs; the file is summarize's extra task."""
    from workflow_scripts.evals.preference_eval import evaluate, preference_metrics
    from workflow_scripts.report.summarize import summary_table, with_tasks

    m = preference_metrics(np.array([-1.0, -3.0, -2.0, -1.0]), np.array([-2.0, -2.0, -2.0, -2.0]), beta=0.5)
    assert m["accuracy"] == 0.5 and m["margin"] == pytest.approx(0.5 * ((1 + 1) + (0 - 1)) / 2)
    assert m["chosen_likelier"] == 0.5 and m["accuracy_stderr"] == pytest.approx(0.5 / math.sqrt(2))
    base = evaluate(str(pair_assets["base"]), pair_assets["node0"], pair_assets["reference"], beta=0.1)
    assert base["accuracy"] == 0 and base["margin"] == 0 and 0 <= base["chosen_likelier"] <= 1
    results = [{"model": "base", "eval_loss": 2.0, "exact_match": 0.0, "tasks": {}},
               {"model": "node0", "eval_loss": 1.0, "exact_match": 0.5}]  # fmt: skip
    extra = [{"model": m, "tasks": {"preference": {"accuracy": a, "accuracy_stderr": 0.1}}} for m, a in
             (("base", 0.0), ("node0", 0.75))]  # fmt: skip
    table = summary_table(with_tasks(results, extra))
    assert table["preference.accuracy"].tolist() == [0.0, 0.75]
