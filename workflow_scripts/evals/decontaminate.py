"""decontaminate: which training rows share an n-gram with what the models are scored on.

The evaluation sets are the held-out set (its prompts and answers) and every eval.tasks task's scored
documents as lm-eval renders them, the target included (lm-eval's ``doc_to_text`` and the target, the
right choice's text for a multiple-choice task). A text's n-grams are its runs of ``n`` words (13 by
default, lm-eval's decontamination convention), lowercased, punctuation dropped. The evaluation sets'
n-grams are held in memory (a GSM8K-sized set: about 0.2M); the training shards are streamed once, batch
by batch, so memory does not grow with the training data. A document shorter than ``n`` words has no
n-gram and is counted as not checked.

``data.decontaminate``: ``report`` (the default) writes data/decontamination.json and trains on every
row; ``drop`` also leaves the training rows involved out: each node's shard is written again without
them (data/decontaminated/<node>.parquet, what tokenization then reads) and they are rejects with reason
``contaminated`` (data/contaminated.parquet), accounted row for row.
"""

import argparse
import contextlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from workflow_scripts.core.contracts import REJECT_SCHEMA, SPLIT_SCHEMA, batches
from workflow_scripts.core.pipeline_io import Progress, atomic_path, cli, write_json
from workflow_scripts.core.settings import DecontaminateConfig

log = logging.getLogger("decontaminate")
WORD = re.compile(r"\w+")
SHOWN = 20  # contaminated documents (per set) and training rows listed in the report


def ngrams(text: str, n: int) -> set[int]:
    """The hashes of ``text``'s n-grams of words (lowercased, punctuation dropped). Python's string hash is
    salted per process: hashes are compared within one run only."""
    words = WORD.findall(text.lower())
    return {hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1)}


def conversation_text(messages: list[dict]) -> str:
    return "\n".join(turn["content"] for turn in messages)


class EvalIndex:
    """The evaluation sets' n-grams: each n-gram's (set, document) pairs, and each set's counts."""

    def __init__(self, n: int):
        self.n, self.grams, self.sets, self.texts = n, {}, {}, {}

    def add(self, name: str, docs: Iterable[str]) -> None:
        count = short = 0
        for i, text in enumerate(docs):
            count += 1
            grams = ngrams(text, self.n)
            short += not grams
            for g in grams:
                self.grams.setdefault(g, []).append((name, i))
            self.texts[(name, i)] = text
        self.sets[name] = {"docs": count, "docs_shorter_than_n": short}


def heldout_docs(eval_split: Path) -> Iterator[str]:
    """The held-out set's conversations (prompt and answer), as the split wrote them."""
    for batch in batches(pq.ParquetFile(eval_split), 4096, ["messages"]):
        yield from (conversation_text(json.loads(m)) for m in batch.column("messages").to_pylist())


def rendered_docs(task) -> Iterator[str]:
    """A task's scored documents as lm-eval renders them: the prompt (doc_to_text) and the target (for a
    multiple-choice task, the right choice's text)."""
    for doc in task.eval_docs:
        text, target = task.doc_to_text(doc), task.doc_to_target(doc)
        if task.OUTPUT_TYPE == "multiple_choice":
            choices = task.doc_to_choice(doc)
            target = choices[target] if isinstance(target, int) else target
        if isinstance(target, list):
            target = " ".join(map(str, target))
        yield f"{text} {target}"


def task_sets(tasks: list[str], task_data: list[str]) -> Iterator[tuple[str, Iterator[str]]]:
    """Each extra task (leaf tasks of groups) and its rendered scored documents, loaded offline as evaluation
    loads them."""
    if not tasks:
        return
    from workflow_scripts.evals.heldout import leaf_tasks
    from workflow_scripts.evals.tasks import extra_tasks

    loaded, _ = extra_tasks(tasks, task_data)
    for task in leaf_tasks(loaded):
        yield task.config.task, rendered_docs(task)


def scan(shard: Path, index: EvalIndex, hits: dict) -> Iterator[tuple[pa.RecordBatch, list[bool], list[dict]]]:
    """Stream a node's shard: each batch, which of its rows share an n-gram with an evaluation set, and those
    rows (with their conversation); the documents hit are recorded in ``hits`` ((set, doc) -> training rows)."""
    keys = index.grams.keys()
    for batch in batches(pq.ParquetFile(shard), 4096):
        cols = batch.to_pydict()
        flags, rows = [], []
        for i, text in enumerate(cols["messages"]):
            shared = keys & ngrams(conversation_text(json.loads(text)), index.n)
            flags.append(bool(shared))
            if not shared:
                continue
            docs = sorted({doc for g in shared for doc in index.grams[g]})
            where = {"shard": shard.stem, "source_file": cols["source_file"][i], "source_row": cols["source_row"][i]}
            rows.append(where | {"content_hash": cols["content_hash"][i], "ngrams": len(shared),
                                 "docs": [f"{s}:{d}" for s, d in docs[:5]], "messages": text})  # fmt: skip
            for doc in docs:
                hits.setdefault(doc, []).append(where)
        yield batch, flags, rows


def summary(index: EvalIndex, hits: dict, rows: list, by_shard: dict, policy: str, training_rows: int) -> dict:
    """data/decontamination.json: per evaluation set, the documents sharing an n-gram with training rows (a
    few shown, with their rows), and the training rows involved."""
    sets = {}
    for name, counts in index.sets.items():
        docs = sorted(d for s, d in hits if s == name)
        examples = [
            {"doc": d, "text": index.texts[(name, d)][:300], "training_rows": hits[(name, d)][:3]} for d in docs[:SHOWN]
        ]
        sets[name] = counts | {"docs_contaminated": len(docs), "examples": examples}
    return {
        "ngram": index.n,
        "policy": policy,
        "training_rows": training_rows,
        "training_rows_contaminated": sum(by_shard.values()),
        "training_rows_by_shard": by_shard,
        "sets": sets,
        "rows": rows,  # the first SHOWN
    }


def decontaminate(shards: list[Path], index: EvalIndex, policy: str, clean: list[Path], rejects: Path | None):
    """Scan every shard; with ``drop``, write each without its contaminated rows (``clean``) and those rows to
    ``rejects``. Returns the report."""
    hits, shown, by_shard, total = {}, [], {}, 0
    progress = Progress("decontaminate", sum(pq.ParquetFile(s).metadata.num_rows for s in shards))
    with contextlib.ExitStack() as stack:
        dropped = None
        if policy == "drop":
            dropped = pq.ParquetWriter(stack.enter_context(atomic_path(rejects)), REJECT_SCHEMA)
            stack.callback(dropped.close)
            dropped.write_table(REJECT_SCHEMA.empty_table())
        for i, shard in enumerate(shards):
            out = None
            if policy == "drop":
                out = pq.ParquetWriter(stack.enter_context(atomic_path(clean[i])), SPLIT_SCHEMA)
                stack.callback(out.close)
                out.write_table(SPLIT_SCHEMA.empty_table())
            for batch, flags, rows in scan(shard, index, hits):
                total += len(flags)
                by_shard[shard.stem] = by_shard.get(shard.stem, 0) + len(rows)
                shown += [{k: v for k, v in r.items() if k != "messages"} for r in rows[: SHOWN - len(shown)]]
                if out is not None:
                    out.write_batch(batch.filter(pa.array([not f for f in flags])))
                    dropped.write_table(pa.Table.from_pylist([reject_row(r) for r in rows], schema=REJECT_SCHEMA))
                progress.update(len(flags))
    progress.done()
    return summary(index, hits, shown, by_shard, policy, total)


def reject_row(row: dict) -> dict:
    detail = f"shares {row['ngrams']} n-gram(s) with {', '.join(row['docs'])} (data.decontaminate: drop)"
    return {"source_file": row["source_file"], "source_row": row["source_row"], "reason": "contaminated",
            "detail": detail, "content_hash": row["content_hash"], "messages": row["messages"]}  # fmt: skip


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="settings.DecontaminateConfig as JSON (rules/common.smk)")
    p.add_argument("--shards", nargs="+", required=True, type=Path, help="the split's node shards")
    p.add_argument("--eval", required=True, type=Path, help="the split's held-out set")
    p.add_argument("--output", required=True, type=Path, help="data/decontamination.json")
    p.add_argument("--clean", nargs="*", type=Path, default=[], help="drop: each shard without its contaminated rows")
    p.add_argument("--rejects", type=Path, help="drop: the contaminated rows")
    a = p.parse_args(argv)
    cfg = DecontaminateConfig.from_json(a.config)
    if cfg.decontaminate == "drop" and (len(a.clean) != len(a.shards) or a.rejects is None):
        p.error("data.decontaminate: drop needs a --clean path per shard and --rejects")
    index = EvalIndex(cfg.decontaminate_ngram)
    index.add("heldout", heldout_docs(a.eval))
    for name, docs in task_sets(cfg.tasks, cfg.task_data):
        index.add(name, docs)
    report = decontaminate(a.shards, index, cfg.decontaminate, a.clean, a.rejects)
    write_json(a.output, report)
    per_set = ", ".join(f"{n}: {s['docs_contaminated']} of {s['docs']} docs" for n, s in report["sets"].items())
    print(f"{report['training_rows_contaminated']} of {report['training_rows']} training rows share a "
          f"{index.n}-gram with an evaluation set ({per_set}); data.decontaminate: {cfg.decontaminate}")  # fmt: skip


if __name__ == "__main__":
    main()
