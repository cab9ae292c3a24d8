"""The demo's second stage (config/demo_lora.yaml): LoRA on task families stage 1 never saw (repeating letters,
and repeat_letters tool calls), with a stage-1 node model as its base, ends below its base's eval loss and makes
tool calls its base cannot. The demo's own base is random, where LoRA cannot show that it learns; this is the
check that a broken adapter (never trained, never merged, saved without its weights) would fail."""

import csv
import json

import pandas as pd
import pytest
import yaml
from conftest import DEMO_CSV, REPO, snakemake, tiny_config

from workflow_scripts.core.settings import validated
from workflow_scripts.data.make_demo_data import (
    ANSWERED,
    HELD_OUT_CATEGORY,
    REPEAT_ROWS,
    TOOL_CATEGORY,
    TOOL_NAME,
    TOOL_ROWS,
    generate,
    generate_held_out,
)

LORA_DATA = REPO / "resources" / "demo" / "lora_task.jsonl"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # as config/demo_lora.yaml


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def user_question(row):
    return next(t["content"] for t in row["messages"] if t["role"] == "user")


def test_demo_data_regenerates_and_the_lora_family_is_held_out():
    """Both files are the generator's output, and no question or category of the LoRA stage is in stage 1's; the
    tool rows call repeat_letters with the question's letters, and about a quarter go on to the tool's answer."""
    assert read_rows(DEMO_CSV) == generate(0)
    lora_rows = read_jsonl(LORA_DATA)
    assert lora_rows == generate_held_out(0)
    by_category = {c: [r for r in lora_rows if r["category"] == c] for c in (HELD_OUT_CATEGORY, TOOL_CATEGORY)}
    assert len(by_category[HELD_OUT_CATEGORY]) == REPEAT_ROWS and len(by_category[TOOL_CATEGORY]) == TOOL_ROWS
    assert len(lora_rows) == REPEAT_ROWS + TOOL_ROWS
    stage1 = read_rows(DEMO_CSV)
    assert not {HELD_OUT_CATEGORY, TOOL_CATEGORY} & {r["category"] for r in stage1}
    questions = [user_question(r) for r in lora_rows]
    assert not set(questions) & {r["question"] for r in stage1}
    assert not {q.split(":")[0] for q in questions} & {r["question"].split(":")[0] for r in stage1}
    for row in by_category[TOOL_CATEGORY]:
        call = row["messages"][1]["tool_calls"][0]["function"]
        assert call["name"] == row["tools"][0]["function"]["name"] == TOOL_NAME
        assert f'"{json.loads(call["arguments"])["letters"]}"' in user_question(row)
    answered = sum(len(r["messages"]) == 4 for r in by_category[TOOL_CATEGORY])
    assert abs(answered / len(by_category[TOOL_CATEGORY]) - ANSWERED) < 0.1


def test_the_demo_template_renders_the_tool_rows(tmp_path):
    """The demo model's chat template renders a conversation without tools as plain ChatML, as before, and the
    LoRA stage's tool rows in its compact layout: every row fits data.max_seq_len 128 untruncated (overlength:
    error), and each held-out conversation ending with a call has that call, parsed, as its reference (what the
    tool_call score compares with)."""
    from conftest import split_files

    from workflow_scripts.data.chat_render import messages_for
    from workflow_scripts.data.tokenization import tokenize_shard
    from workflow_scripts.data.tool_calls import calls_in_text
    from workflow_scripts.model.demo_model import texts_from, train_tokenizer

    tokenizer = train_tokenizer(texts_from(str(DEMO_CSV)), 1024)
    plain = messages_for("S", "Q", "A")
    chatml = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    assert tokenizer.apply_chat_template(plain, tokenize=False) == chatml
    out = split_files(tmp_path / "split", LORA_DATA, nodes=1)
    assert out["mapping"] == "chat" and out["reasons"] == {}
    _, stats = tokenize_shard(tokenizer, out["splits"][0], tmp_path / "t.parquet", 128, "error")
    _, eval_stats = tokenize_shard(tokenizer, out["eval"], tmp_path / "e.parquet", 128, "error")
    assert stats["rejected"] == eval_stats["rejected"] == {}
    assert stats["examples"] + eval_stats["examples"] == REPEAT_ROWS + TOOL_ROWS
    held_out = pd.read_parquet(tmp_path / "e.parquet")
    calls = [calls_in_text(text) for text in held_out["response"] if text.startswith("{")]
    assert len(calls) >= 5 and all(len(c) == 1 and c[0][0] == TOOL_NAME for c in calls)
    assert all(len(c[0][1]["letters"]) == 5 for c in calls)  # "c a f"


def test_demo_lora_config():
    """Valid; LoRA on stage 1's node0 over the held-out family; a run of its own; and every key stage 1's
    config sets is set again, since --configfile is merged over config/config.yaml."""
    stage1 = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    stage2 = yaml.safe_load((REPO / "config" / "demo_lora.yaml").read_text())
    config = validated(stage2)
    assert config["model"]["name_or_path"] == f"results/{stage1['run']}/models/node0"
    assert config["data"]["path"] == str(LORA_DATA.relative_to(REPO))
    assert config["training"]["peft"] == "lora" and config["run"] != stage1["run"]

    def keys(d, prefix=""):
        return {
            k for key, v in d.items() for k in (keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [prefix + key])
        }

    assert keys(stage1) <= keys(stage2)


@pytest.mark.e2e
def test_lora_on_a_stage1_model_beats_its_base(ddp_run, tmp_path):
    """The tiny stage-1 run's node0 (12 steps) is the base; 24 steps of LoRA on the held-out families lower
    the eval loss (to about 0.67x the base's on 2 cores; an adapter never trained or never merged gives
    1.00x), and the model evaluated is the merged one, its adapter saved beside it. The held-out conversations
    that end with a call get a tool_call score, 0 for the base, which never makes the call (the demo's stage
    1 node0 neither; its LoRA stage takes it to about 0.9: docs/demo.md)."""
    workdir, stage1 = ddp_run
    base = workdir / "results" / stage1["run"] / "models" / "node0"
    config = tiny_config("t-lora", peft="lora", max_steps=24, log_every=8, checkpoint_every=24)
    config |= {"nodes": 1, "model": {"name_or_path": str(base)}}
    config["data"] |= {"path": str(LORA_DATA), "train_on": "all"}  # as config/demo_lora.yaml
    config["training"]["lora"] = {"r": 16, "alpha": 32, "target_modules": TARGETS}
    config["eval"] |= {"max_new_tokens": 48}  # a call is 42 tokens
    snakemake(tmp_path, config)
    root = tmp_path / "results" / "t-lora"
    summary = pd.read_csv(root / "eval" / "summary.csv").set_index("model")
    assert summary.index.tolist() == ["base", "node0"]
    assert summary.loc["node0", "eval_loss"] < 0.9 * summary.loc["base", "eval_loss"], summary.to_string()
    assert summary["tool_call"].notna().all() and summary.loc["base", "tool_call"] == 0, summary.to_string()
    consolidation = json.loads((root / "models" / "node0" / "consolidation.json").read_text())
    assert consolidation["peft"] == "lora" and consolidation["lora_b_tensors"] == 4 * len(TARGETS)  # 4 layers
    assert (root / "models" / "node0" / "adapter" / "adapter_model.safetensors").exists()
    # the adapter names its base by absolute path, and both folders carry a model card (model_card.py)
    from huggingface_hub import ModelCard

    adapter = json.loads((root / "models" / "node0" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(base.resolve()) and adapter["revision"] is None
    for folder, library in (("node0", "transformers"), ("node0/adapter", "peft")):
        card = ModelCard.load(root / "models" / folder / "README.md")
        assert (card.data.base_model, card.data.library_name) == ("node0", library)
        assert "| optimizer steps | 24 " in card.text and "it is not on the Hugging Face Hub" in card.text
