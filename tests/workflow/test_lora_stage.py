"""The demo's second stage (config/demo_lora.yaml): LoRA on a task family stage 1 never saw, with a
stage-1 node model as its base, ends below its base's eval loss. The demo's own base is random, where
LoRA cannot show that it learns; this is the check that a broken adapter (never trained, never merged,
saved without its weights) would fail."""

import csv
import json

import pandas as pd
import pytest
import yaml
from conftest import DEMO_CSV, REPO, snakemake, tiny_config

from workflow_scripts.core.settings import validated
from workflow_scripts.data.make_demo_data import HELD_OUT_CATEGORY, generate, generate_held_out

LORA_CSV = REPO / "resources" / "demo" / "lora_task.csv"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # as config/demo_lora.yaml


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_demo_data_regenerates_and_the_lora_family_is_held_out():
    """Both files are the generator's output, and no question or category of the LoRA stage is in stage 1's."""
    assert read_rows(DEMO_CSV) == generate(0)
    lora_rows = read_rows(LORA_CSV)
    assert lora_rows == generate_held_out(0)
    assert len(lora_rows) == 512 and {r["category"] for r in lora_rows} == {HELD_OUT_CATEGORY}
    stage1 = read_rows(DEMO_CSV)
    assert HELD_OUT_CATEGORY not in {r["category"] for r in stage1}
    assert not {r["question"] for r in lora_rows} & {r["question"] for r in stage1}
    assert not {r["question"].split(":")[0] for r in lora_rows} & {r["question"].split(":")[0] for r in stage1}


def test_demo_lora_config():
    """Valid; LoRA on stage 1's node0 over the held-out family; a run of its own; and every key stage 1's
    config sets is set again, since --configfile is merged over config/config.yaml."""
    stage1 = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    stage2 = yaml.safe_load((REPO / "config" / "demo_lora.yaml").read_text())
    config = validated(stage2)
    assert config["model"]["name_or_path"] == f"results/{stage1['run']}/models/node0"
    assert config["data"]["path"] == str(LORA_CSV.relative_to(REPO))
    assert config["training"]["peft"] == "lora" and config["run"] != stage1["run"]

    def keys(d, prefix=""):
        return {
            k for key, v in d.items() for k in (keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [prefix + key])
        }

    assert keys(stage1) <= keys(stage2)


@pytest.mark.e2e
def test_lora_on_a_stage1_model_beats_its_base(ddp_run, tmp_path):
    """The tiny stage-1 run's node0 (12 steps) is the base; 24 steps of LoRA on the held-out family lower
    the eval loss (to about 0.81x the base's on 2 cores; an adapter never trained or never merged gives
    1.00x), and the model evaluated is the merged one, its adapter saved beside it."""
    workdir, stage1 = ddp_run
    base = workdir / "results" / stage1["run"] / "models" / "node0"
    config = tiny_config("t-lora", peft="lora", max_steps=24, log_every=8, checkpoint_every=24)
    config |= {"nodes": 1, "model": {"name_or_path": str(base)}}
    config["data"]["path"] = str(LORA_CSV)
    config["training"]["lora"] = {"r": 16, "alpha": 32, "target_modules": TARGETS}
    snakemake(tmp_path, config)
    root = tmp_path / "results" / "t-lora"
    summary = pd.read_csv(root / "eval" / "summary.csv").set_index("model")
    assert summary.index.tolist() == ["base", "node0"]
    assert summary.loc["node0", "eval_loss"] < 0.9 * summary.loc["base", "eval_loss"], summary.to_string()
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
