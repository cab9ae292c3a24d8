"""Models that travel: every consolidated folder carries a model card (README.md) that huggingface_hub reads back
as written, and a LoRA adapter names its base so that peft's AutoPeftModelForCausalLM loads it from another
working directory: by the hub id and commit when the base came from the hub (its snapshot folder in a Hugging
Face cache), else by the absolute path, never the checkout-relative path training was given.

The checkpoints are written as test_consolidate.py writes them (a DDP ``state.pt``, no torchrun); the loading
is checked in a fresh interpreter started in another folder, offline, with its own Hugging Face cache.
"""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import BIN, tool_env
from huggingface_hub import ModelCard
from test_consolidate import tiny_base, write_checkpoint

from workflow_scripts.core.settings import training_config
from workflow_scripts.export.model_card import (
    Base,
    base_of,
    card_data,
    card_text,
    hub_datasets,
    hub_snapshot,
    node_base,
    soup_card_text,
    training_summary,
)

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "acme/tiny-chat"
LORA = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}


def lora_state(steps: int = 4) -> dict:
    """A train_state.json as train.py writes it (config and plan) for a LoRA run."""
    cfg = dataclasses.asdict(training_config({"peft": "lora", **LORA}))
    plan = {"examples": 459, "tokens": 15752, "steps_per_epoch": 38, "global_batch": 4, "total_steps": steps,
            "world_size": 2, "nodes": 1, "strategy": "ddp", "peft": "lora"}  # fmt: skip
    return {"checkpoint": "x", "step": steps, "strategy": "ddp", "peft": "lora", "config": cfg, "plan": plan}


MANIFEST = {
    "rows_in": 512,
    "nodes": [{"node": 0, "rows": 459}],
    "sources": [
        {"path": "resources/demo/lora_task.csv", "sha256": "d2" * 32},
        {"path": f"/home/u/.cache/huggingface/hub/datasets--acme--letters/snapshots/{SHA}/train.parquet",
         "sha256": "ab" * 32},
    ],
}  # fmt: skip
METRICS = [{"step": 370, "loss": 0.05}, {"step": 380, "loss": 0.04, "eval_loss": 0.041}, {"step": 380}]


def test_a_cache_snapshot_names_its_hub_repo_and_a_local_path_becomes_absolute(tmp_path, monkeypatch):
    snapshot = f"/scratch/hf/hub/models--{REPO_ID.replace('/', '--')}/snapshots/{SHA}"
    assert hub_snapshot(snapshot) == (REPO_ID, SHA)
    assert hub_snapshot(snapshot + "/config.json") == (REPO_ID, SHA)
    assert hub_snapshot(f"/c/models--gpt2/snapshots/{SHA}") == ("gpt2", SHA)  # a repo without an owner
    assert hub_snapshot("/c/models--acme--x/snapshots/main") is None  # not a commit
    assert hub_snapshot(snapshot, "dataset") is None
    assert base_of(snapshot) == Base(hub_id=REPO_ID, revision=SHA)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "demo" / "models" / "node0").mkdir(parents=True)
    local = base_of("results/demo/models/node0")
    assert local == Base(path=str(tmp_path / "results" / "demo" / "models" / "node0"))
    assert local.name == "node0" and local.reference == local.path and Path(local.path).is_absolute()


def test_the_training_summary_reads_state_plan_metrics_and_manifest():
    summary = training_summary(lora_state(380), METRICS, MANIFEST)
    assert summary["steps"] == 380 and summary["strategy"] == "ddp" and summary["examples"] == 459
    assert summary["tokens_seen"] == 157520  # 10 epochs of 15,752 tokens
    assert summary["lora"] == {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    assert summary["train_loss"] == {"step": 380, "value": 0.04}
    assert summary["eval_loss"] == {"step": 380, "value": 0.041}
    assert summary["data"]["rows_in"] == 512 and hub_datasets(summary) == ["acme/letters"]
    bare = training_summary({"step": 2, "strategy": "fsdp", "peft": "none", "config": {}})  # nothing else written
    assert bare == {"strategy": "fsdp", "peft": "none", "steps": 2}


@pytest.mark.parametrize("adapter", [False, True], ids=["model", "adapter"])
@pytest.mark.parametrize("base", [Base(hub_id=REPO_ID, revision=SHA), Base(path="/data/models/node0")],
                         ids=["hub", "local"])  # fmt: skip
def test_the_card_loads_back_with_its_metadata(tmp_path, base, adapter):
    summary = training_summary(lora_state(380), METRICS, MANIFEST)
    where = str(tmp_path / "node0" / ("adapter" if adapter else ""))
    text = card_text(base, summary, where, adapter, None if adapter else {"dtype": "bfloat16", "files": ["a"]})
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    written = card_data(base, summary, adapter).to_dict()
    assert card.data.to_dict() == written
    assert written["base_model"] == (REPO_ID if base.hub_id else "node0")
    assert written["library_name"] == ("peft" if adapter else "transformers")
    assert written["pipeline_tag"] == "text-generation" and written["datasets"] == ["acme/letters"]
    assert written["base_model_relation"] == ("adapter" if adapter else "finetune")
    assert "model-index" not in written and "model-index is left out" in card.text.replace("`", "")
    if base.hub_id:
        assert f"https://huggingface.co/{REPO_ID}) at commit `{SHA}`" in card.text
    else:
        assert "a local model, `/data/models/node0`: it is not on the Hugging Face Hub" in card.text
        assert "local-base-model" in written["tags"]
    loading = [line for line in card.text.splitlines() if "from_pretrained(" in line or line.startswith("from ")]
    assert len(loading) == 2 and all(json.dumps(where) in line for line in loading[1:])
    if adapter:
        assert loading[0] == "from peft import AutoPeftModelForCausalLM"
        assert f"names that base as `{base.reference}`" in card.text
    else:
        assert "| weights written | bfloat16 (a) |" in card.text
    for row in ("| optimizer steps | 380 (38 an epoch, global batch 4) |", "| tokens seen | about 157,520",
                "| data rows | 459 examples trained on |", "| final held-out loss | 0.041 (step 380) |",
                "| packing | yes |"):  # fmt: skip
        assert row in card.text


def test_a_soup_card_names_the_base_its_node_models_cards_name(tmp_path):
    summary = training_summary(lora_state(380), METRICS, MANIFEST)
    nodes = []
    for i in range(2):
        nodes.append(tmp_path / f"node{i}")
        nodes[-1].mkdir()
        (nodes[-1] / "README.md").write_text(card_text(Base(hub_id=REPO_ID, revision=SHA), summary, str(nodes[-1])))
    assert node_base(nodes) == (REPO_ID, ["acme/letters"])
    where = str(tmp_path / "soup_greedy")
    text = soup_card_text(where, ["node1", "node0"], *node_base(nodes))
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.to_dict() == {"base_model": REPO_ID, "datasets": ["acme/letters"], "library_name": "transformers",
                                   "pipeline_tag": "text-generation", "tags": ["llm-finetune-workflow", "model-soup",
                                   "merge"]}  # fmt: skip
    assert "best held-out loss first" in card.text and "Members: node1, node0 (each fine-tuned from" in card.text
    assert f"AutoModelForCausalLM.from_pretrained({json.dumps(where)})" in card.text
    (nodes[1] / "README.md").unlink()  # a node consolidated before cards: no base named
    assert node_base(nodes) == (None, [])


# ---------------------------------------------------------------- consolidation, and loading from elsewhere

LOAD = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
ids = torch.arange(3, 19).reshape(1, 16)
diffs = []
for adapter, merged in json.loads(sys.argv[1]):
    with torch.no_grad():
        a = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    diffs.append((a - b).abs().max().item())
print(json.dumps(diffs))
"""


def consolidate_lora(run_root: Path, base, output: Path) -> dict:
    """A LoRA checkpoint over ``base`` (trained: random non-zero adapter) consolidated by the script's main, as
    the rule runs it; the train_state.json written, with a plan, beside metrics.jsonl, the run's manifest above."""
    from workflow_scripts.export.consolidate import main, rebuild

    cfg = dataclasses.asdict(training_config({"peft": "lora", **LORA}))
    model = rebuild({"base_model": str(base), "config": cfg})
    gen = torch.Generator().manual_seed(3)
    adapter = {n: 0.05 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters() if p.requires_grad}
    train_dir = run_root / "train" / "node0"
    state = write_checkpoint(train_dir, base, adapter, peft="lora", **LORA)
    state["plan"] = lora_state(4)["plan"]
    (train_dir / "train_state.json").write_text(json.dumps(state))
    (train_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    (run_root / "data").mkdir()
    (run_root / "data" / "manifest.json").write_text(json.dumps(MANIFEST))
    main(["--state", str(train_dir / "train_state.json"), "--output", str(output)])
    return state


def test_consolidated_folders_carry_cards_and_the_adapter_loads_from_elsewhere(tmp_path, monkeypatch):
    """Two LoRA runs: one over a local base named relative to the checkout (as config/demo_lora.yaml names
    results/demo/models/node0), one over a hub model's snapshot in a Hugging Face cache (as fetch_model leaves
    it). From another folder, offline, AutoPeftModelForCausalLM loads each adapter and gives the merged
    model's logits."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    tiny_base(checkout / "results" / "demo" / "models" / "node0", torch.float32)
    local_out = checkout / "results" / "demo-lora" / "models" / "node0"
    consolidate_lora(checkout / "results" / "demo-lora", Path("results/demo/models/node0"), local_out)

    hf_home = tmp_path / "hf"
    snapshot = hf_home / "hub" / "models--acme--tiny-chat" / "snapshots" / SHA
    tiny_base(tmp_path / "hub-model", torch.float32, seed=1)
    shutil.copytree(tmp_path / "hub-model", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(SHA)
    hub_out = checkout / "results" / "h" / "models" / "node0"
    consolidate_lora(checkout / "results" / "h", snapshot, hub_out)

    local = json.loads((local_out / "adapter" / "adapter_config.json").read_text())
    assert local["base_model_name_or_path"] == str(checkout / "results" / "demo" / "models" / "node0")
    assert local["revision"] is None
    hub = json.loads((hub_out / "adapter" / "adapter_config.json").read_text())
    assert (hub["base_model_name_or_path"], hub["revision"]) == (REPO_ID, SHA)

    for out, name in ((local_out, "node0"), (hub_out, REPO_ID)):
        for folder, library in ((out, "transformers"), (out / "adapter", "peft")):
            card = ModelCard.load(folder / "README.md")
            assert card.data.base_model == name and card.data.library_name == library
            assert "| data rows | 459 examples trained on |" in card.text
    assert "it is not on the Hugging Face Hub" in (local_out / "README.md").read_text()
    assert "| weights written | float32 (model.safetensors) |" in (hub_out / "README.md").read_text()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cases = [[str(out / "adapter"), str(out)] for out in (local_out, hub_out)]
    env = tool_env() | {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_ENDPOINT", None)
    proc = subprocess.run([str(BIN / "python"), "-c", LOAD, json.dumps(cases)], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(diffs) == 2 and all(d < 1e-4 for d in diffs), diffs
