"""evaluator.py: the held-out loss during training (training.eval_every) under every strategy on 2 CPU ranks."""

import json

import pytest
import torch
from conftest import run_trainer

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.train.evaluator import eval_batches, label_tokens


@pytest.mark.parametrize("rows,samples,world,size", [(13, None, 2, 2), (100, 13, 2, 4), (5, 50, 3, 1), (8, 8, 2, 4)])
def test_eval_batches_take_the_first_samples_once_with_as_many_passes_on_every_rank(rows, samples, world, size):
    shares = [eval_batches(rows, samples, world, rank, size) for rank in range(world)]
    seen = sorted(i for share in shares for batch in share for i in batch)
    assert seen == list(range(min(rows, samples or rows)))
    assert len({len(share) for share in shares}) == 1  # FSDP2 / ZeRO-3 gather in every forward pass
    assert all(len(batch) <= size for share in shares for batch in share)


def test_label_tokens_are_those_the_shifted_loss_averages_over():
    labels = torch.tensor([[IGNORE, IGNORE, 5, 6, IGNORE], [7, 8, 9, IGNORE, IGNORE]])
    assert label_tokens(labels) == 2 + 2  # row 2's first label predicts nothing


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]


BASE = {"lr": 3e-3, "micro_batch_size": 2, "max_steps": 7, "log_every": 2, "checkpoint_every": 100}


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "extra",
    [
        # one case a strategy module: DDP's own eval_loss (LoRA with dropout: a model left in eval mode
        # changes the training losses), FSDP2's, and DeepSpeed's engine (the base class's, as ZeRO-1/2 use it)
        {"strategy": "ddp", "peft": "lora", "lora": {"r": 4, "dropout": 0.1}},
        {"strategy": "fsdp"},
        {"strategy": "deepspeed", "zero_stage": 3, "peft": "lora", "lora": {"r": 4}},
    ],
    ids=["ddp-lora-dropout", "fsdp", "zero3-lora"],
)
def test_held_out_loss_is_logged_without_changing_the_training_losses(tmp_path, demo_assets, extra):
    run_trainer(tmp_path / "off", demo_assets, BASE | extra)
    run_trainer(tmp_path / "on", demo_assets, BASE | extra | {"eval_every": 3, "eval_samples": 13})
    off, on = records(tmp_path / "off"), records(tmp_path / "on")
    # the evaluations log steps 3 and 6 besides log_every's; the last step is evaluated too
    assert [r["step"] for r in on if "eval_loss" in r] == [3, 6, 7]
    assert [r["step"] for r in on] == [2, 3, 4, 6, 7]
    losses = {r["step"]: r["loss"] for r in on}
    assert [losses[r["step"]] for r in off] == [r["loss"] for r in off]  # exactly: same data order, same RNG
    held_out = [r for r in on if "eval_loss" in r]
    assert all(r["eval_samples"] == 13 and r["eval_tokens"] == held_out[0]["eval_tokens"] > 0 for r in held_out)
    assert held_out[-1]["eval_loss"] < held_out[0]["eval_loss"]
    if extra["strategy"] == "ddp":  # TensorBoard: the held-out loss under eval/
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "on" / "train"))
        events.Reload()
        assert [e.step for e in events.Scalars("eval/loss")] == [3, 6, 7]
        assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([r["eval_loss"] for r in held_out])


@pytest.mark.torchrun
def test_the_last_held_out_loss_is_the_trained_models_token_weighted_loss(tmp_path, demo_assets):
    """The 2 ranks' shares, summed, are one model's loss over the first 13 held-out examples, token-weighted."""
    from conftest import consolidate
    from transformers import AutoModelForCausalLM

    from workflow_scripts.train.batching import collate, load_examples

    run_trainer(tmp_path, demo_assets, BASE | {"eval_every": 100, "eval_samples": 13})
    last = records(tmp_path)[-1]
    assert last["step"] == 7
    out = tmp_path / "model"
    assert consolidate(tmp_path / "train" / "train_state.json", out).returncode == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    examples = load_examples([demo_assets["eval"]], tmp_path / "stores")
    total = tokens = 0.0
    with torch.no_grad():
        for i in range(13):
            batch = collate([examples[i]], model.config.pad_token_id or 0)
            n = label_tokens(batch["labels"])
            total += model(**batch).loss.item() * n
            tokens += n
    assert last["eval_tokens"] == tokens
    assert last["eval_loss"] == pytest.approx(total / tokens, rel=1e-4)
