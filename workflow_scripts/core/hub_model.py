"""A hub model as the workflow knows it: the commit sha a revision means, and the folder a job loads.

fetch_model (workflow_scripts/model/fetch_model.py) downloads a hub id's files at one commit and records them in
results/<run>/base_model.json; rules/common.smk resolves model.revision to that commit when the workflow is
parsed (resolve_commit), and every script turns the record into its snapshot folder (record_folder, through
fingerprint.model_location), never downloading.
"""

import json
import re
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError

ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model (SentencePiece)
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",  # chat_template.jinja, chat_template.json
]
COMMIT = re.compile(r"[0-9a-f]{40}")


def is_commit(revision: str) -> bool:
    """Whether the revision is a full commit sha (immutable), not a branch or tag."""
    return bool(COMMIT.fullmatch(revision))


def fetch_command(repo: str, revision: str) -> str:
    """The command that puts the model into the Hugging Face cache (the `hf` CLI of huggingface_hub)."""
    return f"hf download {repo} --revision {revision}"


def absent_message(repo: str, revision: str) -> str:
    return (
        f"model.name_or_path {repo} (model.revision {revision}): not in the local Hugging Face cache and downloads"
        f" are off here (HF_HUB_OFFLINE); fetch it first: {fetch_command(repo, revision)}"
    )


def cache_folder(repo: str) -> Path:
    """The repo's folder in the hub cache (HF_HUB_CACHE, under HF_HOME)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")


def cached_commit(repo: str, revision: str) -> str | None:
    """The sha the hub cache maps the revision to (refs/<revision>), None when it has none."""
    if is_commit(revision):
        return revision
    try:
        sha = (cache_folder(repo) / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return sha if is_commit(sha) else None


def read_record(path) -> dict | None:
    """fetch_model's record, None when there is none (or it is unreadable: the fetch reruns)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"repo", "revision", "sha"} <= record.keys() else None


def recorded_commit(record_path, repo: str, revision: str) -> str | None:
    """The sha the last fetch of this repo and revision resolved to, None when the record is of another."""
    record = read_record(record_path)
    if record and record["repo"] == repo and record["revision"] == revision and is_commit(str(record["sha"])):
        return record["sha"]
    return None


def hub_commit(repo: str, revision: str) -> str:
    """The sha the hub's revision points to now: one API call (GET /api/models/<repo>/revision/<revision>)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        sha = HfApi().repo_info(repo, revision=revision).sha
    except RevisionNotFoundError as e:
        raise UserError(f"model.revision {revision}: no such revision of {repo} on the hub") from e
    except RepositoryNotFoundError as e:
        raise UserError(
            f"model.name_or_path {repo}: not on the hub, or private or gated without a token (hf auth login)"
        ) from e
    except Exception as e:  # connection refused, a timeout, the hub down, a proxy's HTML page
        raise UserError(
            f"model.name_or_path {repo}: the hub did not answer ({type(e).__name__}); set HF_HUB_OFFLINE=1 to use"
            f" the local cache, or fetch it where there is internet: {fetch_command(repo, revision)}"
        ) from e
    if not sha or not is_commit(sha):
        raise UserError(f"model.name_or_path {repo}: the hub gave no commit for revision {revision}")
    return sha


def resolve_commit(repo: str, revision: str, record_path, online: bool, main_process: bool) -> str:
    """The sha that model.revision means for this parse of the workflow.

    A sha is itself. The main Snakemake process online asks the hub (so a moved `main` is seen by a dry
    run); offline it takes the hub cache's refs/<revision>, else the last fetch's record. A job's own
    Snakemake (a SLURM job re-parses the workflow on a compute node, without internet) never asks the
    hub: it takes the record its fetch_model wrote, else the cache's ref."""
    if is_commit(revision):
        return revision
    if main_process and online:
        return hub_commit(repo, revision)
    sources = (cached_commit, recorded_commit) if main_process else (recorded_commit, cached_commit)
    for source in sources:
        sha = source(repo, revision) if source is cached_commit else source(record_path, repo, revision)
        if sha:
            return sha
    raise UserError(absent_message(repo, revision))


def cached_snapshot(repo: str, sha: str) -> Path | None:
    """The hub cache's snapshot folder of the commit, None when it is not there (never downloads)."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, revision=sha, allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except Exception:  # not cached, incomplete, an unreadable cache: not there
        return None
    return folder if (folder / "config.json").is_file() else None


def record_folder(record_path) -> Path:
    """The folder a job loads the base model from: the fetched snapshot its record names, else that commit's
    snapshot in this machine's hub cache (another HF_HOME on the compute nodes). Never downloads."""
    record = read_record(record_path)
    if record is None:
        raise UserError(f"{record_path}: not a fetch_model record (repo, revision, sha); delete it to fetch again")
    folder = Path(record.get("snapshot") or "")
    if record.get("snapshot") and (folder / "config.json").is_file():
        return folder
    folder = cached_snapshot(record["repo"], record["sha"])
    if folder is None:
        raise UserError(
            f"{record_path}: commit {record['sha']} of {record['repo']} is not in the Hugging Face cache here;"
            f" fetch it first: {fetch_command(record['repo'], record['sha'])}"
        )
    return folder
