"""Padding-free packed batches: per-sequence losses packed equal unpacked, nothing crosses a boundary."""

import pytest
import torch

from workflow_scripts.core.settings import training_config
from workflow_scripts.train.batching import IGNORE, Batches, DataPlan, collate_packed, load_bins, load_examples
from workflow_scripts.train.metrics_logger import flops_per_sequence_fn
from workflow_scripts.train.train import load_model


def per_token_losses(model, batch) -> torch.Tensor:
    """Cross-entropy of every position predicting the next token (IGNORE where not trained)."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none"
    ).view_as(labels)
    return torch.where(labels == IGNORE, torch.nan, losses)


def sequence_losses_alone(model, seqs) -> list[torch.Tensor]:
    """Each sequence on its own, batch of one, no padding: the reference."""
    out = []
    for ids, lab in seqs:
        batch = {"input_ids": torch.tensor([ids.tolist()]), "labels": torch.tensor([lab.tolist()])}
        out.append(per_token_losses(model, batch)[0])
    return out


def test_collate_packed_restarts_positions_and_masks_boundaries():
    rows = [[([1, 2, 3], [IGNORE, 2, 3]), ([4, 5], [4, 5])], [([6], [6])]]
    batch = collate_packed(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]]
    # the first label of every sequence is masked: 3 is never trained to predict 4
    assert batch["labels"].tolist() == [[IGNORE, 2, 3, IGNORE, 5], [IGNORE] * 5]
    assert "attention_mask" not in batch


@pytest.fixture(scope="module")
def packed_data(demo_assets, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    examples = load_examples([demo_assets["node0"]], tmp_path_factory.mktemp("token-store"))
    bins = load_bins([demo_assets["packing"]], [demo_assets["node0"]])
    models = {
        attn: AutoModelForCausalLM.from_pretrained(demo_assets["base"], dtype=torch.float32, attn_implementation=attn)
        for attn in ("sdpa", "eager")
    }
    for model in models.values():
        model.config.use_cache = False  # as train.load_model does
    return examples, bins, models


def test_training_model_has_no_kv_cache(demo_assets):
    """With a cache, transformers would not derive the packed attention mask from the position ids."""
    model, attn = load_model(str(demo_assets["base"]), training_config(), torch.device("cpu"))
    assert attn == "sdpa" and model.config.use_cache is False


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("one_row", [False, True], ids=["row-per-bin", "one-row"])
def test_packed_per_sequence_losses_equal_unpacked(packed_data, attn, one_row):
    examples, bins, models = packed_data
    model = models[attn].eval()
    chosen = [i for i, b in enumerate(bins) if len(b) >= 3][:3]  # bins holding several sequences
    assert len(chosen) == 3
    batch, lengths = Batches(examples, bins, pad_id=0, one_row=one_row).make(chosen)
    seqs = [examples[j] for i in chosen for j in bins[i]]
    assert lengths == [len(ids) for ids, _ in seqs]
    assert batch["input_ids"].shape[0] == (1 if one_row else 3)
    packed = per_token_losses(model, batch)
    alone = sequence_losses_alone(model, seqs)

    # walk the packed rows in the same order as the sequences were laid out
    rows = (
        [[seq for i in chosen for seq in (examples[j] for j in bins[i])]]
        if one_row
        else [[examples[j] for j in bins[i]] for i in chosen]
    )
    k = 0
    for r, row in enumerate(rows):
        at = 0
        for ids, _ in row:
            got = packed[r, at : at + len(ids) - 1]  # predictions inside the sequence
            want = alone[k]
            assert torch.equal(got.isnan(), want.isnan())
            torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5)
            if at > 0:  # the token before a sequence is never trained to predict its first token
                assert packed[r, at - 1].isnan()
            at += len(ids)
            k += 1
    assert k == len(seqs)

    # the training loss is the token-weighted mean of the per-sequence losses
    with torch.no_grad():
        loss = model(**batch).loss
    reference = torch.cat([t[~t.isnan()] for t in alone]).mean()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)


def test_changing_one_sequence_leaves_its_neighbours_untouched(packed_data):
    examples, bins, models = packed_data
    model = models["sdpa"].eval()
    i = next(i for i, b in enumerate(bins) if len(b) >= 3)
    batch, _ = Batches(examples, bins, pad_id=0, one_row=False).make([i])
    first = len(examples[bins[i][0]][0])
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, :first] = (changed["input_ids"][0, :first] + 7) % model.config.vocab_size
    before, after = per_token_losses(model, batch), per_token_losses(model, changed)
    torch.testing.assert_close(before[0, first:].nan_to_num(), after[0, first:].nan_to_num(), atol=0, rtol=0)


def test_packing_fills_bins_and_cuts_steps(packed_data):
    examples, bins, _ = packed_data
    padded = DataPlan(len(examples), 2, 8, 1, 1.0, None)
    packed = DataPlan(len(bins), 2, 8, 1, 1.0, None)
    assert len(bins) < len(examples) / 2  # the demo's short examples share bins of 128 tokens
    assert packed.steps_per_epoch < padded.steps_per_epoch
    assert all(sum(len(examples[j][0]) for j in b) <= 128 for b in bins)


def test_a_plan_that_does_not_cover_the_shard_is_refused(tmp_path, demo_assets):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflow_scripts.core.pipeline_io import UserError

    pq.write_table(pa.table({"bin": [0], "examples": [[0, 1]]}), tmp_path / "plan.parquet")
    with pytest.raises(UserError, match="plan.parquet: packing plan does not cover the .* examples of node0.parquet"):
        load_bins([tmp_path / "plan.parquet"], [demo_assets["node0"]])


def test_plans_of_several_shards_index_the_concatenation(demo_assets):
    import pyarrow.parquet as pq

    one = [b.tolist() for b in load_bins([demo_assets["packing"]], [demo_assets["node0"]])]
    two = [b.tolist() for b in load_bins([demo_assets["packing"]] * 2, [demo_assets["node0"]] * 2)]
    n = pq.ParquetFile(demo_assets["node0"]).metadata.num_rows
    assert len(one) > 1 and two == one + [[i + n for i in b] for b in one]


def test_model_flops_count_matmuls_and_attention(packed_data):
    _, _, models = packed_data
    model = models["sdpa"]
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    flops = flops_per_sequence_fn(model, n)
    embed = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    attention = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim
    assert flops([10]) == 6 * (n - embed) * 10 + attention * 100
    # packing two sequences of 10 costs less attention than one of 20
    assert flops([10, 10]) == 2 * flops([10]) < flops([20])
