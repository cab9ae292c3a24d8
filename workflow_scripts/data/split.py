"""split_dataset: read raw instruction data, validate it, and split it into per-node shards.

Every input example ends in exactly one place: a node's shard, the shared eval set,
or ``rejects.parquet`` with its source file, row and a reason code. The data is
read and written in record batches, so memory stays bounded whatever the file size.

Assignment is deterministic and stable: the eval set is chosen by a hash of the
prompt (all but the final answer, so one question never straddles train and eval)
and a seed; nodes by a hash of the whole content (``balance: rows``) or by the
least-loaded node in input order (``balance: tokens``). Appending rows never moves
an existing row.

The split loads no tokenizer under ``balance: rows`` (the default): every row's length, the
length policy (data.max_seq_len, data.overlength) and special-token text in the data
(data.special_text) are tokenize_shard's, so a new base model reruns tokenization, not the split.
``balance: tokens`` measures rows by the tokenizer's fast path (render and a batch encode
without offsets or labels: chat_render.render_lengths).

The split refuses to write an empty eval set or a node shard with fewer rows than
``--min-examples-per-shard`` (1 unless given), with one line saying how many rows are
usable and what to change, so a run never reaches training with nothing to train on.
"""

import argparse
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from workflow_scripts.core.contracts import REJECT_SCHEMA, SPLIT_SCHEMA
from workflow_scripts.core.fingerprint import model_location
from workflow_scripts.core.pipeline_io import (
    Progress,
    UserError,
    atomic_path,
    cli,
    fewer_gc_pauses,
    file_sha256,
    write_json,
)
from workflow_scripts.core.settings import SplitConfig
from workflow_scripts.data.chat_render import ChatRenderer, load_tokenizer, render_lengths, use_template
from workflow_scripts.data.identity import JSON_TEXT, conversation_hashes, is_eval, node_by_hash, prompt_hash
from workflow_scripts.data.mappings import ControlChars, check_columns, resolve_mapping, to_examples
from workflow_scripts.data.readers import delimiter_arg, estimate_rows, iter_records, resolve_paths
from workflow_scripts.data.tool_calls import load_tools, with_tools

log = logging.getLogger("split")

REASONS = (
    "missing_field",
    "empty_response",
    "invalid_utf8",
    "invalid_json",
    "bad_turn_order",
    "unsupported_content",
    "unknown_role",
    "bad_tool_arguments",
    "unknown_tool",
    "control_chars",
    "duplicate",
    "eval_overlap",
    # a preference pair's (data.mapping preference: preference_pairs.PAIR_REASONS)
    "identical_pair",
    "empty_answer",
    "prompt_mismatch",
)


@dataclass
class Splitter:
    """Validation and assignment state carried from one batch to the next."""

    nodes: int
    eval_fraction: float
    seed: int = 0
    balance: str = "rows"
    lengths: object = None  # balance: tokens: callable(list of conversations) -> their lengths in tokens
    eval_prompts: set | None = None  # prompt hashes of a separate eval file
    control: object = None  # ControlChars: data.control_chars on each conversation
    tools: list | None = None  # data.tools: the function specs of every conversation without its own
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
            try:
                examples = to_examples(rec.fields, mapping, names)
            except RecursionError:  # a JSON array's item nested thousands deep (JSONL's: data_readers)
                deep = f"nested deeper than the JSON reader follows ({sys.getrecursionlimit()})"
                rejects.append(reject(replace(rec, fields=None), "invalid_json", deep))
                continue
            for messages, problem in examples:
                if not problem and self.control is not None:
                    messages, problem = self.control(messages)
                if not problem and self.tools:
                    messages, problem = with_tools(messages, self.tools)
                if problem:
                    rejects.append(reject(rec, *problem))
                elif not messages[-1]["content"].strip() and not messages[-1].get("tool_calls"):
                    rejects.append(reject(rec, "empty_response", "the answer is blank", messages))
                elif not all(t["content"].strip() for t in messages if t["role"] == "user"):
                    rejects.append(reject(rec, "missing_field", "a user turn is blank", messages))
                else:
                    category = rec.fields.get(category_column) if category_column else None
                    candidates.append((rec, messages, "" if category is None else str(category)))
        by_tokens = []  # (row, conversation) still to be given a node by their tokens
        for rec, messages, category in candidates:
            chash, phash = conversation_hashes(messages)
            if not force_eval and self.eval_prompts is not None and phash in self.eval_prompts:
                rejects.append(reject(rec, "eval_overlap", "its prompt is in the eval set", messages, chash))
                continue
            if chash in self.seen:
                detail = f"same content as an earlier row ({chash[:12]})"
                rejects.append(reject(rec, "duplicate", detail, messages, chash))
                continue
            self.seen.add(chash)
            row = {
                "messages": JSON_TEXT.encode(messages),
                "response": messages[-1]["content"],
                "content_hash": chash,
                "source_file": rec.source_file,
                "source_row": rec.source_row,
                "category": category,
                "dest": self.destination(chash, phash, force_eval),
            }
            kept.append(row)
            if row["dest"] is None:
                by_tokens.append((row, messages))
        self.assign_by_tokens(by_tokens)
        return kept, rejects

    def destination(self, chash: str, phash: str, force_eval: bool):
        """ "eval", a node, or None: the least-loaded node, once the row's length is known (balance: tokens)."""
        if force_eval or (self.eval_prompts is None and is_eval(phash, self.seed, self.eval_fraction)):
            return "eval"
        return None if self.balance == "tokens" else node_by_hash(chash, self.seed, self.nodes)

    def assign_by_tokens(self, pending: list[tuple[dict, list]]) -> None:
        """Each row, in input order, to the node with the fewest tokens so far (a row counts 0 without
        a tokenizer); the lengths are measured for the batch at once."""
        if not pending:
            return
        counts = self.lengths([m for _, m in pending]) if self.lengths else [0] * len(pending)
        for (row, _), tokens in zip(pending, counts, strict=True):
            row["dest"] = min(range(self.nodes), key=lambda n: (self.node_tokens[n], n))
            self.node_tokens[row["dest"]] += tokens


def reject(rec, reason: str, detail: str, messages: list | None = None, chash: str | None = None) -> dict:
    """A rejects row (contracts.REJECT_SCHEMA) for an input record, with its conversation where there is one."""
    record = json.dumps(rec.fields, ensure_ascii=False, default=str) if rec.fields is not None else None
    return {
        "source_file": rec.source_file,
        "source_row": rec.source_row,
        "line": rec.line,
        "reason": reason,
        "detail": detail,
        "content_hash": chash,
        "messages": JSON_TEXT.encode(messages) if messages is not None else None,
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
        self.rejects_tmp = tmps[-1]
        self.rows = [0] * len(self.writers)

    def keep_rejects(self, path: Path) -> None:
        """The rejects found so far, one JSON object a line, to ``path`` (outside the rule's outputs, which
        Snakemake deletes when the job fails), for a stop that leaves no rejects.parquet."""
        self.writers[-1].close()
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            for batch in pq.ParquetFile(self.rejects_tmp).iter_batches():
                for row in batch.to_pylist():
                    f.write(json.dumps({k: v for k, v in row.items() if v is not None}, ensure_ascii=False) + "\n")

    def write(self, kept: list[dict], rejects: list[dict]) -> None:
        nodes = len(self.writers) - 2
        groups: dict[int, list[dict]] = {}
        for row in kept:
            groups.setdefault(nodes if row["dest"] == "eval" else row["dest"], []).append(row)
        for idx, rows in groups.items():
            columns = {name: [r[name] for r in rows] for name in SPLIT_SCHEMA.names}
            self.writers[idx].write_table(pa.Table.from_pydict(columns, schema=SPLIT_SCHEMA))
            self.rows[idx] += len(rows)
        if rejects:
            self.writers[-1].write_table(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA))
            self.rows[-1] += len(rejects)

    def close(self, ok: bool) -> None:
        for w in self.writers:
            if w.is_open:
                w.close()
        for c in self.contexts:
            if ok:
                c.__exit__(None, None, None)
            else:
                c.__exit__(RuntimeError, RuntimeError("failed"), None)


def length_counter(path: str | None, cfg: SplitConfig):
    """``balance: tokens``: a function giving each conversation's length in tokens, by the base model's
    tokenizer with the template training uses (its fast path: chat_render.render_lengths); None for
    ``balance: rows``, which loads no tokenizer."""
    if cfg.balance != "tokens" or not path:
        return None
    tokenizer = use_template(load_tokenizer(path), path, cfg.chat_template, cfg.format_template)
    render = ChatRenderer(tokenizer, cfg.template_kwargs)
    return lambda conversations: render_lengths(render, conversations)


def run_split(
    cfg: SplitConfig, splits: list[Path], eval_path: Path, rejects: Path, tokenizer: str | None = None,
    min_examples: int = 1, kept_rejects: Path | None = None,
) -> dict:  # fmt: skip
    """Split ``cfg.path`` (and ``cfg.eval_path``) into ``splits``, ``eval_path`` and ``rejects``; stop with
    one line when too much is rejected or a shard is short (``check_shards``). When it stops for its rejects
    (none usable, above data.max_reject_fraction), they are written to ``kept_rejects`` as JSONL, which the
    line names: the failed job's outputs are deleted. A run that does not stop so removes an old one."""
    if kept_rejects is not None:
        Path(kept_rejects).unlink(missing_ok=True)
    delimiter = delimiter_arg(cfg.delimiter)
    mapping, names = resolve_mapping(cfg.path, cfg.format, cfg.mapping, cfg.columns, delimiter)
    if cfg.mapping == "auto":
        log.info("data.mapping auto: %s read as %s, columns %s", cfg.path, mapping, names)
    splitter = Splitter(cfg.nodes, cfg.eval_fraction, cfg.seed, cfg.balance, length_counter(tokenizer, cfg))
    splitter.control = ControlChars(cfg.control_chars)
    splitter.tools = load_tools(cfg.tools) if cfg.tools else None
    fewer_gc_pauses()
    outputs = Outputs(splits, eval_path, rejects)
    reasons, rows_in, ok = Counter(), 0, False
    totals = [estimate_rows(spec, cfg.format) for spec in (cfg.eval_path, cfg.path) if spec]
    known = all(t is not None for t, _ in totals)
    progress = Progress("split", sum(t for t, _ in totals) if known else None, exact=all(e for _, e in totals))
    try:
        if cfg.eval_path:  # a separate held-out file: all of it is eval, and overlaps leave training
            check_columns(cfg.eval_path, cfg.format, mapping, names, delimiter)
            eval_prompts = set()
            for records in iter_records(cfg.eval_path, cfg.format, delimiter):
                kept, rejected = splitter.process(records, mapping, names, cfg.category_column, force_eval=True)
                outputs.write(kept, rejected)
                rows_in += len(kept) + len(rejected)
                reasons.update(r["reason"] for r in rejected)
                progress.update(len(records))
                eval_prompts.update(prompt_hash(json.loads(r["messages"])) for r in kept)
            splitter.eval_prompts = eval_prompts
        for records in iter_records(cfg.path, cfg.format, delimiter):
            kept, rejected = splitter.process(records, mapping, names, cfg.category_column)
            outputs.write(kept, rejected)
            rows_in += len(kept) + len(rejected)
            reasons.update(r["reason"] for r in rejected)
            progress.update(len(records))
        progress.done()
        n_rej = sum(reasons.values())
        kept = ""
        if n_rej and kept_rejects is not None and (n_rej == rows_in or n_rej / rows_in > cfg.max_reject_fraction):
            outputs.keep_rejects(kept_rejects)
            kept = f"; the rejects are in {kept_rejects}"
        if rows_in == 0 or n_rej == rows_in:
            raise UserError(
                f"{cfg.path}: no usable rows left ({rows_in} read, {n_rej} rejected: {dict(reasons)}){kept}"
            )
        if n_rej / rows_in > cfg.max_reject_fraction:
            raise UserError(
                f"{cfg.path}: {n_rej} of {rows_in} rows rejected ({dict(reasons)}), above "
                f"data.max_reject_fraction={cfg.max_reject_fraction}{kept}"
            )
        assert rows_in == sum(outputs.rows), "row accounting broken"
        check_shards(cfg, outputs.rows, dict(reasons), min_examples)
        ok = True
    finally:
        outputs.close(ok)
    result = {"rows_in": rows_in, "reasons": dict(reasons), "rows": outputs.rows, "tokens": splitter.node_tokens}
    result |= {"mapping": mapping, "columns": names}
    return result | {"control_chars": splitter.control.summary()}


def check_shards(cfg: SplitConfig, rows: list[int], reasons: dict, least: int) -> None:
    """Stop with one line when the eval set is empty or a node shard has fewer than ``least`` rows
    (0: no check); ``rows``: per node, eval, rejects."""
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
            f"add rows to {cfg.eval_path}" if cfg.eval_path else f"raise data.eval_fraction (now {cfg.eval_fraction})"
        )
    elif short and not cfg.eval_path:
        fixes.append(f"lower data.eval_fraction (now {cfg.eval_fraction})")
    if not what:
        return
    usable = sum(rows[:-1])
    why = f" ({rejected} rejected: {reasons})" if rejected else ""
    data = f"{cfg.path} and {cfg.eval_path}" if cfg.eval_path else cfg.path
    raise UserError(
        f"{data}: {usable} usable row{'s' * (usable != 1)}{why} make {' and '.join(what)}; {', '.join(fixes)}"
    )


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="settings.SplitConfig as JSON (rules/common.smk)")
    p.add_argument("--tokenizer", default=None, help="the base model's tokenizer (read only for balance: tokens)")
    p.add_argument(
        "--min-examples-per-shard",
        type=int,
        default=1,
        help="stop when a node shard has fewer rows (0: no check); the eval set must not be empty",
    )
    p.add_argument("--splits", nargs="+", required=True, type=Path, help="one output path per node")
    p.add_argument("--eval", required=True, type=Path)
    p.add_argument("--rejects", required=True, type=Path)
    p.add_argument("--manifest", required=True, type=Path)
    p.add_argument(
        "--kept-rejects", type=Path, default=None, help="where the rejects go as JSONL when the split stops for them"
    )
    a = p.parse_args(argv)
    a.tokenizer = a.tokenizer and model_location(a.tokenizer)  # a fetch record: its snapshot folder
    cfg = SplitConfig.from_json(a.config)
    if len(a.splits) != cfg.nodes:
        raise UserError(f"nodes is {cfg.nodes} but {len(a.splits)} split paths were given")
    result = run_split(cfg, a.splits, a.eval, a.rejects, a.tokenizer, a.min_examples_per_shard, a.kept_rejects)
    rows = result["rows"]
    write_json(
        a.manifest,
        {
            "sources": [{"path": str(f), "sha256": file_sha256(f)} for f in resolve_paths(cfg.path)],
            "rows_in": result["rows_in"],
            "nodes": [
                {"node": i, "rows": rows[i], "path": str(pth), "sha256": file_sha256(pth)}
                for i, pth in enumerate(a.splits)
            ],
            "eval": {"rows": rows[-2], "path": str(a.eval), "sha256": file_sha256(a.eval)},
            "rejects": {"rows": rows[-1], "by_reason": result["reasons"], "path": str(a.rejects)},
            "control_chars": result["control_chars"],
            "settings": {
                "seed": cfg.seed,
                "eval_fraction": cfg.eval_fraction,
                "balance": cfg.balance,
                "mapping": result["mapping"],  # as read: data.mapping auto's choice
                "columns": result["columns"],
            },  # fmt: skip
        },
    )
    print(f"{result['rows_in']} rows: {rows[:-2]} per node, {rows[-2]} eval, {rows[-1]} rejected {result['reasons']}")


if __name__ == "__main__":
    main()
