"""eval.tasks checked at parse time, before any job: each task is lm-eval's own (a task, group or tag of its
index) or defined by a task YAML of eval.task_data, and a folder of split files holds the splits it reads.

lm-eval's TaskManager parses its ~14,000 task YAMLs on every start (5-10 s, after 3 s of imports). The same
names, by the same rules (lm_eval.tasks._index.TaskIndex: a YAML's ``class`` or ``task`` is a task and its
``tag`` a tag, its ``group`` a group; ``include`` merged first), are read here without importing lm-eval,
once per lm-eval installation: the index (name -> kind and YAML) is kept as JSON under
.snakemake/lm_eval_tasks/, keyed by lm-eval's version and the folder of its tasks.
"""

import difflib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import yaml

from workflow_scripts.core.pipeline_io import UserError, atomic_path
from workflow_scripts.evals.task_data import check_local_splits, task_sources

CACHE = Path(".snakemake") / "lm_eval_tasks"  # relative to the workflow's working directory
CONFIG_KEYS = ("task", "training_split", "validation_split", "test_split", "fewshot_split", "num_fewshot",
               "fewshot_config")  # fmt: skip
NAMING_RULE = "a task is named by the `task:` (or `group:`, `tag:`) of its YAML, lm-eval's own or one in eval.task_data"


class _Loader(yaml.CSafeLoader if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader):
    """YAML with lm-eval's ``!function`` tags read as plain strings (nothing imported)."""


_Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def load_task_yaml(path: Path, seen: frozenset = frozenset(), loaded: dict | None = None) -> dict:
    """A task YAML with its ``include`` files merged under it, as lm-eval's load_yaml merges them. ``loaded``:
    the files already read, by path (thousands of lm-eval's YAMLs include the same few)."""
    path, loaded = Path(os.path.abspath(path)), {} if loaded is None else loaded  # abspath: no realpath calls
    if path in seen:
        raise ValueError(f"include cycle at {path}")
    if path not in loaded:
        loaded[path] = yaml.load(path.read_bytes(), Loader=_Loader)  # noqa: S506 (SafeLoader, one more tag)
    cfg = dict(loaded[path]) if isinstance(loaded[path], dict) else None
    if cfg is None:
        raise ValueError(f"{path} is no YAML mapping")
    includes = cfg.pop("include", None) or []
    merged = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        merged |= load_task_yaml(path.parent / inc, seen | {path}, loaded)
    return merged | cfg


def names_of(cfg: dict) -> list[tuple[str, str]]:
    """(name, kind) of what a task YAML defines, by lm-eval's TaskIndex rules: a ``class`` or ``task`` is a
    task (and each of its ``tag`` a tag), else a ``group`` a group."""
    if "class" in cfg or ("task" in cfg and "group" not in cfg):
        tags = cfg.get("tag") or []
        return [(str(cfg["task"]), "task")] + [(str(t), "tag") for t in ([tags] if isinstance(tags, str) else tags)]
    if "group" in cfg:
        return [(str(cfg["group"]), "group")]
    return []


def build_index(root: Path) -> dict[str, dict]:
    """Every name the task YAMLs under ``root`` define: {name: {"kind", "yaml"}} (yaml relative to ``root``;
    a tag's is its first task's). A YAML that does not load is skipped, as lm-eval skips it."""
    index, loaded = {}, {}
    for path in sorted(root.glob("**/*.yaml"), key=lambda p: p.as_posix()):
        if {"__pycache__", ".ipynb_checkpoints"} & set(path.parts):
            continue
        try:
            defined = names_of(load_task_yaml(path, loaded=loaded))
        except Exception:  # noqa: BLE001 (lm-eval skips a YAML it cannot read, whatever the error)
            continue
        for name, kind in defined:
            index.setdefault(name, {"kind": kind, "yaml": path.relative_to(root).as_posix()})
    return index


def lm_eval_tasks_dir() -> tuple[str, Path] | None:
    """lm-eval's version and the folder of its task YAMLs, without importing it; None where it is not installed."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return importlib.metadata.version("lm_eval"), Path(next(iter(spec.submodule_search_locations))) / "tasks"


def lm_eval_index(cache: Path = CACHE) -> tuple[str, Path, dict[str, dict]] | None:
    """lm-eval's version, tasks folder and index, from ``cache`` when it holds this installation's (else built,
    ~2 s, and kept there; a cache that cannot be written is skipped). None without lm-eval."""
    found = lm_eval_tasks_dir()
    if found is None:
        return None
    version, root = found
    path = cache / f"{version}-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}.json"
    try:
        return version, root, json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    index = build_index(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(index, sort_keys=True))
    except OSError:
        pass
    return version, root, index


def lm_eval_task_folders(names: set[str], cache: Path = CACHE) -> list[str]:
    """The folders of the YAMLs of lm-eval's own tasks ``names``, by the index: a TaskManager over them knows
    those tasks without parsing lm-eval's 14,000 YAMLs. [] unless each name is a task there (a group or a tag
    may reach across folders)."""
    index = (lm_eval_index(cache) or (None, None, {}))[2]
    if not names or not all(index.get(n, {}).get("kind") == "task" for n in names):
        return []
    root = lm_eval_tasks_dir()[1]
    return sorted({str((root / index[n]["yaml"]).parent) for n in names})


def task_config(yaml_path: Path) -> SimpleNamespace:
    """What check_local_splits reads of a task (its splits and few-shot settings), from its YAML."""
    cfg = load_task_yaml(yaml_path)
    return SimpleNamespace(config=SimpleNamespace(**{k: cfg.get(k) for k in CONFIG_KEYS}))


def unknown_task(name: str, version: str | None, index: dict, local: dict) -> UserError:
    near = difflib.get_close_matches(name, [*index, *local], n=3, cutoff=0.75)
    found = f"lm-eval {version} has none of that name"
    yamls = ", ".join(f"{n} ({p.name})" for n, p in sorted(local.items())) or "none"
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return UserError(
        f"eval.tasks: {name} is no task: {found}, and eval.task_data's YAMLs define {yamls}; {NAMING_RULE}{hint}"
    )


def check_tasks(tasks: list[str], task_data: list[str], cache: Path = CACHE) -> None:
    """At parse time: each task of eval.tasks is defined by a YAML of eval.task_data or known to lm-eval; a
    folder of split files named after a task holds only splits it reads, among them the split it scores and
    the split of its few-shot examples; one data file for every split, only a task whose few-shot examples do
    not come from another split than the scored one. Else one line naming the task, what was found and the rule. Where
    Snakemake's own environment has no lm-eval (the jobs run in another), lm-eval's names are left to the jobs."""
    include, files = task_sources([p for p in task_data if Path(p).exists()])
    local = {}  # name -> (YAML, kind)
    for folder in map(Path, include):
        local |= {n: (folder / e["yaml"], e["kind"]) for n, e in build_index(folder).items() if n not in local}
    for path in (Path(p) for p in task_data if Path(p).suffix in (".yaml", ".yml") and Path(p).is_file()):
        try:  # a YAML given by its path
            local |= {n: (path, kind) for n, kind in names_of(load_task_yaml(path))}
        except (OSError, ValueError, yaml.YAMLError) as e:
            reason = " ".join(str(e).split())[:200]
            raise UserError(f"eval.task_data: {path} is no task YAML lm-eval can read ({reason})") from None
    lm_eval = None
    for name in tasks:
        if name in local:
            yaml_path, kind = local[name]
        else:
            lm_eval = lm_eval or lm_eval_index(cache) or (None, None, None)
            version, root, index = lm_eval
            if index is None:  # no lm-eval where Snakemake runs (its jobs' environment has it): they check
                continue
            if name not in index:
                raise unknown_task(name, version, index, {n: p for n, (p, _) in local.items()})
            yaml_path, kind = root / index[name]["yaml"], index[name]["kind"]
        if name in files and kind == "task":  # a folder of split files, or one file for every split
            task = task_config(yaml_path)
            if isinstance(files[name], dict):
                check_split_files(name, task, files[name])
            else:
                check_local_splits(task, files)


def check_split_files(name: str, task, split_files: dict) -> None:
    """A folder of split files: each named after a split the task reads; the scored and few-shot splits there."""
    cfg = task.config
    reads = {s for s in (cfg.training_split, cfg.validation_split, cfg.test_split, cfg.fewshot_split) if s}
    for split, path in sorted(split_files.items()):
        if split not in reads:
            raise UserError(
                f"eval.task_data: {path} is named after no split {name} reads ({', '.join(sorted(reads))}): "
                f"each file of {name}/ is named after the split it replaces, e.g. "
                f"{name}/{cfg.test_split or cfg.validation_split}.jsonl"
            )
    check_local_splits(task, {name: split_files})
