"""publish: a consolidated model goes to the hub as exactly its files (weights, config, generation config,
tokenizer, chat template, card), its LoRA adapter as a repo of its own, never .snakemake_timestamp or
consolidation.json; what went up is recorded; the published card carries model-index from the evaluation.

The hub is tests/hub_server.py (the fetch stage's, HF_ENDPOINT) answering the upload API as the hub does (plain
LFS: HF_HUB_DISABLE_XET=1). The script runs as the rule runs it, in a fresh interpreter; the model is read back
through the same server with snapshot_download and AutoModelForCausalLM.from_pretrained at the recorded commit.
"""

import hashlib
import json
import subprocess

import pytest
import torch
from conftest import BIN, planned_jobs, snakemake, tiny_config, tool_env
from hub_server import HubServer
from test_consolidate import tiny_base

from workflow_scripts.export.model_card import Base, card_text, training_summary
from workflow_scripts.export.publish import eval_results, published_card, published_files

TOKEN = "hf_test_write_token"
REPO_ID, ADAPTER_REPO = "acme/tiny-chat-sft", "acme/tiny-chat-sft-lora"
SHA = "0123456789abcdef0123456789abcdef01234567"
RESULT = {"model": "node0", "path": "results/h/models/node0", "examples": 12, "eval_loss": 1.25, "perplexity": 3.49,
          "exact_match": 0.25, "rouge_l": 0.5, "bleu": 0.0, "chrf": 0.4, "tool_call": float("nan"),
          "tasks": {"demo_mc": {"acc": 0.75, "acc_stderr": 0.1, "acc_norm": 0.5}}}  # fmt: skip
# the model's files as consolidate_node leaves them, and what is published of them
MODEL = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "README.md"]  # fmt: skip
HOME = [".snakemake_timestamp", "consolidation.json"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny consolidated model folder: a Qwen3's save_pretrained files, its card, the workflow's own files
    and a LoRA adapter folder (bytes only: the adapter's repo is compared byte for byte)."""
    folder = tmp_path_factory.mktemp("run") / "models" / "node0"
    tiny_base(folder, torch.float32)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "eos_token_id": 2}))
    base = Base(hub_id="acme/tiny-chat", revision=SHA)
    (folder / "README.md").write_text(card_text(base, training_summary({"strategy": "ddp", "step": 4}), str(folder)))
    (folder / ".snakemake_timestamp").write_text("")
    (folder / "consolidation.json").write_text(json.dumps({"checkpoint": str(folder.parent / "ckpt")}))
    adapter = folder / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "acme/tiny-chat"}))
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 64)
    (adapter / "README.md").write_text(card_text(base, {"strategy": "ddp", "peft": "lora", "lora": {
        "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}}, str(adapter), adapter=True))  # fmt: skip
    return folder


def publish_env(server, tmp_path, token=TOKEN) -> dict:
    env = tool_env() | {"HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
                        "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    env.pop("HF_TOKEN", None)
    return env | ({"HF_TOKEN": token} if token else {})


def run_publish(model, env, output, *args) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "python"), "-m", "workflow_scripts.export.publish", "--model", str(model), "--name", "node0",
           "--output", str(output), *args]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


READ_BACK = """
import hashlib, json, sys
from huggingface_hub import ModelCard, snapshot_download
from transformers import AutoModelForCausalLM
out = {}
for repo, sha in json.loads(sys.argv[1]):
    folder = snapshot_download(repo, revision=sha)
    import pathlib
    files = {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}
    card = ModelCard.load(pathlib.Path(folder) / "README.md")
    scores = {f"{r.dataset_type}/{r.metric_type}": r.metric_value for r in card.data.eval_results or []}
    out[repo] = {"files": files, "scores": scores, "text": card.text}
model = AutoModelForCausalLM.from_pretrained(json.loads(sys.argv[1])[0][0], revision=json.loads(sys.argv[1])[0][1])
out["params"] = sum(p.numel() for p in model.parameters())
print(json.dumps(out))
"""


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.e2e
def test_published_files_read_back_byte_for_byte_with_scores_in_the_card(model, tmp_path):
    server = HubServer(token=TOKEN)
    try:
        result = tmp_path / "node0.json"
        result.write_text(json.dumps(RESULT))
        output = tmp_path / "publish" / "node0.json"
        proc = run_publish(model, publish_env(server, tmp_path), output, "--repo", REPO_ID,
                           "--adapter-repo", ADAPTER_REPO, "--eval", str(result), "--revision", "release")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = json.loads(output.read_text())
        assert [u["kind"] for u in record["uploads"]] == ["model", "adapter"]
        up, adapter_up = record["uploads"]
        assert [f["path"] for f in up["files"]] == sorted(MODEL)
        assert up["left_home"] == [*HOME, "adapter/"] and up["revision"] == "release"
        assert adapter_up["adapter_base"] == "acme/tiny-chat"
        assert [f["path"] for f in adapter_up["files"]] == ["README.md", "adapter_config.json",
                                                          "adapter_model.safetensors"]  # fmt: skip
        # exactly these files were committed (the LFS weights too), nothing of the workflow's own
        committed = [f"{REPO_ID}/{f}" for f in MODEL] + [f"{ADAPTER_REPO}/{f['path']}" for f in adapter_up["files"]]
        assert sorted(server.uploads()) == sorted(committed)
        assert any(line.startswith("PUT /lfs-upload/") for line in server.log)
        assert server.repos[REPO_ID].refs["release"] == up["commit"] and up["commit"] in up["commit_url"]

        repos = [[REPO_ID, up["commit"]], [ADAPTER_REPO, adapter_up["commit"]]]
        env = publish_env(server, tmp_path / "reader", token=None)
        proc = subprocess.run([str(BIN / "python"), "-c", READ_BACK, json.dumps(repos)], env=env,
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        back = json.loads(proc.stdout.strip().splitlines()[-1])
        assert back["params"] > 0
        for upload, folder in ((up, model), (adapter_up, model / "adapter")):
            files = back[upload["repo_id"]]["files"]
            assert files.pop(".gitattributes")  # the hub's own, made with the repo
            assert files == {f["path"]: f["sha256"] for f in upload["files"]}
            for name, digest in files.items():  # byte for byte the folder's, but the card (model-index added)
                assert name == "README.md" or digest == sha256(folder / name), name
        for repo in (REPO_ID, ADAPTER_REPO):
            scores = back[repo]["scores"]
            expected = {f"heldout/{k}": RESULT[k] for k in ("eval_loss", "perplexity", "exact_match", "rouge_l",
                                                           "bleu", "chrf")}  # fmt: skip
            assert scores == expected | {"demo_mc/acc": 0.75, "demo_mc/acc_norm": 0.5}
            assert str(model) not in back[repo]["text"]  # the load lines name the repo
        assert f'from_pretrained("{REPO_ID}")' in back[REPO_ID]["text"]
        assert "| held-out split (12 examples) | exact_match | 0.25 |" in back[REPO_ID]["text"]

        # published again unchanged: a commit of the card alone would be a no-op; the hub keeps the files
        before = len(server.uploads())
        proc = run_publish(model, publish_env(server, tmp_path), output, "--repo", REPO_ID, "--eval", str(result),
                           "--revision", "release")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(server.uploads()) == before  # preupload's oids: nothing changed, nothing sent
    finally:
        server.stop()


def test_a_missing_token_stops_in_one_line_naming_HF_TOKEN(model, tmp_path):
    server = HubServer(token=TOKEN)
    try:
        proc = run_publish(model, publish_env(server, tmp_path, token=None), tmp_path / "p.json", "--repo", REPO_ID)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert "HF_TOKEN" in proc.stderr and proc.stderr.startswith("error: publish:")
        assert server.log == [] and not (tmp_path / "p.json").exists()
    finally:
        server.stop()


def test_only_the_models_files_are_published_and_the_card_gets_model_index(model):
    up, home = published_files(model)
    assert up == sorted(MODEL) and home == HOME
    results = eval_results(RESULT)
    assert {(r.dataset_type, r.metric_type) for r in results} >= {("heldout", "eval_loss"), ("demo_mc", "acc")}
    assert not any(r.metric_type == "tool_call" or r.metric_type.endswith("_stderr") for r in results)
    card = published_card((model / "README.md").read_text(), model, REPO_ID, "node0", None, False)
    assert "model-index:" not in card and "`model-index` is left out" in card
    assert str(model) not in card.split("## Training")[0]


def test_publish_plans_one_job_per_configured_model_and_none_without(tmp_path, tiny_dry_run):
    assert "publish_model" not in planned_jobs(tiny_dry_run)
    config = tiny_config("t") | {"publish": {"repo_id": {"node0": "acme/n0", "node1": "acme/n1"}, "private": True}}
    proc = snakemake(tmp_path / "w", config, "publish", "-n", "-p")
    jobs = planned_jobs(proc)
    assert jobs["publish_model"] == 2 and jobs["evaluate_model"] == 2, jobs
    out = proc.stdout + proc.stderr
    assert "--repo acme/n0" in out and "--repo acme/n1" in out and "--private" in out
    bad = tiny_config("t") | {"publish": {"repo_id": {"base": "acme/b"}}}
    proc = snakemake(tmp_path / "b", bad, "publish", "-n", check=False)
    assert proc.returncode != 0 and "publish.repo_id: base" in proc.stderr
    proc = snakemake(tmp_path / "n", tiny_config("t"), "publish", "-n", check=False)  # the target, nothing configured
    assert proc.returncode != 0 and "error: publish: nothing to publish: set publish.repo_id" in proc.stderr
