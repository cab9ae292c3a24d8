"""Experiment grids: variants from `grid:`, their validation, one DAG whose data stages and base evaluation
run once, and eval/grid.csv comparing them."""

import json
import time

import pandas as pd
import pytest
from conftest import planned_jobs, snakemake, tiny_config

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import check_grid, validated
from workflow_scripts.core.variants import expand_grid, variant_name, variant_training
from workflow_scripts.report.grid import grid_rows, grid_table, metrics_of

GRID = {"training.lr": [1.0e-5, 2.0e-5], "training.lora.r": [8, 32]}
VARIANTS = ["lr-1e-05_lora.r-8", "lr-1e-05_lora.r-32", "lr-2e-05_lora.r-8", "lr-2e-05_lora.r-32"]


def test_variants_are_the_cartesian_product_in_written_order():
    variants = expand_grid(GRID)
    assert list(variants) == VARIANTS
    assert variants["lr-2e-05_lora.r-8"] == {"training.lr": 2.0e-5, "training.lora.r": 8}
    assert expand_grid({}) == {}


@pytest.mark.parametrize(
    ("values", "name"),
    [
        ({"training.lr": 3e-3}, "lr-0.003"),
        ({"training.packing": False, "training.max_steps": None}, "packing-false_max_steps-null"),
        ({"training.strategy": "deepspeed", "training.zero_stage": 3}, "strategy-deepspeed_zero_stage-3"),
        ({"training.lora.target_modules": ["q_proj", "v_proj"]}, "lora.target_modules-q_proj+v_proj"),
        ({"training.deepspeed_config": "cfg/ds z3.json"}, "deepspeed_config-cfg-ds-z3.json"),
    ],
)
def test_variant_names_are_file_system_safe(values, name):
    assert variant_name(values) == name


def test_a_value_listed_twice_is_refused():
    with pytest.raises(UserError, match=r"^grid: training.lr lists 1e-05 twice$"):
        expand_grid({"training.lr": [1e-5, 1.0e-5]})


def test_variant_training_sets_nested_keys_and_keeps_the_rest():
    training = validated({"training": {"lr": 3e-3, "lora": {"alpha": 32}}})["training"]
    merged = variant_training(training, {"training.lr": 1e-5, "training.lora.r": 32})
    assert (merged["lr"], merged["lora"]["r"], merged["lora"]["alpha"]) == (1e-5, 32, 32)
    assert training["lr"] == 3e-3 and training["lora"]["r"] == 8  # not changed in place


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"training.lrr": [1e-5]}, "grid: training.lrr is not a training key"),
        ({"training.lora.rank": [8]}, "grid: training.lora.rank is not a training key"),
        ({"data.max_seq_len": [64]}, "grid: data.max_seq_len is not a training key (data, model and eval"),
        ({"lr": [1e-5]}, "grid: lr is not a training key (data, model and eval"),
        ({"training.lora": [{"r": 8}]}, "grid: training.lora is a section; name one of its keys"),
        ({"training.mode": ["joint"]}, "grid: training.mode cannot vary in a grid"),
        ({"training.procs_per_node": [1, 2]}, "grid: training.procs_per_node cannot vary in a grid"),
        ({"training.lr": ["fast"]}, "grid: training.lr value 'fast': 'fast' is not of type 'number'"),
        ({"training.lora.r": [8, 0]}, "grid: training.lora.r value 0: 0 is less than the minimum of 1"),
        ({"training.strategy": ["ddp", "zero"]}, "grid: training.strategy value 'zero': 'zero' is not one of"),
    ],
)
def test_bad_grid_keys_and_values_name_the_key(grid, message):
    with pytest.raises(UserError) as e:
        check_grid(validated({"grid": grid})["grid"])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"training.lr": []}, "config key grid.training.lr: [] should be non-empty"),
        ({"training.lr": 1e-5}, "config key grid.training.lr: 1e-05 is not of type 'array'"),
    ],
)
def test_a_grid_key_needs_a_list_of_values(grid, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validated({"grid": grid})


def test_grid_rows_compare_with_base_and_mark_the_best():
    variants = expand_grid({"training.lr": [1e-5, 2e-5]})
    results = {
        ("lr-1e-05", "node0"): {"eval_loss": 2.0, "exact_match": 0.5, "examples": 48, "tasks": {"arc": {"acc": 0.3}}},
        ("lr-2e-05", "node0"): {"eval_loss": 1.5, "exact_match": 0.5, "examples": 48, "tasks": {"arc": {"acc": 0.2}}},
    }
    base = {"model": "base", "eval_loss": 4.0, "exact_match": 0.0, "examples": 48, "tasks": {"arc": {"acc": 0.25}}}
    table = grid_table(grid_rows(variants, results, base), variants).set_index("variant")
    assert list(table.index) == ["base", "lr-1e-05", "lr-2e-05"]
    assert "examples" not in table  # describes the eval set, not a model
    assert table.loc["lr-2e-05", "eval_loss_ratio"] == pytest.approx(0.375)
    assert table.loc["lr-1e-05", "exact_match_delta"] == pytest.approx(0.5)
    assert table.loc["lr-1e-05", "arc.acc_delta"] == pytest.approx(0.05)
    assert table.loc["lr-2e-05", "best_for"] == "eval_loss"  # exact_match: a tie of every variant marks none
    assert table.loc["lr-1e-05", "best_for"] == "arc.acc"
    assert table.loc["base", "best_for"] == "" and pd.isna(table.loc["base", "lr"])
    assert list(table.columns[:6]) == ["model", "lr", "eval_loss", "exact_match", "arc.acc", "eval_loss_delta"]
    shuffled = {key: dict(reversed(result.items())) for key, result in results.items()}  # JSON keys come sorted
    assert grid_table(grid_rows(variants, shuffled, base), variants).columns.tolist() == ["variant", *table.columns]
    results[("lr-1e-05", "node0")]["exact_match"] = 0.75
    table = grid_table(grid_rows(variants, results, base), variants).set_index("variant")
    assert table.loc["lr-1e-05", "best_for"] == "exact_match;arc.acc"


def test_metrics_of_flattens_tasks_and_skips_non_numbers():
    result = {
        "model": "node0",
        "eval_loss": 1.0,
        "exact_match_stderr": 0.1,
        "samples": [],
        "flag": True,
        "tasks": {"hellaswag": {"alias": "hellaswag", "acc_norm,none": 0.4, "acc_norm_stderr,none": "N/A"}},
    }
    assert metrics_of(result) == {"eval_loss": 1.0, "hellaswag.acc_norm": 0.4}


def test_dry_run_plans_the_shared_stages_once_and_each_variant_s_jobs(tmp_path):
    config = tiny_config("g") | {"grid": GRID}
    jobs = planned_jobs(snakemake(tmp_path, config, "-n"))
    once = ("split_dataset", "tokenize_eval", "data_report", "check_environment", "build_demo_model", "evaluate_base")
    assert {rule: jobs[rule] for rule in once} == dict.fromkeys(once, 1)
    assert jobs["tokenize_shard"] == 2  # per node, not per variant
    for rule in ("plan_training", "summarize", "provenance", "copy_base_eval"):
        assert jobs[rule] == 4, rule
    for rule in ("train_node", "consolidate_node", "evaluate_model"):
        assert jobs[rule] == 4 * 2, rule  # variants x nodes; the base model is evaluate_base's alone
    assert jobs["compare_grid"] == 1


def test_without_a_grid_there_is_no_variant_and_no_comparison(tiny_dry_run):
    proc = tiny_dry_run  # tiny_config("t"), -n -p
    jobs = planned_jobs(proc)
    assert "compare_grid" not in jobs and "evaluate_base" not in jobs and jobs["evaluate_model"] == 3
    assert "results/t/train/node0/metrics.jsonl" in proc.stdout and "grid.csv" not in proc.stdout


def test_a_bad_grid_stops_the_workflow_with_one_line(tmp_path):
    config = tiny_config("g") | {"grid": {"training.lrr": [1e-5]}}
    proc = snakemake(tmp_path, config, "-n", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == ["error: grid: training.lrr is not a training key"]
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_a_2x2_grid_runs_to_one_comparison(tmp_path):
    """Two learning rates x two micro-batch sizes (the plan differs too) on one node, 4 steps each."""
    config = tiny_config("g", procs_per_node=1, max_steps=4, log_every=2, checkpoint_every=4)
    config |= {"nodes": 1, "eval": {"batch_size": 32, "max_new_tokens": 4, "max_samples": 16}}
    config["grid"] = {"training.lr": [1e-3, 3e-3], "training.micro_batch_size": [1, 2]}
    names = ["lr-0.001_micro_batch_size-1", "lr-0.001_micro_batch_size-2",
             "lr-0.003_micro_batch_size-1", "lr-0.003_micro_batch_size-2"]  # fmt: skip
    # the comparison, and one variant's summary and provenance (rule all's dry run is tested above)
    targets = [
        "results/g/eval/grid.csv",
        f"results/g/{names[0]}/eval/summary.csv",
        f"results/g/{names[0]}/provenance.json",
    ]
    start = time.monotonic()
    proc = snakemake(tmp_path, config, *targets)
    took = time.monotonic() - start
    jobs = planned_jobs(proc)  # a real run prints the same job table before it starts
    assert jobs["split_dataset"] == jobs["tokenize_shard"] == jobs["tokenize_eval"] == jobs["evaluate_base"] == 1
    assert jobs["train_node"] == jobs["consolidate_node"] == jobs["evaluate_model"] == jobs["plan_training"] == 4
    assert proc.stderr.count("rule split_dataset:") == 1 and proc.stderr.count("rule tokenize_shard:") == 1
    assert proc.stderr.count("rule evaluate_base:") == 1 and proc.stderr.count("rule train_node:") == 4
    root = tmp_path / "results" / "g"
    table = pd.read_csv(root / "eval" / "grid.csv")
    assert table["variant"].tolist() == ["base", *names] and table["model"].tolist() == ["base", *["node0"] * 4]
    assert (
        table["micro_batch_size"].tolist()[1:] == [1, 2, 1, 2] and table["lr"].tolist()[1:] == [1e-3] * 2 + [3e-3] * 2
    )
    assert (table["eval_loss"][1:] < table["eval_loss"][0]).all()  # every variant learned
    assert table["best_for"].str.contains("eval_loss").sum() >= 1
    assert (root / "eval" / "grid.png").stat().st_size > 10_000
    checkpoints = set()
    for name in names:
        state = json.loads((root / name / "train" / "node0" / "train_state.json").read_text())
        assert f"results/g/{name}/checkpoints/node0/" in state["checkpoint"]
        checkpoints.add(state["checkpoint"])
    assert len(checkpoints) == 4  # no variant resumed or shares another's
    summary = pd.read_csv(root / names[0] / "eval" / "summary.csv")  # with the shared base's row
    assert summary["model"].tolist() == ["base", "node0"]
    assert summary["eval_loss"][0] == pytest.approx(table["eval_loss"][0], rel=1e-4)
    provenance = json.loads((root / names[0] / "provenance.json").read_text())["config"]
    assert (provenance["training"]["lr"], provenance["training"]["micro_batch_size"]) == (1e-3, 1)
    plans = {n: json.loads((root / n / "plan" / "memory.json").read_text()) for n in names}
    assert plans[names[0]] != plans[names[1]]  # micro_batch_size changes the memory plan
    # rerunning one variant's training is like rerunning one node: one train_node job, nothing shared
    target = f"results/g/{names[2]}/train/node0/train_state.json"
    assert planned_jobs(snakemake(tmp_path, config, "-n", target, "--forcerun", "train_node")) == {"train_node": 1}
    print(f"2x2 grid on 1 node: {took:.0f} s")
