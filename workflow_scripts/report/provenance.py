"""provenance: what exactly produced these models — config, code, data, tokenizer, packages, jobs."""

import argparse
import json
import subprocess
from pathlib import Path

from workflow_scripts.core.pipeline_io import cli, file_sha256, write_json


def git_commit(repo: Path) -> dict:
    def git(*args):
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def tokenizer_hashes(model: str) -> dict:
    folder = Path(model)
    if not folder.is_dir():
        return {"hub_id": model}
    return {p.name: file_sha256(p) for p in sorted(folder.glob("tokenizer*")) + sorted(folder.glob("chat_template*"))}


def base_model_provenance(base: str, fetch_record: Path | None) -> dict:
    """What the base model was: the folder (or name) training loaded and, for a hub model, the repo, the
    revision asked for and the commit sha it resolved to, with the files fetched (fetch_model's record)."""
    out = {"loaded_from": base}
    if fetch_record:
        record = json.loads(fetch_record.read_text())
        out |= {key: record.get(key) for key in ("repo", "revision", "sha", "files")}
    return out


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True, help="the resolved config as JSON")
    p.add_argument("--repo", required=True, type=Path)
    p.add_argument("--manifest", required=True, type=Path)
    p.add_argument("--env", required=True, type=Path)
    p.add_argument("--states", nargs="+", required=True, type=Path)
    p.add_argument("--fetch-record", type=Path, help="fetch_model's record of a hub base model (its sha)")
    p.add_argument("--output", required=True, type=Path)
    a = p.parse_args(argv)
    manifest = json.loads(a.manifest.read_text())
    env = json.loads(a.env.read_text())
    states = {s.parent.name: json.loads(s.read_text()) for s in a.states}
    base = next(iter(states.values()))["base_model"]
    write_json(
        a.output,
        {
            "config": json.loads(a.config),
            "code": git_commit(a.repo),
            "data": {
                "sources": manifest["sources"],
                "shards": {f"node{n['node']}": n["sha256"] for n in manifest["nodes"]}
                | {"eval": manifest["eval"]["sha256"]},
            },
            "base_model": base_model_provenance(base, a.fetch_record),
            "tokenizer": tokenizer_hashes(base),
            "packages": env["packages"] | {"python": env["python"]},
            "hardware": env["gpu"],
            "training": {
                node: {"checkpoint": s["checkpoint"], "step": s["step"], "slurm_job_id": s.get("slurm_job_id")}
                for node, s in states.items()
            },
        },
    )
    print(f"provenance written to {a.output}")


if __name__ == "__main__":
    main()
