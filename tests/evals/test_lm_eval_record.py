"""lm-eval's results JSON kept per model (eval/lm_eval/<model>.json) holds what lm-eval's own CLI writes with
--log_samples: chat_template and its sha, system_instruction, fewshot_as_multiturn, task_hashes, the model's
source and name. The keys come from lm-eval's own code (simple_evaluate fills an EvaluationTracker); the rest of
the output is what it was without the tracker."""

import json

import pandas as pd
import pytest
from conftest import REPO

from workflow_scripts.evals.evaluation import lm_eval_record
from workflow_scripts.evals.heldout import evaluate_model, model_class
from workflow_scripts.evals.tasks import extra_tasks

DEMO_MC = REPO / "resources" / "demo" / "tasks" / "demo_mc.yaml"
CLI_KEYS = {"task_hashes", "model_source", "model_name", "model_name_sanitized", "system_instruction",
            "system_instruction_sha", "fewshot_as_multiturn", "chat_template", "chat_template_sha",
            "total_evaluation_time_seconds"}  # fmt: skip


@pytest.fixture(scope="module")
def runs(demo_assets):
    """The demo base on 4 held-out rows and 3 demo_mc documents, chat template applied: without a tracker (as
    before) and with one."""
    from lm_eval.loggers import EvaluationTracker

    frame = pd.read_parquet(demo_assets["eval"]).iloc[:4]
    lm = model_class("hf")(pretrained=str(demo_assets["base"]), device="cpu", dtype="float32", batch_size=16)
    extra, manager = extra_tasks(["demo_mc"], [str(DEMO_MC)])
    plain = evaluate_model(lm, frame, extra, manager, 4, True, {}, limit=3)
    extra, manager = extra_tasks(["demo_mc"], [str(DEMO_MC)])
    tracker = EvaluationTracker()
    out = evaluate_model(lm, frame, extra, manager, 4, True, {}, limit=3, tracker=tracker)
    return lm, plain, out, tracker


def test_the_record_holds_what_lm_evals_cli_writes(runs, demo_assets, tmp_path):
    from lm_eval.utils import handle_non_serializable, hash_string

    lm, plain, out, tracker = runs
    model = str(demo_assets["base"])
    record = lm_eval_record(out, tracker, "hf", model)
    assert set(record) >= CLI_KEYS and "samples" not in record
    template = lm.chat_template(True)
    assert template and template == lm.tokenizer.chat_template
    assert record["chat_template"] == template and record["chat_template_sha"] == hash_string(template)
    assert record["system_instruction"] is None and record["system_instruction_sha"] is None
    assert record["fewshot_as_multiturn"] is True  # simple_evaluate's default, which evaluate_model keeps
    assert set(record["task_hashes"]) == {"heldout", "heldout_loss", "demo_mc"}
    assert (record["model_source"], record["model_name"]) == ("hf", model)

    # lm-eval's own writer, given the same output and tracker, writes the same JSON (its time apart)
    tracker.output_path = str(tmp_path / "cli")
    tracker.save_results_aggregated(results={k: v for k, v in out.items() if k != "samples"}, samples=out["samples"])
    (written,) = (tmp_path / "cli").rglob("results_*.json")
    cli = json.loads(written.read_text())
    ours = json.loads(json.dumps(record, default=handle_non_serializable))
    assert list(cli) == list(ours)
    assert {k: v for k, v in cli.items() if k != "total_evaluation_time_seconds"} == {
        k: v for k, v in ours.items() if k != "total_evaluation_time_seconds"
    }

    # otherwise the output is what it was without the tracker (the date apart)
    def same(o):
        return json.loads(json.dumps({k: v for k, v in o.items() if k != "date"}, default=handle_non_serializable))

    assert same(out) == same(plain)
    assert {k: v for k, v in record.items() if k not in CLI_KEYS} == {k: v for k, v in out.items() if k != "samples"}


def test_the_task_hashes_follow_the_prompts(runs, demo_assets):
    """A task's hash is lm-eval's, over its samples' doc, prompt and target hashes: another prompt, another hash."""
    from lm_eval.loggers import EvaluationTracker

    _, _, out, _ = runs
    changed = {task: [dict(s) for s in samples] for task, samples in out["samples"].items()}
    changed["demo_mc"][0]["prompt_hash"] = "0" * 64
    before = lm_eval_record(out, EvaluationTracker(), "hf", "m")["task_hashes"]
    after = lm_eval_record(out | {"samples": changed}, EvaluationTracker(), "hf", "m")["task_hashes"]
    assert after["demo_mc"] != before["demo_mc"] and after["heldout"] == before["heldout"]


def test_evaluate_models_cli_writes_the_record(demo_assets, tmp_path):
    """evaluation.py's command line (its main, in this process) writes lm-eval's JSON with the CLI's keys."""
    from workflow_scripts.evals.evaluation import main

    config = {"max_samples": 4, "max_new_tokens": 4, "batch_size": 8}
    main(["--model", str(demo_assets["base"]), "--name", "base", "--eval", str(demo_assets["eval"]),
          "--config", json.dumps(config), "--output", str(tmp_path / "r.json"),
          "--lm-eval-output", str(tmp_path / "l.json")])  # fmt: skip
    own = json.loads((tmp_path / "l.json").read_text())
    result = json.loads((tmp_path / "r.json").read_text())
    assert set(own) >= CLI_KEYS and set(own["task_hashes"]) == {"heldout", "heldout_loss"}
    assert own["model_source"] == "hf" and own["model_name"] == str(demo_assets["base"])
    assert (own["chat_template"] is not None) == (own["chat_template_sha"] is not None)
    assert own["results"]["heldout_loss"]["eval_loss,none"] == result["eval_loss"] and result["examples"] == 4
