"""Model cards: the README.md of every exported model folder, and the base an adapter names.

consolidate_node writes a card into the model folder (library_name transformers) and one into its LoRA
adapter (library_name peft), in the job that writes the folder: no new rule input, so an existing run reruns
nothing for it. The card's YAML front matter is huggingface_hub's ModelCardData (ModelCard.load reads it
back as written): ``base_model`` is the hub id when the base came from the hub (its snapshot folder in a
Hugging Face cache, as fetch_model leaves it, says which repo and commit), else the local folder's name, the
card saying it is local and where it is; ``pipeline_tag: text-generation``; ``tags``; ``datasets`` where a
data file came from the hub's cache. The body says how the model was trained, from what the training stage
wrote (train_state.json, its plan, metrics.jsonl beside it, the data manifest of the run), and the two
Python lines that load the folder.

Scores are not in the card: evaluation is a later stage that reads this folder (a card naming them would make
consolidation wait for it), so ``model-index`` is left out.

An adapter's ``adapter_config.json`` names its base as it can be loaded from anywhere (adapter_base): the hub
id and commit (``revision``) when it came from the hub, else the folder's absolute path, never the path
relative to the checkout that training was given.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from workflow_scripts.core.fingerprint import is_hub_id
from workflow_scripts.core.hub_model import is_commit
from workflow_scripts.core.layout import RUN_FILES

PROJECT = "llm-finetune-workflow"
CARD = "README.md"


@dataclass(frozen=True)
class Base:
    """Where a model's training started: a hub repo (``hub_id``, at ``revision``, a commit when known) or a
    local folder (``path``, absolute)."""

    hub_id: str | None = None
    revision: str | None = None
    path: str | None = None

    @property
    def reference(self) -> str:
        """What from_pretrained loads it by, from any working directory."""
        return self.hub_id or self.path

    @property
    def name(self) -> str:
        """The card's ``base_model``: the hub id, else the local folder's name."""
        return self.hub_id or Path(self.path).name


def hub_snapshot(path, kind: str = "model") -> tuple[str, str] | None:
    """(repo id, commit) when ``path`` is in a Hugging Face cache's snapshot of a ``kind`` repo
    (``.../models--owner--name/snapshots/<sha>[/file]``), else None. Repo ids never hold ``--``."""
    parts = Path(path).parts
    prefix = f"{kind}s--"
    for i, part in enumerate(parts[:-2]):
        if part.startswith(prefix) and parts[i + 1] == "snapshots" and is_commit(parts[i + 2]):
            repo = part.removeprefix(prefix).replace("--", "/")
            if repo:
                return repo, parts[i + 2]
    return None


def base_of(base_model: str) -> Base:
    """The base train_state.json names (its ``base_model``: a local folder as training was given it, or a
    fetched hub model's snapshot folder), as a Base."""
    if snapshot := hub_snapshot(base_model):
        return Base(hub_id=snapshot[0], revision=snapshot[1])
    if is_hub_id(base_model):  # a hub id itself (not what the rules pass, but a valid train.py argument)
        return Base(hub_id=base_model)
    return Base(path=str(Path(base_model).expanduser().resolve()))


def adapter_base(folder: Path, base: Base) -> None:
    """Name the base in the saved adapter's adapter_config.json so that AutoPeftModelForCausalLM loads it
    from any working directory: the hub id at its commit (``revision``), or the absolute path. Rewritten
    after peft's save_pretrained, which saved with the folder training loaded (a hub id there would make
    peft ask the hub whether the vocabulary changed: a compute node without internet waits on it)."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base.reference
    config["revision"] = base.revision
    path.write_text(json.dumps(config, indent=2, sort_keys=True))  # as peft writes it


# ---------------------------------------------------------------- what training wrote


def last_with(records: list[dict], key: str) -> dict | None:
    return next((r for r in reversed(records) if r.get(key) is not None), None)


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's records (a line cut short by a crash is skipped); [] when there is none."""
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def find_manifest(train_dir: Path) -> dict | None:
    """The run's data manifest (results/<run>/data/manifest.json) for a training folder
    (results/<run>[/<variant>]/train/<node>); None when it is not there."""
    for root in train_dir.parents[1:3]:
        try:
            return json.loads((root / RUN_FILES["MANIFEST"]).read_text())
        except (OSError, ValueError):
            continue
    return None


def training_summary(state: dict, metrics: list[dict] | None = None, manifest: dict | None = None) -> dict:
    """What the card says of training, from train_state.json (its config and plan), metrics.jsonl's records
    and the data manifest; a key is left out when what it comes from is not there."""
    cfg, plan = state.get("config") or {}, state.get("plan") or {}
    steps = state.get("step")
    summary = {"strategy": state.get("strategy"), "peft": state.get("peft") or "none", "steps": steps}
    for key in ("precision", "lr", "schedule", "epochs", "max_steps", "micro_batch_size", "grad_accum", "packing"):
        if key in cfg:
            summary[key] = cfg[key]
    if summary["peft"] == "lora":
        summary["lora"] = {k: cfg.get(f"lora_{k}") for k in ("r", "alpha", "dropout", "target_modules")}
    for key in ("world_size", "nodes", "global_batch", "steps_per_epoch", "examples", "tokens"):
        if plan.get(key) is not None:
            summary[key] = plan[key]
    if plan.get("tokens") and plan.get("steps_per_epoch") and steps:
        # every step takes global_batch of the epoch's units: the epochs done times the tokens of one
        summary["tokens_seen"] = round(plan["tokens"] * steps / plan["steps_per_epoch"])
    if metrics:
        if last := last_with(metrics, "loss"):
            summary["train_loss"] = {"step": last.get("step"), "value": last["loss"]}
        if last := last_with(metrics, "eval_loss"):
            summary["eval_loss"] = {"step": last.get("step"), "value": last["eval_loss"]}
    if manifest:
        summary["data"] = {
            "rows_in": manifest.get("rows_in"),
            "rows_trained_on_node": [n.get("rows") for n in manifest.get("nodes", [])],
            "sources": [{"path": s.get("path"), "sha256": s.get("sha256")} for s in manifest.get("sources", [])],
        }
    return summary


def hub_datasets(summary: dict) -> list[str]:
    """The hub ids of the data files that came from a Hugging Face cache's dataset snapshot."""
    ids = []
    for source in (summary.get("data") or {}).get("sources", []):
        if source.get("path") and (snapshot := hub_snapshot(source["path"], "dataset")):
            ids.append(snapshot[0])
    return list(dict.fromkeys(ids))


# ---------------------------------------------------------------- the card


def card_data(base: Base, summary: dict, adapter: bool = False) -> ModelCardData:
    """The front matter: what the hub indexes the folder by."""
    tags = [PROJECT, "fine-tuned", summary.get("strategy") or "unknown-strategy"]
    if summary.get("peft") == "lora":
        tags += ["lora", "peft"] if not adapter else ["lora"]
    if base.hub_id is None:
        tags.append("local-base-model")
    data = ModelCardData(
        base_model=base.name,
        base_model_relation="adapter" if adapter else "finetune",
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(tags)),
        datasets=hub_datasets(summary) or None,
    )
    return data


def base_sentence(base: Base) -> str:
    if base.hub_id:
        commit = f" at commit `{base.revision}`" if base.revision else ""
        return f"[{base.hub_id}](https://huggingface.co/{base.hub_id}){commit} on the Hugging Face Hub"
    return (
        f"a local model, `{base.path}`: it is not on the Hugging Face Hub, and `base_model` above names only its folder"
    )


def number(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}" if isinstance(value, float) else str(value)


def training_rows(summary: dict) -> list[tuple[str, str]]:
    rows = []
    ranks = summary.get("world_size")
    where = f" on {ranks} rank(s), {summary.get('nodes', 1)} node(s)" if ranks else ""
    rows.append(("strategy", f"{summary.get('strategy')}{where}"))
    if summary.get("peft") == "lora":
        lora = summary["lora"]
        modules = ", ".join(lora.get("target_modules") or [])
        lora_text = f"LoRA, r {lora['r']}, alpha {lora['alpha']}, dropout {lora['dropout']} on {modules}"
        rows.append(("fine-tuning", lora_text))
    else:
        rows.append(("fine-tuning", "full (every weight trained)"))
    steps = f"{number(summary.get('steps'))}"
    if summary.get("steps_per_epoch"):
        steps += f" ({number(summary['steps_per_epoch'])} an epoch, global batch {number(summary.get('global_batch'))})"
    rows.append(("optimizer steps", steps))
    if "tokens_seen" in summary:
        rows.append(("tokens seen", f"about {number(summary['tokens_seen'])} ({number(summary['tokens'])} an epoch)"))
    if "examples" in summary:
        rows.append(("data rows", f"{number(summary['examples'])} examples trained on"))
    for key in ("precision", "lr", "schedule", "epochs", "max_steps", "micro_batch_size", "grad_accum", "packing"):
        if summary.get(key) is not None:
            rows.append((key.replace("_", " "), number(summary[key])))
    for key, label in (("train_loss", "final training loss"), ("eval_loss", "final held-out loss")):
        if key in summary:
            rows.append((label, f"{number(summary[key]['value'])} (step {number(summary[key]['step'])})"))
    return rows


def card_body(base: Base, summary: dict, location: str, adapter: bool = False, weights: dict | None = None) -> str:
    """The card's Markdown: what the folder is, how to load it, how it was trained."""
    what = "A LoRA adapter" if adapter else "A causal language model"
    lines = [f"# {Path(location).parent.name if adapter else Path(location).name}", ""]
    lines.append(f"{what} fine-tuned by {PROJECT} from {base_sentence(base)}.")
    if adapter:
        revision = f", revision `{base.revision}`" if base.revision else ""
        lines += [
            "",
            f"`adapter_config.json` names that base as `{base.reference}`{revision}: AutoPeftModelForCausalLM loads"
            " it from any working directory. The merged model (the base with this adapter added in) is the folder"
            " above, with the tokenizer and chat template training used.",
        ]
    lines += ["", "## Use", "", "```python"]
    path = json.dumps(location)
    if adapter:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            f"model = AutoPeftModelForCausalLM.from_pretrained({path})",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"model, tokenizer = AutoModelForCausalLM.from_pretrained({path}), AutoTokenizer.from_pretrained({path})",
        ]
    lines += ["```", ""]
    if not adapter:
        lines += [
            "The tokenizer carries the chat template training used (`apply_chat_template`), and the generation config"
            " stops at its end-of-turn tokens.",
            "",
        ]
    lines += ["## Training", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in training_rows(summary)]
    if weights:
        lines += [f"| weights written | {weights.get('dtype')} ({', '.join(weights.get('files', []))}) |"]
    data = summary.get("data")
    if data:
        lines += ["", "## Data", "", f"{number(data.get('rows_in'))} rows read, from:", ""]
        lines += [f"- `{s['path']}` (sha256 `{s['sha256']}`)" for s in data.get("sources", [])]
    lines += [
        "",
        "## Evaluation",
        "",
        "Scores are written by the workflow's evaluation stage, after this folder (results/<run>/eval/), and are not"
        " in this card: `model-index` is left out.",
        "",
    ]
    return "\n".join(lines)


def card_text(base: Base, summary: dict, location: str, adapter: bool = False, weights: dict | None = None) -> str:
    """The whole README.md: the front matter (card_data) and the body."""
    data = card_data(base, summary, adapter)
    return f"---\n{data.to_yaml()}\n---\n\n{card_body(base, summary, location, adapter, weights)}"


def write_cards(output: Path, state: dict, train_dir: Path | None = None, report: dict | None = None) -> list[Path]:
    """README.md into the model folder and, with LoRA, its adapter/; the paths written. ``train_dir`` is
    the folder of train_state.json (metrics.jsonl beside it), ``report`` consolidate's (the dtype written)."""
    base = base_of(state["base_model"])
    metrics = read_metrics(train_dir / "metrics.jsonl") if train_dir else []
    manifest = find_manifest(train_dir.resolve()) if train_dir else None
    summary = training_summary(state, metrics, manifest)
    output = output.resolve()
    weights = None
    if report:
        weights = {"dtype": report.get("dtype"), "files": report.get("weight_files") or []}
    written = []
    folders = [(output, False)] + ([(output / "adapter", True)] if (output / "adapter").is_dir() else [])
    for folder, adapter in folders:
        ModelCard(card_text(base, summary, str(folder), adapter, None if adapter else weights)).save(folder / CARD)
        written.append(folder / CARD)
    return written


# ---------------------------------------------------------------- a model soup's card

SOUP_KINDS = {
    "soup_uniform": "the element-wise mean of every node model's weights",
    "soup_greedy": "the mean of the node models kept greedily: best held-out loss first, each next one added only"
    " if the soup's held-out loss improved (the eval set chose them, so its scores on it are optimistic)",
}


def node_base(models: list[Path]) -> tuple[str | None, list[str]]:
    """The ``base_model`` the node models' own cards name (None when they have none, or disagree) and the
    hub datasets they name."""
    bases, datasets = set(), []
    for folder in models:
        try:
            data = ModelCard.load(folder / CARD).data
        except Exception:  # no card (a folder consolidated before cards were written), or an unreadable one
            return None, []
        bases.add(data.base_model)
        datasets += data.datasets or []
    return (bases.pop() if len(bases) == 1 else None), list(dict.fromkeys(datasets))


def soup_card_text(location: str, members: list[str], base_model: str | None, datasets: list[str]) -> str:
    """A soup's README.md: its members and how they were averaged, the lines that load it."""
    name = Path(location).name
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=[PROJECT, "model-soup", "merge"],
        datasets=datasets or None,
    )
    fine_tuned = f" (each fine-tuned from `{base_model}`)" if base_model else ""
    path = json.dumps(location)
    body = [
        f"# {name}",
        "",
        f"A model soup by {PROJECT}: {SOUP_KINDS.get(name, 'an average of node models')}, averaged in fp32 and"
        f" saved in the node models' dtype. Members: {', '.join(members)}{fine_tuned}; soup.json beside this"
        " card lists them (and the greedy soup's trail of held-out losses).",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"model, tokenizer = AutoModelForCausalLM.from_pretrained({path}), AutoTokenizer.from_pretrained({path})",
        "```",
        "",
        "How each member was trained: its own card (models/<node>/README.md). Scores: the evaluation stage"
        " (results/<run>/eval/), not this card (`model-index` is left out).",
        "",
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)


def write_soup_card(out: Path, models: list[Path], members: list[str]) -> Path:
    """README.md into a soup's folder, its base and datasets those the node models' cards name."""
    base_model, datasets = node_base(models)
    out = out.resolve()
    ModelCard(soup_card_text(str(out), members, base_model, datasets)).save(out / CARD)
    return out / CARD
