"""training.objective dpo in the workflow: the reference_logps stage where the loss reads a cached reference,
the trainer given its files, and an SFT run's commands as before the objective existed; the demo's DPO stage in
small on the shared stage-1 run, and a new beta that reuses its reference."""

import json
import re

import pandas as pd
import pytest
from conftest import REPO, planned_jobs, snakemake, tiny_config

from workflow_scripts.core.settings import as_before_objectives, training_config

PAIRS = REPO / "resources" / "demo" / "preferences.jsonl"


def dpo_dry_run(tmp_path, **dpo) -> str:
    config = tiny_config("t", objective="dpo", dpo=dpo, packing=False)
    config["data"] = {"path": str(PAIRS), "max_seq_len": 128}
    return snakemake(tmp_path, config, "-n", "-p").stdout


def train_commands(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "train.py --config" in line]


def test_a_cached_reference_is_computed_once_per_shard_and_given_to_the_trainer(tmp_path):
    out = dpo_dry_run(tmp_path / "cached", reference="cached")
    # the two node shards and the eval pairs (the held-out preference accuracy's reference)
    assert re.search(r"^reference_logps\s+3$", out, re.M) and re.search(r"^preference_eval\s+3$", out, re.M)
    summarize = next(line for line in out.splitlines() if "summarize.py --results" in line)
    assert all(f"results/t/eval/preference/{m}.json" in summarize for m in ("base", "node0", "node1"))
    commands = train_commands(out)
    assert len(commands) == 2 and all("--reference-logps results/t/data/reference_logps/node" in c for c in commands)
    config = json.loads(re.search(r"train\.py --config '([^']*)'", commands[0]).group(1))
    assert config["objective"] == "dpo" and config["dpo"]["reference"] == "cached"
    lines = [line for line in out.splitlines() if "tokenization.py" in line]
    tokenize = {re.search(r"--output \S+/(\w+)\.parquet", line).group(1): line for line in lines}
    assert all("--both-sides" in tokenize[shard] for shard in ("node0", "node1", "eval_pairs"))
    assert "--both-sides" not in tokenize["eval"]  # the eval set: the chosen answers


def test_a_reference_free_loss_trains_without_the_reference(tmp_path):
    out = dpo_dry_run(tmp_path, reference="cached", loss="simpo")
    assert re.search(r"^reference_logps\s+1$", out, re.M)  # the eval pairs' alone, for the preference accuracy
    assert all("--reference-logps" not in c for c in train_commands(out))


def test_an_sft_section_is_passed_as_before_the_objective():
    sft = training_config({})
    section = {"lr": 1e-3, "objective": "sft", "dpo": {"beta": 0.1}}
    assert as_before_objectives(section) == {"lr": 1e-3}
    dpo = section | {"objective": "dpo"}
    assert as_before_objectives(dpo) == dpo and sft.objective == "sft"


def test_an_sft_dry_run_passes_no_objective_key(tiny_dry_run):
    commands = train_commands(tiny_dry_run.stdout)
    assert commands and all('"objective"' not in c and "--reference-logps" not in c for c in commands)
    out = tiny_dry_run.stdout
    assert not {"reference_logps", "preference_eval", "eval_pairs", "--both-sides", "--preference"} & set(out.split())


def test_demo_dpo_config():
    """Valid; DPO on stage 1's node0 over the demo's pairs with the cached reference; a run of its own; every key
    stage 1's config sets is set again (--configfile is merged over config/config.yaml)."""
    import yaml

    from workflow_scripts.core.settings import validated

    stage1 = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    stage3 = yaml.safe_load((REPO / "config" / "demo_dpo.yaml").read_text())
    config = validated(stage3)
    assert config["model"]["name_or_path"] == f"results/{stage1['run']}/models/node0" and config["run"] != stage1["run"]
    assert config["data"]["path"] == str(PAIRS.relative_to(REPO)) and config["data"]["mapping"] == "preference"
    assert config["training"]["objective"] == "dpo" and config["training"]["dpo"]["reference"] == "cached"

    def keys(d, prefix=""):
        return {
            k for key, v in d.items() for k in (keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [prefix + key])
        }

    assert keys(stage1) <= keys(stage3), keys(stage1) - keys(stage3)


def test_the_objective_is_the_same_for_every_variant():
    """It decides what the shared tokenization writes of pairs (both answers, or the chosen)."""
    from workflow_scripts.core.pipeline_io import UserError
    from workflow_scripts.core.settings import check_grid

    check_grid({"training.dpo.beta": [0.1, 0.3]})
    with pytest.raises(UserError, match="training.objective cannot vary in a grid"):
        check_grid({"training.objective": ["sft", "dpo"]})


@pytest.mark.e2e
def test_dpo_on_a_stage1_model_learns_the_rule_and_a_new_beta_reuses_the_reference(ddp_run, tmp_path):
    """The demo's third stage in small (config/demo_dpo.yaml on the tiny stage-1 run's node0, 12 steps, 192 pairs):
    the held-out pairs' preference accuracy goes from 0 (base, the reference itself) to most, beside the SFT
    scores, in summary.csv and the leaderboard (this base finds the chosen answer likelier already: 12 steps of
    stage 1 are not the demo's node0, whose share is about half); then a new beta trains again but reuses the
    cached reference: no reference_logps job in its dry run (the stage's key is the model and the tokenized pairs
    only)."""
    workdir, stage1 = ddp_run
    base = workdir / "results" / stage1["run"] / "models" / "node0"
    dpo = {"loss": "sigmoid", "beta": 0.1, "reference": "cached"}
    config = tiny_config("t-dpo", objective="dpo", dpo=dpo, packing=False, micro_batch_size=4, lr=1e-3)
    config["training"] |= {"max_steps": 12, "log_every": 4, "checkpoint_every": 12, "warmup_ratio": 0.0}
    config |= {"nodes": 1, "model": {"name_or_path": str(base)}}
    pairs = tmp_path / "pairs.jsonl"  # the demo's first 192 pairs: less to tokenize, score and evaluate
    pairs.write_text("".join(PAIRS.read_text(encoding="utf-8").splitlines(keepends=True)[:192]), encoding="utf-8")
    config["data"] |= {"path": str(pairs), "mapping": "preference"}
    snakemake(tmp_path, config)
    root = tmp_path / "results" / "t-dpo"
    summary = pd.read_csv(root / "eval" / "summary.csv").set_index("model")
    assert summary.loc["base", "preference.accuracy"] == 0 and summary["eval_loss"].notna().all()
    assert summary.loc["node0", "preference.accuracy"] > 0.8, summary.to_string()
    leaderboard = (root / "eval" / "leaderboard.txt").read_text()
    assert re.search(r"preference\.accuracy +node0 [01]\.\d+ \[", leaderboard), leaderboard  # with its interval
    metrics = [json.loads(line) for line in (root / "train" / "node0" / "metrics.jsonl").read_text().splitlines()]
    assert {"rewards/accuracies", "rewards/margins", "logps/chosen"} <= set(metrics[-1])

    config["training"]["dpo"] = dpo | {"beta": 0.3}
    jobs = planned_jobs(snakemake(tmp_path, config, "-n"))
    assert jobs.get("train_node") == 1 and jobs.get("preference_eval") == 2 and "reference_logps" not in jobs, jobs
