"""eval.task_data: where the extra lm-eval tasks of eval.tasks find their data offline, and the checks that
keep a score meaning what the field means by it (few-shot examples never drawn from the scored documents).

Light on imports (lm-eval only inside functions): common.smk checks the names at parse time.

- a task YAML, or a folder of them: an lm-eval include path; relative data files in a YAML are relative to
  its folder;
- a data file named after a task (``arc_easy.jsonl``): it serves every split the task reads, so only a task
  without few-shot examples from another split;
- a folder named after a task holding one data file per split, each named after the split it replaces
  (``gsm8k/train.jsonl``, ``gsm8k/test.jsonl``).
"""

from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def task_sources(task_data: list[str]) -> tuple[list[str], dict[str, Path | dict[str, Path]]]:
    """eval.task_data: include paths (a task YAML's folder, a folder of task YAMLs) and local data by task: a
    data file named after its task (every split), or a folder named after it of one file per split
    (``gsm8k/train.jsonl``, ``gsm8k/test.jsonl``: {split: file})."""
    include, files = set(), {}
    for p in map(Path, task_data):
        data = sorted(f for f in p.iterdir() if f.suffix in DATA_SUFFIXES) if p.is_dir() else []
        if p.is_dir() and data and not any(p.glob("*.y*ml")):
            files[p.name] = {f.stem: f.resolve() for f in data}
        elif p.is_dir() or p.suffix in (".yaml", ".yml"):
            include.add(str((p if p.is_dir() else p.parent).resolve()))
        elif p.suffix in DATA_SUFFIXES:
            files[p.stem] = p.resolve()
        else:
            raise UserError(f"eval.task_data: {p} is no task YAML, folder or {'/'.join(DATA_SUFFIXES)} file")
    return sorted(include), files


def data_override(entry, files: dict, include: list[str]) -> dict | None:
    """lm-eval config keys for a task's local data: a data file named after it serves every split it reads, a
    folder named after it each split it has a file for; relative data files in a task YAML of eval.task_data
    are relative to the YAML's folder (datasets' data_dir)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if path := files.get(entry.name):
        splits = dict.fromkeys(("train", "validation", "test"), path) if isinstance(path, Path) else path
        kinds = {DATA_SUFFIXES[f.suffix] for f in splits.values()}
        if len(kinds) > 1:
            raise UserError(f"eval.task_data: {entry.name}'s split files mix formats ({sorted(kinds)}): use one")
        data_files = {split: str(f) for split, f in splits.items()}
        return dict(dataset_path=kinds.pop(), dataset_name=None, dataset_kwargs={"data_files": data_files})
    folder = Path(entry.yaml_path).resolve().parent if entry.yaml_path else None
    if folder is None or not any(folder.is_relative_to(d) for d in include):
        return None  # lm-eval's own task, or a YAML outside eval.task_data
    kwargs = load_yaml(entry.yaml_path, resolve_func=False).get("dataset_kwargs") or {}
    return {"dataset_kwargs": {"data_dir": str(folder)} | kwargs} if kwargs.get("data_files") else None


def fewshot_split(task) -> str | None:
    """The split ``task`` draws its few-shot examples from, by lm-eval's rule (ConfigurableTask.fewshot_docs):
    its fewshot split, else its training, validation or test split; None without few-shot examples
    (num_fewshot 0, or examples written into its config)."""
    cfg = task.config
    shots = cfg.fewshot_config or {}
    get = shots.get if isinstance(shots, dict) else lambda key: getattr(shots, key, None)
    if not cfg.num_fewshot:
        return None
    if split := cfg.fewshot_split or get("split"):
        return split
    if get("samples") is not None:
        return None
    return cfg.training_split or cfg.validation_split or cfg.test_split


def missing_split(name: str, split: str, local: dict, what: str = "a split it reads") -> UserError:
    """The one line for a task whose folder of split files lacks ``split``."""
    return UserError(
        f"eval.task_data: {name}'s folder has no {split} file for {what} (split {split!r}); it holds "
        f"{sorted(local)}: each file is named after the split it replaces, e.g. {name}/{split}.jsonl"
    )


def check_local_splits(task, files: dict) -> None:
    """A task scored on local data draws its few-shot examples from other documents than those it scores:
    a folder of split files has the scored split's and the few-shot split's; a single file (every split)
    only serves a task without few-shot examples from another split. Else one line naming the fix."""
    name, cfg = task.config.task, task.config
    scored, shots = cfg.test_split or cfg.validation_split, fewshot_split(task)
    local = files.get(name)
    if isinstance(local, dict):
        for split, what in ((scored, "the documents it scores"), (shots, f"its {cfg.num_fewshot}-shot examples")):
            if split and split not in local:
                raise missing_split(name, split, local, what)
    elif local is not None and shots and shots != scored:
        raise UserError(
            f"eval.task_data: {local} serves every split of {name}, whose {cfg.num_fewshot}-shot examples come "
            f"from its {shots} split: they would be drawn from the {scored} documents it scores; give a folder "
            f"{name}/ with one file per split instead ({name}/{shots}.jsonl, {name}/{scored}.jsonl)"
        )


def check_names(tasks: list[str], task_data: list[str]) -> None:
    """At parse time: every data file and split folder of eval.task_data is named after a task of eval.tasks
    (GSM8K's own test.jsonl, given as is, would serve no task and leave gsm8k to the hub)."""
    _, files = task_sources([p for p in task_data if Path(p).exists()])
    for name, local in files.items():
        if name not in tasks:
            what = f"{next(iter(local.values())).parent}/" if isinstance(local, dict) else str(local)
            raise UserError(
                f"eval.task_data: {what} is named after no task of eval.tasks ({', '.join(tasks) or 'none'}): a data "
                "file is named after its task (gsm8k.jsonl: every split), a folder after its task with one file per "
                "split (gsm8k/train.jsonl, gsm8k/test.jsonl)"
            )
