"""Preference pairs in (data/preference_pairs.py): the preference mapping's forms and rejects, the split, and
tokenization of both sides after the same prompt (two consecutive rows, labels on the answers only)."""

import json

import pyarrow.parquet as pq
import pytest
from conftest import split_files

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.data.mappings import MAPPINGS, column_names, detect_mapping, to_examples
from workflow_scripts.data.preference_pairs import pair_sides
from workflow_scripts.data.split import REASONS
from workflow_scripts.data.tokenization import tokenize_shard
from workflow_scripts.model.demo_model import train_tokenizer

NAMES = column_names("preference", {})
USER, GOOD, BAD = "What is 3 + 4?", "It is 7.", "It is 8."


def pair(record: dict):
    (out,) = to_examples(record, "preference", NAMES)
    return out


def expected(prompt=({"role": "user", "content": USER},)) -> list[dict]:
    return [*prompt, {"role": "assistant", "content": GOOD, "rejected": BAD}]


def test_every_form_of_a_pair_is_read_as_one_conversation():
    text = {"prompt": USER, "chosen": GOOD, "rejected": BAD}
    chat = {
        "chosen": [{"role": "user", "content": USER}, {"role": "assistant", "content": GOOD}],
        "rejected": [{"role": "user", "content": USER}, {"role": "assistant", "content": BAD}],
    }
    conversational = {"prompt": [{"role": "user", "content": USER}], "chosen": [{"role": "assistant", "content": GOOD}],
                      "rejected": [{"role": "assistant", "content": BAD}]}  # fmt: skip
    sharegpt = {"conversations": [{"from": "human", "value": USER}], "chosen": {"from": "gpt", "value": GOOD},
                "rejected": {"from": "gpt", "value": BAD}}  # fmt: skip
    csv_chat = {k: json.dumps(v) for k, v in chat.items()}
    for record in (text, chat, conversational, sharegpt, csv_chat):
        assert pair(record) == (expected(), None), record
    system = {"role": "system", "content": "Be brief."}
    with_system = {k: [system, *v] for k, v in chat.items()}
    assert pair(with_system) == (expected((system, {"role": "user", "content": USER})), None)


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"prompt": USER, "chosen": GOOD, "rejected": " It is  7. "}, "identical_pair"),
        ({"prompt": USER, "chosen": GOOD, "rejected": "  "}, "empty_answer"),
        ({"prompt": USER, "chosen": "", "rejected": BAD}, "empty_answer"),
        ({"prompt": USER, "chosen": GOOD}, "missing_field"),
        ({"chosen": GOOD, "rejected": BAD}, "missing_field"),
        (
            {
                "chosen": [{"role": "user", "content": USER}, {"role": "assistant", "content": GOOD}],
                "rejected": [{"role": "user", "content": "Another?"}, {"role": "assistant", "content": BAD}],
            },
            "prompt_mismatch",
        ),
        (
            {
                "conversations": [{"from": "human", "value": USER}],
                "chosen": {"from": "observation", "value": GOOD},
                "rejected": BAD,
            },
            "bad_turn_order",  # a tool result as the answer, no call before it (data/tool_calls.py)
        ),  # fmt: skip
        ({"prompt": [{"role": "assistant", "content": USER}], "chosen": GOOD, "rejected": BAD}, "bad_turn_order"),
    ],
)
def test_a_bad_pair_is_rejected_with_its_reason(record, reason):
    messages, problem = pair(record)
    assert messages is None and problem[0] == reason and reason in REASONS


def test_auto_finds_pairs_before_sharegpt_and_the_mapping_is_registered():
    assert detect_mapping(["prompt", "chosen", "rejected"]) == ("preference", {})
    assert detect_mapping(["conversations", "chosen", "rejected"]) == ("preference", {})
    assert detect_mapping(["conversations"])[0] == "sharegpt"
    assert MAPPINGS["preference"].required == ("chosen", "rejected")


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"{USER} {GOOD} {BAD} Be brief. Which colour? Blue. Green. system user assistant"] * 20
    return train_tokenizer(texts, 400)


def split_pairs(tmp_path, rows: list[dict]) -> dict:
    """The split of ``rows`` to one node, with a pair of its own as the eval set."""
    data, held_out = tmp_path / "pairs.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out.write_text(json.dumps({"prompt": "Held out?", "chosen": "Yes.", "rejected": "No."}) + "\n")
    return split_files(tmp_path / "split", data, nodes=1, eval_data=str(held_out))


def test_pairs_split_and_tokenize_as_two_rows_after_the_same_prompt(tmp_path, tokenizer):
    rows = [{"prompt": f"{USER} ({i})", "chosen": f"{GOOD} ({i})", "rejected": f"{BAD} ({i})"} for i in range(12)]
    rows += [{"prompt": "Which colour?", "chosen": "Blue.", "rejected": "Blue."}]  # identical
    out = split_pairs(tmp_path, rows)
    rejects = pq.read_table(out["rejects"]).to_pylist()
    assert [(r["reason"], r["source_row"]) for r in rejects] == [("identical_pair", 12)]
    shard = out["splits"][0]
    assert pq.read_table(shard).num_rows == 12
    lengths, stats = tokenize_shard(tokenizer, shard, tmp_path / "tokens.parquet", 128, "truncate")
    tokens = pq.read_table(tmp_path / "tokens.parquet").to_pylist()
    assert len(tokens) == len(lengths) == 24 and stats["examples"] == 24
    for chosen, rejected in zip(tokens[::2], tokens[1::2], strict=True):
        i = chosen["response"].split("(")[1].rstrip(")")
        prompt = [{"role": "user", "content": f"{USER} ({i})"}]
        for row, answer in ((chosen, f"{GOOD} ({i})"), (rejected, f"{BAD} ({i})")):
            conversation = [*prompt, {"role": "assistant", "content": answer}]
            ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
            assert row["input_ids"] == list(ids) and row["response"] == answer
            trained = [t for t in row["labels"] if t != IGNORE]
            assert tokenizer.decode(trained, skip_special_tokens=True).strip() == answer
            assert all(t == IGNORE for t in row["labels"][: row["prompt_length"]])
        assert chosen["prompt_length"] == rejected["prompt_length"]
        assert chosen["content_hash"] == rejected["content_hash"]


def test_the_length_policy_applies_to_the_longer_side(tmp_path, tokenizer):
    long_answer = " ".join([BAD] * 40)
    rows = [{"prompt": USER, "chosen": GOOD, "rejected": long_answer}, {"prompt": "Which colour?", "chosen": "Blue.",
            "rejected": "Green."}]  # fmt: skip
    shard = split_pairs(tmp_path, rows)["splits"][0]
    _, stats = tokenize_shard(tokenizer, shard, tmp_path / "drop.parquet", 48, "drop")
    assert stats["rejected"] == {"too_long": 1} and stats["examples"] == 2
    _, stats = tokenize_shard(tokenizer, shard, tmp_path / "cut.parquet", 48, "truncate")
    cut = pq.read_table(tmp_path / "cut.parquet").to_pylist()
    assert stats["examples"] == 4 and stats["truncated"] == 1 and max(r["length"] for r in cut) == 48


def test_an_sft_row_is_its_own_single_side():
    conversation = [{"role": "user", "content": USER}, {"role": "assistant", "content": GOOD}]
    assert pair_sides(conversation) == [conversation]
    chosen, rejected = pair_sides(expected())
    assert chosen == conversation and rejected[-1] == {"role": "assistant", "content": BAD}


def test_the_eval_set_keeps_a_pairs_chosen_answer_alone(tmp_path, tokenizer):
    from workflow_scripts.data.preference_pairs import has_pairs

    rows = [{"prompt": f"{USER} ({i})", "chosen": f"{GOOD} ({i})", "rejected": f"{BAD} ({i})"} for i in range(4)]
    out = split_pairs(tmp_path, rows)
    shard = out["splits"][0]
    assert has_pairs(shard) and has_pairs(out["eval"])
    _, stats = tokenize_shard(tokenizer, shard, tmp_path / "chosen.parquet", 128, "truncate", chosen_only=True)
    chosen = pq.read_table(tmp_path / "chosen.parquet").to_pylist()
    assert stats["examples"] == 4 and all(r["response"].startswith(GOOD) for r in chosen)


def test_the_demo_pairs_map_without_a_reject():
    """The file is the generator's; each pair is stage 1's answer twice, ending with the chosen and the rejected
    mark (the rule its DPO stage learns); every pair maps."""
    import json

    from conftest import REPO

    from workflow_scripts.data.make_demo_data import CHOSEN_END, PREFERENCE_ROWS, REJECTED_END, generate, preferences

    pairs = preferences(generate())
    assert len(pairs) == PREFERENCE_ROWS
    demo = REPO / "resources" / "demo" / "preferences.jsonl"
    assert [json.loads(line) for line in demo.read_text(encoding="utf-8").splitlines()] == pairs
    assert all(p["chosen"][:-1] == p["rejected"][:-1] for p in pairs)
    assert all(p["chosen"].endswith(CHOSEN_END) and p["rejected"].endswith(REJECTED_END) for p in pairs)
    mapped = [pair(p) for p in pairs]
    assert all(problem is None for _, problem in mapped)
    assert all(m[0]["role"] == "system" and m[-1]["rejected"] != m[-1]["content"] for m, _ in mapped)
