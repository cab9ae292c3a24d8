"""Where a run's files live: every path under results/<run>/, defined once.

rules/common.smk builds its path patterns from these (the rules name them, Snakemake fills the wildcards)
and status.py reads a run's files by them, so a folder renamed here moves in both. A grid's variants each
plan, train, consolidate, evaluate and summarize under results/<run>/<variant>/ (VARIANT_FILES); without
a grid those paths are under results/<run>/ itself. The rest (RUN_FILES) is shared by every variant.
Logs go under logs/<run>/ (logs/<run>/<variant>/ for a variant's jobs), each rule naming its own file.
"""

import json
import string
from pathlib import Path

from workflow_scripts.core.pages import PAGES as REPORT_PAGES

RESULTS = "results/{run}"
LOGS = "logs/{run}"
VARIANT = "{variant}"  # a grid variant's folder under results/<run>/ and logs/<run>/

# under results/<run>/, shared by a grid's variants
RUN_FILES = {
    "DEMO_MODEL": "base_model",  # written by build_demo_model
    "FETCH_RECORD": "base_model.json",  # fetch_model's record of a hub model: repo, revision, sha, snapshot folder
    "ENV_CHECK": "env/check.json",
    "MANIFEST": "data/manifest.json",
    "SPLIT": "data/splits/{shard}.parquet",
    "EVAL_SPLIT": "data/eval.parquet",
    "REJECTS": "data/rejects.parquet",
    "TOKENIZED": "data/tokenized/{shard}.parquet",  # shard: node0.. or eval
    "PACKING": "data/tokenized/{shard}.packing.parquet",
    "TOKEN_STATS": "data/tokenized/{shard}.json",
    "TOKEN_REJECTS": "data/tokenized/{shard}.rejects.parquet",  # examples tokenization left out
    # training.dpo.reference cached: the base model's log-probability of each tokenized row (reference_logps)
    "REFERENCE_LOGPS": "data/reference_logps/{shard}.parquet",
    "DECONTAMINATION": "data/decontamination.json",  # data.decontaminate's report
    "DECONTAMINATED": "data/decontaminated/{shard}.parquet",  # data.decontaminate: drop: the shard without them
    "CONTAMINATED": "data/contaminated.parquet",  # data.decontaminate: drop: the rows left out
    "DATA_REPORT": "data/report.json",
    "DATA_PLOT": "data/overview.png",
    "BASE_EVAL": "eval/{model}.json",  # model: base; shared by a grid's variants (evaluate_base)
    "BASE_LM_EVAL": "eval/lm_eval/{model}.json",
    "GRID_TABLE": "eval/grid.csv",  # compare_grid: every variant's models against base
    "GRID_PLOT": "eval/grid.png",
    "REPORT": "report.html",  # snakemake --report (the Makefile)
    "TRACKERS": "trackers",  # logging.trackers' local stores: wandb's offline runs, MLflow's SQLite store
}

# under a variant's folder: results/<run>/<variant>/ with a grid, results/<run>/ without
VARIANT_FILES = {
    "PLAN": "plan/memory.json",
    "PLAN_TABLE": "plan/memory.csv",
    "TRAIN_DIR": "train/{node}",  # node: node0.. or joint; train.py's --log-dir
    "TRAIN_METRICS": "train/{node}/metrics.jsonl",
    "TRAIN_PLAN": "train/{node}/plan.json",  # the training job's own plan (steps, resumed from)
    "TRAIN_STATE": "train/{node}/train_state.json",
    "CHECKPOINTS": "checkpoints/{node}",
    "MODEL_DIR": "models/{model}",  # model: a trained node, joint or a soup (base is BASE_MODEL)
    "EVAL_RESULT": "eval/{model}.json",
    "PREFERENCE_RESULT": "eval/preference/{model}.json",  # training.objective dpo: held-out preference accuracy
    "LM_EVAL_RESULT": "eval/lm_eval/{model}.json",  # lm-eval's own results JSON (results, configs...)
    "SUMMARY": "eval/summary.csv",
    "TASKS": "eval/tasks.csv",  # one row per model x task x metric, the held-out set as task "heldout"
    "TASKS_PLOT": "eval/tasks.png",
    "LOSS_CURVES": "eval/loss_curves.png",
    "THROUGHPUT": "eval/throughput.png",
    "LEADERBOARD": "eval/leaderboard.png",
    "LEADERBOARD_TEXT": "eval/leaderboard.txt",
    "CATEGORIES": "eval/categories.png",
    "SAMPLES": "eval/samples.csv",
    "CONSOLIDATION": "eval/consolidation.csv",
    "PROVENANCE": "provenance.json",
    # make publish (publish.repo_id): what went to the hub of each model, its repo, commit and files (publish_model)
    "PUBLISH_RECORD": "publish/{model}.json",
    # eval.checkpoints all/every_n: each scored checkpoint (key: the trainer's run key, train_state.json's
    # plan.checkpoints), its model consolidated for the time of its evaluation, and the table and curves of all
    "CHECKPOINT_MODEL": "eval/checkpoints/{node}/{key}/step-{step}.model",
    "CHECKPOINT_EVAL": "eval/checkpoints/{node}/{key}/step-{step}.json",
    "CHECKPOINT_LM_EVAL": "eval/checkpoints/{node}/{key}/step-{step}.lm_eval.json",
    "CHECKPOINT_SCORES": "eval/checkpoints.csv",
    "CHECKPOINT_PLOT": "eval/checkpoints.png",
}


def place_pages(pages) -> tuple[dict[str, str], dict[str, str]]:
    """The report's pages (report_pages.PAGES) as layout names: each beside the file it renders, a variant's
    page (in VARIANT_FILES) where that file is a variant's, else the run's (in RUN_FILES). A page whose file or
    image is no layout name stops here, naming it."""
    run, variant = {}, {}
    for page in pages:
        for name in (page.source, *page.images):
            if name not in RUN_FILES and name not in VARIANT_FILES:
                raise ValueError(f"report_pages.py: page {page.name!r}: {name} is no file of layout.py")
        (variant if page.source in VARIANT_FILES else run)[page.key] = page.path
    return run, variant


# the report's pages (report_pages.py, rendered by rules/report_pages.smk): an output above as HTML the report
# shows in place
RUN_PAGES, VARIANT_PAGES = place_pages(REPORT_PAGES)
RUN_FILES |= RUN_PAGES
VARIANT_FILES |= VARIANT_PAGES


class Pattern(str):
    """A path pattern whose .format() fills the wildcards it is given and keeps the others as they are
    (a grid variant's paths hold {variant}, which the job's wildcards fill)."""

    class Keep(dict):
        def __missing__(self, key):
            return f"{{{key}}}"

    def format(self, *args, **kwargs):
        return Pattern(string.Formatter().vformat(self, args, self.Keep(kwargs)))


def patterns(run: str, grid: bool) -> dict[str, Pattern]:
    """Every path pattern of ``run`` by name (RUN_FILES and VARIANT_FILES), as the rules name them, and the
    prefixes R (results/<run>), LOGS, and V, VLOGS (a variant's: with {variant} when ``grid``)."""
    r, logs = RESULTS.format(run=run), LOGS.format(run=run)
    v, vlogs = (f"{r}/{VARIANT}", f"{logs}/{VARIANT}") if grid else (r, logs)
    return (
        {"R": r, "LOGS": logs, "V": v, "VLOGS": vlogs}
        | {name: Pattern(f"{r}/{path}") for name, path in RUN_FILES.items()}
        | {name: Pattern(f"{v}/{path}") for name, path in VARIANT_FILES.items()}
    )


def file(prefix: Path, name: str, **wildcards) -> Path:
    """File ``name`` of RUN_FILES or VARIANT_FILES under ``prefix`` (results/<run>/ or a variant's folder), its
    wildcards filled ("*" for a glob)."""
    return prefix / (RUN_FILES | VARIANT_FILES)[name].format(**wildcards)


def matching(prefix: Path, name: str, **wildcards) -> list[Path]:
    """The existing paths of file ``name`` under ``prefix`` whose wildcards are given as globs ("*"), sorted."""
    return sorted(prefix.glob((RUN_FILES | VARIANT_FILES)[name].format(**wildcards)))


def expected_train_dirs(results: Path, config: dict | None) -> list[Path]:
    """Every training folder (TRAIN_DIR) results/<run>/ is to have, made or not yet: with the run's ``config``,
    each grid variant's `joint` or node0..node<nodes-1> (none for an invalid config); without it, as
    many nodes as the split's manifest lists (node0.. under results/<run>/), or none before the split or where
    the folders show a joint or grid run."""
    if config is not None:
        from workflow_scripts.core.pipeline_io import UserError
        from workflow_scripts.core.settings import validated
        from workflow_scripts.core.variants import expand_grid

        try:
            config = validated(config)
            variants = list(expand_grid(config["grid"]))
        except UserError:
            return []
        names = ["joint"] if config["training"]["mode"] == "joint" else [f"node{i}" for i in range(config["nodes"])]
        prefixes = [results / v for v in variants] or [results]
        return [file(p, "TRAIN_DIR", node=n) for p in prefixes for n in names]
    grid = any(matching(p, "TRAIN_DIR", node="*") for p in results.iterdir() if p.is_dir())
    if grid or matching(results, "TRAIN_DIR", node="joint"):
        return []
    try:
        nodes = json.loads(file(results, "MANIFEST").read_text()).get("nodes")
    except (OSError, ValueError, AttributeError):
        return []
    return [file(results, "TRAIN_DIR", node=f"node{i}") for i in range(len(nodes))] if isinstance(nodes, list) else []
