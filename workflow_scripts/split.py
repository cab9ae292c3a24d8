"""split_dataset: read raw instruction data, validate it, and split it into per-node shards.

Every input example ends in exactly one place: a node's shard, the shared eval set,
or ``rejects.parquet`` with its source file, row and a reason code. The data is
read and written in record batches, so memory stays bounded whatever the file size.

Assignment is deterministic and stable: the eval set is chosen by a hash of the
prompt (all but the final answer, so one question never straddles train and eval)
and a seed; nodes by a hash of the whole content (``balance: rows``) or by the
least-loaded node in input order (``balance: tokens``). Appending rows never moves
an existing row.

The split refuses to write an empty eval set or a node shard with fewer rows than
``--min-examples-per-shard`` (1 unless given), with one line saying how many rows are
usable and what to change, so a run never reaches training with nothing to train on.
"""

import argparse
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from chat_format import KNOWN_MARKERS, SpecialText, special_texts
from data_formats import (
    check_columns,
    column_names,
    conversation_text,
    delimiter_arg,
    estimate_rows,
    iter_records,
    resolve_paths,
    to_examples,
)
from pipeline_io import Progress, UserError, atomic_path, cli, file_sha256, json_object, write_json
from settings import option

REASONS = (
    "missing_field",
    "empty_response",
    "invalid_utf8",
    "invalid_json",
    "bad_turn_order",
    "too_long",
    "duplicate",
    "eval_overlap",
    "special_text",
)
SPLIT_SCHEMA = pa.schema(
    [
        ("messages", pa.string()),  # JSON list of {role, content}
        ("response", pa.string()),
        ("content_hash", pa.string()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("tokens", pa.int32()),
        ("category", pa.string()),
    ]
)
REJECT_SCHEMA = pa.schema(
    [
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("record", pa.string()),  # the input row as JSON, so nothing is lost
    ]
)


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def content_hash(messages: list[dict]) -> str:
    """Hash of the normalized conversation; equal for rows that differ only in whitespace."""
    norm = [{"role": t["role"], "content": normalize(t["content"])} for t in messages]
    return hashlib.sha256(conversation_text(norm).encode("utf-8")).hexdigest()


def prompt_hash(messages: list[dict]) -> str:
    return content_hash(messages[:-1])


def unit(key: str, seed: int, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{salt}:{key}".encode()).digest()[:8], "big")


def is_eval(phash: str, seed: int, eval_fraction: float) -> bool:
    return unit(phash, seed, "eval") / 2**64 < eval_fraction


def node_by_hash(chash: str, seed: int, nodes: int) -> int:
    return unit(chash, seed, "node") % nodes


@dataclass
class Splitter:
    """Validation and assignment state carried from one batch to the next."""

    nodes: int
    eval_fraction: float
    seed: int = 0
    balance: str = "rows"
    max_len: int | None = None
    overlength: str = "truncate"
    count_tokens: object = None  # callable(list of conversations) -> list of token counts
    eval_prompts: set | None = None  # prompt hashes of a separate eval file
    special: object = None  # SpecialText: data.special_text on each conversation
    seen: set = field(default_factory=set)
    node_tokens: list = field(default_factory=list)

    def __post_init__(self):
        self.node_tokens = [0] * self.nodes

    def process(self, records, mapping: str, names: dict, category_column: str | None, force_eval: bool = False):
        """Return (kept rows with a "dest", rejected rows) for one batch of Records."""
        kept, rejects, candidates = [], [], []
        for rec in records:
            if rec.error:
                rejects.append(reject(rec, *rec.error))
                continue
            for messages, problem in to_examples(rec.fields, mapping, names):
                if not problem and self.special is not None:
                    messages, problem = self.special(messages)
                if problem:
                    rejects.append(reject(rec, *problem))
                elif not messages[-1]["content"].strip():
                    rejects.append(reject(rec, "empty_response", "the answer is blank"))
                elif not all(t["content"].strip() for t in messages if t["role"] == "user"):
                    rejects.append(reject(rec, "missing_field", "a user turn is blank"))
                else:
                    category = rec.fields.get(category_column) if category_column else None
                    candidates.append((rec, messages, "" if category is None else str(category)))
        counts = self.count_tokens([m for _, m, _ in candidates]) if self.count_tokens and candidates else None
        for i, (rec, messages, category) in enumerate(candidates):
            tokens = counts[i] if counts else 0
            if self.max_len and tokens > self.max_len:
                if self.overlength == "error":
                    raise UserError(
                        f"{rec.source_file}: row {rec.source_row} has {tokens} tokens, above data.max_seq_len="
                        f"{self.max_len} (data.overlength: error)"
                    )
                if self.overlength == "drop":
                    rejects.append(reject(rec, "too_long", f"{tokens} tokens > max_seq_len {self.max_len}"))
                    continue
            chash, phash = content_hash(messages), prompt_hash(messages)
            if not force_eval and self.eval_prompts is not None and phash in self.eval_prompts:
                rejects.append(reject(rec, "eval_overlap", "its prompt is in the eval set"))
                continue
            if chash in self.seen:
                rejects.append(reject(rec, "duplicate", f"same content as an earlier row ({chash[:12]})"))
                continue
            self.seen.add(chash)
            kept.append(
                {
                    "messages": json.dumps(messages, ensure_ascii=False),
                    "response": messages[-1]["content"],
                    "content_hash": chash,
                    "source_file": rec.source_file,
                    "source_row": rec.source_row,
                    "tokens": tokens,
                    "category": category,
                    "dest": self.destination(chash, phash, tokens, force_eval),
                }
            )
        return kept, rejects

    def destination(self, chash: str, phash: str, tokens: int, force_eval: bool):
        if force_eval or (self.eval_prompts is None and is_eval(phash, self.seed, self.eval_fraction)):
            return "eval"
        if self.balance == "tokens":
            node = min(range(self.nodes), key=lambda n: (self.node_tokens[n], n))
        else:
            node = node_by_hash(chash, self.seed, self.nodes)
        self.node_tokens[node] += tokens
        return node


def reject(rec, reason: str, detail: str) -> dict:
    record = json.dumps(rec.fields, ensure_ascii=False, default=str) if rec.fields is not None else None
    return {
        "source_file": rec.source_file,
        "source_row": rec.source_row,
        "reason": reason,
        "detail": detail,
        "record": record,
    }


class Outputs:
    """Parquet writers for every shard, the eval set and the rejects, renamed into place on success."""

    def __init__(self, splits: list[Path], eval_path: Path, rejects: Path):
        self.targets = [*map(Path, splits), Path(eval_path), Path(rejects)]
        self.contexts = [atomic_path(p) for p in self.targets]
        tmps = [c.__enter__() for c in self.contexts]
        schemas = [SPLIT_SCHEMA] * (len(splits) + 1) + [REJECT_SCHEMA]
        self.writers = [pq.ParquetWriter(t, s) for t, s in zip(tmps, schemas, strict=True)]
        self.rows = [0] * len(self.writers)
        self.tokens = [0] * len(self.writers)

    def write(self, kept: list[dict], rejects: list[dict]) -> None:
        nodes = len(self.writers) - 2
        groups: dict[int, list[dict]] = {}
        for row in kept:
            groups.setdefault(nodes if row["dest"] == "eval" else row["dest"], []).append(row)
        for idx, rows in groups.items():
            self.writers[idx].write_table(pa.Table.from_pylist(rows, schema=SPLIT_SCHEMA))
            self.rows[idx] += len(rows)
            self.tokens[idx] += sum(r["tokens"] for r in rows)
        if rejects:
            self.writers[-1].write_table(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA))
            self.rows[-1] += len(rejects)

    def close(self, ok: bool) -> None:
        for w in self.writers:
            w.close()
        for c in self.contexts:
            if ok:
                c.__exit__(None, None, None)
            else:
                c.__exit__(RuntimeError, RuntimeError("failed"), None)


def token_counter(
    tokenizer_path: str | None,
    chat_template: str | None,
    template_kwargs: dict | None = None,
    format_template: str | None = None,
):
    """A function giving each conversation's token count as tokenize_shard will produce it
    (0 for a row the chat template cannot render, which tokenize_shard rejects); its ``tokenizer``
    attribute is the tokenizer. A tokenizer without a chat template, and neither data.chat_template
    nor data.format_template, is a one-line UserError here, the first stage that needs one."""
    if not tokenizer_path:
        return None
    from tokenization import ChatRenderer, encode_messages, use_template
    from transformers import AutoTokenizer

    tokenizer = use_template(
        AutoTokenizer.from_pretrained(tokenizer_path), tokenizer_path, chat_template, format_template
    )
    render = ChatRenderer(tokenizer, template_kwargs)

    def count(convs):
        return [len(e.get("input_ids", ())) for e in encode_messages(tokenizer, convs, render)]

    count.tokenizer = tokenizer
    return count


def special_text_check(counter, policy: str) -> SpecialText:
    """data.special_text over the tokenizer's special tokens (without a tokenizer, the common families')."""
    return SpecialText(special_texts(counter.tokenizer) if counter else KNOWN_MARKERS, policy)


def reject_hint(reasons) -> str:
    return (
        " (rows with special-token text: data.special_text strip or escape keeps them)"
        if reasons.get("special_text")
        else ""
    )


def run_split(a) -> dict:
    mapping, names = a.mapping, column_names(a.mapping, json.loads(a.columns))
    delimiter = delimiter_arg(a.delimiter)
    check_columns(a.data, a.format, mapping, names, delimiter)
    counter = token_counter(a.tokenizer, a.chat_template, a.template_kwargs, a.format_template)
    splitter = Splitter(a.nodes, a.eval_fraction, a.seed, a.balance, a.max_seq_len, a.overlength, counter)
    splitter.special = special_text_check(counter, a.special_text)
    outputs = Outputs(a.splits, a.eval, a.rejects)
    reasons, rows_in, ok = Counter(), 0, False
    totals = [estimate_rows(spec, a.format) for spec in (a.eval_data, a.data) if spec]
    known = all(t is not None for t, _ in totals)
    progress = Progress("split", sum(t for t, _ in totals) if known else None, exact=all(e for _, e in totals))
    try:
        if a.eval_data:  # a separate held-out file: all of it is eval, and overlaps leave training
            check_columns(a.eval_data, a.format, mapping, names, delimiter)
            eval_prompts = set()
            for records in iter_records(a.eval_data, a.format, delimiter):
                kept, rejects = splitter.process(records, mapping, names, a.category_column, force_eval=True)
                outputs.write(kept, rejects)
                rows_in += len(kept) + len(rejects)
                reasons.update(r["reason"] for r in rejects)
                progress.update(len(records))
                eval_prompts.update(prompt_hash(json.loads(r["messages"])) for r in kept)
            splitter.eval_prompts = eval_prompts
        for records in iter_records(a.data, a.format, delimiter):
            kept, rejects = splitter.process(records, mapping, names, a.category_column)
            outputs.write(kept, rejects)
            rows_in += len(kept) + len(rejects)
            reasons.update(r["reason"] for r in rejects)
            progress.update(len(records))
        progress.done()
        n_rej = sum(reasons.values())
        if rows_in == 0 or n_rej == rows_in:
            raise UserError(
                f"{a.data}: no usable rows left ({rows_in} read, {n_rej} rejected: {dict(reasons)})"
                + reject_hint(reasons)
            )
        if n_rej / rows_in > a.max_reject_fraction:
            raise UserError(
                f"{a.data}: {n_rej} of {rows_in} rows rejected ({dict(reasons)}), above "
                f"data.max_reject_fraction={a.max_reject_fraction}{reject_hint(reasons)}"
            )
        assert rows_in == sum(outputs.rows), "row accounting broken"
        check_shards(a, outputs.rows, dict(reasons))
        ok = True
    finally:
        outputs.close(ok)
    result = {"rows_in": rows_in, "reasons": dict(reasons), "rows": outputs.rows, "tokens": outputs.tokens}
    return result | {"special_text": splitter.special.summary()}


def check_shards(a, rows: list[int], reasons: dict) -> None:
    """Stop with one line when the eval set is empty or a node shard has fewer than
    ``a.min_examples_per_shard`` rows (0: no check); ``rows``: per node, eval, rejects."""
    least = a.min_examples_per_shard
    if least <= 0:
        return
    nodes, eval_rows, rejected = rows[:-2], rows[-2], rows[-1]
    short = [(f"node{i}", n) for i, n in enumerate(nodes) if n < least]
    what, fixes = [], []
    if short and least == 1:
        names = [name for name, _ in short]
        what.append(f"an empty {names[0]} shard" if len(names) == 1 else f"empty {', '.join(names)} shards")
    elif short:
        listed = ", ".join(f"{name} ({n} rows)" for name, n in short)
        what.append(f"{listed} below the {least} rows one micro-batch on every rank needs")
    if short:
        fixes.append(f"add rows or lower `nodes` (now {len(nodes)})")
    if eval_rows == 0:
        what.append("an empty eval set")
        fixes.append(
            f"add rows to {a.eval_data}" if a.eval_data else f"raise data.eval_fraction (now {a.eval_fraction})"
        )
    elif short and not a.eval_data:
        fixes.append(f"lower data.eval_fraction (now {a.eval_fraction})")
    if not what:
        return
    usable = sum(rows[:-1])
    why = f" ({rejected} rejected: {reasons})" if rejected else ""
    data = f"{a.data} and {a.eval_data}" if a.eval_data else a.data
    raise UserError(
        f"{data}: {usable} usable row{'s' * (usable != 1)}{why} make {' and '.join(what)}; {', '.join(fixes)}"
    )


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a file, a folder or a glob")
    p.add_argument("--eval-data", default=None, help="optional separate held-out file")
    p.add_argument("--format", **option("data.format"))
    p.add_argument("--delimiter", default=None)
    p.add_argument("--mapping", **option("data.mapping"))
    p.add_argument("--columns", required=True, help="JSON mapping field -> column name")
    p.add_argument("--category-column", **option("data.category_column"))
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--eval-fraction", type=float, required=True)
    p.add_argument("--seed", type=int, **option("data.seed"))
    p.add_argument("--balance", **option("data.balance"))
    p.add_argument("--tokenizer", default=None, help="tokenizer for lengths (too_long, balance: tokens)")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--format-template", **option("data.format_template"))
    p.add_argument("--special-text", **option("data.special_text"))
    p.add_argument("--template-kwargs", type=json_object, **option("data.template_kwargs"))
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--overlength", **option("data.overlength"))
    p.add_argument("--max-reject-fraction", type=float, **option("data.max_reject_fraction"))
    p.add_argument(
        "--min-examples-per-shard",
        type=int,
        default=1,
        help="stop when a node shard has fewer rows (0: no check); the eval set must not be empty",
    )
    p.add_argument("--splits", nargs="+", required=True, help="one output path per node")
    p.add_argument("--eval", required=True)
    p.add_argument("--rejects", required=True)
    p.add_argument("--manifest", required=True)
    a = p.parse_args(argv)
    if len(a.splits) != a.nodes:
        raise UserError(f"nodes is {a.nodes} but {len(a.splits)} split paths were given")
    result = run_split(a)
    rows, tokens = result["rows"], result["tokens"]
    write_json(
        a.manifest,
        {
            "sources": [{"path": str(f), "sha256": file_sha256(f)} for f in resolve_paths(a.data)],
            "rows_in": result["rows_in"],
            "nodes": [
                {"node": i, "rows": rows[i], "tokens": tokens[i], "path": str(pth), "sha256": file_sha256(pth)}
                for i, pth in enumerate(a.splits)
            ],
            "eval": {"rows": rows[-2], "tokens": tokens[-2], "path": str(a.eval), "sha256": file_sha256(a.eval)},
            "rejects": {"rows": rows[-1], "by_reason": result["reasons"], "path": str(a.rejects)},
            "special_text": result["special_text"],
            "settings": {
                "seed": a.seed,
                "eval_fraction": a.eval_fraction,
                "balance": a.balance,
                "mapping": a.mapping,
                "max_seq_len": a.max_seq_len,
                "overlength": a.overlength,
            },
        },
    )
    print(f"{result['rows_in']} rows: {rows[:-2]} per node, {rows[-2]} eval, {rows[-1]} rejected {result['reasons']}")


if __name__ == "__main__":
    main()
