"""What a base model *is*: where its files are, and a hash of their content.

A checkpoint is resumed only by a job that trains the same thing, so the resume key covers the
base model's content (weights, config, tokenizer, chat template), not its path: a folder
overwritten in place, or a hub model updated in the cache, gets a new key and a fresh start.

Hashing is paid once per file: digests are cached by (path, size, mtime) in a JSON file beside
the checkpoints, under a lock, so the ranks of a job (and later jobs) hash each file once. A
file in the Hugging Face hub cache is a link to a blob named by its hash: that name is used.
"""

import hashlib
import json
import os
import re
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError, file_sha256, locked, write_json

HEX_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # git sha1 or LFS sha256 blob names


def is_hub_id(name_or_path: str) -> bool:
    """Whether the name is a hub id (owner/name), not a file-system path."""
    local = Path(name_or_path).expanduser().exists() or name_or_path.startswith(("/", ".", "~"))
    return not local and name_or_path.count("/") == 1


def is_fetch_record(name_or_path: str) -> bool:
    """Whether the name is fetch_model's record of a hub model (results/<run>/base_model.json), which the
    rules give the jobs as their base model in place of the hub id."""
    return name_or_path.endswith(".json") and Path(name_or_path).is_file()


def model_location(name_or_path: str) -> str:
    """What from_pretrained loads: a fetch record becomes its snapshot folder (never downloading), anything
    else stays as given. Each script's model argument goes through this first."""
    if is_fetch_record(name_or_path):
        from workflow_scripts.core.hub_model import record_folder

        return str(record_folder(name_or_path))
    return name_or_path


def local_model_folder(name_or_path: str) -> Path:
    """The folder from_pretrained reads: a local path, a fetch record's snapshot, or the hub cache's
    snapshot of a hub id.

    Never downloads; a one-line UserError names model.name_or_path and what to do."""
    name_or_path = model_location(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model.name_or_path {name_or_path}: folder has no config.json (not a Hugging Face model)")
        return path
    if not is_hub_id(name_or_path):
        raise UserError(
            f"model.name_or_path {name_or_path}: no such model folder"
            " (give a local Hugging Face folder or a hub id such as Qwen/Qwen3-0.6B)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise UserError(
            f"model.name_or_path {name_or_path}: not in the local Hugging Face cache and downloads are off here;"
            f" download it first (hf download {name_or_path}) or point to a local folder"
        ) from e


def check_model(name_or_path: str) -> None:
    """At DAG time, before any job: a local folder must be a model; a hub id must be in the local
    cache when downloads are off (HF_HUB_OFFLINE), else fetch_model downloads it."""
    from huggingface_hub import constants

    try:
        local_model_folder(name_or_path)
    except UserError:
        if not is_hub_id(name_or_path) or constants.HF_HUB_OFFLINE:
            raise


def file_digest(path: Path, cache: dict) -> str:
    """A file's content hash: its hub blob name, a cached digest of the same size and mtime, or sha256."""
    if path.is_symlink() and HEX_NAME.fullmatch(path.resolve().name):
        return path.resolve().name
    stat = path.stat()
    key = str(path.resolve())
    hit = cache.get(key)
    if hit and hit["size"] == stat.st_size and hit["mtime_ns"] == stat.st_mtime_ns:
        return hit["sha256"]
    digest = file_sha256(path)
    cache[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    return digest


def model_fingerprint(name_or_path: str, cache_file: Path) -> str:
    """sha256 over (relative path, content hash) of every file of the model's folder."""
    folder = local_model_folder(name_or_path)
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(folder).parts)
    )
    with locked(cache_file):
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        lines = [f"{p.relative_to(folder)}\t{file_digest(p, cache)}" for p in files]
        write_json(cache_file, cache)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def optional_file_sha256(path: str | None) -> str | None:
    """The content hash of an optional config file (a DeepSpeed JSON), None when not given."""
    return file_sha256(path) if path else None


def cache_file_for(checkpoint_root: Path) -> Path:
    """Where the digests are cached: beside every node's checkpoints of the run."""
    return Path(os.path.abspath(checkpoint_root)).parent / "content-hashes.json"
