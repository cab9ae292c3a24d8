"""tokenize_shard: chat template, answer-only labels, length policy, packing, content-addressed cache."""

import json
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import REPO, split_files, tokenize_config, tool_env

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.data.chat_render import ChatRenderer, encode, encode_messages, messages_for
from workflow_scripts.data.packing import pack_best_fit_decreasing, packing_stats
from workflow_scripts.data.tokenization import fit_length
from workflow_scripts.model.demo_model import train_tokenizer

CONVERSATIONS = [
    messages_for("Answer with the number only.", "What is 3 + 4?", "7"),
    messages_for("", "hi", "yes"),
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "two"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["What is 3 + 4? 7 Answer with the number only. first second one two system user assistant"] * 20
    return train_tokenizer(texts, 400)


def test_renderer_matches_apply_chat_template(tokenizer):
    render = ChatRenderer(tokenizer)
    for conv in CONVERSATIONS:
        assert render(conv) == tokenizer.apply_chat_template(conv, tokenize=False)
        gen = tokenizer.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False)
        assert render(conv[:-1], add_generation_prompt=True) == gen


def test_labels_cover_only_the_answers_and_eos(tokenizer):
    (ex,) = encode(tokenizer, ["Answer with the number only."], ["What is 3 + 4?"], ["7"])
    n = ex["prompt_length"]
    assert all(x == IGNORE for x in ex["labels"][:n])
    answer = [t for t in ex["labels"] if t != IGNORE]
    assert answer[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(answer, skip_special_tokens=True) == "7"
    (multi,) = encode_messages(tokenizer, [CONVERSATIONS[2]], train_on="all")
    labelled = tokenizer.decode([t for t in multi["labels"] if t != IGNORE])
    assert labelled == "one<|im_end|>two<|im_end|>"
    (last,) = encode_messages(tokenizer, [CONVERSATIONS[2]])  # data.train_on's default: the last answer only
    assert tokenizer.decode([t for t in last["labels"] if t != IGNORE]) == "two<|im_end|>"


def test_evaluation_prompt_ids_equal_training_prefix(tokenizer):
    """What evaluation feeds the model is exactly the prompt part of the cached training sequence."""
    for conv, ex in zip(CONVERSATIONS, encode_messages(tokenizer, CONVERSATIONS), strict=True):
        prompt = ex["input_ids"][: ex["prompt_length"]]
        # evaluation reads these ids from the same cache; they decode to the generation prompt
        rendered = tokenizer.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(prompt) == rendered
        (again,) = encode_messages(tokenizer, [conv])
        assert again["input_ids"] == ex["input_ids"]


def test_length_policies(tokenizer):
    (ex,) = encode(tokenizer, ["s"], ["q"], ["a long answer " * 10])
    short = ex["prompt_length"] + 2
    assert len(fit_length(ex, short, "truncate")["input_ids"]) == short
    assert fit_length(ex, short, "drop") is None
    with pytest.raises(UserError, match="max_seq_len"):
        fit_length(ex, short, "error")
    assert fit_length(ex, 10_000, "error") is ex


def test_best_fit_decreasing_packs_tightly():
    import random

    rng = random.Random(0)
    lengths = [min(2048, int(rng.paretovariate(1.2) * 60)) for _ in range(5000)]
    bins = pack_best_fit_decreasing(lengths, 2048)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    stats = packing_stats(lengths, bins, 2048)
    assert stats["packing_efficiency"] > 0.98
    assert stats["pad_to_longest_efficiency"] < stats["packing_efficiency"]


def tokenize_argv(tmp_path, shard, tok_dir, cache, name, **config) -> list[str]:
    """tokenization.py's arguments for one shard, its outputs named ``name`` in tmp_path."""
    return [
        "--shard", str(shard),
        "--tokenizer", str(tok_dir), "--config", tokenize_config(max_seq_len=64, cache_dir=str(cache), **config),
        "--output", str(tmp_path / f"{name}.parquet"), "--packing", str(tmp_path / f"{name}.packing.parquet"),
        "--stats", str(tmp_path / f"{name}.json"),
    ]  # fmt: skip


def tokenize_cli(tmp_path, shard, tok_dir, cache, name, **config) -> subprocess.CompletedProcess:
    """tokenization.py on one shard, its command line in a process of its own; fails the test if it fails."""
    cmd = [sys.executable, "-m", "workflow_scripts.data.tokenization", *tokenize_argv(tmp_path, shard, tok_dir, cache,
                                                                                         name, **config)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=tool_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def run_tokenize(tmp_path, shard, tok_dir, cache, name, **config):
    """tokenization.py's main on one shard in this process (conftest.run_main: a new process would import
    transformers again, seconds on 2 cores, for a test of the cache, not of the command line)."""
    from conftest import run_main

    from workflow_scripts.data.tokenization import main

    proc = run_main(main, tokenize_argv(tmp_path, shard, tok_dir, cache, name, **config))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_cache_hits_across_runs_and_misses_on_tokenizer_or_template(tmp_path, tokenizer):
    data = tmp_path / "d.csv"
    pd.DataFrame({"question": [f"What is {i} + 4?" for i in range(50)], "response": ["7"] * 50}).to_csv(
        data, index=False
    )
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    cache = tmp_path / "cache"
    # two runs with different names write the same shard bytes
    shard_a = split_files(tmp_path / "runA", data, nodes=1)["splits"][0]
    shard_b = split_files(tmp_path / "runB", data, nodes=1)["splits"][0]
    assert shard_a.read_bytes() == shard_b.read_bytes()
    first = run_tokenize(tmp_path, shard_a, tok_dir, cache, "a")
    second = run_tokenize(tmp_path, shard_b, tok_dir, cache, "b")
    assert (first["cache"], second["cache"]) == ("miss", "hit")
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))
    # another template: a miss
    template = tmp_path / "template.jinja"
    template.write_text(tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> "))
    assert run_tokenize(tmp_path, shard_a, tok_dir, cache, "c", chat_template=str(template))["cache"] == "miss"
    # another tokenizer: a miss
    other = tmp_path / "tok2"
    train_tokenizer(
        ["completely different text for another vocabulary system user assistant"] * 20, 350
    ).save_pretrained(other)
    assert run_tokenize(tmp_path, shard_a, other, cache, "d")["cache"] == "miss"
    # another shard: a miss
    data2 = tmp_path / "d2.csv"
    pd.DataFrame({"question": ["What is 1 + 1?"], "response": ["2"]}).to_csv(data2, index=False)
    shard_c = split_files(tmp_path / "runC", data2, nodes=1)["splits"][0]
    assert run_tokenize(tmp_path, shard_c, tok_dir, cache, "e")["cache"] == "miss"
    stats = json.loads((tmp_path / "a.json").read_text())
    assert stats["examples"] == pq.read_metadata(shard_a).num_rows  # every row of the shard
    assert 0 < stats["packing_efficiency"] <= 1


def test_cli_logs_progress_lines(tmp_path, tokenizer):
    data = tmp_path / "d.csv"
    pd.DataFrame({"question": [f"What is {i} + 4?" for i in range(30)], "response": ["7"] * 30}).to_csv(
        data, index=False
    )
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    shard = split_files(tmp_path / "split", data, nodes=1)["splits"][0]
    rows = pq.ParquetFile(shard).metadata.num_rows
    proc = tokenize_cli(tmp_path, shard, tok_dir, tmp_path / "cache", "t")
    tokens = json.loads((tmp_path / "t.json").read_text())["tokens"]
    line = next(x for x in proc.stderr.splitlines() if "INFO tokenize node0.parquet: done, " in x)
    assert f"{rows:,}/{rows:,} rows (100%)" in line and f"{tokens:,} tokens (" in line and "\r" not in proc.stderr


def test_the_tokenization_cli_keeps_torch_out_and_tokenizes_as_in_process(tmp_path, tokenizer):
    """chat_render.load_tokenizer: the stage's process never imports torch (a tokenizer needs none), prints
    no advice about it, and its ids and labels equal those of the tokenizer loaded with torch present."""
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    script = REPO / "workflow_scripts" / "data/tokenization.py"
    probe = (
        f"import runpy, sys; sys.path.insert(0, {str(script.parent)!r}); sys.argv[0] = {str(script)!r}\n"
        f"try:\n    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "finally:\n    print('torch:', sys.modules.get('torch'))\n"
    )
    shard = tmp_path / "s.parquet"
    rows = [{"messages": json.dumps(m), "content_hash": str(i), "category": ""} for i, m in enumerate(CONVERSATIONS)]
    pd.DataFrame(rows).to_parquet(shard)
    out = tmp_path / "t.parquet"
    args = ["--config", tokenize_config(cache_dir=""), "--shard", str(shard), "--tokenizer", str(tok_dir)]
    args += ["--output", str(out), "--packing", str(tmp_path / "p.parquet"), "--stats", str(tmp_path / "t.json")]
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=tool_env())
    assert proc.returncode == 0, proc.stderr
    assert "torch: None" in proc.stdout and "PyTorch was not found" not in proc.stderr
    expected = encode_messages(tokenizer, CONVERSATIONS, ChatRenderer(tokenizer))
    got = pq.read_table(out).to_pylist()
    assert [r["input_ids"] for r in got] == [e["input_ids"] for e in expected]
    assert [r["labels"] for r in got] == [e["labels"] for e in expected]
