"""evaluate_model: one model through lm-eval-harness: the held-out set (heldout.py's two tasks) and the extra
tasks of eval.tasks, loaded offline from eval.task_data; our result JSON and lm-eval's own, as its CLI
writes it (lm_eval_record: the chat template and its sha, system instruction, few-shot setting, task hashes).
"""

import argparse
import json
import math
import os
from pathlib import Path

import pandas as pd
import torch

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.fingerprint import model_location
from workflow_scripts.core.pipeline_io import atomic_path, cli, write_json
from workflow_scripts.core.settings import EvalConfig
from workflow_scripts.evals.heldout import evaluate_model, flat_metrics, label_spans, model_class
from workflow_scripts.evals.intervals import LEVEL, RESAMPLES, SEED, example_losses, heldout_intervals
from workflow_scripts.evals.metrics import HELDOUT, HELDOUT_LOSS, LOSSES, METRICS, SCORES, exact_match, exact_matches
from workflow_scripts.evals.tasks import extra_tasks
from workflow_scripts.model.weights import DTYPES, dtype_name


def exact_match_by_category(predictions: list[str], references: list[str], categories: list) -> dict:
    """Exact match within each category (the overall one's normalization)."""
    rows = pd.DataFrame({"p": predictions, "r": references, "c": categories})
    return {str(c): exact_match(list(zip(g["p"], g["r"], strict=True))) for c, g in rows.groupby("c", sort=True)}


def scored_losses(frame: pd.DataFrame, loss_samples: list[dict]):
    """Per example of ``frame`` (summed loss, label tokens) from lm-eval's heldout_loss samples, one per run of
    label tokens, in the order heldout_tasks made them (example by example)."""
    spans = [len(label_spans([IGNORE, *labels[1:]])) for labels in frame["labels"]]
    pairs = [s["eval_loss"] for s in sorted(loss_samples, key=lambda s: s["doc_id"])]
    return example_losses(pairs, spans)


def result_json(name: str, path: str, frame: pd.DataFrame, out: dict, tokenizer) -> dict:
    """Our result (the keys summarize and soup read) from lm-eval's output."""
    scores = {k: flat_metrics(v) for k, v in out["results"].items()}
    samples = sorted(out["samples"][HELDOUT], key=lambda s: s["doc_id"])
    predictions, references = map(list, zip(*(s["exact_match"] for s in samples), strict=True))
    loss, tokens = scores[HELDOUT_LOSS]["eval_loss"], int(scores[HELDOUT_LOSS]["label_tokens"])
    result = {"model": name, "path": path, "examples": len(frame), "label_tokens": tokens}
    held = {k: scores[HELDOUT][k] for k in SCORES}
    absent = {k for k, v in held.items() if math.isnan(v)}  # a score over no example: tool_call without tool turns
    result |= {k: METRICS[k].score(loss) for k in LOSSES} | {k: v for k, v in held.items() if k not in absent}
    if frame["category"].astype(bool).any():
        categories = frame["category"].tolist()
        result["exact_match_by_category"] = exact_match_by_category(predictions, references, categories)
    pairs = list(zip(predictions, references, strict=True))
    intervals = heldout_intervals(pairs, scored_losses(frame, out["samples"][HELDOUT_LOSS]))
    result["intervals"] = {k: v for k, v in intervals.items() if k not in absent}
    result["intervals"] |= {"resamples": RESAMPLES, "level": LEVEL, "seed": SEED}
    result |= {f"{k}_stderr": v["stderr"] for k, v in result["intervals"].items() if isinstance(v, dict)}
    correct = exact_matches(pairs)
    result["samples"] = [
        {"prompt": tokenizer.decode(ids[:n], skip_special_tokens=True)[-300:], "reference": r, "prediction": p,
         "correct": ok, "content_hash": h}
        for ids, n, r, p, ok, h in zip(frame["input_ids"], frame["prompt_length"], references[:20], predictions,
                                       correct, frame["content_hash"], strict=False)
    ]  # fmt: skip
    result["tasks"] = {k: v for k, v in scores.items() if k not in (HELDOUT, HELDOUT_LOSS)}
    counts = {k: v for k, v in (out.get("n-samples") or {}).items() if k not in (HELDOUT, HELDOUT_LOSS)}
    result["tasks_documents"] = {k: {"scored": v["effective"], "of": v["original"]} for k, v in counts.items()}
    return result


def lm_eval_record(out: dict, tracker, backend: str, model: str) -> dict:
    """lm-eval's results JSON as its CLI writes it (``lm_eval run --model <backend> --model_args pretrained=<model>
    --log_samples --output_path``: EvaluationTracker.save_results_aggregated): the output without its samples,
    then ``task_hashes`` (each task's samples' doc, prompt and target hashes, hashed together) and the fields of
    the tracker's GeneralConfigTracker, which simple_evaluate filled (chat_template and its sha,
    system_instruction, fewshot_as_multiturn). Given a model object, not a name, lm-eval records the model as
    CUSTOM under a random name: here it gets the backend and path the CLI's arguments would have given it."""
    from dataclasses import asdict

    from lm_eval.utils import hash_string, sanitize_model_name

    general = tracker.general_config_tracker
    general.model_source, general.model_name, general.model_name_sanitized = backend, model, sanitize_model_name(model)
    general.log_end_time()
    hashes = {
        task: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples))
        for task, samples in (out.get("samples") or {}).items()
    }
    return {k: v for k, v in out.items() if k != "samples"} | {"task_hashes": hashes} | asdict(general)


def load_model(backend: str, model: str, precision: str, batch_size: int):
    """The model on every visible GPU in ``precision`` (fp32 on the CPU): hf spreads layers over several
    (parallelize), vLLM shards tensors (tensor_parallel_size). vLLM on a CPU would reserve 92% of the host's
    memory for its KV cache: it gets VLLM_CPU_KVCACHE_SPACE GiB, 2 unless set."""
    gpus = torch.cuda.device_count()
    dtype = dtype_name(DTYPES[precision]) if gpus else "float32"
    if backend == "vllm":
        cache = {} if gpus else {"kv_cache_memory_bytes": int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 2) << 30}
        return model_class("vllm")(
            pretrained=model, dtype=dtype, batch_size="auto", tensor_parallel_size=max(gpus, 1), **cache
        )
    where = {"parallelize": True} if gpus > 1 else {"device": "cuda" if gpus else "cpu"}
    return model_class("hf")(pretrained=model, dtype=dtype, batch_size=batch_size, **where)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder or hub id")
    p.add_argument("--name", required=True, help="name in the summary (base, node0, ...)")
    p.add_argument("--eval", required=True, type=Path, help="tokenized eval set")
    p.add_argument("--config", required=True, help="settings.EvalConfig as JSON (a key left out: its default)")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--lm-eval-output", required=True, type=Path, help="lm-eval's own results JSON")
    a = p.parse_args(argv)
    a.model = model_location(a.model)  # a fetch record: its snapshot folder
    c = EvalConfig.from_json(a.config)
    frame = pd.read_parquet(a.eval).iloc[: c.max_samples or None]
    extra, manager = extra_tasks(c.tasks, c.task_data)  # before the model loads: missing data stops at once
    lm = load_model(c.backend, a.model, c.dtype, c.batch_size)
    from lm_eval.loggers import EvaluationTracker  # no output path: lm_eval_record writes what it would

    tracker = EvaluationTracker()
    generation = (c.max_new_tokens, c.apply_chat_template, c.template_kwargs)
    out = evaluate_model(lm, frame, extra, manager, *generation, limit=c.limit, tracker=tracker)
    result = result_json(a.name, a.model, frame, out, lm.tokenizer)
    from lm_eval.utils import handle_non_serializable  # lm-eval's JSON as its EvaluationTracker writes it

    with atomic_path(a.lm_eval_output) as tmp:
        own = lm_eval_record(out, tracker, c.backend, a.model)
        tmp.write_text(json.dumps(own, indent=2, default=handle_non_serializable))
    write_json(a.output, result)
    scores = {k: result[k] for k in ("eval_loss", "perplexity", "exact_match")}
    scores |= {f"{t} {k}": v for t, s in result["tasks"].items() for k, v in s.items() if not k.endswith("_stderr")}
    print(f"{a.name}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))


if __name__ == "__main__":
    main()
