"""tokenize_shard: chat template, response-only labels, length policy, same ids for evaluation."""

import pandas as pd
import pytest
from demo_model import train_tokenizer
from pipeline_io import UserError
from tokenization import IGNORE, encode, fit_length, messages_for, tokenize_frame


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["What is 3 + 4? 7 Answer with the number only. system user assistant"] * 20
    return train_tokenizer(texts, 400)


def test_labels_cover_only_the_answer_and_eos(tokenizer):
    (ex,) = encode(tokenizer, ["Answer with the number only."], ["What is 3 + 4?"], ["7"])
    n = ex["prompt_length"]
    assert all(x == IGNORE for x in ex["labels"][:n])
    answer = [t for t in ex["labels"] if t != IGNORE]
    assert answer[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(answer, skip_special_tokens=True) == "7"
    assert len(ex["input_ids"]) == len(ex["labels"])


def test_evaluation_prompt_ids_equal_training_prefix(tokenizer):
    """What evaluation feeds the model is exactly the training sequence's prompt part."""
    cases = [("Answer with the number only.", "What is 3 + 4?", "7"), ("", "hi", "yes")]
    for system, user, answer in cases:
        (ex,) = encode(tokenizer, [system], [user], [answer])
        rendered = tokenizer.apply_chat_template(messages_for(system, user), add_generation_prompt=True, tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert ex["input_ids"][: ex["prompt_length"]] == ids


def test_length_policies(tokenizer):
    (ex,) = encode(tokenizer, ["s"], ["q"], ["a long answer " * 10])
    short = ex["prompt_length"] + 2
    assert len(fit_length(ex, short, "truncate")["input_ids"]) == short
    assert fit_length(ex, short, "drop") is None
    with pytest.raises(UserError, match="max_seq_len"):
        fit_length(ex, short, "error")
    assert fit_length(ex, 10_000, "error") is ex


def test_tokenize_frame_counts(tokenizer):
    frame = pd.DataFrame(
        {"prompt": ["s", "s"], "question": ["q", "q2"], "response": ["a", "b " * 200], "content_hash": ["h1", "h2"]}
    )
    out, stats = tokenize_frame(tokenizer, frame, 64, "drop")
    assert stats["examples"] == 1 and stats["dropped_too_long"] == 1
    assert out["length"].tolist() == [len(out["input_ids"][0])]
