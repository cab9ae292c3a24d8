"""Config validation, results paths, the base model, scripts' arguments and input functions for every rule file."""

import json
import os
import shlex
import sys
from pathlib import Path

SCRIPTS = Path(workflow.basedir) / "workflow_scripts"
# The rules call `python` and `torchrun` by name: those beside the interpreter running Snakemake come first
# when it holds the training stack, so `.venv/bin/snakemake` works without activating .venv (and a job's
# conda env of --sdm conda still comes before it). Snakemake's jobs (SLURM too) inherit this PATH.
INTERPRETER_BIN = str(Path(sys.executable).parent)
if (Path(INTERPRETER_BIN) / "torchrun").exists() and os.environ.get("PATH", "").split(os.pathsep)[0] != INTERPRETER_BIN:
    os.environ["PATH"] = os.pathsep.join([INTERPRETER_BIN, os.environ.get("PATH", "")])
sys.path.insert(0, str(SCRIPTS))

from presets import preset_name  # noqa: E402
from pipeline_io import UserError  # noqa: E402
from data_formats import check_columns, delimiter_arg, resolve_paths  # noqa: E402
from fingerprint import check_model, local_model_folder  # noqa: E402
from chat_format import has_chat_template, no_template_message, parse_format  # noqa: E402
from settings import validated  # noqa: E402


def fail(message):
    """Stop at parse time with one line on stderr, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


# config/schema.yaml: every key's default filled in, a wrong key, type or value one line naming it
try:
    config.update(validated(config))
except UserError as e:
    fail(e)

RUN = config["run"]
R = f"results/{RUN}"
LOGS = f"logs/{RUN}"
NODES = [f"node{i}" for i in range(config["nodes"])]  # the data shards, one per node
JOINT = config["training"]["mode"] == "joint"
if JOINT and config["nodes"] < 2:
    fail("training.mode joint trains one model over `nodes` machines and needs nodes >= 2 (use per_node for one)")
if JOINT and config["eval"]["soup"]:
    fail("eval.soup averages per-node models; training.mode joint trains one model: set eval.soup to false")
TRAINED = ["joint"] if JOINT else NODES  # the trained models: one over all nodes, or one per node
SOUPS = ["soup_uniform", "soup_greedy"] if config["eval"]["soup"] else []
MODELS = ["base", *TRAINED, *SOUPS]
try:
    PRESET = preset_name(config["model"]["name_or_path"])  # demo, a from-scratch size, or None
except UserError as e:
    fail(e)
DEMO = PRESET is not None  # the base model is built by build_demo_model
METRICS = Path(workflow.basedir) / "metrics"

# Every path under results/<run>/, defined once: rules name these patterns, expand() fills them
# for lists, and .format() fills one wildcard or renames it (train_node reads {shard} as {node}).
DEMO_MODEL = f"{R}/base_model"  # written by build_demo_model
ENV_CHECK = f"{R}/env/check.json"
MANIFEST = f"{R}/data/manifest.json"
SPLIT = f"{R}/data/splits/{{shard}}.parquet"
EVAL_SPLIT = f"{R}/data/eval.parquet"
REJECTS = f"{R}/data/rejects.parquet"
TOKENIZED = f"{R}/data/tokenized/{{shard}}.parquet"  # shard: node0.. or eval
PACKING = f"{R}/data/tokenized/{{shard}}.packing.parquet"
TOKEN_STATS = f"{R}/data/tokenized/{{shard}}.json"
TOKEN_REJECTS = f"{R}/data/tokenized/{{shard}}.rejects.parquet"  # examples tokenization left out
DATA_REPORT = f"{R}/data/report.json"
DATA_PLOT = f"{R}/data/overview.png"
PLAN = f"{R}/plan/memory.json"
PLAN_TABLE = f"{R}/plan/memory.csv"
TRAIN_DIR = f"{R}/train/{{node}}"  # node: node0.. or joint
TRAIN_METRICS = f"{TRAIN_DIR}/metrics.jsonl"
TRAIN_STATE = f"{TRAIN_DIR}/train_state.json"
CHECKPOINTS = f"{R}/checkpoints/{{node}}"
MODEL_DIR = f"{R}/models/{{model}}"  # model: a trained node, joint or a soup (base is BASE_MODEL)
EVAL_RESULT = f"{R}/eval/{{model}}.json"
LM_EVAL_RESULT = f"{R}/eval/lm_eval/{{model}}.json"  # lm-eval's own results JSON (results, configs, ...)
SUMMARY = f"{R}/eval/summary.csv"
LOSS_CURVES = f"{R}/eval/loss_curves.png"
THROUGHPUT = f"{R}/eval/throughput.png"
LEADERBOARD = f"{R}/eval/leaderboard.png"
CATEGORIES = f"{R}/eval/categories.png"
SAMPLES = f"{R}/eval/samples.csv"
CONSOLIDATION = f"{R}/eval/consolidation.csv"
PROVENANCE = f"{R}/provenance.json"

# The base model, one name per use:
# what from_pretrained loads (the demo build, a local path or a hub id),
BASE_MODEL = DEMO_MODEL if DEMO else config["model"]["name_or_path"]
# the same as a tracked input, where it is a file-system path (a hub id is none),
BASE_MODEL_INPUT = BASE_MODEL if DEMO or Path(BASE_MODEL).exists() else []
# and what plan_training needs of it, its shape: a preset by name, or the model's config.
MODEL_SHAPE = ("demo" if PRESET == "demo" else f"preset:{PRESET}") if DEMO else BASE_MODEL
# A folder without config.json, a path that does not exist, a hub id not in the cache while offline:
# one line naming model.name_or_path, before any job runs.
try:
    DEMO or check_model(BASE_MODEL)
except UserError as e:
    fail(e)


wildcard_constraints:
    node="|".join(TRAINED),
    model="|".join(MODELS),
    shard="|".join(NODES),


# Fail at parse time, before any job runs, when the data cannot be used.
DATA = config["data"]
DATA_SPECS = [spec for spec in (DATA["path"], DATA["eval_path"]) if spec]  # as written: a file, folder or glob
try:
    for spec in DATA_SPECS:
        check_columns(spec, DATA["format"], DATA["mapping"], DATA["columns"], delimiter_arg(DATA["delimiter"]))
    DATA_FILES = [str(p) for spec in DATA_SPECS for p in resolve_paths(spec)]  # every input data file
except UserError as e:
    fail(e)


# eval.tasks run offline: a task's local YAML or data file that is not there stops before any job runs
# (a task of lm-eval's own without eval.task_data is checked by evaluate_model, before its model loads).
EVAL = config["eval"]
for path in EVAL["task_data"]:
    if not Path(path).exists():
        fail(f"eval.task_data: {path} does not exist (evaluation runs offline: a task's data must be local)")
EVAL_TASK_FILES = EVAL["task_data"]  # evaluate_model's inputs: a changed task reruns it
VLLM = EVAL["backend"] == "vllm"  # vLLM pins an older transformers: its own environment
EVAL_ENV = "../envs/eval-vllm.yaml" if VLLM else "../envs/eval.yaml"  # with --sdm conda
# without conda: the interpreter of a venv with vLLM (README, "vLLM backend"), else the project's `python`
EVAL_PYTHON = os.environ.get("EVAL_VLLM_PYTHON", "python") if VLLM else "python"


def check_template():
    """The base model's tokenizer gets a chat template: data.chat_template, data.format_template (a valid
    one), or its own where its files can tell (a local folder or a cached hub model; else split_dataset
    says so)."""
    if DATA["chat_template"] and DATA["format_template"]:
        raise UserError("data.chat_template and data.format_template are both set; set one")
    if DATA["format_template"]:
        parse_format(DATA["format_template"])
    if DEMO or DATA["chat_template"] or DATA["format_template"]:
        return
    try:
        folder = local_model_folder(BASE_MODEL)
    except UserError:
        return
    if has_chat_template(folder) is False:
        raise UserError(no_template_message(f"model.name_or_path {BASE_MODEL}"))


try:
    check_template()
except UserError as e:
    fail(e)


def cli_args(**options):
    """`--some-option value` (shell-quoted) for each option with a value, in order; None and "" are left out."""
    return " ".join(
        f"--{name.replace('_', '-')} {shlex.quote(str(value))}"
        for name, value in options.items()
        if value not in (None, "")
    )


def verbatim(args):
    """A params function giving ``args`` as they are: Snakemake fills {name} in a params string with
    wildcards, and data.format_template's {question} is no wildcard."""
    return lambda wildcards: args


# The command-line arguments of the scripts that read the data config (split.py and tokenization.py
# share what they need to count tokens).
TOKENIZER_OPTIONS = dict(
    tokenizer=BASE_MODEL,
    chat_template=DATA["chat_template"],
    format_template=DATA["format_template"],
    max_seq_len=DATA["max_seq_len"],
    overlength=DATA["overlength"],
    template_kwargs=json.dumps(DATA["template_kwargs"]),
)
SPLIT_ARGS = cli_args(
    data=DATA["path"],
    eval_data=DATA["eval_path"],
    format=DATA["format"],
    delimiter=DATA["delimiter"],
    mapping=DATA["mapping"],
    columns=json.dumps(DATA["columns"]),
    category_column=DATA["category_column"],
    nodes=config["nodes"],
    eval_fraction=DATA["eval_fraction"],
    seed=DATA["seed"],
    balance=DATA["balance"],
    special_text=DATA["special_text"],
    **TOKENIZER_OPTIONS,
    max_reject_fraction=DATA["max_reject_fraction"],
)
TOKENIZE_ARGS = cli_args(
    **TOKENIZER_OPTIONS,
    train_on=DATA["train_on"],
    cache_dir=DATA["cache_dir"],
    max_reject_fraction=DATA["max_reject_fraction"],
)
# params functions, not strings (see verbatim): they carry data.format_template
SPLIT_ARGS, TOKENIZE_ARGS = verbatim(SPLIT_ARGS), verbatim(TOKENIZE_ARGS)
# The template training used, for the exported model folders (consolidate_node)
TEMPLATE_ARGS = verbatim(
    cli_args(
        chat_template=DATA["chat_template"],
        format_template=DATA["format_template"],
        template_kwargs=json.dumps(DATA["template_kwargs"]),
    )
)
EVAL_ARGS = verbatim(
    cli_args(
        batch_size=EVAL["batch_size"],
        max_new_tokens=EVAL["max_new_tokens"],
        max_samples=EVAL["max_samples"],
        backend=EVAL["backend"],
        precision=config["training"]["precision"] if EVAL["precision"] == "training" else EVAL["precision"],
        tasks=json.dumps(EVAL["tasks"]),
        task_data=json.dumps(EVAL["task_data"]),
        chat_template=json.dumps(EVAL["apply_chat_template"]),
        template_kwargs=json.dumps(DATA["template_kwargs"]),
    )
)
# A node's shard must fill one micro-batch on every rank of its node, in packed bins (training.packing)
# or examples, before a training job is queued (joint mode: asked of each shard, more than it needs).
PER_RANK = config["training"]["micro_batch_size"] * config["training"]["procs_per_node"]
NODE_TOKENIZE_ARGS = cli_args(**{"min_bins" if config["training"]["packing"] else "min_examples": PER_RANK})
DEMO_MODEL_ARGS = cli_args(
    data=DATA["path"],  # as written: a folder or glob stays one argument
    format=DATA["format"],
    mapping=DATA["mapping"],
    columns=json.dumps(DATA["columns"]),
    vocab_size=config["model"]["demo_vocab_size"],
    max_seq_len=DATA["max_seq_len"],
    seed=config["model"]["seed"],
    preset=PRESET,
)


def script_path(name):
    """Path of a workflow script, passed to shell commands through params."""
    return str(SCRIPTS / name)


def get_model(wildcards, input=None):
    """The model a job loads: results/<run>/models/<model>, or the base model (model=base, or a job
    without a {model} wildcard: training).

    As an input function the base model is BASE_MODEL_INPUT (a hub id is no file); as a params
    function (Snakemake passes the job's `input` to one that takes it) it is BASE_MODEL. A param
    given as a plain path would be taken by `snakemake --lint` for a hard-coded input prefix.
    """
    model = wildcards.get("model", "base")
    if model != "base":
        return MODEL_DIR.format(model=model)
    return BASE_MODEL_INPUT if input is None else BASE_MODEL


def training_json():
    """The trainer's config: the validated `training` section (train.py builds its TrainConfig from it)."""
    return json.dumps(config["training"], sort_keys=True)


MEMORY_KEYS = ["mode", "strategy", "zero_stage", "offload", "peft", "lora", "procs_per_node", "precision",
               "micro_batch_size", "gradient_checkpointing", "gpu_memory_gb"]  # fmt: skip


def memory_json():
    """The training keys that change memory use (so a new learning rate does not rerun the plan)."""
    keys = {k: config["training"][k] for k in MEMORY_KEYS} | {"nodes": config["nodes"]}
    if JOINT:  # ZeRO and FSDP shard over every node's ranks
        keys["world_size"] = config["nodes"] * config["training"]["procs_per_node"]
    return json.dumps(keys, sort_keys=True)


def train_mem_mb():
    """The host memory (MB, per node) of the training job as Snakemake will submit it, for plan_training:
    the train_node / train_joint `mem_mb` of --set-resources (profiles/slurm: TRAIN_MEM_MB), else of
    --default-resources; None when neither sets a fixed number (no profile: no limit to check)."""
    settings = workflow.resource_settings
    name = "train_joint" if JOINT else "train_node"
    for resources in (settings.overwrite_resources.get(name) or {}, settings.default_resources or {}):
        if "mem_mb" in resources:  # Snakemake has turned mem, mem_mib and "500GB" into mem_mb
            value = resources["mem_mb"]
            if hasattr(value, "is_evaluable"):  # a parsed Resource; an evaluable one depends on the job
                value = None if value.is_evaluable() else value.value
            return value if isinstance(value, int) else None
    return None


def final_outputs():
    """The report's inputs and each trained model (so a deleted model is rebuilt)."""
    return [
        *expand(MODEL_DIR, model=TRAINED),
        ENV_CHECK,
        MANIFEST,
        DATA_REPORT,
        PLAN,
        SUMMARY,
        LOSS_CURVES,
        LEADERBOARD,
        PROVENANCE,
    ]
