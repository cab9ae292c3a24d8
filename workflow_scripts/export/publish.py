"""publish: a consolidated model's files onto the Hugging Face Hub, and the record of what went up.

Opt-in (config `publish.repo_id`, model name -> hub repo id; `make publish`): the rule publish_model runs this
where Snakemake runs (a local rule: it needs internet, as fetch_model does). It uploads exactly the files
that make the model (PUBLISHED: weights, config, generation config, tokenizer files, chat template, the card),
never what the workflow keeps beside them: `.snakemake_timestamp`, `consolidation.json` (local paths stay
home), a soup's `soup.json`, the LoRA `adapter/` folder, which goes to a repo of its own when
`publish.adapter_repo_id` names one. One commit per repo (HfApi.create_commit, after create_repo with
exist_ok), on `publish.revision` (a branch, made from main when it does not exist).

The card uploaded is the local README.md with `model-index` (ModelCardData.eval_results) filled from the
model's evaluation (results/<run>/eval/<model>.json: the held-out set's metrics and every eval.tasks score)
and the load lines naming the repo instead of the local folder: the local card is written at consolidation,
before evaluation, and stays as it is.

The token is huggingface_hub's (HF_TOKEN, else `hf auth login`'s); none stops with one line naming HF_TOKEN.
The record (results/<run>/publish/<model>.json): each repo, its commit sha and URL, and every file uploaded with
its size and sha256 (the card's as uploaded), the files left home, and the base an adapter names.
"""

import argparse
import fnmatch
import hashlib
import json
import math
from pathlib import Path

from workflow_scripts.core.hub_model import ALLOW_PATTERNS
from workflow_scripts.core.pipeline_io import UserError, cli, file_sha256, write_json
from workflow_scripts.evals.metrics import METRICS

CARD = "README.md"
ADAPTER = "adapter"
# a model folder's files that make the model (a LoRA adapter's too: adapter_model.safetensors, adapter_config.json)
PUBLISHED = [*ALLOW_PATTERNS, "adapter_config.json", CARD]
HELD_OUT = "heldout"  # the model-index dataset of the held-out split


def published_files(folder: Path) -> tuple[list[str], list[str]]:
    """(the files of ``folder`` that are published, those left home), by name; subfolders (adapter/) are
    neither: they are published as their own repo, or not at all."""
    if not folder.is_dir():
        raise UserError(f"{folder}: no model folder to publish (consolidate it first)")
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    up = [n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in PUBLISHED)]
    if "config.json" not in up and "adapter_config.json" not in up:
        raise UserError(f"{folder}: neither config.json nor adapter_config.json: not a model folder")
    return up, [n for n in names if n not in up]


def finite(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def eval_results(result: dict):
    """The model-index entries (huggingface_hub EvalResult) of an evaluation result (eval/<model>.json): each
    held-out metric of the registry the result has, and each eval.tasks score (not its stderr)."""
    from huggingface_hub import EvalResult

    out = []
    examples = result.get("examples")
    split = f"held-out split ({examples} examples)" if examples else "held-out split"
    for name in METRICS:
        value = finite(result.get(name))
        if value is not None:
            out.append(EvalResult(task_type="text-generation", dataset_type=HELD_OUT, dataset_name=split,
                                  dataset_split="eval", metric_type=name, metric_value=value))  # fmt: skip
    for task, scores in sorted((result.get("tasks") or {}).items()):
        for metric, raw in sorted(scores.items()):
            value = finite(raw)
            if value is None or metric.endswith("_stderr"):
                continue
            out.append(EvalResult(task_type="text-generation", task_name=task, dataset_type=task, dataset_name=task,
                                  metric_type=metric, metric_value=value))  # fmt: skip
    return out


def score_rows(results) -> list[str]:
    rows = ["| dataset | metric | value |", "|---|---|---|"]
    rows += [f"| {r.dataset_name} | {r.metric_type} | {r.metric_value:.4g} |" for r in results]
    return rows


def published_card(text: str | None, folder: Path, repo_id: str, name: str, result: dict | None, adapter: bool):
    """The card uploaded: the local card (``text``; a minimal one for a folder consolidated before cards were
    written) with ``model-index`` from ``result`` and the load lines naming ``repo_id``, not the folder."""
    from huggingface_hub import ModelCard, ModelCardData

    if text is None:
        library = "peft" if adapter else "transformers"
        data = ModelCardData(library_name=library, pipeline_tag="text-generation", tags=["llm-finetune-workflow"])
        text = f"---\n{data.to_yaml()}\n---\n\n# {name}\n\n## Evaluation\n"
    card = ModelCard(text.replace(json.dumps(str(folder.resolve())), json.dumps(repo_id)))
    results = eval_results(result) if result else []
    if results:
        card.data.model_name = repo_id.split("/")[-1]
        card.data.eval_results = results
    head = card.text.split("\n## Evaluation\n", 1)[0].rstrip("\n")
    what = "the merged model (this adapter on its base)" if adapter else "this model"
    body = [head, "", "## Evaluation", ""]
    if results:
        body += [f"Scores of {what}, by the workflow's evaluation stage (also in `model-index` above):", ""]
        body += score_rows(results)
    else:
        body += ["No scores were given when this card was published: `model-index` is left out."]
    return f"---\n{card.data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"


def token() -> str:
    """The Hugging Face token huggingface_hub would send (HF_TOKEN, else the one `hf auth login` stored)."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise UserError("publish: HF_HUB_OFFLINE is set (uploads are off): run with HF_HUB_OFFLINE=0 (make publish)")
    found = get_token()
    if not found:
        raise UserError("publish: no Hugging Face token: set HF_TOKEN to a write token (or run `hf auth login`)")
    return found


def file_entry(name: str, source: Path | bytes) -> dict:
    """A file uploaded, as the record lists it: its path in the repo, size and sha256."""
    if isinstance(source, bytes):
        return {"path": name, "size": len(source), "sha256": hashlib.sha256(source).hexdigest()}
    return {"path": name, "size": source.stat().st_size, "sha256": file_sha256(source)}


def upload(api, repo_id: str, folder: Path, card: str, revision: str, private: bool, message: str) -> dict:
    """One commit of ``folder``'s published files to ``repo_id`` at branch ``revision``, the card as ``card``;
    the record of it. The weights are sent from their files (streamed: a 65 GB model is not read into memory)."""
    from huggingface_hub import CommitOperationAdd

    files, home = published_files(folder)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision != "main":
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    contents = {name: folder / name for name in files if name != CARD} | {CARD: card.encode()}
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=src) for name, src in contents.items()]
    info = api.create_commit(repo_id, operations, commit_message=message, revision=revision)
    return {
        "repo_id": repo_id,
        "revision": revision,
        "commit": info.oid,
        "commit_url": info.commit_url,
        "url": str(info.repo_url),
        "files": [file_entry(name, contents[name]) for name in sorted(contents)],
        "left_home": home + sorted(p.name + "/" for p in folder.iterdir() if p.is_dir()),
    }


def adapter_base(folder: Path) -> str | None:
    """The base the adapter's adapter_config.json names; a local folder there (not on the hub) is said in the log:
    AutoPeftModelForCausalLM finds it only on this machine."""
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if base and Path(base).is_absolute():
        print(f"warning: {folder}/adapter_config.json names a local base, {base}: the published adapter loads only"
              " where that folder is (publish the base model, or train from a hub model)")  # fmt: skip
    return base


def read_card(folder: Path) -> str | None:
    try:
        return (folder / CARD).read_text()
    except OSError:
        return None


def publish(model: Path, name: str, repo_id: str, adapter_repo: str | None, result: dict | None, revision: str,
            private: bool) -> dict:  # fmt: skip
    """The model's repo (and its adapter's, where ``adapter_repo`` names one); the record of both."""
    from huggingface_hub import HfApi

    api = HfApi(token=token())
    adapter = model / ADAPTER
    if adapter_repo and not (adapter / "adapter_config.json").is_file():
        raise UserError(f"publish.adapter_repo_id.{name}: {model} has no LoRA adapter ({ADAPTER}/adapter_config.json)")
    uploads = []
    for folder, repo, is_adapter in ((model, repo_id, False), (adapter, adapter_repo, True)):
        if not repo:
            continue
        card = published_card(read_card(folder), folder, repo, name, result, is_adapter)
        what = "LoRA adapter" if is_adapter else "model"
        message = f"{name}: {what} published by llm-finetune-workflow"
        try:
            record = upload(api, repo, folder, card, revision, private, message)
        except UserError:
            raise
        except Exception as e:  # the hub's answer: no write access, a bad token, the hub down; one line
            first = (str(e).strip().splitlines() or [""])[0]
            raise UserError(f"publish {name} to {repo}: {type(e).__name__}: {first}") from e
        if is_adapter:
            record["adapter_base"] = adapter_base(folder)
        uploads.append(record | {"kind": "adapter" if is_adapter else "model"})
    return {"model": name, "uploads": uploads}


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="the model folder (results/<run>/models/<model>)")
    p.add_argument("--name", required=True, help="the model's name (node0, joint, soup_uniform)")
    p.add_argument("--repo", required=True, help="the hub repo id, owner/name")
    p.add_argument("--adapter-repo", help="the hub repo id of the LoRA adapter (adapter/), its own repo")
    p.add_argument("--eval", type=Path, help="the model's evaluation (eval/<model>.json): model-index")
    p.add_argument("--revision", default="main", help="the branch committed to (made from main if new)")
    p.add_argument("--private", action="store_true", help="create the repo private (an existing one keeps its own)")
    p.add_argument("--output", required=True, type=Path, help="the record (results/<run>/publish/<model>.json)")
    a = p.parse_args(argv)
    result = None
    if a.eval:
        try:
            result = json.loads(a.eval.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{a.eval}: not an evaluation result ({type(e).__name__})") from e
    record = publish(a.model, a.name, a.repo, a.adapter_repo, result, a.revision, a.private)
    write_json(a.output, record)
    for up in record["uploads"]:
        print(f"{a.name} ({up['kind']}): {len(up['files'])} files to {up['repo_id']} at {up['commit']}")


if __name__ == "__main__":
    main()
