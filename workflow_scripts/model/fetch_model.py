"""fetch_model: a hub model's files for training, at one commit, and the record later jobs load it by.

A hub id in model.name_or_path is fetched once, on the login node (a local rule: it needs internet), at
the commit model.revision names: `main` (a branch or tag) is resolved to its sha when the workflow is
parsed (hub_model.resolve_commit), so the sha is part of fetch_model's params and a new sha on the hub
reruns it and everything after it. Only what training needs is downloaded (hub_model.ALLOW_PATTERNS). The
record (results/<run>/base_model.json: repo, revision, sha, snapshot folder, files) is every later job's
base model: hub_model.record_folder turns it into the snapshot folder, which from_pretrained reads without
any download, on any node.
"""

import argparse
import os
from pathlib import Path

from workflow_scripts.core.hub_model import ALLOW_PATTERNS, cache_folder, fetch_command, is_commit
from workflow_scripts.core.pipeline_io import UserError, cli, write_json


def keep_ref(repo: str, revision: str, sha: str) -> None:
    """refs/<revision> in the hub cache names the fetched sha, as `hf download --revision <revision>` leaves
    it: an offline parse then resolves the revision to what was fetched, not to an older ref."""
    if is_commit(revision):
        return
    ref = cache_folder(repo) / "refs" / revision
    if ref.is_file() and ref.read_text().strip() == sha:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f"{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(sha)
    os.replace(tmp, ref)


def fetch(repo: str, revision: str, sha: str) -> dict:
    """Download (or find in the cache, offline) the commit's ALLOW_PATTERNS files; the record of it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, revision=sha, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:  # offline and not cached (or the hub unreachable)
        raise UserError(
            f"model.name_or_path {repo}: commit {sha} is not in the local Hugging Face cache and could not be"
            f" downloaded here (offline, or the hub unreachable); fetch it first: {fetch_command(repo, revision)}"
        ) from e
    except Exception as e:  # the hub's answer: gone, gated, down; one line for the log's reason
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"model.name_or_path {repo}: fetching commit {sha} failed: {type(e).__name__}: {first}") from e
    if not (folder / "config.json").is_file():
        raise UserError(f"model.name_or_path {repo}: commit {sha} has no config.json (not a transformers model)")
    keep_ref(repo, revision, sha)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return {"repo": repo, "revision": revision, "sha": sha, "snapshot": str(folder), "files": files}


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repo", required=True, help="hub id, owner/name")
    p.add_argument("--revision", required=True, help="model.revision as written (main, a tag, a sha)")
    p.add_argument("--sha", required=True, help="the commit the revision was resolved to when the workflow was parsed")
    p.add_argument("--output", required=True, type=Path, help="the record (results/<run>/base_model.json)")
    a = p.parse_args(argv)
    record = fetch(a.repo, a.revision, a.sha)
    write_json(a.output, record)
    print(f"{a.repo} {a.revision} = {a.sha}: {len(record['files'])} files in {record['snapshot']}")


if __name__ == "__main__":
    main()
