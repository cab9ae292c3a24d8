"""Config validation, results paths, the base model, scripts' arguments and input functions for every rule file."""

import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path

from workflow_scripts.model.presets import preset_name
from workflow_scripts.core.pipeline_io import UserError, interpreter_first_on_path
from workflow_scripts.data.mappings import check_rows_fill_nodes, first_tool_row, resolve_mapping
from workflow_scripts.data.readers import delimiter_arg, resolve_paths
from workflow_scripts.data.tool_calls import check_model_template_renders_tools, check_tools_config
from workflow_scripts.core.fingerprint import check_model, is_hub_id, local_model_folder
from workflow_scripts.core.hub_model import absent_message, cached_snapshot, read_record, resolve_commit
from workflow_scripts.data.chat_format import chat_template_text, format_list, has_chat_template, no_template_message
from workflow_scripts.core.settings import accumulation, as_before_objectives, check_grid, job_ranks, validated
from workflow_scripts.core.settings import check_publish
from workflow_scripts.core.settings import OBJECTIVE_CONFIG_KEYS, reads_cached_reference
from workflow_scripts.core.settings import ConsolidateConfig, DemoModelConfig, EnvironmentConfig, EvalConfig, GridConfig
from workflow_scripts.core.settings import TEMPLATE_KEYS, DecontaminateConfig, PlanConfig, SplitConfig, TokenizeConfig
from workflow_scripts.core.variants import expand_grid, variant_training
from workflow_scripts.core.layout import patterns
from workflow_scripts.core.wildcards import one_of
from workflow_scripts.evals.task_data import check_names as check_task_names
from workflow_scripts.evals.task_index import check_tasks

SCRIPTS = Path(workflow.basedir) / "workflow_scripts"
RUN_STARTED = time.time()  # handlers.smk: a SLURM log older than this run is an earlier run's

# The rules call `python` and `torchrun` by name: .venv/bin/snakemake works without activating .venv.
interpreter_first_on_path()


def fail(message):
    """Stop at parse time with one line on stderr, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


# config/schema.yaml: every key's default filled in, a wrong key, type or value one line naming it
# and each grid key and value checked against the training keys (settings.check_grid)
try:
    config.update(validated(config))
    check_grid(config["grid"])
    VARIANTS = expand_grid(config["grid"])  # a grid variant's name -> its values; {} without `grid:`
except UserError as e:
    fail(e)
GRID = bool(VARIANTS)

RUN = config["run"]
# Every path under results/<run>/ (workflow_scripts/core/layout.py, which status.py reads them by), as the rules
# name them: R, LOGS; V, VLOGS (a grid variant's prefixes, results/<run>/<variant>/ and logs/<run>/<variant>/;
# without a grid results/<run>/ itself); ENV_CHECK, MANIFEST, SPLIT, ..., TRAIN_DIR, ..., GRID_PLOT. expand()
# fills them for lists, and .format() fills one wildcard or renames it (train_node reads {shard} as {node}).
# The variant's paths (layout.VARIANT_FILES: PLAN to PROVENANCE) hold {variant}: expand those with allow_missing=True.
globals().update(patterns(RUN, GRID))
# The same paths with the run left as a wildcard, {run}, held to RUN (wildcard_constraints below): the report pages'
# rules write theirs by these, so `snakemake --list-target-rules`, which lists the rules without a wildcard, leaves
# them out (a page is never a target of its own). The paths written are the same.
PAGES = patterns("{run}", GRID)
NODES = [f"node{i}" for i in range(config["nodes"])]  # the data shards, one per node
JOINT = config["training"]["mode"] == "joint"
if JOINT and config["nodes"] < 2:
    fail("training.mode joint trains one model over `nodes` machines and needs nodes >= 2 (use per_node for one)")
if JOINT and config["eval"]["soup"]:
    fail("eval.soup averages per-node models; training.mode joint trains one model: set eval.soup to false")
TRAINED = ["joint"] if JOINT else NODES  # the trained models: one over all nodes, or one per node
SOUPS = ["soup_uniform", "soup_greedy"] if config["eval"]["soup"] else []
MODELS = ["base", *TRAINED, *SOUPS]
# make publish only (rules/publish.smk): the models publish.repo_id names, each published by publish_model
PUBLISH = config["publish"]
try:
    check_publish(PUBLISH, [*TRAINED, *SOUPS], config["training"]["peft"] == "lora", GRID)
except UserError as e:
    fail(e)
try:
    PRESET = preset_name(config["model"]["name_or_path"])  # demo, a from-scratch size, or None
except UserError as e:
    fail(e)
DEMO = PRESET is not None  # the base model is built by build_demo_model


def hub_repo(name_or_path):
    """The hub id model.name_or_path names, None for a local folder (fingerprint.is_hub_id)."""
    return name_or_path if is_hub_id(name_or_path) else None


def resolve_hub_model(repo, revision, record, main_process):
    """The commit sha model.revision means for this parse (hub_model.resolve_commit): the hub's, asked
    only by the main Snakemake process and only online; the cache's ref or fetch_model's record offline and
    in a job's own Snakemake (a SLURM job re-parses this file on a compute node, without internet).
    Offline, the main process also needs that commit's files here (the cache, or the record's snapshot
    folder): one line naming the `hf download` command that fetches them."""
    from huggingface_hub import constants

    online = not constants.HF_HUB_OFFLINE
    sha = resolve_commit(repo, revision, record, online, main_process)
    if main_process and not online and cached_snapshot(repo, sha) is None:
        fetched = read_record(record) or {}
        if fetched.get("sha") != sha or not (Path(fetched.get("snapshot") or "") / "config.json").is_file():
            raise UserError(absent_message(repo, revision))
    return sha


# A hub id is fetched by fetch_model (rules/fetch_model.smk) at the commit model.revision resolves to:
# HUB_REPO, HUB_REVISION, HUB_SHA (resolve_hub_model); None for a local folder, the demo or a preset.
HUB_REPO = None if DEMO else hub_repo(config["model"]["name_or_path"])
HUB_REVISION = config["model"]["revision"]
try:
    HUB_SHA = HUB_REPO and resolve_hub_model(HUB_REPO, HUB_REVISION, FETCH_RECORD, workflow.is_main_process)
except UserError as e:
    fail(e)

# The base model, one name per use:
# what the jobs load (the demo build, a local path, or fetch_model's record of a hub model, which each
# script turns into the snapshot folder: fingerprint.model_location),
BASE_MODEL = DEMO_MODEL if DEMO else FETCH_RECORD if HUB_REPO else config["model"]["name_or_path"]
# the same as a tracked input, where it is a file-system path (a refetched record reruns its readers),
BASE_MODEL_INPUT = BASE_MODEL if DEMO or HUB_REPO or Path(BASE_MODEL).exists() else []
# and what plan_training needs of it, its shape: a preset by name, or the model's config.
MODEL_SHAPE = ("demo" if PRESET == "demo" else f"preset:{PRESET}") if DEMO else BASE_MODEL
# A hub model's record as an input of the jobs that name its shape or its commit without loading it
# (plan_training, provenance): a refetch reruns them too. A local folder's shape is read as it is, as before.
BASE_RECORD_INPUT = FETCH_RECORD if HUB_REPO else []
# A folder without config.json, a path that does not exist: one line naming model.name_or_path, before any
# job runs (a hub id's absence offline stopped in resolve_hub_model).
try:
    DEMO or HUB_REPO or check_model(BASE_MODEL)
except UserError as e:
    fail(e)


# exactly these names, each as a short regex (core/wildcards.py: an alternation of 256 names is slow to compile and match)
wildcard_constraints:
    node=one_of(TRAINED),
    model=one_of(MODELS),
    shard=one_of(NODES),
    variant=one_of(VARIANTS),  # without a grid nothing is a variant
    run=re.escape(RUN),  # PAGES' {run}: the config's run only


# Fail at parse time, before any job runs, when the data cannot be used.
DATA = config["data"]
DATA_SPECS = [spec for spec in (DATA["path"], DATA["eval_path"]) if spec]  # as written: a file, folder or glob
try:
    DELIMITER = delimiter_arg(DATA["delimiter"])
    DATA_MAPPINGS = [
        resolve_mapping(spec, DATA["format"], DATA["mapping"], DATA["columns"], DELIMITER)[0] for spec in DATA_SPECS
    ]
    # rows that cannot fill `nodes` shards: one line now, not a DAG of thousands of jobs (a line count: cheap)
    if DATA["path"]:
        check_rows_fill_nodes(DATA["path"], DATA["format"], DATA_MAPPINGS[0], config["nodes"], bool(DATA["eval_path"]))
    DATA_FILES = [str(p) for spec in DATA_SPECS for p in resolve_paths(spec)]  # every input data file
    # data.tools, or else the first tool row among the data's first rows: a template known here checked to render tools
    TOOL_ROW = None
    if not DATA["tools"]:
        found = (first_tool_row(s, DATA["format"], DATA["mapping"], DATA["columns"], DELIMITER) for s in DATA_SPECS)
        TOOL_ROW = next(filter(None, found), None)
    check_tools_config(DATA["tools"], DATA["chat_template"], DATA["format_template"], TOOL_ROW)
except UserError as e:
    fail(e)
DATA_TOOLS = [DATA["tools"]] if DATA["tools"] else []  # the split's input: a changed specs file reruns it


# eval.tasks run offline: a task's local YAML or data file that is not there, a task neither lm-eval's nor a
# YAML's, split files not named after the task's splits stop before any job runs (the data of a task of
# lm-eval's own without eval.task_data is checked by evaluate_model, before its model loads).
EVAL = config["eval"]
for path in EVAL["task_data"]:
    if not Path(path).exists():
        fail(f"eval.task_data: {path} does not exist (evaluation runs offline: a task's data must be local)")
try:
    check_task_names(EVAL["tasks"], EVAL["task_data"])
    # each task lm-eval's (its index cached in .snakemake/lm_eval_tasks/) or a YAML's; split files named right
    check_tasks(EVAL["tasks"], EVAL["task_data"])
except UserError as e:
    fail(e)
EVAL_TASK_FILES = EVAL["task_data"]  # evaluate_model's inputs: a changed task reruns it
VLLM = EVAL["backend"] == "vllm"  # vLLM pins an older transformers: its own environment
EVAL_ENV = "../envs/eval-vllm.yaml" if VLLM else "../envs/eval.yaml"  # with --sdm conda
# without conda: the interpreter of a venv with vLLM (docs/evaluation.md, "vLLM backend"), else the project's `python`
EVAL_PYTHON = os.environ.get("EVAL_VLLM_PYTHON", "python") if VLLM else "python"


def check_template():
    """The base model's tokenizer gets a chat template: data.chat_template, data.format_template (a valid
    one), or its own where its files can tell (a local folder or a cached hub model; else split_dataset
    says so)."""
    if DATA["chat_template"] and DATA["format_template"]:
        raise UserError("data.chat_template and data.format_template are both set; set one")
    if DATA["format_template"]:
        format_list(DATA["format_template"])
    if DEMO or DATA["chat_template"] or DATA["format_template"]:
        return
    if HUB_REPO:  # the fetched commit's files, where they are here already (else fetch_model gets them)
        folder = cached_snapshot(HUB_REPO, HUB_SHA)
        if folder is None:
            return
    else:
        try:
            folder = local_model_folder(BASE_MODEL)
        except UserError:
            return
    if has_chat_template(folder) is False:
        raise UserError(no_template_message(f"model.name_or_path {BASE_MODEL}"))
    template = chat_template_text(folder)
    check_model_template_renders_tools(DATA["tools"], template, f"model.name_or_path {BASE_MODEL}", TOOL_ROW)


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


# Each stage's typed config (settings.StageConfig): the keys its stage depends on, as JSON, so a key reruns
# only the stages that read it (data.train_on: tokenization on, not the split). params functions, not
# strings (see verbatim): they carry data.format_template's braces.
TOKENIZER = verbatim(BASE_MODEL)  # what tokenization loads the tokenizer from (a params function)
# The split reads the tokenizer and the template only to balance nodes by tokens: otherwise a new base
# model or template leaves it be.
BY_TOKENS = config["data"]["balance"] == "tokens"
# data.tools unset: left out, so a config without it gives the split the params it had before the key existed
SPLIT_WITHOUT = (() if BY_TOKENS else TEMPLATE_KEYS) + (() if DATA["tools"] else ("data.tools",))
SPLIT_CONFIG = verbatim(SplitConfig.to_json(config, without=SPLIT_WITHOUT))
SPLIT_TOKENIZER_INPUT = BASE_MODEL_INPUT if BY_TOKENS else []
SPLIT_TOKENIZER = verbatim(cli_args(tokenizer=BASE_MODEL if BY_TOKENS else None))
TOKENIZE_CONFIG = verbatim(TokenizeConfig.to_json(config))
DECONTAMINATE_CONFIG = verbatim(DecontaminateConfig.to_json(config))
# data.decontaminate: drop: tokenization reads each node's shard without the contaminated rows
DROP_CONTAMINATED = config["data"]["decontaminate"] == "drop"
NODE_SHARD = DECONTAMINATED if DROP_CONTAMINATED else SPLIT
CONSOLIDATE_CONFIG = verbatim(ConsolidateConfig.to_json(config))  # the dtype, the template training used
EVAL_CONFIG = verbatim(EvalConfig.to_json(config))
ENV_CONFIG = verbatim(EnvironmentConfig.to_json(config))
GRID_CONFIG = verbatim(GridConfig.to_json(config))
# A node's shard must fill one micro-batch on every rank of its node, in packed bins (training.packing)
# or examples, before a training job is queued (joint mode: asked of each shard, more than it needs).
# A grid's shared tokenization asks for what the largest variant needs.
TRAININGS = [variant_training(config["training"], values) for values in VARIANTS.values()] or [config["training"]]
# training.global_batch_size that no accumulation keeps at the job's ranks: one line before any job
try:
    for t in TRAININGS:
        accumulation(t["micro_batch_size"], t["grad_accum"], t["global_batch_size"], job_ranks(t, config["nodes"]))
except UserError as e:
    fail(e)
PER_RANK = [(t["packing"], t["micro_batch_size"] * t["procs_per_node"]) for t in TRAININGS]
NODE_TOKENIZE_ARGS = cli_args(
    min_bins=max((n for packing, n in PER_RANK if packing), default=None),
    min_examples=max((n for packing, n in PER_RANK if not packing), default=None),
)
# preference pairs: both answers for DPO (training.objective, the same for every variant: settings.NOT_GRIDDED);
# SFT on them trains the chosen answers alone
NODE_TOKENIZE_ARGS += " --both-sides" if config["training"]["objective"] == "dpo" else ""
DEMO_MODEL_CONFIG = verbatim(DemoModelConfig.to_json(config))
DEMO_MODEL_ARGS = cli_args(preset=PRESET)


# The training jobs' logs (train_node, train_joint): Snakemake deletes a job's log before each attempt, so the
# shell starts it with a header (the attempt, when, where, the SLURM job) and hard-links it as
# <log>.attempts/<n>.log, which keeps each attempt's text; the command then appends to the log.
ATTEMPT_LOG = (
    "n=1; while [ -e {log:q}.attempts/$n.log ]; do n=$((n + 1)); done; mkdir -p {log:q}.attempts;"
    " echo \"=== attempt $n: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), host $(uname -n),"
    ' SLURM job ${{SLURM_JOB_ID:-none}} (every attempt: {log}.attempts/)" > {log:q};'
    " ln -f {log:q} {log:q}.attempts/$n.log 2>/dev/null"
    " || echo 'this attempt is not kept: no hard links here' >> {log:q};"
)


class Untracked:
    """A params value that is no rerun trigger: Snakemake records a job's params only where it can repr them
    (builtins: snakemake.persistence._params leaves out anything else), and this formats as its value in the
    shell command. For what cannot change a stage's result: where the checkout lives (a script's absolute path:
    a checkout copied to /scratch reruns nothing) and the profile's resources (TRAIN_MEM_MB, checked at parse
    time against the plan instead: check_host_memory)."""

    def __init__(self, value):
        self.value = value

    def __str__(self):
        return str(self.value)

    def __repr__(self):
        return f"Untracked({self.value!r})"


def script_path(name):
    """Path of a workflow script, passed to shell commands through params, untracked: a moved checkout is the
    same code (Snakemake's code trigger compares the rules' shell commands, which do not hold the path)."""
    return Untracked(SCRIPTS / name)


def get_model(wildcards, input=None):
    """The model a job loads: results/<run>/models/<model>, or the base model (model=base, or a job
    without a {model} wildcard: training).

    As an input function the base model is BASE_MODEL_INPUT (a hub id is no file); as a params
    function (Snakemake passes the job's `input` to one that takes it) it is BASE_MODEL. A param
    given as a plain path would be taken by `snakemake --lint` for a hard-coded input prefix.
    """
    model = wildcards.get("model", "base")
    if model != "base":
        return MODEL_DIR.format(model=model, **variant_of(wildcards))
    return BASE_MODEL_INPUT if input is None else BASE_MODEL


def variant_of(wildcards):
    """The job's {variant} wildcard as format() keywords ({} without a grid)."""
    return {"variant": wildcards.variant} if GRID else {}


def training_section(wildcards):
    """The validated `training` section of the job's grid variant (the config's own without a grid)."""
    return variant_training(config["training"], VARIANTS[wildcards.variant]) if GRID else config["training"]


def training_json():
    """The trainer's config, a params function: the job's `training` section (train.py builds its
    TrainConfig from it; a grid variant's values change its checkpoint key, so variants never share one)."""
    return lambda wildcards: json.dumps(as_before_objectives(training_section(wildcards)), sort_keys=True)


def measured_gpu_input(wildcards):
    """check_environment's report as plan_training's named input `env`, where the job's training.gpu_memory_gb
    is unset: the plan then uses the GPU memory it measured (preflight.gpu_memory)."""
    return {} if training_section(wildcards)["gpu_memory_gb"] is not None else {"env": ENV_CHECK}


def environment_args(wildcards, input):
    """plan_training's --environment where the job has the `env` input (a params function)."""
    return f"--environment {shlex.quote(input.env)}" if input.get("env") else ""


def held_out_input(wildcards):
    """The tokenized eval set as the training job's named input `eval`, only where the job's training.eval_every
    is on: turning it on or off changes the job's inputs, as it changes its metrics."""
    return {"eval": TOKENIZED.format(shard="eval")} if training_section(wildcards)["eval_every"] else {}


def reference_input(wildcards):
    """The reference_logps files of the job's shards as its named input `reference`, where it reads them."""
    training = training_section(wildcards)
    if not reads_cached_reference(training["objective"], training["dpo"]):
        return {}
    return {"reference": expand(REFERENCE_LOGPS, shard=[wildcards.node] if "node" in wildcards.keys() else NODES)}


EVAL_PAIRS = "eval_pairs"  # the eval split's pairs tokenized with both answers (tokenize_eval_pairs)


def preference_input(wildcards):
    """Each model's held-out preference accuracy (preference_eval) as summarize's named input `preference`, where
    the variant trains with training.objective dpo."""
    if training_section(wildcards)["objective"] != "dpo":
        return {}
    return {"preference": expand(PREFERENCE_RESULT, model=MODELS, **variant_of(wildcards))}


def summary_tail_args(wildcards):
    """summarize's --trackers values (logging.trackers) and its --preference files where the job has the
    `preference` input: one param, so that an SFT summary's shell command and params are as before the objective
    existed (Snakemake's code and params rerun triggers). Of the wildcards alone: a params function of `input` is
    left out of the params Snakemake compares at planning, and an SFT summary would rerun."""
    files = preference_input(wildcards).get("preference")
    tail = f" --preference {' '.join(shlex.quote(f) for f in files)}" if files else ""
    return " ".join(config["logging"]["trackers"]) + tail


def publish_records(wildcards):
    """The target publish's inputs: the record of each model of publish.repo_id; none stops with one line."""
    if not PUBLISH["repo_id"]:
        fail("publish: nothing to publish: set publish.repo_id (model name -> hub repo id; config/README.md#publish)")
    return expand(PUBLISH_RECORD, model=sorted(PUBLISH["repo_id"]))


def publish_args(wildcards):
    """publish.py's --repo, --adapter-repo, --revision and --private of the job's model (publish.smk)."""
    model = wildcards.model
    args = cli_args(repo=PUBLISH["repo_id"][model], adapter_repo=PUBLISH["adapter_repo_id"].get(model))
    return f"{args} {cli_args(revision=PUBLISH['revision'])}" + (" --private" if PUBLISH["private"] else "")


def reference_args(input) -> str:
    """The trainer's --reference-logps where the job has the `reference` input."""
    files = input.get("reference")
    return f" --reference-logps {' '.join(shlex.quote(f) for f in files)}" if files else ""


def reference_cache_args(wildcards):
    """reference_logps' --cache-dir: beside data.cache_dir's tokenization cache (none where that is off)."""
    cache = config["data"]["cache_dir"]
    return f"--cache-dir {shlex.quote(str(Path(cache).parent / 'reference_logps'))}" if cache else ""


def held_out_args(wildcards, input):
    """The trainer's --eval-data where the job has the `eval` input (a params function); and its --reference-logps
    where it has the `reference` input (training.dpo.reference cached): in this param, so that an SFT job's shell
    command and params are as before the objective existed (Snakemake's code and params rerun triggers)."""
    return (f"--eval-data {shlex.quote(input.eval)}" if input.get("eval") else "") + reference_args(input)


def model_shape(wildcards, input):
    """plan_training's --model, MODEL_SHAPE (a params function: a hub model's record, also the job's input,
    given as a plain path looks to `snakemake --lint` like a hard-coded prefix)."""
    return input.get("model") or MODEL_SHAPE


def fetch_record_args(wildcards, input):
    """provenance.py's --fetch-record where the job has the `fetched` input (a hub model; a params function)."""
    return f"--fetch-record {shlex.quote(input.fetched)}" if input.get("fetched") else ""


def plan_json(wildcards):
    """plan_training's config (settings.PlanConfig), a params function: the job's grid variant's training keys
    that change memory use (so a new learning rate does not rerun the plan), max_seq_len, the vocabulary and
    the nodes."""
    training = training_section(wildcards)
    sft = training["objective"] == "sft"  # its plan's params as before the objective's keys
    return PlanConfig.to_json(config | {"training": training}, without=OBJECTIVE_CONFIG_KEYS if sft else ())


def provenance_json(wildcards):
    """The resolved config of the job's variant: its `training` section in place of the config's."""
    resolved = config | {"training": as_before_objectives(training_section(wildcards))}
    if not GRID:  # the config as it was before grids existed
        resolved.pop("grid")
    resolved.pop("publish")  # where a model went after the run: nothing of how it was made
    if not DATA["tools"]:  # and before data.tools existed
        resolved["data"] = {k: v for k, v in resolved["data"].items() if k != "tools"}
    return json.dumps(as_before_checkpoints(resolved), sort_keys=True)  # rules/checkpoint_eval.smk


def trackers_json(wildcards):
    """train.py's --trackers (trackers.TrackerSettings), a params function: logging.trackers and the tracker run of
    the job's model, named and tagged by run, grid variant and node, grouped by run and variant, in the
    project logging.project (else the run)."""
    variant = wildcards.variant if GRID else ""
    node = wildcards.get("node", "joint")
    group = f"{RUN}/{variant}" if variant else RUN
    settings = {
        "trackers": config["logging"]["trackers"],
        "project": config["logging"]["project"] or RUN,
        "group": group,
        "name": f"{group}/{node}",
        "tags": {"run": RUN, "variant": variant, "node": node},
        "dir": TRACKERS,
    }
    return json.dumps(settings, sort_keys=True)


def joint_log_dir(wildcards):
    """train_joint's log folder (a params function: a plain path looks to `snakemake --lint` like a
    hard-coded prefix of the outputs)."""
    return TRAIN_DIR.format(node="joint", **variant_of(wildcards))


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


def check_host_memory():
    """A finished plan against the training job's host memory as Snakemake will submit it now (the profile's
    TRAIN_MEM_MB, untracked in plan_training's params): more is no reason to re-plan or retrain; less than
    the plan needs stops here, with one line, before anything is queued."""
    limit_mb = train_mem_mb()
    if limit_mb is None:
        return
    for path in expand(PLAN, variant=list(VARIANTS)):
        try:
            host = json.loads(Path(path).read_text())["host"]
            need_gb = host["peak_gb"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no finished plan: plan_training checks the limit when it runs
        if need_gb > limit_mb / 1024:
            raise UserError(
                f"{path}: training needs about {need_gb:.0f} GB of host memory per node but the training job now "
                f"has {limit_mb / 1024:.0f} GB (mem_mb {limit_mb}: TRAIN_MEM_MB in profiles/slurm); "
                f"set TRAIN_MEM_MB={math.ceil(need_gb * 1024)} or more"
            )


# One GPU count: training.procs_per_node (one rank a GPU) is what train_node, train_joint (per node) and
# check_environment ask SLURM for; the profile sets none. A GPU count given elsewhere that disagrees stops here.
GPUS_PER_NODE = config["training"]["procs_per_node"]
GPU_RULES = ("train_node", "train_joint", "check_environment")


def check_gpu_count():
    """TRAIN_GPUS (the profile's variable before the rules asked for the GPUs) or a profile's set-resources
    GPU count for a GPU job must equal training.procs_per_node (else one line naming both). A profile's
    `gpu: 0` is a cluster without GPUs (CPU training), not a count."""
    said = os.environ.get("TRAIN_GPUS")
    if said not in (None, "") and said != str(GPUS_PER_NODE):
        raise UserError(
            f"TRAIN_GPUS={said} but training.procs_per_node is {GPUS_PER_NODE}: the training jobs ask SLURM for"
            " training.procs_per_node GPUs (one a rank); unset TRAIN_GPUS or set procs_per_node"
        )
    for job in GPU_RULES:
        resources = workflow.resource_settings.overwrite_resources.get(job) or {}
        for name in ("gpu", "gres"):
            value = resources.get(name)
            value = getattr(value, "value", value)  # a parsed Resource
            if value in (None, 0, "0", ""):
                continue
            count = str(value).rsplit(":", 1)[-1] if name == "gres" else str(value)
            if count != str(GPUS_PER_NODE):
                raise UserError(
                    f"the profile's set-resources {job}: {name}: {value} but training.procs_per_node is"
                    f" {GPUS_PER_NODE}: the rules ask SLURM for training.procs_per_node GPUs; remove {name} there"
                )


def final_outputs():
    """The report's inputs and each trained model (so a deleted model is rebuilt), of every grid variant,
    and the grid's comparison."""
    from workflow_scripts.core.pages import made

    variants = list(VARIANTS)  # expand() leaves out a wildcard its pattern does not have (no grid)
    return [
        *expand(MODEL_DIR, model=TRAINED, variant=variants),
        ENV_CHECK,
        MANIFEST,
        DATA_REPORT,
        *expand([PLAN, SUMMARY, LOSS_CURVES, LEADERBOARD, PROVENANCE], variant=variants),
        *([GRID_TABLE, GRID_PLOT] if GRID else []),
        *(expand([CHECKPOINT_SCORES, CHECKPOINT_PLOT], variant=variants) if SCORE_CHECKPOINTS else []),
        # the report's pages (workflow_scripts/core/pages.py, rules/report_pages.smk), in the table's order
        *expand([globals()[page.key] for page in made(GRID)], variant=variants),
    ]


def remember_signatures():
    """The input, params and log functions of the workflow's rules keep their parameters, computed once here
    (Snakemake's own overwrite_function_params). Snakemake reads a function's signature with inspect twice
    per job and function, about 8,000 times at 256 nodes (0.1-0.2 s of the dry run), always the same."""
    import inspect

    from snakemake.common import FUNC_OVERWRITE_PARAMS_ATTR, overwrite_function_params
    from snakemake.io import AnnotatedString, _IOFile

    for each in workflow.rules:  # (not named `rule`: --lint would read a rule in this file)
        for item in [*each.input, *each.params, *each.log]:
            item = item._file if isinstance(item, _IOFile) else item  # a function as input: its callable
            item = item.callable if isinstance(item, AnnotatedString) else item
            if callable(item) and not hasattr(item, FUNC_OVERWRITE_PARAMS_ATTR):
                overwrite_function_params(item, inspect.signature(item).parameters)


try:
    check_gpu_count()
    check_host_memory()
except UserError as e:
    fail(e)
