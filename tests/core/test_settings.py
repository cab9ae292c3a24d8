"""config/schema.yaml is the one source of defaults: the trainer has none of its own."""

import dataclasses
import json

import pytest
import yaml
from conftest import REPO

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import PlanConfig, TrainConfig, flat_training, schema, training_config, validated


def schema_defaults(properties: dict) -> dict:
    """Each key's default as written in the schema (nested objects through their own properties)."""
    out = {}
    for key, prop in properties.items():
        if "properties" in prop:
            out[key] = schema_defaults(prop["properties"])
        elif "default" in prop:
            out[key] = prop["default"]
    return out


def test_the_trainer_config_has_no_defaults_of_its_own():
    for field in dataclasses.fields(TrainConfig):
        assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING, field.name


def test_trainer_fields_are_the_schemas_training_keys():
    keys = flat_training(schema_defaults(schema()["properties"]["training"]["properties"]))
    assert sorted(f.name for f in dataclasses.fields(TrainConfig)) == sorted(keys)


def test_an_empty_training_section_gets_every_schema_default():
    expected = flat_training(schema_defaults(schema()["properties"]["training"]["properties"]))
    assert dataclasses.asdict(training_config()) == expected
    # the values the issue found disagreeing between the trainer and the schema
    cfg = training_config()
    assert (cfg.lr, cfg.precision, cfg.warmup_ratio, cfg.micro_batch_size, cfg.checkpoint_every) == (
        2.0e-5, "bf16", 0.03, 4, 500,
    )  # fmt: skip


def test_the_workflow_and_the_trainer_read_the_same_config():
    """What train_node passes (the validated `training` section as JSON) is what the trainer runs."""
    config = validated(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    cfg = TrainConfig.from_json(json.dumps(config["training"]))
    assert cfg.lr == 3.0e-3 and cfg.precision == "fp32" and cfg.epochs == 20
    assert cfg.lora_r == config["training"]["lora"]["r"] == 8
    assert dataclasses.asdict(cfg) == flat_training(config["training"])


def test_partial_configs_are_completed_not_replaced():
    cfg = training_config({"lr": 1e-3, "lora": {"r": 32}})
    assert (cfg.lr, cfg.lora_r, cfg.lora_alpha) == (1e-3, 32, 16)


def test_stage_configs_fill_nested_defaults_of_hand_written_values():
    """The planner's typed config from a hand-written section (no lora, or a partial one) gets lora's defaults,
    as the workflow's validation fills them: its LoRA proposal names r and the target modules."""
    from workflow_scripts.plan.proposals import lora

    assert PlanConfig.build({}).lora == schema_defaults_of_lora()
    t = PlanConfig.build({"lora": {"target_modules": ["q_proj"]}})
    assert t.lora == schema_defaults_of_lora() | {"target_modules": ["q_proj"]}
    est = {"total_gb": 1.0, "host": {"peak_gb": 1.0, "memory_gb": 8.0}, "fits": True, "grad_accum": 1,
           "world_size": 2, "method": "formula"}  # fmt: skip
    [proposal] = lora(PlanConfig.build({}), lambda t: est)
    assert "(r 8 on q_proj, k_proj, v_proj, o_proj)" in proposal["proposal"], proposal


def schema_defaults_of_lora() -> dict:
    props = schema()["properties"]["training"]["properties"]["lora"]["properties"]
    return {k: p["default"] for k, p in props.items()}


@pytest.mark.parametrize(
    ("training", "message"),
    [
        ({"learning_rate": 1}, r"config key training: unknown key\(s\) \['learning_rate'\]"),
        ({"strategy": "zero"}, "config key training.strategy: 'zero' is not one of"),
        ({"lora": {"r": 0}}, "config key training.lora.r: 0 is less than the minimum of 1"),
        ({"precision": "fp8"}, "config key training.precision"),
    ],
)
def test_invalid_values_name_their_key(training, message):
    with pytest.raises(UserError, match=message):
        training_config(training)


@pytest.mark.parametrize(
    "text, key",
    [
        ("training: {lr: .nan}", "training.lr"),
        ("training: {max_grad_norm: .inf}", "training.max_grad_norm"),
        ("data: {eval_fraction: -.inf}", "data.eval_fraction"),
        ("training: {adam_betas: [0.9, .nan]}", r"training.adam_betas\[1\]"),
        ("grid: {training.lr: [1.0e-4, .nan]}", r"grid.training.lr\[1\]"),
    ],
)
def test_nan_and_infinite_numbers_are_refused_naming_their_key(text, key):
    with pytest.raises(UserError, match=f"^config key {key}: -?(nan|inf) is not a finite number$"):
        validated(yaml.safe_load(text))
    with pytest.raises(UserError, match="training.lr: nan"):
        training_config({"lr": float("nan")})


def test_config_files_as_written_are_checked_naming_file_key_and_lines(tmp_path):
    from workflow_scripts.core.settings import check_config_file

    path = tmp_path / "c.yaml"
    path.write_text("run: x\ntraining:\n  lr: 1.0e-4\n  seed: 3\n  lr: 2.0e-4\n")
    with pytest.raises(UserError, match=rf"^{path}: key training.lr is given twice, on lines 3 and 5 \(keep one\)$"):
        check_config_file(path)
    path.write_text("grid:\n  training.lr: [1, 2]\n  training.lr: [3]\n")
    with pytest.raises(UserError, match="key grid.training.lr is given twice, on lines 2 and 3"):
        check_config_file(path)
    for text in ("", "# only a comment\n", "~\n"):
        path.write_text(text)
        with pytest.raises(UserError, match=f"^{path}: the config file is empty"):
            check_config_file(path)
    path.write_text("- run\n")
    with pytest.raises(UserError, match="must give keys at its top level"):
        check_config_file(path)
    path.write_text('{"run": "x", "training": {"lr": 0.001}}')  # JSON, well formed
    check_config_file(path)
    check_config_file(REPO / "config" / "config.yaml")
