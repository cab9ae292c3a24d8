"""evaluate_model through lm-eval-harness: the held-out numbers equal the plain forward pass and generate() loop
it replaced, eval.tasks run offline from local files or stop with one line, the demo's multiple-choice task."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import BIN, REPO, snakemake, tiny_config, tool_env

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.evals.evaluation import result_json
from workflow_scripts.evals.heldout import evaluate_model, flat_metrics, label_spans, model_class
from workflow_scripts.evals.metrics import HELDOUT
from workflow_scripts.evals.tasks import extra_tasks

DEMO_MC = REPO / "resources" / "demo" / "tasks" / "demo_mc.yaml"
SAMPLES, NEW_TOKENS = 24, 8  # two batches of 16, the second partial


# --- the oracle: evaluation.py before lm-eval (commit f208e47), a plain forward pass and a generate() loop ---


@torch.no_grad()
def reference_loss(model, frame: pd.DataFrame, pad_id: int, batch_size: int) -> tuple[float, int]:
    total, count = 0.0, 0
    for start in range(0, len(frame), batch_size):
        batch = frame.iloc[start : start + batch_size]
        width = int(batch["length"].max())
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, y) in enumerate(zip(batch["input_ids"], batch["labels"], strict=True)):
            ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        total += F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        ).item()
        count += int((labels[:, 1:] != -100).sum())
    return total / count, count


@torch.no_grad()
def reference_answers(model, tokenizer, frame: pd.DataFrame, stops: list[int], batch_size: int) -> list[str]:
    answers, pad = [], tokenizer.pad_token_id
    for start in range(0, len(frame), batch_size):
        batch = frame.iloc[start : start + batch_size]
        prompts = [list(x[:n]) for x, n in zip(batch["input_ids"], batch["prompt_length"], strict=True)]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, pr in enumerate(prompts):
            ids[i, width - len(pr) :], mask[i, width - len(pr) :] = torch.tensor(pr), 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=pad, eos_token_id=stops)  # fmt: skip
        answers += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return [a.strip() for a in answers]


@pytest.fixture(scope="module")
def heldout_run(demo_assets):
    """The demo base model through evaluation.py's lm-eval path (demo_mc: the e2e test below)."""
    frame = pd.read_parquet(demo_assets["eval"]).iloc[:SAMPLES]
    lm = model_class("hf")(pretrained=str(demo_assets["base"]), device="cpu", dtype="float32", batch_size=16)
    extra, manager = extra_tasks([], [])
    out = evaluate_model(lm, frame, extra, manager, NEW_TOKENS, True, {})
    return lm, frame, out, result_json("base", str(demo_assets["base"]), frame, out, lm.tokenizer)


def test_heldout_numbers_equal_the_plain_forward_pass(heldout_run):
    """Loss, perplexity and label tokens to 1e-6 (relative: fp32 sums in another order), the same greedy
    answer for every prompt, so the same exact match: lm-eval sees our cached token ids, not its own."""
    from workflow_scripts.data.chat_render import generation_settings

    lm, frame, out, result = heldout_run
    loss, tokens = reference_loss(lm.model, frame, lm.tokenizer.pad_token_id, 16)
    assert result["label_tokens"] == tokens
    assert math.isclose(result["eval_loss"], loss, rel_tol=1e-6, abs_tol=0)
    assert math.isclose(result["perplexity"], math.exp(loss), rel_tol=1e-6)
    stops = generation_settings(lm.tokenizer)["eos_token_id"]
    expected = reference_answers(lm.model, lm.tokenizer, frame, stops, 16)
    answers = [s["exact_match"][0] for s in sorted(out["samples"][HELDOUT], key=lambda s: s["doc_id"])]
    assert answers == expected
    hits = sum(a == r.strip() for a, r in zip(expected, frame["response"], strict=True)) / len(frame)
    assert math.isclose(result["exact_match"], hits, abs_tol=1e-12)


def test_multi_turn_loss_scores_every_answer_run(heldout_run):
    """Examples with several runs of label tokens (multi-turn: two demo examples back to back) and a label
    on the first token (no context: never scored, as in the shifted cross-entropy): the loss task's docs are
    the runs, and their token-weighted loss equals the plain forward pass's."""
    lm, frame, _, _ = heldout_run
    rows = frame.iloc[:6]
    pairs = zip(rows.iloc[::2].itertuples(), rows.iloc[1::2].itertuples(), strict=True)
    joined = pd.DataFrame([{"input_ids": [*a.input_ids, *b.input_ids], "labels": [*a.labels, *b.labels],
                            "prompt_length": a.prompt_length, "response": a.response,
                            "length": a.length + b.length} for a, b in pairs])  # fmt: skip
    joined.at[0, "labels"] = [joined.at[0, "input_ids"][0], *joined.at[0, "labels"][1:]]
    out = evaluate_model(lm, joined, [], extra_tasks([], [])[1], NEW_TOKENS, True, {}, heldout=("heldout_loss",))
    loss, tokens = reference_loss(lm.model, joined, lm.tokenizer.pad_token_id, 16)
    scores = flat_metrics(out["results"]["heldout_loss"])
    assert scores["label_tokens"] == tokens and len(out["samples"]["heldout_loss"]) == 2 * len(joined)
    assert math.isclose(scores["eval_loss"], loss, rel_tol=1e-6, abs_tol=0)


def test_eval_limit_scores_each_extra_tasks_first_documents_and_every_heldout_row(heldout_run):
    """eval.limit is lm-eval's limit for the extra tasks only: demo_mc scores its first 5 documents (a fraction:
    that share, rounded up), the held-out set every row it was given; the counts reach the result."""
    from workflow_scripts.evals.heldout import task_samples

    lm, frame, _, _ = heldout_run
    extra, manager = extra_tasks(["demo_mc"], [str(DEMO_MC)])
    total = len(extra[0].eval_docs)
    assert task_samples(extra, 0) is None and task_samples(extra, 0.1) == {
        "demo_mc": list(range(math.ceil(total / 10)))
    }
    out = evaluate_model(lm, frame.iloc[:6], extra, manager, NEW_TOKENS, True, {}, limit=5)
    assert out["n-samples"]["demo_mc"] == {"original": total, "effective": 5}
    assert out["n-samples"]["heldout"]["effective"] == 6 and total > 5
    result = result_json("base", "b", frame.iloc[:6], out, lm.tokenizer)
    assert result["tasks_documents"] == {"demo_mc": {"scored": 5, "of": total}}


def test_result_keeps_every_key(heldout_run):
    _, _, _, result = heldout_run
    assert {"model", "path", "examples", "label_tokens", "eval_loss", "perplexity", "exact_match", "rouge_l", "bleu",
            "chrf", "exact_match_by_category", "samples", "tasks"} <= set(result)  # fmt: skip
    assert result["tasks"] == {}  # the held-out set stays in the top-level keys
    assert "tool_call" not in result and "tool_call" not in result["intervals"]  # no tool-call turn: no score


def test_lm_eval_names_lose_the_none_filter():
    scores = {"alias": "gsm8k", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": 0.1,
              "acc,none": 0.25, "acc_stderr,none": "N/A", "sample_len": 3}  # fmt: skip
    assert flat_metrics(scores) == {
        "exact_match/strict-match": 0.5,
        "exact_match/strict-match_stderr": 0.1,
        "acc": 0.25,
    }


def test_label_spans():
    assert label_spans([-100, -100, 5, 6, -100, 7, -100]) == [(2, 4), (5, 6)]
    assert label_spans([-100, 1, 2]) == [(1, 3)]


def test_task_without_offline_data_stops_with_one_line(tmp_path):
    """A task YAML whose data file is missing: a UserError naming the task, raised before any model loads."""
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text(
        DEMO_MC.read_text().replace("task: demo_mc", "task: mine").replace("demo_mc.jsonl", "gone.jsonl")
    )
    with pytest.raises(UserError, match=r"^eval.tasks: mine: its data is not available offline") as e:
        extra_tasks(["mine"], [str(yaml_file)])
    assert "\n" not in str(e.value)


def test_a_data_file_serves_the_task_it_is_named_after(tmp_path):
    """eval.task_data: arc_easy.jsonl is lm-eval's arc_easy over local data (here: the task YAML's include
    path holds a copy of demo_mc renamed, and the data file replaces its data)."""
    from workflow_scripts.evals.task_data import data_override, task_sources

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text(DEMO_MC.read_text().replace("task: demo_mc", "task: mine"))
    include, files = task_sources([str(tmp_path / "tasks"), str(tmp_path / "mine.jsonl")])
    assert include == [str((tmp_path / "tasks").resolve())] and files == {"mine": (tmp_path / "mine.jsonl").resolve()}
    entry = type("Entry", (), {"name": "mine", "yaml_path": tmp_path / "tasks" / "mine.yaml"})
    override = data_override(entry, files, include)
    assert override["dataset_path"] == "json" and set(override["dataset_kwargs"]["data_files"]) == {
        "train",
        "validation",
        "test",
    }
    entry.name = "other"
    assert data_override(entry, files, include) == {  # datasets resolves relative data_files in data_dir
        "dataset_kwargs": {"data_dir": str(tmp_path / "tasks"), "data_files": {"test": "demo_mc.jsonl"}}
    }


def test_hub_data_offline_stops_with_one_line_no_traceback(demo_assets, tmp_path):
    """A task whose data set is on the hub (arc_easy's), offline: the script exits 2 with one line naming it,
    before the model loads. (A task of lm-eval's own without eval.task_data takes the same path; indexing
    lm-eval's 14,000 task YAMLs would add 10-20 s here.)"""
    yaml_file = tmp_path / "hubby.yaml"
    hub = "dataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy"
    yaml_file.write_text(DEMO_MC.read_text().replace("task: demo_mc", "task: hubby").replace("dataset_path: json", hub))
    proc = subprocess.run(
        [str(BIN / "python"), "-m", "workflow_scripts.evals.evaluation", "--model", str(demo_assets["base"]),
         "--name", "base", "--eval", str(demo_assets["eval"]),
         "--config", json.dumps({"tasks": ["hubby"], "task_data": [str(yaml_file)]}),
         "--output", str(tmp_path / "r.json"), "--lm-eval-output", str(tmp_path / "l.json")],
        capture_output=True, text=True, env=tool_env() | {"HF_DATASETS_OFFLINE": "1"}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: eval.tasks: hubby: its data is not available offline")


def test_missing_task_data_stops_at_parse_time(tmp_path):
    config = tiny_config("t") | {"eval": {"tasks": ["mine"], "task_data": [str(tmp_path / "gone.yaml")]}}
    proc = snakemake(tmp_path / "w", config, "-n", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: eval.task_data: {tmp_path / 'gone.yaml'} does not exist"
        " (evaluation runs offline: a task's data must be local)"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_demo_mc_task_in_the_workflows_results(tmp_path):
    """evaluate_model with eval.tasks: [demo_mc] writes its scores and lm-eval's own JSON (results, configs)."""
    config = tiny_config("t")
    config["eval"] |= {"tasks": ["demo_mc"], "task_data": [str(DEMO_MC)], "limit": 7}
    snakemake(tmp_path, config, "results/t/eval/base.json")
    result = json.loads((tmp_path / "results/t/eval/base.json").read_text())
    assert result["tasks_documents"]["demo_mc"]["scored"] == 7  # eval.limit
    assert set(result["tasks"]) == {"demo_mc"} and result["examples"] == config["eval"]["max_samples"]
    assert set(result["tasks"]["demo_mc"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert 0 <= result["tasks"]["demo_mc"]["acc"] <= 1
    own = json.loads((tmp_path / "results/t/eval/lm_eval/base.json").read_text())
    assert {"results", "configs"} <= set(own) and "acc,none" in own["results"]["demo_mc"]
    assert own["configs"]["demo_mc"]["output_type"] == "multiple_choice"
    assert own["results"]["heldout_loss"]["eval_loss,none"] == result["eval_loss"]
    assert own["results"]["demo_mc"]["acc,none"] == result["tasks"]["demo_mc"]["acc"]


VLLM_PYTHON = os.environ.get("EVAL_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)


def briefly_trained(assets: dict, out) -> str:
    """The demo base after 300 AdamW steps on node0's shard, as a demo node model is: a random model's greedy
    answers are near-ties that two backends' kernels break differently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model, tokenizer = (cls.from_pretrained(assets["base"]) for cls in (AutoModelForCausalLM, AutoTokenizer))
    frame, optimizer = pd.read_parquet(assets["node0"]), torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(300):
        batch = frame.sample(32, random_state=step)
        ids = torch.zeros((32, int(batch["length"].max())), dtype=torch.long)
        labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
        for i, (x, y) in enumerate(zip(batch["input_ids"], batch["labels"], strict=True)):
            ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step(), optimizer.zero_grad()
    model.save_pretrained(out), tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM: EVAL_VLLM_PYTHON names a venv with it (docs/evaluation.md)")
def test_hf_and_vllm_give_the_same_greedy_answers(demo_assets, tmp_path):
    """evaluation.py with eval.backend hf (this venv) and vllm (its own venv, as the rule runs it): the same
    greedy answers (the samples and the four scores over every prompt) and the same held-out loss."""
    results, model = {}, briefly_trained(demo_assets, tmp_path / "model")
    for backend, python in (("hf", str(BIN / "python")), ("vllm", VLLM_PYTHON)):
        proc = subprocess.run(
            [python, "-m", "workflow_scripts.evals.evaluation", "--model", model,
             "--name", "base", "--eval", str(demo_assets["eval"]),
             "--config", json.dumps({"backend": backend, "batch_size": 32, "max_new_tokens": NEW_TOKENS}),
             "--output", str(tmp_path / f"{backend}.json"),
             "--lm-eval-output", str(tmp_path / f"{backend}.lm_eval.json")],
            capture_output=True, text=True, env=tool_env(), timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[backend] = json.loads((tmp_path / f"{backend}.json").read_text())
    hf, vllm = results["hf"], results["vllm"]
    assert [s["prediction"] for s in hf["samples"]] == [s["prediction"] for s in vllm["samples"]]
    assert {k: hf[k] for k in ("exact_match", "rouge_l", "bleu", "chrf")} == {
        k: vllm[k] for k in ("exact_match", "rouge_l", "bleu", "chrf")
    }
    assert hf["label_tokens"] == vllm["label_tokens"] and math.isclose(hf["eval_loss"], vllm["eval_loss"], rel_tol=1e-4)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def few_shot_task(tmp_path, splits: dict[str, list[dict]] | None = None, single: list[dict] | None = None):
    """A 2-shot multiple-choice task "fs" (demo_mc's YAML with a train split for its few-shot examples) and its
    local data: a folder fs/ of split files, or one file fs.jsonl; returns eval.task_data."""
    tasks = tmp_path / "tasks"
    tasks.mkdir(parents=True)
    own = 'task: fs\ntraining_split: train\nfewshot_split: train\nnum_fewshot: 2\nfewshot_delimiter: "\\n\\n"\n'
    (tasks / "fs.yaml").write_text(DEMO_MC.read_text().replace("task: demo_mc\n", own))
    rows = lambda docs: "".join(json.dumps(d) + "\n" for d in docs)  # noqa: E731
    if single is not None:
        (tmp_path / "fs.jsonl").write_text(rows(single))
        return [str(tasks), str(tmp_path / "fs.jsonl")]
    (tmp_path / "fs").mkdir()
    for split, docs in splits.items():
        (tmp_path / "fs" / f"{split}.jsonl").write_text(rows(docs))
    return [str(tasks), str(tmp_path / "fs")]


def mc(question: str) -> dict:
    return {"question": question, "choices": ["yes", "no"], "answer": 0}


def test_task_data_by_split_draws_few_shot_examples_from_the_train_file_only(heldout_run, tmp_path):
    """A folder named after the task, one file per split: the scored documents are test.jsonl's, the few-shot
    examples train.jsonl's, never a scored question. A missing few-shot split, or one file for every split of a
    few-shot task, stops with one line."""
    lm, frame, _, _ = heldout_run
    train, test = [mc(f"TRAIN question {i}?") for i in range(4)], [mc(f"TEST question {i}?") for i in range(5)]
    extra, manager = extra_tasks(["fs"], few_shot_task(tmp_path / "ok", {"train": train, "test": test}))
    out = evaluate_model(lm, frame.iloc[:4], extra, manager, NEW_TOKENS, False, {}, limit=3)
    assert out["n-samples"]["fs"] == {"original": 5, "effective": 3}
    for sample in out["samples"]["fs"]:
        context = sample["arguments"]["gen_args_0"]["arg_0"] if isinstance(sample["arguments"], dict) else None
        context = context or sample["arguments"][0][0]
        assert context.count("TRAIN question") == 2 and context.count("TEST question") == 1, context
    with pytest.raises(UserError, match=r"fs's folder has no train file for a split it reads .*fs/train.jsonl"):
        extra_tasks(["fs"], few_shot_task(tmp_path / "no-train", {"test": test}))
    with pytest.raises(
        UserError, match=r"fs.jsonl serves every split of fs, whose 2-shot examples come from its train"
    ):
        extra_tasks(["fs"], few_shot_task(tmp_path / "one-file", single=train + test))


def test_task_data_named_after_no_task_stops_at_parse_time(tmp_path):
    from workflow_scripts.evals.task_data import check_names

    (tmp_path / "test.jsonl").write_text(json.dumps(mc("q")) + "\n")
    with pytest.raises(UserError, match=r"test.jsonl is named after no task of eval.tasks \(gsm8k\)"):
        check_names(["gsm8k"], [str(tmp_path / "test.jsonl")])
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps(mc("q")) + "\n")
    check_names(["gsm8k"], [str(tmp_path / "gsm8k")])  # a folder named after it: fine
