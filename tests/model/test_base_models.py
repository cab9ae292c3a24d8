"""Base models without a chat template or a pad token (Llama 2, Mistral v0.1, Qwen3 base), the plain
data.format_template, special-token text in the data (data.special_text), and the exported folder's
template and generation config.

The tokenizers are small byte-level BPEs trained here: ``llama2_base`` has a BOS that its post-processor
puts before any text, EOS ``</s>``, no pad token and no chat template; ``qwen3_base`` has EOS
``<|endoftext|>`` while its (ChatML) turns end with ``<|im_end|>``, and no pad token. Models are tiny
random Llamas. Token ids are compared, never decoded text.
"""

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from conftest import bpe_tokenizer, snakemake, split_files, tiny_config, tokenize_config, trained_runs
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.data.chat_format import (
    ZERO_WIDTH_SPACE,
    SpecialText,
    format_chat_template,
    format_list,
    format_prompt,
    parse_format,
    special_texts,
)
from workflow_scripts.data.chat_render import (
    ChatRenderer,
    encode_messages,
    generation_settings,
    render_lengths,
    use_template,
)

FORMAT = "{system}### Question:\n{question}\n### Answer:\n"
QA = [
    ("What is the capital of France?", "Paris"),
    ("What is 3 + 4?", "7"),
    ("Name a large ocean.", "The Pacific Ocean"),
    ("What colour is the sky?", "Blue"),
    ("Which planet is red?", "Mars"),
    ("What do bees make?", "Honey"),
]
ROWS = [(f"{q} (variant {i})", a) for i in range(12) for q, a in QA]  # 72 distinct questions
CORPUS = [FORMAT, *(f"{q}\n{a}" for q, a in ROWS), "Answer briefly. system user assistant"] * 5
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bpe(special: list[str], bos: str | None = None, **tokens) -> PreTrainedTokenizerFast:
    return bpe_tokenizer(CORPUS, special, None, bos, vocab_size=500, **tokens)


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def save_model(folder: Path, tokenizer, seed: int = 0) -> Path:
    tiny_llama(tokenizer, seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps({"prompt": None, "question": q, "response": a}) + "\n" for q, a in rows))
    return path


@pytest.fixture(scope="module")
def llama2_base():
    tok = bpe(["<s>", "</s>", "<unk>", "<|endoftext|>"], bos="<s>", eos_token="</s>", unk_token="<unk>")
    assert tok.chat_template is None and tok.pad_token is None
    return tok


@pytest.fixture(scope="module")
def qwen3_base():
    tok = bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, llama2_base):
    """A tiny random Llama with the llama2_base tokenizer: no chat template, no pad token."""
    return save_model(tmp_path_factory.mktemp("llama2-base") / "model", llama2_base)


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, base_dir):
    """The rows split and tokenized through the scripts' command lines with data.format_template."""
    from workflow_scripts.data.split import main as split_main
    from workflow_scripts.data.tokenization import main as tokenize_main

    root = tmp_path_factory.mktemp("tokenized")
    data = write_jsonl(root / "data.jsonl", [*ROWS, ("Say hi", "hi<|endoftext|>")])
    splits = [root / "node0.parquet", root / "node1.parquet"]
    config = {"path": str(data), "nodes": 2, "eval_fraction": 0.2}
    split_main(
        ["--config", json.dumps(config), "--tokenizer", str(base_dir),
         "--splits", *map(str, splits), "--eval", str(root / "eval.parquet"),
         "--rejects", str(root / "rejects.parquet"), "--manifest", str(root / "manifest.json")]
    )  # fmt: skip
    for shard in ("node0", "eval"):
        tokenize_main(
            ["--shard", str(root / f"{shard}.parquet"), "--tokenizer", str(base_dir),
             "--config", tokenize_config(format_template=FORMAT, max_seq_len=256, special_text="strip"),
             "--output", str(root / f"{shard}.tok.parquet"),
             "--packing", str(root / f"{shard}.packing.parquet"), "--stats", str(root / f"{shard}.json")]
        )  # fmt: skip
    return root


# ---------------------------------------------------------------- the plain format


def test_format_template_renders_as_python_formats(base_dir):
    fmt = 'Sys: {system}|"q" \\ {{x}} é😀\t{question}\n#A:\n'
    tok = use_template(AutoTokenizer.from_pretrained(base_dir), "t", None, fmt)
    conv = chat(("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2"))
    text = tok.apply_chat_template(conv, tokenize=False)
    assert text == "<s>" + format_prompt(fmt, "Q1", "S") + "A1</s>" + format_prompt(fmt, "Q2") + "A2</s>"
    assert format_prompt(fmt, "Q", "S") == 'Sys: S|"q" \\ {x} é😀\tQ\n#A:\n'
    prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False)
    assert text.startswith(prompt) and prompt.endswith(format_prompt(fmt, "Q2"))
    assert ChatRenderer(tok)(conv) == text  # the workflow's renderer agrees
    # no BOS wanted: none written
    assert not format_chat_template(fmt).count("bos_token")


@pytest.mark.parametrize(
    ("fmt", "needle"),
    [
        ("Q: {answer}\n", "unknown placeholder {answer}"),
        ("Q: {question!r}\n", "unknown placeholder {question!r}"),
        ("Q: {system}\n", "no {question}"),
        ("Question: {question}\nAnswer: ", "ends with a space"),
        ("Q: {question\n", "literal braces"),
    ],
)
def test_bad_format_templates_are_one_line(fmt, needle):
    with pytest.raises(UserError, match="data.format_template") as e:
        parse_format(fmt)
    assert needle in str(e.value)


def test_labels_are_the_answer_and_eos_and_the_prompt_is_the_format(tokenized, llama2_base, base_dir):
    tok = llama2_base
    render = ChatRenderer(use_template(AutoTokenizer.from_pretrained(base_dir), "t", None, FORMAT))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    rows = pq.read_table(tokenized / "node0.tok.parquet").to_pylist()
    shard = {r["content_hash"]: r for r in pq.read_table(tokenized / "node0.parquet").to_pylist()}
    assert len(rows) == len(shard) > 10
    for row in rows:
        question = json.loads(shard[row["content_hash"]]["messages"])[0]["content"]
        prompt = [bos, *ids(tok, format_prompt(FORMAT, question))]
        assert row["input_ids"][: row["prompt_length"]] == prompt
        assert trained_runs(row) == [ids(tok, row["response"]) + [eos]]
        assert row["input_ids"].count(bos) == 1 and row["input_ids"][-1] == eos
        messages = json.loads(shard[row["content_hash"]]["messages"])
        assert render_lengths(render, [messages]) == [row["length"]]  # balance: tokens counts what tokenize made


def test_multi_turn_in_the_format(base_dir):
    tok = use_template(AutoTokenizer.from_pretrained(base_dir), "t", None, FORMAT)
    conv = chat(("user", "What is 3 + 4?"), ("assistant", "7"), ("user", "Which planet is red?"), ("assistant", "Mars"))
    (ex,) = encode_messages(tok, [conv], ChatRenderer(tok), train_on="all")
    assert trained_runs(ex) == [ids(tok, "7</s>"), ids(tok, "Mars</s>")]
    prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True)["input_ids"]
    assert ex["input_ids"][: ex["prompt_length"]] == prompt
    (bad,) = encode_messages(tok, [[{"role": "tool", "content": "x"}, *conv]], ChatRenderer(tok))
    assert bad["reject"][0] == "template_error" and "tool" in bad["reject"][1]


def test_no_template_is_one_line(tmp_path, base_dir, capsys):
    """At tokenization; at the split too under balance: tokens, the one case it reads the tokenizer."""
    from workflow_scripts.data.split import main as split_main
    from workflow_scripts.data.tokenization import main as tokenize_main

    data = write_jsonl(tmp_path / "d.jsonl", ROWS[:5])
    config = {"path": str(data), "nodes": 1, "eval_fraction": 0.5, "balance": "tokens"}
    split = ["--tokenizer", str(base_dir), "--splits", str(tmp_path / "n.parquet"),
             "--eval", str(tmp_path / "e.parquet"), "--rejects", str(tmp_path / "r.parquet"),
             "--manifest", str(tmp_path / "m.json")]  # fmt: skip
    tokenize = ["--shard", str(tmp_path / "n.parquet"), "--tokenizer", str(base_dir), "--config", tokenize_config(),
                "--output", str(tmp_path / "t.parquet"), "--packing", str(tmp_path / "p.parquet"),
                "--stats", str(tmp_path / "s.json")]  # fmt: skip
    for run in (
        lambda: split_main(["--config", json.dumps(config), *split]),
        lambda: split_main(["--config", json.dumps(config | {"balance": "rows"}), *split]) or tokenize_main(tokenize),
    ):
        with pytest.raises(SystemExit) as e:
            run()
        assert e.value.code == 2
        err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
        assert len(err) == 1 and "has no chat template" in err[0]
    assert "data.chat_template" in err[0] and "data.format_template" in err[0]
    with pytest.raises(UserError, match="both set"):
        use_template(AutoTokenizer.from_pretrained(base_dir), "t", str(tmp_path / "x.jinja"), FORMAT)


# ---------------------------------------------------------------- special-token text


def tokenize_policy(tmp: Path, data: Path, base_dir, policy: str) -> tuple[dict, list[dict], list[dict]]:
    """Split ``data`` to one node (no tokenizer: the split leaves special text alone) and tokenize the
    shard and the eval set under data.special_text ``policy``: (the stats by shard, the kept
    conversations, the rejects)."""
    from workflow_scripts.data.tokenization import main as tokenize_main

    out = split_files(tmp, data, nodes=1)
    assert "special_text" not in out["reasons"]
    stats, kept, rejects = {}, [], []
    for shard in (out["splits"][0], out["eval"]):
        tokenize_main(
            ["--shard", str(shard), "--tokenizer", str(base_dir),
             "--config", tokenize_config(format_template=FORMAT, max_seq_len=256, special_text=policy,
                                         max_reject_fraction=1.0),
             "--output", str(shard.with_suffix(".tok.parquet")), "--packing", str(shard.with_suffix(".pack.parquet")),
             "--stats", str(shard.with_suffix(".json")), "--rejects", str(shard.with_suffix(".rej.parquet"))]
        )  # fmt: skip
        stats[shard.stem] = json.loads(shard.with_suffix(".json").read_text())
        kept += pq.read_table(shard.with_suffix(".tok.parquet")).to_pylist()
        rejects += pq.read_table(shard.with_suffix(".rej.parquet")).to_pylist()
    return stats, kept, rejects


def test_special_text_policies(tmp_path, base_dir):
    """data.special_text is tokenization's, with the tokenizer's own special tokens: reject, strip, escape."""
    rows = [*ROWS[:20], ("Say hi", "hi<|endoftext|>"), ("Repeat </s> please", "ok"), ("Only", "</s>")]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    stats, kept, rejects = tokenize_policy(tmp_path / "reject", data, base_dir, "reject")
    assert sorted(r["reason"] for r in rejects) == ["special_text"] * 3
    assert sum(s["rejected"].get("special_text", 0) for s in stats.values()) == 3
    assert len(kept) == len(rows) - 3  # rows in = rows out + rejects
    found = [s["special_text"] for s in stats.values() if s["special_text"]["rows"]]
    assert sum(f["rows"] for f in found) == 3 and all(f["policy"] == "reject" for f in found)
    assert "<|endoftext|>" in stats["node0"]["special_text"]["tokens"]
    for policy, hi, repeat in (
        ("strip", "hi", "Repeat  please"),
        ("escape", f"hi<{ZERO_WIDTH_SPACE}|endoftext|>", f"Repeat <{ZERO_WIDTH_SPACE}/s> please"),
    ):
        stats, kept, rejects = tokenize_policy(tmp_path / policy, data, base_dir, policy)
        assert sum(s["special_text"]["rows"] for s in stats.values()) == 3
        # strip leaves the third row's answer empty: rejected as such, never trained on an empty answer
        assert [r["reason"] for r in rejects] == (["empty_response"] if policy == "strip" else [])
        assert len(kept) + len(rejects) == len(rows)
        assert [r["response"] for r in kept if r["response"].startswith("hi")] == [hi]
        tok = AutoTokenizer.from_pretrained(base_dir)
        prompts = [tok.decode(r["input_ids"][: r["prompt_length"]]) for r in kept]
        assert sum(repeat in p for p in prompts) == 1
    # escaped text is plain text to the tokenizer: no special token in it
    tok = AutoTokenizer.from_pretrained(base_dir)
    escaped = ids(tok, f"hi<{ZERO_WIDTH_SPACE}|endoftext|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in escaped and len(escaped) > 3


def test_the_split_reads_no_tokenizer_under_balance_rows(tmp_path, monkeypatch):
    """balance: rows never loads a tokenizer (a new base model reruns tokenization, not the split)."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("the split loaded a tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    data = write_jsonl(tmp_path / "d.jsonl", [*ROWS[:10], ("Say hi", "hi<|im_end|>")])
    out = split_files(tmp_path / "s", data, nodes=1, tokenizer="/nonexistent/model")
    assert out["reasons"] == {} and out["rows_in"] == 11


def test_special_texts_are_the_tokenizers_special_tokens(llama2_base, qwen3_base):
    assert special_texts(llama2_base) == ["</s>", "<s>", "<unk>", "<|endoftext|>"]
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(special_texts(qwen3_base))
    check = SpecialText(["<|im_end|>", "<|im_end|>x"], "strip")
    assert check([{"role": "user", "content": "a<|im_end|>xb"}])[0][0]["content"] == "ab"  # longest first
    with pytest.raises(UserError, match="data.special_text"):
        SpecialText([], "drop")


def test_exact_match_compares_like_with_like(llama2_base):
    """The held-out task's process_results takes every special token's text out of answers and references."""
    from workflow_scripts.evals.heldout import heldout_tasks

    frame = pd.DataFrame({"input_ids": [[1, 5]], "labels": [[-100, 5]], "prompt_length": [1], "response": ["x"]})
    (generation, _), _ = heldout_tasks(frame, llama2_base, 4, {})
    cases = [("hi", "hi<|endoftext|>"), (" Paris<|endoftext|>", "Paris"), ("7", "7</s>")]
    pairs = [generation["process_results"]({"response": r}, [p])["exact_match"] for p, r in cases]
    assert generation["metric_list"][0]["aggregation"](pairs) == 1.0


# ---------------------------------------------------------------- no pad token: evaluation and soup


def test_evaluation_without_a_pad_token(tmp_path, base_dir, tokenized):
    from workflow_scripts.evals.evaluation import main as evaluate_main
    from workflow_scripts.evals.heldout import stop_ids

    tok = AutoTokenizer.from_pretrained(base_dir)
    assert tok.pad_token_id is None
    evaluate_main(
        ["--model", str(base_dir), "--name", "base", "--eval", str(tokenized / "eval.tok.parquet"),
         "--config", json.dumps({"batch_size": 3, "max_new_tokens": 4}),
         "--output", str(tmp_path / "base.json"), "--lm-eval-output", str(tmp_path / "lm_eval.json")]
    )  # fmt: skip
    result = json.loads((tmp_path / "base.json").read_text())
    assert result["examples"] > 1 and result["label_tokens"] > 0 and result["eval_loss"] > 0
    assert "exact_match" in result
    model = LlamaForCausalLM.from_pretrained(base_dir)
    assert stop_ids(model, tok) == [tok.eos_token_id]


def test_generation_stops_at_the_templates_end_of_turn(qwen3_base):
    from workflow_scripts.evals.heldout import stop_ids

    eot, eos = qwen3_base.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model = tiny_llama(qwen3_base)
    assert set(stop_ids(model, qwen3_base)) == {eos, eot}
    bare = bpe(["<|endoftext|>"], eos_token="<|endoftext|>")  # no chat template at all: still the EOS
    assert generation_settings(bare) == {"eos_token_id": [eos], "chat_template_kwargs": {}}


def test_soup_without_a_pad_token(tmp_path, llama2_base, tokenized):
    from workflow_scripts.export.soup import main as soup_main

    paths, results = [], []
    for i, loss in enumerate([2.0, 1.0]):
        paths.append(save_model(tmp_path / f"node{i}", llama2_base, seed=i))
        results.append(tmp_path / f"node{i}.json")
        results[-1].write_text(json.dumps({"model": f"node{i}", "eval_loss": loss}))
    soup_main(
        ["--models", *map(str, paths), "--results", *map(str, results),
         "--eval", str(tokenized / "eval.tok.parquet"), "--uniform", str(tmp_path / "u"),
         "--greedy", str(tmp_path / "g")]
    )  # fmt: skip
    trail = json.loads((tmp_path / "g" / "soup.json").read_text())["trail"]
    assert trail[0]["added"] == "node1" and trail[1]["tried"] == "node0"


# ---------------------------------------------------------------- the exported folder


def test_exported_folder_carries_the_training_template(tmp_path, base_dir, tokenized):
    from workflow_scripts.export.consolidate import save_metadata

    out = tmp_path / "model"
    save_metadata(str(base_dir), out, {"format_template": FORMAT, "template_kwargs": {"style": "short"}})
    trained = use_template(AutoTokenizer.from_pretrained(base_dir), "t", None, FORMAT)
    exported = AutoTokenizer.from_pretrained(out)
    assert exported.chat_template == trained.chat_template
    assert (out / "chat_template.jinja").read_text() == trained.chat_template
    shard = {r["content_hash"]: r for r in pq.read_table(tokenized / "eval.parquet").to_pylist()}
    for row in pq.read_table(tokenized / "eval.tok.parquet").to_pylist():
        messages = json.loads(shard[row["content_hash"]]["messages"])
        prompt = exported.apply_chat_template(messages[:-1], add_generation_prompt=True)["input_ids"]
        assert prompt == row["input_ids"][: row["prompt_length"]]
        assert exported.apply_chat_template(messages)["input_ids"] == row["input_ids"]
    generation = GenerationConfig.from_pretrained(out)
    eos = exported.eos_token_id
    assert generation.eos_token_id == eos and generation.pad_token_id == eos
    assert generation.chat_template_kwargs == {"style": "short"}


def test_exported_folder_with_a_template_file_and_end_of_turn_stops(tmp_path, qwen3_base):
    from workflow_scripts.export.consolidate import save_metadata

    base = tmp_path / "qwen3-base"
    bare = bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|endoftext|>")
    save_model(base, bare)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    save_metadata(str(base), tmp_path / "out", {"chat_template": str(template), "template_kwargs": {}})
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == CHATML
    generation = GenerationConfig.from_pretrained(tmp_path / "out")
    eos, eot = bare.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert generation.eos_token_id == [eos, eot] and generation.pad_token_id == eos
    assert getattr(generation, "chat_template_kwargs", None) is None


# ---------------------------------------------------------------- the workflow's config


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({}, "has no chat template"),
        ({"format_template": FORMAT, "chat_template": "x.jinja"}, "both set"),
        ({"format_template": "Q: {answer}\n"}, "unknown placeholder"),
        ({"format_template": FORMAT}, None),
    ],
    ids=["no-template", "both", "bad-format", "format"],
)
def test_config_checks_the_template_at_parse_time(tmp_path, base_dir, data, needle):
    config = tiny_config("t")
    config["model"] = {"name_or_path": str(base_dir)}
    config["data"] |= data
    proc = snakemake(tmp_path, config, "-n", "-p", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if needle is None:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert '"format_template": "{system}### Question:' in proc.stdout + proc.stderr  # verbatim in the jobs
        return
    assert proc.returncode != 0 and len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_base_model_trains_evaluates_and_exports_with_the_plain_format(tmp_path, base_dir, llama2_base):
    """The issue's case end to end: a base model without template or pad token, T0-style answers ending
    in a literal <|endoftext|> (stripped), data.format_template; the exported template is the training one."""
    data = write_jsonl(tmp_path / "data.jsonl", [(q, a + "<|endoftext|>") for q, a in ROWS])
    config = tiny_config("b", procs_per_node=1, max_steps=4, log_every=2, checkpoint_every=4)
    config["nodes"] = 1
    config["model"] = {"name_or_path": str(base_dir)}
    config["data"] = {"path": str(data), "max_seq_len": 128, "format_template": FORMAT, "special_text": "strip"}
    config["data"]["template_kwargs"] = {"style": "short"}
    snakemake(tmp_path / "w", config)
    root = tmp_path / "w" / "results" / "b"
    report = json.loads((root / "data" / "report.json").read_text())
    assert report["special_text"]["rows"] == len(ROWS) and report["rejected"] == 0
    model = root / "models" / "node0"
    trained = use_template(AutoTokenizer.from_pretrained(base_dir), "t", None, FORMAT)
    assert AutoTokenizer.from_pretrained(model).chat_template == trained.chat_template
    generation = GenerationConfig.from_pretrained(model)
    assert generation.eos_token_id == llama2_base.eos_token_id and generation.chat_template_kwargs == {"style": "short"}
    summary = pd.read_csv(root / "eval" / "summary.csv")
    assert summary["model"].tolist() == ["base", "node0"]


# Stanford Alpaca's own prompts (tatsu-lab/stanford_alpaca, train.py's PROMPT_DICT); its training text is
# the prompt, the output and the EOS.
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def test_alpaca_prompts_reproduce_the_originals_text(base_dir):
    """data.format_template as a list with the record's own fields: Alpaca's prompt with an input when
    the record has one, the one without otherwise, exactly as its train.py writes them."""
    from workflow_scripts.data.mappings import column_names, to_examples

    tok = use_template(AutoTokenizer.from_pretrained(base_dir), "t", None, [ALPACA_INPUT, ALPACA_NO_INPUT])
    render = ChatRenderer(tok)
    names = column_names("alpaca", {})
    for record in (
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Name a colour.", "input": "", "output": "Blue"},
    ):
        ((conv, problem),) = to_examples(record, "alpaca", names)
        original = (ALPACA_INPUT if record["input"] else ALPACA_NO_INPUT).format_map(record)
        assert problem is None
        assert (
            render(conv)
            == tok.apply_chat_template(conv, tokenize=False)
            == "<s>" + original + record["output"] + "</s>"
        )
        assert format_prompt([ALPACA_INPUT, ALPACA_NO_INPUT], conv[0]["content"], fields=conv[0]["fields"]) == original
    # the exported model given a plain conversation: the instruction is the turn's text, no input
    plain = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False)
    assert plain == "<s>" + ALPACA_NO_INPUT.format(instruction="Name a colour.")
    # strip and escape reach the fields the prompt is written from
    special = SpecialText(["</s>"], "strip")
    ((conv, _),) = to_examples({"instruction": "Say", "input": "a</s>b", "output": "ok"}, "alpaca", names)
    fixed, _ = special(conv)
    assert fixed[0]["fields"]["input"] == "ab" and "</s>" not in render(fixed)[:-4]
    with pytest.raises(UserError, match="non-empty list"):
        format_list([])
