"""Real chat templates (Qwen3, Llama 3): whole-render tokenization, labels, prompts, BOS, rejects.

Token ids are compared, never decoded text. The templates are read in place from
../shared/templates; the tokenizers are small byte-level BPEs trained here that carry
each family's special tokens.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, tokenize_config, trained_runs
from conftest import bpe_tokenizer as shared_bpe_tokenizer
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.data.chat_render import ChatRenderer, encode_messages
from workflow_scripts.data.tokenization import main, tokenize_shard

TEMPLATES = Path(__file__).resolve().parents[3] / "shared" / "templates"
EXAMPLE_LLAMA3 = REPO / "config" / "examples" / "llama3_chat_template.jinja"
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ("<think>", "</think>")  # added tokens, but not special ones: Qwen3's tokenizer_config.json
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PHRASES = (
    "You are a travel agent.", "Where should I fly?", "Try Oslo.", "Copenhagen please?", "Copenhagen it is.",
    "The user wants a destination: Scandinavia is lovely in summer and Copenhagen has good connections.",
    "They asked for Copenhagen.", "What is 3 + 4?", "7", "Answer with the number only.", "Paris.",
    "system", "user", "assistant",
)  # fmt: skip
CORPUS = [*PHRASES, " ".join(PHRASES), "\n".join(PHRASES)] * 20

REASONING = "The user wants a destination: Scandinavia is lovely in summer and Copenhagen has good connections."
MULTI_TURN = [
    {"role": "system", "content": "You are a travel agent."},
    {"role": "user", "content": "Where should I fly?"},
    {"role": "assistant", "content": f"<think>\n{REASONING}\n</think>\n\nTry Oslo."},
    {"role": "user", "content": "Copenhagen please?"},  # shorter than the earlier turn's reasoning
    {"role": "assistant", "content": "<think>\nThey asked for Copenhagen.\n</think>\n\nCopenhagen it is."},
]
SINGLE_TURN = [
    {"role": "system", "content": "Answer with the number only."},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7"},
]


def template(name: str) -> str:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (the shared chat templates are not checked out)")
    return path.read_text()


def bpe_tokenizer(special: list[str], chat_template: str, bos: str | None = None, **tokens) -> PreTrainedTokenizerFast:
    return shared_bpe_tokenizer(CORPUS, special, chat_template, bos, vocab_size=600, **tokens)


@pytest.fixture(scope="module")
def qwen3():
    return bpe_tokenizer(
        QWEN3_SPECIAL,
        added=QWEN3_ADDED,
        chat_template=template("qwen3.jinja"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


@pytest.fixture(scope="module")
def llama3():
    """Llama 3 Instruct: Meta's template, EOS <|eot_id|>."""
    return bpe_tokenizer(
        LLAMA3_SPECIAL, template("llama3_instruct.jinja"), bos="<|begin_of_text|>", eos_token="<|eot_id|>"
    )


@pytest.fixture(scope="module")
def llama3_base():
    """Meta-Llama-3-8B (base, EOS <|end_of_text|>) with config/examples' template, as 001-llama3-8b-fsdp.yaml."""
    return bpe_tokenizer(
        LLAMA3_SPECIAL, EXAMPLE_LLAMA3.read_text(), bos="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generation_prompt_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, **kwargs)["input_ids"]


def encode_one(tokenizer, messages, **kwargs) -> dict:
    render = ChatRenderer(tokenizer, kwargs.pop("template_kwargs", None))
    (ex,) = encode_messages(tokenizer, [messages], render, **kwargs)
    assert "reject" not in ex, ex
    return ex


def test_test_tokenizers_have_the_families_tokens(qwen3, llama3):
    for tokenizer, special in ((qwen3, [*QWEN3_SPECIAL, *QWEN3_ADDED]), (llama3, LLAMA3_SPECIAL)):
        assert all(len(ids(tokenizer, t)) == 1 for t in special)
        assert len(ids(tokenizer, "Copenhagen")) == 1  # one token, so a mis-cut shows


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_renderer_matches_apply_chat_template(qwen3, llama3, llama3_base, kwargs):
    for tokenizer in (qwen3, llama3, llama3_base):
        render = ChatRenderer(tokenizer, kwargs)
        for conv in (MULTI_TURN, SINGLE_TURN):
            assert render(conv) == tokenizer.apply_chat_template(conv, tokenize=False, **kwargs)
            gen = tokenizer.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False, **kwargs)
            assert render(conv[:-1], add_generation_prompt=True) == gen


def test_qwen3_single_turn_thinking_default(qwen3):
    ex = encode_one(qwen3, SINGLE_TURN)
    full = qwen3.apply_chat_template(SINGLE_TURN, tokenize=False)
    assert ex["input_ids"] == ids(qwen3, full)  # the whole render, tokenized as one string
    prompt = generation_prompt_ids(qwen3, SINGLE_TURN)
    assert ex["input_ids"][: ex["prompt_length"]] == prompt
    header = ids(qwen3, "<|im_start|>assistant\n")
    assert prompt[-len(header) :] == header
    # the empty think block the template gives the last turn is part of the answer
    assert trained_runs(ex) == [ids(qwen3, "<think>\n\n</think>\n\n7<|im_end|>")]
    assert ex["labels"][-1] == IGNORE  # the "\n" after <|im_end|> is template scaffolding


def test_qwen3_single_turn_without_thinking(qwen3):
    kwargs = {"enable_thinking": False}
    ex = encode_one(qwen3, SINGLE_TURN, template_kwargs=kwargs)
    prompt = generation_prompt_ids(qwen3, SINGLE_TURN, **kwargs)
    assert ex["input_ids"][: ex["prompt_length"]] == prompt
    header = ids(qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt[-len(header) :] == header
    assert trained_runs(ex) == [ids(qwen3, "7<|im_end|>")]
    # the training sequence is the same text either way; only the prompt/answer boundary moves
    assert ex["input_ids"] == encode_one(qwen3, SINGLE_TURN)["input_ids"]


@pytest.mark.parametrize(
    ("kwargs", "last_turn", "answer"),
    [
        ({}, MULTI_TURN[-1]["content"], "<think>\nThey asked for Copenhagen.\n</think>\n\nCopenhagen it is."),
        ({}, "Copenhagen it is.", "<think>\n\n</think>\n\nCopenhagen it is."),
        ({"enable_thinking": False}, "Copenhagen it is.", "Copenhagen it is."),
    ],
)
def test_qwen3_multi_turn_with_earlier_reasoning(qwen3, kwargs, last_turn, answer):
    """The issue's case: earlier reasoning (longer than the next user turn) is dropped from history."""
    conv = [*MULTI_TURN[:-1], {"role": "assistant", "content": last_turn}]
    full = qwen3.apply_chat_template(conv, tokenize=False, **kwargs)
    assert REASONING not in full and len(REASONING) > len(conv[3]["content"])
    last = encode_one(qwen3, conv, template_kwargs=kwargs)
    every = encode_one(qwen3, conv, template_kwargs=kwargs, train_on="all")
    copenhagen = ids(qwen3, "Copenhagen")
    for ex in (last, every):
        assert ex["input_ids"] == ids(qwen3, full)
        assert ex["input_ids"][: ex["prompt_length"]] == generation_prompt_ids(qwen3, conv, **kwargs)
        # the second user turn: "Copenhagen" one token, <|im_end|> one special token, none of it trained
        turn = ids(qwen3, "<|im_start|>user\nCopenhagen please?<|im_end|>")
        assert turn[:4] == ids(qwen3, "<|im_start|>user\n") + copenhagen
        at = next(i for i in range(len(ex["input_ids"])) if ex["input_ids"][i : i + len(turn)] == turn)
        assert all(y == IGNORE for y in ex["labels"][at : at + len(turn)]) and at + len(turn) <= ex["prompt_length"]
        assert ex["input_ids"].count(qwen3.convert_tokens_to_ids("<|im_end|>")) == 5
    assert trained_runs(last) == [ids(qwen3, answer + "<|im_end|>")]
    # train_on all: the earlier turn as the conversation renders it (no reasoning), then the last
    assert trained_runs(every) == [ids(qwen3, "Try Oslo.<|im_end|>"), ids(qwen3, answer + "<|im_end|>")]
    assert every["prompt_length"] == last["prompt_length"]


def test_qwen3_reasoning_in_the_last_turn_without_thinking_is_a_reject(qwen3):
    """With enable_thinking false the prompt ends in an empty think block the answer does not continue."""
    render = ChatRenderer(qwen3, {"enable_thinking": False})
    (ex,) = encode_messages(qwen3, [MULTI_TURN], render)
    assert ex["reject"][0] == "prompt_mismatch"


def test_llama3_multi_turn_with_system(llama3):
    conv = [
        {"role": "system", "content": "You are a travel agent."},
        {"role": "user", "content": "Where should I fly?"},
        {"role": "assistant", "content": "Try Oslo.  "},  # the template trims it
        {"role": "user", "content": "Copenhagen please?"},
        {"role": "assistant", "content": "Copenhagen it is."},
    ]
    bos, eot = llama3.convert_tokens_to_ids("<|begin_of_text|>"), llama3.convert_tokens_to_ids("<|eot_id|>")
    every = encode_one(llama3, conv, train_on="all")
    last = encode_one(llama3, conv)
    for ex in (every, last):
        # the template writes {{ bos_token }}: exactly one BOS, first
        assert ex["input_ids"][0] == bos and ex["input_ids"].count(bos) == 1
        assert ex["input_ids"] == ids(llama3, llama3.apply_chat_template(conv, tokenize=False))
        assert ex["input_ids"][: ex["prompt_length"]] == generation_prompt_ids(llama3, conv)
        assert ex["input_ids"].count(eot) == 5
    assert trained_runs(every) == [ids(llama3, "Try Oslo.<|eot_id|>"), ids(llama3, "Copenhagen it is.<|eot_id|>")]
    assert trained_runs(last) == [ids(llama3, "Copenhagen it is.<|eot_id|>")]


def test_llama3_example_template_gets_its_bos(llama3_base):
    """config/examples' template writes no BOS; the Llama 3 tokenizer wants one, so it is put first."""
    tok = llama3_base
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert "bos_token" not in EXAMPLE_LLAMA3.read_text()
    conv = [*MULTI_TURN[:2], {"role": "assistant", "content": "Try Oslo."}, *MULTI_TURN[3:4]]
    conv.append({"role": "assistant", "content": "Copenhagen it is."})
    ex = encode_one(tok, conv, train_on="all")
    assert ex["input_ids"][0] == bos and ex["input_ids"].count(bos) == 1
    assert ex["input_ids"] == [bos, *ids(tok, tok.apply_chat_template(conv, tokenize=False))]
    # the prompt is what apply_chat_template gives, with that BOS, which is also what
    # tokenizer(apply_chat_template(..., tokenize=False)) gives at inference
    prompt = ex["input_ids"][: ex["prompt_length"]]
    assert prompt == [bos, *generation_prompt_ids(tok, conv)]
    assert prompt == tok(tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False))["input_ids"]
    end = "<|end_of_text|>"  # the template closes turns with the EOS
    assert trained_runs(ex) == [ids(tok, f"Try Oslo.{end}"), ids(tok, f"Copenhagen it is.{end}")]


def test_qwen3_has_no_bos(qwen3):
    assert qwen3.bos_token is None and ChatRenderer(qwen3).bos_ids("<|im_start|>") == []


RAISING = (  # Gemma-style: no system role
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_raises_is_a_reject(qwen3):
    tok = bpe_tokenizer(
        QWEN3_SPECIAL, added=QWEN3_ADDED, chat_template=RAISING, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    bad, good = encode_messages(tok, [SINGLE_TURN, SINGLE_TURN[1:]])
    assert bad["reject"][0] == "template_error" and "System role not supported" in bad["reject"][1]
    assert trained_runs(good) == [ids(tok, "7<|im_end|>")]


def test_a_merge_across_the_prompt_end_is_a_reject(qwen3):
    """A generation prompt ending in a space merges with the answer when tokenized whole."""
    plain = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tok = bpe_tokenizer(QWEN3_SPECIAL, added=QWEN3_ADDED, chat_template=plain, eos_token="<|im_end|>")
    (ex,) = encode_messages(tok, [SINGLE_TURN])
    assert ex["reject"][0] == "prompt_mismatch"


def test_an_answer_with_the_end_of_turn_token_as_text_is_a_reject(qwen3):
    conv = [*SINGLE_TURN[:2], {"role": "assistant", "content": "7<|im_end|>8"}]
    (ex,) = encode_messages(qwen3, [conv])
    assert ex["reject"][0] == "control_token"


class WithoutBackend:
    """A tokenizer seen without its Rust backend: offsets come from return_offsets_mapping."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


def test_same_examples_with_trimmed_offsets_or_without_backend(qwen3, llama3_base):
    """Offsets that skip whitespace (ByteLevel trim_offsets) or come through transformers change nothing."""
    conv = [*MULTI_TURN[:-1], {"role": "assistant", "content": "Copenhagen it is."}]
    spaced = (  # the answer's first token starts with the space after "assistant:"; trimmed, it does not
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    plain = bpe_tokenizer(QWEN3_SPECIAL, added=QWEN3_ADDED, chat_template=spaced, eos_token="<|im_end|>")
    assert trained_runs(encode_one(plain, SINGLE_TURN)) == [ids(plain, " 7<|im_end|>")]
    for tok in (qwen3, llama3_base, plain):
        expected = encode_messages(tok, [conv, SINGLE_TURN], train_on="all")
        trimmed = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.backend_tokenizer.to_str()))
        trimmed.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
        trimmed.chat_template, trimmed.eos_token = tok.chat_template, tok.eos_token
        # (no BOS post-processor on the copy, so none is expected either)
        bos = 1 if tok.bos_token else 0
        got = encode_messages(trimmed, [conv, SINGLE_TURN], train_on="all")
        assert [e["labels"][bos:] for e in expected] == [e["labels"] for e in got]
        assert [e["prompt_length"] - bos for e in expected] == [e["prompt_length"] for e in got]
        assert encode_messages(WithoutBackend(tok), [conv, SINGLE_TURN], train_on="all") == expected


def write_shard(path: Path, conversations: list[list[dict]]) -> Path:
    n = len(conversations)
    pq.write_table(
        pa.table(
            {
                "messages": [json.dumps(c) for c in conversations],
                "response": [c[-1]["content"] for c in conversations],
                "content_hash": [f"h{i}" for i in range(n)],
                "source_file": ["chats.jsonl"] * n,
                "source_row": list(range(n)),
                "category": [""] * n,
            }
        ),
        path,
    )
    return path


def test_tokenize_shard_rejects_rows_with_file_and_row(tmp_path):
    tok = bpe_tokenizer(
        QWEN3_SPECIAL, added=QWEN3_ADDED, chat_template=RAISING, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    shard = write_shard(tmp_path / "s.parquet", [SINGLE_TURN[1:], SINGLE_TURN, MULTI_TURN[1:]])
    lengths, stats = tokenize_shard(tok, shard, tmp_path / "t.parquet", 256, "truncate")
    assert stats["examples"] == len(lengths) == 2 and stats["rejected"] == {"template_error": 1}
    (reject,) = stats["rejects"]
    assert (reject["source_file"], reject["source_row"], reject["content_hash"]) == ("chats.jsonl", 1, "h1")
    assert pq.read_table(tmp_path / "t.parquet")["content_hash"].to_pylist() == ["h0", "h2"]


def test_cli_train_on_and_template_kwargs_are_in_the_cache_key(tmp_path, qwen3, capsys):
    tok_dir = tmp_path / "tok"
    qwen3.save_pretrained(tok_dir)
    plain_last = [*MULTI_TURN[:-1], {"role": "assistant", "content": "Copenhagen it is."}]
    shard = write_shard(tmp_path / "s.parquet", [SINGLE_TURN, plain_last])

    def run(name, **config):
        config = tokenize_config(max_seq_len=256, cache_dir=str(tmp_path / "cache"), **config)
        main(
            [
                "--shard", str(shard), "--tokenizer", str(tok_dir), "--config", config,
                "--output", str(tmp_path / f"{name}.parquet"),
                "--packing", str(tmp_path / f"{name}.packing.parquet"), "--stats", str(tmp_path / f"{name}.json"),
            ]
        )  # fmt: skip
        return json.loads((tmp_path / f"{name}.json").read_text()), pq.read_table(tmp_path / f"{name}.parquet")

    default, t_default = run("a")
    assert default["settings"]["train_on"] == "last" and default["settings"]["template_kwargs"] == {}
    nothink, t_nothink = run("b", template_kwargs={"enable_thinking": False})
    every, t_every = run("c", train_on="all")
    again, _ = run("d", template_kwargs={"enable_thinking": False})
    assert [s["cache"] for s in (default, nothink, every, again)] == ["miss", "miss", "miss", "hit"]
    assert len({default["key"], nothink["key"], every["key"]}) == 3
    assert t_default["input_ids"].equals(t_nothink["input_ids"])
    think = len(ids(qwen3, "<think>\n\n</think>\n\n"))  # moves from the answer into the prompt
    assert t_nothink["prompt_length"].to_pylist() == [n + think for n in t_default["prompt_length"].to_pylist()]
    assert t_every["labels"] != t_default["labels"]
    with pytest.raises(SystemExit):
        run("e", template_kwargs=[1])
    assert "data.template_kwargs" in capsys.readouterr().err


def test_split_token_counts_match_tokenization(tmp_path, llama3):
    """The fast lengths (balance: tokens) are tokenize_shard's lengths; a row the template rejects counts 0."""
    from workflow_scripts.data.chat_render import render_lengths

    tok = bpe_tokenizer(
        QWEN3_SPECIAL, added=QWEN3_ADDED, chat_template=RAISING, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    convs = [SINGLE_TURN[1:], SINGLE_TURN, MULTI_TURN[1:]]
    render = ChatRenderer(tok, {"enable_thinking": False})
    counts = render_lengths(render, convs)
    encoded = encode_messages(tok, convs, render)
    assert counts == [len(encoded[0]["input_ids"]), 0, len(encoded[2]["input_ids"])] and counts[2]
    assert counts[0] == len(ids(tok, tok.apply_chat_template(convs[0], tokenize=False)))
    # a family with a BOS (Llama 3): counted as tokenize_shard counts it
    convs = [SINGLE_TURN, MULTI_TURN]
    assert render_lengths(ChatRenderer(llama3), convs) == [len(e["input_ids"]) for e in encode_messages(llama3, convs)]


def test_generation_settings_stop_at_the_end_of_turn(qwen3, llama3_base):
    from workflow_scripts.data.chat_render import generation_settings

    settings = generation_settings(qwen3, {"enable_thinking": False})
    assert settings == {
        "eos_token_id": [qwen3.convert_tokens_to_ids("<|im_end|>")],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    stops = generation_settings(llama3_base)["eos_token_id"]
    assert stops == llama3_base.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
