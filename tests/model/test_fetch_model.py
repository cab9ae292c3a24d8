"""fetch_model: a hub id is fetched once, at the commit model.revision resolves to; a new commit on the
branch reruns the fetch and what reads the base model, the same commit nothing; a pinned sha is what is
trained; offline without the model the parse stops with the `hf download` that fetches it.

The hub is tests/hub_server.py, a real HTTP server on 127.0.0.1 (HF_ENDPOINT) answering as the Hugging Face
Hub does, serving a tiny demo model at two commits."""

import json
import subprocess
import sys

import pytest
from conftest import DEMO_CSV, REPO, planned_jobs, snakemake, tiny_config, tool_env
from hub_server import HubServer, tiny_chat_model

from workflow_scripts.core.pipeline_io import UserError

REPO_ID = "acme/tiny-chat"
# what fetch_model downloads of the model (ALLOW_PATTERNS), not README.md and the .bin copy the repo also has
FETCHED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "chat_template.jinja"}  # fmt: skip
RUN = "h"
RECORD = f"results/{RUN}/base_model.json"
TOKENIZED_EVAL = f"results/{RUN}/data/tokenized/eval.parquet"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """A tiny demo model's files (save_pretrained's, chat template included) and two that are not fetched."""
    files = tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), DEMO_CSV)
    assert set(files) == FETCHED, sorted(files)
    return files | {"README.md": b"# tiny chat\n", "pytorch_model.bin": b"not fetched" * 100}


@pytest.fixture
def hub(model_files):
    server = HubServer()
    server.repo(REPO_ID).commit(model_files)
    yield server
    server.stop()


def hub_env(server, hf_home, online=True) -> dict:
    """The tests' environment pointed at the local hub, with its own Hugging Face cache; online: as on the
    login node (downloads on)."""
    return tool_env() | {
        "HF_ENDPOINT": server.url if server else "http://127.0.0.1:9",
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "0" if online else "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def hub_config(revision=None) -> dict:
    config = tiny_config(RUN)
    config["model"] = {"name_or_path": REPO_ID} | ({"revision": revision} if revision else {})
    return config


def fetched_files(server) -> list[str]:
    """The files sent by the hub, by name (their commit left out)."""
    return sorted(path.rsplit("/", 1)[1] for path in server.downloads())


def revision_calls(server, revision="main") -> int:
    return server.log.count(f"GET /api/models/{REPO_ID}/revision/{revision}")


@pytest.mark.e2e
def test_fetched_once_then_nothing_and_a_new_commit_reruns(hub, tmp_path):
    work, env = tmp_path / "work", hub_env(hub, tmp_path / "hf")
    sha = hub.repos[REPO_ID].refs["main"]
    snakemake(work, hub_config(), RECORD, TOKENIZED_EVAL, env=env)
    # one look-up of main at parse time, then only fetch_model's requests: its files, each once, at the sha
    assert revision_calls(hub) == 1
    expected = sorted(FETCHED)
    assert fetched_files(hub) == expected, hub.log
    assert all(f"/resolve/{sha}/" in line for line in hub.log if "/resolve/" in line), hub.log
    record = json.loads((work / RECORD).read_text())
    assert (record["repo"], record["revision"], record["sha"]) == (REPO_ID, "main", sha)
    assert record["files"] == expected and record["snapshot"].endswith(f"snapshots/{sha}")
    assert (work / TOKENIZED_EVAL).is_file()  # tokenization loaded the tokenizer from the snapshot folder

    # the same commit: nothing to do, nothing downloaded (one look-up of main)
    before = len(hub.log)
    proc = snakemake(work, hub_config(), RECORD, TOKENIZED_EVAL, "-n", env=env)
    assert planned_jobs(proc) == {}, proc.stdout[-2000:]
    assert hub.log[before:] == [f"GET /api/models/{REPO_ID}/revision/main"]

    # a new commit on main: the dry run fetches again and reruns what reads the base model, not the split
    files = hub.repos[REPO_ID].commits[sha] | {"generation_config.json": b'{"max_new_tokens": 7}\n'}
    new_sha = hub.repos[REPO_ID].commit(files)
    proc = snakemake(work, hub_config(), "-n", "-p", env=env)
    assert f"--sha {new_sha}" in proc.stdout + proc.stderr  # fetch_model's
    full = planned_jobs(proc)
    assert full["fetch_model"] == 1 and full["tokenize_eval"] == 1 and full["tokenize_shard"] == 2
    assert full["plan_training"] == 1
    assert full["train_node"] == 2 and full["evaluate_model"] == 3 and "split_dataset" not in full
    assert fetched_files(hub) == expected  # dry runs download nothing

    # a job's own Snakemake (a SLURM job's, on a compute node: --mode remote) never asks the hub, online or
    # not: it takes the sha its fetch_model recorded (so its fetch_model is not stale to it)
    before, no_hub = len(hub.log), env | {"HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = snakemake(work, hub_config(), TOKENIZED_EVAL, "-n", "--mode", "remote", env=no_hub)
    assert planned_jobs(proc) == {} and hub.log[before:] == []

    # offline the cache's refs/main is what was fetched (the old commit): nothing to do, no request
    before = len(hub.log)
    proc = snakemake(work, hub_config(), RECORD, TOKENIZED_EVAL, "-n", env=hub_env(hub, tmp_path / "hf", online=False))
    assert planned_jobs(proc) == {} and hub.log[before:] == []


@pytest.mark.e2e
def test_a_pinned_sha_is_fetched_and_recorded_in_provenance(hub, tmp_path):
    old = hub.repos[REPO_ID].refs["main"]
    files = hub.repos[REPO_ID].commits[old] | {"generation_config.json": b'{"max_new_tokens": 7}\n'}
    new = hub.repos[REPO_ID].commit(files)  # main has moved on; the config pins the old commit
    work, env = tmp_path / "work", hub_env(hub, tmp_path / "hf")
    snakemake(work, hub_config(old), RECORD, env=env)
    assert revision_calls(hub, "main") == 0  # a sha needs no look-up
    assert all(f"/resolve/{old}/" in line for line in hub.log if "/resolve/" in line) and new not in str(hub.log)
    record = json.loads((work / RECORD).read_text())
    assert (record["revision"], record["sha"]) == (old, old)
    # what a model trained on it names as its base (model cards, a LoRA adapter's config): the repo at that commit
    from workflow_scripts.export.model_card import Base, base_of

    assert base_of(record["snapshot"]) == Base(hub_id=REPO_ID, revision=old)

    # provenance.json (through provenance.py, as the rule calls it) names that sha
    state = work / "state" / "node0" / "train_state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"base_model": record["snapshot"], "checkpoint": "c", "step": 12}))
    env_check = work / "env.json"
    env_check.write_text(json.dumps({"packages": {}, "python": "3.11", "gpu": None}))
    manifest = work / "manifest.json"
    manifest.write_text(json.dumps({"sources": [], "nodes": [{"node": 0, "sha256": "x"}], "eval": {"sha256": "y"}}))
    out = work / "provenance.json"
    cmd = [sys.executable, "-m", "workflow_scripts.report.provenance", "--config", "{}", "--repo", str(REPO),
           "--manifest", str(manifest), "--env", str(env_check), "--states", str(state),
           "--fetch-record", str(work / RECORD), "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    base = json.loads(out.read_text())["base_model"]
    assert (base["repo"], base["revision"], base["sha"]) == (REPO_ID, old, old)
    assert base["loaded_from"].endswith(f"snapshots/{old}") and "tokenizer.json" in base["files"]

    # the workflow's own provenance job gets the record; training reads the base model from it
    proc = snakemake(work, hub_config(old), "-n", "-p", env=env)
    out = proc.stdout + proc.stderr
    assert f"--fetch-record {RECORD}" in out and f"--base-model {RECORD}" in out


def test_offline_and_not_cached_stops_at_parse_time_naming_hf_download(tmp_path):
    proc = snakemake(tmp_path / "work", hub_config(), "-n", check=False, env=hub_env(None, tmp_path / "hf", False))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert f"hf download {REPO_ID} --revision main" in errors[0] and "model.name_or_path" in errors[0]
    assert "Traceback" not in proc.stderr


# pure functions: the revision's sha without the hub, and the snapshot folder a job loads


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache (HF_HUB_CACHE) in tmp_path/hub."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def snapshot(cache, sha: str, ref: str | None = "main"):
    """A cached snapshot of REPO_ID at ``sha`` (config.json only), ``ref`` pointing to it."""
    repo = cache / "models--acme--tiny-chat"
    folder = repo / "snapshots" / sha
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return folder


def test_resolve_commit_without_the_hub(cache, tmp_path):
    from workflow_scripts.core.hub_model import resolve_commit

    record = tmp_path / "base_model.json"
    a, b = "a" * 40, "b" * 40
    assert resolve_commit(REPO_ID, b, record, online=True, main_process=True) == b  # a sha is itself, no hub
    with pytest.raises(UserError, match=f"hf download {REPO_ID} --revision main"):
        resolve_commit(REPO_ID, "main", record, online=False, main_process=True)
    snapshot(cache, a)
    record.write_text(json.dumps({"repo": REPO_ID, "revision": "main", "sha": b, "snapshot": ""}))
    # offline, the main process takes the cache's ref; a job's own Snakemake the record its fetch wrote
    assert resolve_commit(REPO_ID, "main", record, online=False, main_process=True) == a
    assert resolve_commit(REPO_ID, "main", record, online=True, main_process=False) == b
    # a record of another revision is no answer
    with pytest.raises(UserError, match="--revision dev"):
        resolve_commit(REPO_ID, "dev", record, online=False, main_process=False)


def test_a_job_loads_the_recorded_snapshot_else_the_commit_in_its_cache(cache, tmp_path):
    from workflow_scripts.core.fingerprint import local_model_folder, model_location
    from workflow_scripts.core.hub_model import record_folder
    from workflow_scripts.model.fetch_model import keep_ref

    sha = "c" * 40
    record = tmp_path / "base_model.json"
    record.write_text(json.dumps({"repo": REPO_ID, "revision": "main", "sha": sha, "snapshot": "/elsewhere/x"}))
    with pytest.raises(UserError, match=f"hf download {REPO_ID} --revision {sha}"):
        record_folder(record)
    folder = snapshot(cache, sha, ref=None)
    assert record_folder(record) == folder  # the compute node's cache (another HF_HOME than the fetch's)
    record.write_text(json.dumps({"repo": REPO_ID, "revision": "main", "sha": sha, "snapshot": str(folder)}))
    assert model_location(str(record)) == str(folder) and local_model_folder(str(record)) == folder
    assert model_location("demo") == "demo" and model_location(REPO_ID) == REPO_ID  # anything else as it is
    keep_ref(REPO_ID, "main", sha)  # the ref follows what was fetched
    assert (cache / "models--acme--tiny-chat" / "refs" / "main").read_text() == sha
