"""The workflow's config: config/schema.yaml is the one source of every default.

The Snakefile validates the user's config against the schema, filling its defaults; the
trainer's typed ``TrainConfig`` is always built from a config validated the same way, so
it has no defaults of its own. Tests and benches build partial configs through
``training_config`` and get exactly what the workflow would run.
"""

import copy
import dataclasses
import functools
import json
import math
import operator
from pathlib import Path

import yaml

from workflow_scripts.core.pipeline_io import UserError

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"
# libyaml's loader where PyYAML has it: the same documents, ~8x faster (the schema is read at every parse: 0.3 s
# with the pure-Python loader on this CPU, about a tenth of a 256-node dry run)
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def schema() -> dict:
    return yaml.load(SCHEMA.read_text(), Loader=LOADER)


def _validator_with_defaults():
    """A Draft 2020-12 validator that fills each missing property with its schema default first."""
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def properties(validator, props, instance, sub):
        if isinstance(instance, dict):
            for name, prop in props.items():
                if "default" in prop:
                    instance.setdefault(name, copy.deepcopy(prop["default"]))
        yield from check_properties(validator, props, instance, sub)

    return validators.extend(Draft202012Validator, {"properties": properties})


def non_finite(value, key: str = "") -> tuple[str, float] | None:
    """(the dotted key, a list's item as key[i]; the number) of the first nan, inf or -inf in ``value``, or None:
    YAML reads `.nan` and `.inf` as numbers, and a nan passes every minimum and maximum of the schema."""
    if isinstance(value, float) and not math.isfinite(value):
        return key or "(top level)", value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = non_finite(v, f"{key}[{k}]" if isinstance(value, list) else f"{key}.{k}" if key else str(k))
        if found:
            return found
    return None


def validated(config: dict, section: str | None = None) -> dict:
    """A copy of ``config`` (the whole config, or one top-level section of it) with every default
    filled in; an invalid value is a UserError naming its key, a nan or infinite number too."""
    bad = non_finite(config, section or "")
    if bad:
        raise UserError(f"config key {bad[0]}: {bad[1]} is not a finite number")
    sub = schema() if section is None else schema()["properties"][section]
    out = copy.deepcopy(config)
    error = next(iter(sorted(_validator_with_defaults()(sub).iter_errors(out), key=lambda e: e.path)), None)
    if error is not None:
        key = ".".join(str(p) for p in [*([section] if section else []), *error.absolute_path]) or "(top level)"
        if error.validator == "additionalProperties":
            unknown = sorted(set(error.instance) - set(error.schema.get("properties", {})))
            raise UserError(f"config key {key}: unknown key(s) {unknown}")
        raise UserError(f"config key {key}: {error.message}")
    return out


def check_config_file(path) -> None:
    """A config file as Snakemake loads it (last key wins, an empty file "must be given as JSON or YAML with
    keys at top level", neither naming the file): a UserError, one line naming the file, when it is empty
    (or only comments), holds no mapping at top level, or gives one key twice (both lines named)."""
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=LOADER)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # Snakemake's loader says what it thinks of it
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag.endswith(":null")):
        raise UserError(f"{path}: the config file is empty (or only comments); it must give keys, e.g. `run: my_run`")
    if not isinstance(root, yaml.MappingNode):
        raise UserError(f"{path}: the config file must give keys at its top level (`run: my_run`), not a list or value")

    def walk(node, key: str) -> None:
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{key}[{i}]")
        if not isinstance(node, yaml.MappingNode):
            return
        seen = {}
        for name_node, value in node.value:
            name = name_node.value if isinstance(name_node, yaml.ScalarNode) else str(name_node.value)
            full = f"{key}.{name}" if key else name
            line = name_node.start_mark.line + 1
            if name in seen and name != "<<":
                raise UserError(f"{path}: key {full} is given twice, on lines {seen[name]} and {line} (keep one)")
            seen[name] = line
            walk(value, full)

    walk(root, "")


# Training keys a grid may not vary: mode changes which models exist (node<i> or joint); procs_per_node
# sizes the shared tokenization's guard, the environment check and the training job's cluster request;
# objective decides what the shared tokenization writes of preference pairs (both answers, or the chosen).
NOT_GRIDDED = {"training.mode", "training.procs_per_node", "training.objective"}


def check_grid(grid: dict) -> None:
    """Each grid key is a dotted path of a training key (training.lr, training.lora.r) other than
    NOT_GRIDDED, and each listed value is valid for that key; else a UserError naming the key."""
    from jsonschema import Draft202012Validator

    for key, values in grid.items():
        prop, parts = schema(), key.split(".")
        for part in parts:
            prop = prop.get("properties", {}).get(part)
            if prop is None:
                break
        if parts[0] != "training":
            raise UserError(f"grid: {key} is not a training key (data, model and eval are shared by every variant)")
        if prop is None or len(parts) < 2:
            raise UserError(f"grid: {key} is not a training key")
        if "properties" in prop:
            first = next(iter(prop["properties"]))
            raise UserError(f"grid: {key} is a section; name one of its keys (e.g. {key}.{first})")
        if key in NOT_GRIDDED:
            raise UserError(f"grid: {key} cannot vary in a grid (it shapes the stages the variants share)")
        for value in values:
            error = next(iter(Draft202012Validator(prop).iter_errors(value)), None)
            if error is not None:
                raise UserError(f"grid: {key} value {value!r}: {error.message}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The `training` section, flat (lora.r -> lora_r); documented in config/schema.yaml."""

    strategy: str
    zero_stage: int
    offload: str
    offload_ratio: float
    offload_pin_memory: bool
    deepspeed_config: str | None
    peft: str
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: list
    mode: str
    procs_per_node: int
    precision: str
    lr: float
    min_lr_ratio: float
    schedule: str
    warmup_ratio: float
    warmup_steps: int | None
    weight_decay: float
    adam_betas: list
    micro_batch_size: int
    packing: bool
    grad_accum: int
    global_batch_size: int | None
    fsdp_no_sync: bool
    chunked_loss: bool
    epochs: float
    max_steps: int | None
    max_grad_norm: float
    dead_model_steps: int
    gradient_checkpointing: bool
    seed: int
    log_every: int
    checkpoint_every: int
    eval_every: int | None
    eval_samples: int | None
    keep_checkpoints: int
    gpu_memory_gb: float | None  # None: check_environment's measure (preflight.gpu_memory)
    peak_tflops: float | None  # None: check_environment's figure (train.py --environment)
    collective_timeout_s: int
    objective: str  # sft or dpo (train/objective.py)
    dpo: dict  # training.dpo, read with objective dpo only

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        """From the workflow's `training` section as JSON (missing keys take the schema's defaults)."""
        return training_config(json.loads(text))


# training.dpo.loss values that read no reference model (train/preference.py's SimPO and ORPO)
REFERENCE_FREE_LOSSES = frozenset({"simpo", "orpo"})


def reads_cached_reference(objective: str, dpo: dict) -> bool:
    """Whether training reads the reference_logps stage's files: objective dpo, training.dpo.reference cached and a
    loss with a reference (the rules' test, without torch, and the trainer's)."""
    return objective == "dpo" and dpo["reference"] == "cached" and dpo["loss"] not in REFERENCE_FREE_LOSSES


OBJECTIVE_KEYS = ("objective", "dpo")  # training keys added with training.objective
OBJECTIVE_CONFIG_KEYS = tuple(f"training.{k}" for k in OBJECTIVE_KEYS)  # as dotted keys (StageConfig.to_json)


def as_before_objectives(training: dict) -> dict:
    """An SFT training section (or TrainConfig as a dict) without OBJECTIVE_KEYS, as it was before them: what the
    rules pass the trainer and provenance, and train_state.json records, so an SFT run's params and files do not
    change (the trainer's TrainConfig takes the schema's defaults for them)."""
    if training.get("objective", "sft") != "sft":
        return training
    return {k: v for k, v in training.items() if k not in OBJECTIVE_KEYS}


def recorded_config(cfg: TrainConfig) -> dict:
    """The config as train_state.json records it: an SFT run's without the objective's keys (as before them)."""
    return as_before_objectives(dataclasses.asdict(cfg))


def flat_training(training: dict) -> dict:
    """The `training` section with the LoRA settings flattened (lora.r -> lora_r)."""
    flat = {k: v for k, v in training.items() if k != "lora"}
    return flat | {f"lora_{k}": v for k, v in training.get("lora", {}).items()}


def training_config(training: dict | None = None) -> TrainConfig:
    """The trainer's config from a (partial) `training` section, validated and completed by the schema."""
    return TrainConfig(**flat_training(validated(training or {}, "training")))


def job_ranks(training: dict, nodes: int) -> int:
    """The ranks of one training job: procs_per_node, times the nodes in joint mode (one job over all)."""
    return training["procs_per_node"] * (nodes if training["mode"] == "joint" else 1)


def accumulation(micro_batch_size: int, grad_accum: int, global_batch_size: int | None, world: int) -> int:
    """The micro-batches accumulated per optimizer step at ``world`` ranks: grad_accum, or the one that keeps
    training.global_batch_size; a UserError (one line) where it does not divide or both keys are set."""
    if global_batch_size is None:
        return grad_accum
    if grad_accum != 1:
        raise UserError(
            f"training.grad_accum is {grad_accum} and training.global_batch_size {global_batch_size}: set one"
            " (with global_batch_size the accumulation follows from it)"
        )
    per_pass = micro_batch_size * world
    if global_batch_size % per_pass:
        fits = sorted({max(1, global_batch_size // per_pass), global_batch_size // per_pass + 1} - {0})
        raise UserError(
            f"training.global_batch_size {global_batch_size} is not a multiple of micro_batch_size x ranks ="
            f" {micro_batch_size} x {world} = {per_pass}, so no accumulation keeps it at {world} rank(s); "
            f"use {' or '.join(str(k * per_pass) for k in fits)}, or another micro_batch_size"
        )
    return global_batch_size // per_pass


def for_world(cfg: "TrainConfig", world: int) -> "TrainConfig":
    """``cfg`` as a job of ``world`` ranks trains it: grad_accum is the accumulation (``accumulation``)."""
    return dataclasses.replace(
        cfg, grad_accum=accumulation(cfg.micro_batch_size, cfg.grad_accum, cfg.global_batch_size, world)
    )


# ---------------------------------------------------------------- typed stage configs


def key_field(key: str):
    """A stage config's field holding config key ``key`` (a dotted path, e.g. "data.max_seq_len")."""
    return dataclasses.field(metadata={"key": key})


def schema_property(key: str) -> dict:
    """The schema of config key ``key`` (a dotted path)."""
    prop = schema()
    for part in key.split("."):
        prop = prop["properties"][part]
    return prop


def with_defaults(prop: dict, value):
    """``value`` with the defaults of an object schema's properties it leaves out, nested (as the workflow's
    validation fills them): a hand-written {"lora": {"target_modules": [...]}} gets lora's r, alpha, dropout."""
    if prop.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for key, sub in prop.get("properties", {}).items():
        if key in out:
            out[key] = with_defaults(sub, out[key])
        elif "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
    return out


class StageConfig:
    """Base of a stage's typed config: a frozen dataclass whose fields are the config keys that stage
    depends on, each named by ``key_field("section.key")``. It has no defaults of its own: a key
    missing from the values takes the schema's default, and each value is checked against its key's
    schema. A rule passes ``to_json(config)`` (only these keys, so changing another key reruns nothing
    here); the stage's script builds the config with ``from_json``."""

    @classmethod
    def keys(cls) -> dict[str, str]:
        """field name -> dotted config key"""
        return {f.name: f.metadata["key"] for f in dataclasses.fields(cls) if "key" in f.metadata}

    @classmethod
    def values(cls, config: dict) -> dict:
        """The stage's keys of a validated (whole) config, by field name."""
        out = {}
        for name, key in cls.keys().items():
            value = config
            for part in key.split("."):
                value = value[part]
            out[name] = value
        return out

    @classmethod
    def to_json(cls, config: dict, without: tuple[str, ...] = ()) -> str:
        """The stage's keys as JSON, but the dotted keys ``without`` (their schema defaults at the stage)."""
        values = {name: v for name, v in cls.values(config).items() if cls.keys()[name] not in without}
        return json.dumps(values, sort_keys=True)

    @classmethod
    def build(cls, values: dict | None = None):
        """The stage config from (some of) its fields' values; the rest are the schema's defaults."""
        from jsonschema import Draft202012Validator

        values = dict(values or {})
        keys = cls.keys()
        unknown = sorted(set(values) - set(keys))
        if unknown:
            raise UserError(f"{cls.__name__}: unknown key(s) {unknown}")
        for name, key in keys.items():
            prop = schema_property(key)
            if name not in values:
                values[name] = copy.deepcopy(prop.get("default"))
            if values[name] is None and "default" in prop and prop["default"] is None:
                continue
            values[name] = with_defaults(prop, values[name])
            error = next(iter(Draft202012Validator(prop).iter_errors(values[name])), None)
            if error is not None:
                raise UserError(f"config key {key}: {error.message}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str):
        return cls.build(json.loads(text))


# ---------------------------------------------------------------- the stages' configs

SCHEMA_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict, "array": list}


def schema_type(key: str):
    """The Python type of config key ``key``, from its schema (``[string, "null"]`` -> ``str | None``)."""
    types = schema_property(key)["type"]
    types = [types] if isinstance(types, str) else types
    py = functools.reduce(operator.or_, (SCHEMA_TYPES[t] for t in types if t != "null"))
    return py | None if "null" in types else py


def stage_config(name: str, doc: str, *keys: str, base: type = StageConfig) -> type:
    """A StageConfig class: a frozen dataclass with a field for each config key (a dotted path), named by the
    key's last part and typed by its schema, so the schema stays the one source of a key's type and default."""
    fields = [(key.rsplit(".", 1)[-1], schema_type(key), key_field(key)) for key in keys]
    return dataclasses.make_dataclass(name, fields, bases=(base,), frozen=True, namespace={"__doc__": doc})


# How the input's rows become conversations (the split; the demo model's tokenizer training), and how a
# conversation is rendered (tokenization; the split checks the template and, for balance: tokens, measures rows)
SOURCE_KEYS = ("data.path", "data.format", "data.mapping", "data.columns")
TEMPLATE_KEYS = ("data.chat_template", "data.format_template", "data.template_kwargs")
SplitConfig = stage_config(
    "SplitConfig",
    "split_dataset's keys: reading, validating and assigning rows (never the length policy: tokenization's).",
    *SOURCE_KEYS, *TEMPLATE_KEYS, "data.eval_path", "data.delimiter", "data.category_column", "nodes",
    "data.eval_fraction", "data.seed", "data.balance", "data.control_chars", "data.max_reject_fraction", "data.tools",
)  # fmt: skip
TokenizeConfig = stage_config(
    "TokenizeConfig",
    "tokenize_shard's keys: the template, special-token text, the labels, the length policy, the cache and its guard.",
    *TEMPLATE_KEYS, "data.special_text", "data.train_on", "data.max_seq_len", "data.overlength", "data.cache_dir",
    "data.max_reject_fraction",
)  # fmt: skip
DecontaminateConfig = stage_config(
    "DecontaminateConfig",
    "decontaminate's keys: the policy, the n-gram length, and the evaluation tasks whose documents it checks.",
    "data.decontaminate", "data.decontaminate_ngram", "eval.tasks", "eval.task_data",
)  # fmt: skip
DemoModelConfig = stage_config(
    "DemoModelConfig",
    "build_demo_model's keys: the data its tokenizer is trained on, the vocabulary, the context length and "
    "the seed (its size, the preset, comes from model.name_or_path as the rule's --preset).",
    *SOURCE_KEYS, "model.demo_vocab_size", "data.max_seq_len", "model.seed",
)  # fmt: skip


class EvalPrecision(StageConfig):
    """EvalConfig's eval.precision "training" comes resolved to training.precision (values): changing
    training.precision reruns evaluation only where eval.precision follows it."""

    @classmethod
    def values(cls, config: dict) -> dict:
        values = super().values(config)
        if values["precision"] == "training":
            values["precision"] = config["training"]["precision"]
        return values

    @property
    def dtype(self) -> str:
        """The precision a GPU evaluates in: eval.precision, or training.precision's default where it is still
        "training" (a config given by hand, not resolved by the workflow)."""
        return schema_property("training.precision")["default"] if self.precision == "training" else self.precision


EvalConfig = stage_config(
    "EvalConfig",
    "evaluate_model's keys: the eval section but eval.soup (make_soup's), and data.template_kwargs (the held-out "
    "prompts' template arguments).",
    "eval.batch_size", "eval.max_new_tokens", "eval.max_samples", "eval.limit", "eval.backend", "eval.precision",
    "eval.tasks",
    "eval.task_data", "eval.apply_chat_template", "data.template_kwargs",
    base=EvalPrecision,
)  # fmt: skip
EnvironmentConfig = stage_config(
    "EnvironmentConfig",
    "check_environment's keys: what it checks the machine against.",
    "training.strategy", "training.peft", "training.procs_per_node", "training.precision", "logging.trackers",
)  # fmt: skip
GridConfig = stage_config("GridConfig", "compare_grid's key: the grid (its variants' names and values).", "grid")


class ConsolidateSelect(StageConfig):
    """ConsolidateConfig's consolidate.select is left out of its JSON while it is last (the default): the export's
    params as before the key existed, so that a finished run does not consolidate again."""

    @classmethod
    def values(cls, config: dict) -> dict:
        values = super().values(config)
        if values["select"] == "last":
            values.pop("select")
        return values


ConsolidateConfig = stage_config(
    "ConsolidateConfig",
    "consolidate_node's keys: the written weights' dtype, the template training used (for the model folder), and "
    "which checkpoint it exports (consolidate.select; left out of the rule's JSON while it is last).",
    "consolidate.dtype", *TEMPLATE_KEYS, "consolidate.select",
    base=ConsolidateSelect,
)  # fmt: skip
PlanConfig = stage_config(
    "PlanConfig",
    "plan_training's keys: what changes memory use (a new learning rate re-plans nothing), the sequence length, "
    "a from-scratch preset's vocabulary, the nodes (joint mode shards over all of their ranks), and the objective "
    "(DPO's forward holds a pair's two sequences and their logits).",
    "training.mode", "training.strategy", "training.zero_stage", "training.offload", "training.peft",
    "training.offload_ratio", "training.offload_pin_memory", "training.lora", "training.procs_per_node",
    "training.precision", "training.micro_batch_size",
    "training.gradient_checkpointing", "training.grad_accum", "training.global_batch_size", "training.fsdp_no_sync",
    "training.chunked_loss", "training.packing",
    "training.gpu_memory_gb", "nodes", "data.max_seq_len",
    "model.demo_vocab_size", "training.objective", "training.dpo",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PlannedConfig(PlanConfig):
    """A PlanConfig as the planner varies it (plan/proposals.py): plus where ZeRO keeps the optimizer states,
    "cpu" or the NVMe proposal's "nvme" (no config key of its own: training.deepspeed_config sets it)."""

    optimizer_device: str = "cpu"


def check_publish(publish: dict, models: list[str], lora: bool, grid: bool) -> None:
    """The models `publish` names (config/schema.yaml) against the run's: each one the run exports (models/<name>/),
    an adapter's a trained LoRA model whose merged model is published too; a UserError naming the key."""
    if (publish["repo_id"] or publish["adapter_repo_id"]) and grid:
        raise UserError("publish: not with a grid (run the chosen variant's values as its own run to publish it)")
    for key in ("repo_id", "adapter_repo_id"):
        for name in publish[key]:
            if name not in models:
                raise UserError(f"publish.{key}: {name} is no model this run exports (one of {', '.join(models)})")
    for name in publish["adapter_repo_id"]:
        if not lora or name.startswith("soup"):
            raise UserError(
                f"publish.adapter_repo_id: {name} has no LoRA adapter (a model trained with training.peft lora)"
            )
        if name not in publish["repo_id"]:
            raise UserError(
                f"publish.adapter_repo_id: {name}'s adapter goes beside its model: set publish.repo_id.{name}"
            )
