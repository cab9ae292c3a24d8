"""tokenize_shard: render conversations with the chat template, tokenize, mask, fit, pack, cache.

The one stage that tokenizes. One Parquet row per example (contracts.TOKENIZED_SCHEMA):
``input_ids``, ``labels`` (-100 everywhere but the trained assistant turns, so the loss is on the
answers only), ``length`` and ``prompt_length`` (the ids evaluation feeds the model before it
generates the last answer). Training and evaluation read the same ids from this cache. How a
conversation becomes ids and labels is chat_render's; the cache is token_cache's.

The length policy is applied here, to the ids the model will see: an example longer than
data.max_seq_len is cut (``overlength: truncate``), left out as ``too_long`` (``drop``), or stops
the stage with one line naming its file and row (``error``).

Special-token text in the data (a literal ``<|im_end|>`` the tokenizer would read as that token) is
handled here too, by data.special_text (chat_format.SpecialText: reject the row, strip or escape the
text), with the tokenizer's own list of special tokens: the split loads no tokenizer.

Every example the stage leaves out (a special_text or template reject, one too long for ``overlength: drop``, one
whose prompt alone fills ``max_seq_len`` under ``truncate``, one with every label masked) is written
to the shard's rejects file with its source file, row, content hash and reason, and counted in the
stats; above ``data.max_reject_fraction`` of the shard, or with no example left, the stage stops with
one line saying what to change. The stats also count the examples by length before the policy
(``length_counts``), for the data report's histograms.
"""

import argparse
import contextlib
import itertools
import json
import logging
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from workflow_scripts.core.contracts import IGNORE, REJECT_SCHEMA, TOKENIZED_SCHEMA, batches
from workflow_scripts.core.fingerprint import model_location
from workflow_scripts.core.pipeline_io import Progress, UserError, atomic_path, cli, fewer_gc_pauses, write_json
from workflow_scripts.core.settings import TokenizeConfig
from workflow_scripts.data.chat_format import SpecialText, special_texts
from workflow_scripts.data.chat_render import ChatRenderer, encode_messages, load_tokenizer, use_template
from workflow_scripts.data.packing import write_packing
from workflow_scripts.data.preference_pairs import has_pairs, pair_sides
from workflow_scripts.data.token_cache import cache_key, cached, tokenizer_fingerprint
from workflow_scripts.data.tool_calls import check_template, is_tool_conversation, renders_tools, row_where

log = logging.getLogger("tokenize")
SHOWN_REJECTS = 100  # rejected rows listed in the stats and the log (all are in the rejects file)
# Reasons tokenization leaves an example out for its length or labels (the others are the template's)
LENGTH_REASONS = ("too_long", "prompt_too_long", "no_labels")


def fit_length(example: dict, max_len: int, policy: str, row: dict | None = None) -> dict | None:
    """Apply the over-length policy: keep, truncate, drop (None) or raise (naming ``row``'s file and row)."""
    if len(example["input_ids"]) <= max_len:
        return example
    if policy == "error":
        where = f"{row.get('source_file')}: row {row.get('source_row')}" if row else "an example"
        raise UserError(
            f"{where} has {len(example['input_ids'])} tokens, above data.max_seq_len={max_len} (data.overlength: error)"
        )
    if policy == "drop" or example["prompt_length"] >= max_len:
        return None
    return {k: v[:max_len] if isinstance(v, list) else v for k, v in example.items()}


def response_text(tokenizer, last: dict, example: dict) -> str:
    """The reference evaluation compares answers with: the last answer's text; for a turn that calls tools, that
    turn as the template renders it, its calls included (the held-out tool_call score parses them), decoded from
    its ids without special tokens, as the model's generated answers are."""
    if not last.get("tool_calls"):
        return last["content"]
    return tokenizer.decode(example["input_ids"][example["prompt_length"] :], skip_special_tokens=True)


def length_reject(example: dict, fitted: dict | None, max_len: int, policy: str) -> tuple[str, str] | None:
    """Why ``fit_length`` left an example out, or emptied it: (reason, detail); None when it is trained."""
    n, p = len(example["input_ids"]), example["prompt_length"]
    if fitted is None and policy == "drop":
        return "too_long", f"{n} tokens > data.max_seq_len {max_len} (data.overlength: drop)"
    if fitted is None:
        return "prompt_too_long", f"the prompt alone has {p} tokens: data.max_seq_len {max_len} leaves no answer token"
    if max(fitted["labels"], default=IGNORE) == IGNORE:  # labels are IGNORE or token ids (>= 0)
        return "no_labels", "every label is masked: nothing of the answer is trained"
    return None


# ---------------------------------------------------------------- stage


def tokenize_shard(
    tokenizer,
    shard: Path,
    tokens_out: Path,
    max_len: int,
    policy: str,
    batch_rows: int = 2048,
    *,
    train_on: str = "last",
    template_kwargs: dict | None = None,
    rejects_out: Path | None = None,
    special: SpecialText | None = None,
    template: str = "the chat template",
    chosen_only: bool = False,
):
    """Stream the shard through special text → render → tokenize → mask → fit, writing as it goes.

    Rows left out (special-token text under data.special_text: reject, by ``special``; the chat
    template cannot render them into a training example, too long,
    no trained token left) are counted in the stats (``rejected`` by reason, ``rejects``:
    the first ones with file, row and detail) and, all of them, written to ``rejects_out``.
    Returns the examples' lengths (for the packing plan) and the stats. A tool-call conversation under a
    template that cannot render tools (called ``template`` in the message) stops the stage with one line
    naming the template and the row (tool_calls.check_template).
    """
    file = pq.ParquetFile(shard)
    render = ChatRenderer(tokenizer, template_kwargs)
    tools_ok = renders_tools(tokenizer.chat_template)
    present = set(file.schema_arrow.names)
    columns = [c for c in ("messages", "content_hash", "category", "source_file", "source_row") if c in present]
    lengths, dropped, truncated, full = [], 0, 0, Counter()
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(pq.ParquetWriter(stack.enter_context(atomic_path(tokens_out)), TOKENIZED_SCHEMA))
        rejected = RejectWriter(shard, stack.enter_context(atomic_path(rejects_out)) if rejects_out else None)
        stack.callback(rejected.close)
        progress = Progress(f"tokenize {shard.name}", file.metadata.num_rows)
        for batch in batches(file, batch_rows, columns):
            cols = batch.to_pydict()  # column lists; a row's dict only where one is reported (row_at)
            # each row's conversations to encode, as data.special_text leaves them: the row's conversation, or a
            # preference pair's chosen and rejected conversations (preference_pairs.pair_sides), kept or left out
            # together
            conversations, rows = [], []
            for i, text in enumerate(cols["messages"]):
                sides = pair_sides(json.loads(text))[: 1 if chosen_only else None]  # chosen_only: a pair's chosen side
                sides = [special(s) if special else (s, None) for s in sides]
                why = next((w for _, w in sides if w), None)
                if not tools_ok and any(is_tool_conversation(s) for s, _ in sides):
                    row = row_at(cols, i)
                    check_template(tokenizer.chat_template, template, row_where(row["source_file"], row["source_row"]))
                if why:
                    rejected.add(row_at(cols, i), *why)
                else:
                    conversations.append([s for s, _ in sides])
                    rows.append(i)
            flat = encode_messages(tokenizer, [s for sides in conversations for s in sides], render, train_on)
            starts = itertools.accumulate((len(sides) for sides in conversations), initial=0)
            encoded = [flat[a:b] for a, b in itertools.pairwise(starts)]
            out = {name: [] for name in TOKENIZED_SCHEMA.names}
            for i, sides, exs in zip(rows, conversations, encoded, strict=True):
                if reject := next((ex["reject"] for ex in exs if "reject" in ex), None):
                    rejected.add(row_at(cols, i), *reject)
                    continue
                ex = max(exs, key=lambda e: len(e["input_ids"]))  # the length policy applies to the longer side
                n = len(ex["input_ids"])
                full[n] += 1
                fits = [e if len(e["input_ids"]) <= max_len else fit_length(e, max_len, policy, row_at(cols, i))
                        for e in exs]  # fmt: skip
                whys = (length_reject(e, f, max_len, policy) for e, f in zip(exs, fits, strict=True))
                if why := next(filter(None, whys), None):
                    rejected.add(row_at(cols, i), *why, tokens=n, prompt_tokens=ex["prompt_length"])
                    dropped += why[0] != "no_labels"
                    continue
                truncated += any(f is not e for e, f in zip(exs, fits, strict=True))
                for messages, fitted in zip(sides, fits, strict=True):
                    for key in ("input_ids", "labels", "prompt_length"):
                        out[key].append(fitted[key])
                    out["length"].append(len(fitted["input_ids"]))
                    out["response"].append(response_text(tokenizer, messages[-1], fitted))
                    out["content_hash"].append(cols["content_hash"][i])
                    out["category"].append(cols["category"][i] or "")
            lengths += out["length"]
            writer.write_table(pa.Table.from_pydict(out, schema=TOKENIZED_SCHEMA))
            rejected.flush()
            progress.update(len(cols["messages"]), tokens=sum(out["length"]))
        progress.done()
        reasons, rejects = rejected.reasons, rejected.shown
        if rejects and not lengths and not reasons.keys() & set(LENGTH_REASONS):
            first = rejects[0]
            raise UserError(
                f"{shard}: every row was rejected ({dict(reasons)}), e.g. "
                f"{first['source_file']}: row {first['source_row']}: {first['detail']}"
            )
    return lengths, {
        "rows": len(lengths) + sum(reasons.values()),
        "examples": len(lengths),
        "tokens": sum(lengths),
        "dropped_too_long": dropped,
        "truncated": truncated,
        "rejected": dict(reasons),
        "rejects": rejects,
        "length_counts": {str(n): full[n] for n in sorted(full)},  # examples by length before the policy
    } | ({"special_text": special.summary()} if special else {})


def row_at(columns: dict[str, list], i: int) -> dict:
    """Row ``i`` of a batch's column lists, as a dict."""
    return {name: values[i] for name, values in columns.items()}


class RejectWriter:
    """The examples tokenization leaves out: counted by reason, the first SHOWN_REJECTS kept for the
    stats and the log, every one written (with its conversation) to ``path`` when one is given."""

    def __init__(self, shard: Path, path: Path | None):
        self.shard, self.reasons, self.shown, self.pending = shard, Counter(), [], []
        self.writer = pq.ParquetWriter(path, REJECT_SCHEMA) if path else None
        if self.writer:  # a schema-only file when nothing is rejected
            self.writer.write_table(REJECT_SCHEMA.empty_table())

    def add(self, row: dict, reason: str, detail: str, tokens: int | None = None, prompt_tokens: int | None = None):
        self.reasons[reason] += 1
        record = {
            "source_file": row.get("source_file", str(self.shard)),
            "source_row": row.get("source_row"),
            "reason": reason,
            "detail": detail,
            "content_hash": row.get("content_hash"),
        }
        if len(self.shown) < SHOWN_REJECTS:
            log.warning("%s: row %s rejected (%s): %s", record["source_file"], record["source_row"], reason, detail)
            self.shown.append(record)
        if self.writer:
            self.pending.append(
                record | {"tokens": tokens, "prompt_tokens": prompt_tokens, "messages": row["messages"]}
            )

    def flush(self) -> None:
        if self.writer and self.pending:
            self.writer.write_table(pa.Table.from_pylist(self.pending, schema=REJECT_SCHEMA))
        self.pending = []

    def close(self) -> None:
        if self.writer:
            self.flush()
            self.writer.close()


# ---------------------------------------------------------------- guards


def length_needed(rejects: Path, max_len: int, allowed: int) -> int | None:
    """The smallest data.max_seq_len that leaves out at most ``allowed`` of the length rejects."""
    table = pq.read_table(rejects, columns=["reason", "tokens", "prompt_tokens"]).to_pylist()
    needs = sorted(
        (
            r["tokens"] if r["reason"] == "too_long" else r["prompt_tokens"] + 1
            for r in table
            if r["reason"] in ("too_long", "prompt_too_long")
        ),
        reverse=True,
    )
    if allowed < 0 or allowed >= len(needs):
        return None
    return max(needs[allowed], max_len + 1)


def advice(stats: dict, rejects: Path, allowed: int) -> str:
    """What to change, for the reasons examples were left out."""
    reasons, settings = stats["rejected"], stats.get("settings", {})
    max_len = settings.get("max_seq_len")
    tips = []
    if reasons.keys() & {"too_long", "prompt_too_long"}:
        need = length_needed(rejects, max_len, allowed) if max_len else None
        keeps = f" to {need} or more" if need else ""
        tips.append(f"raise data.max_seq_len{keeps} (now {max_len})")
        if "too_long" in reasons:
            tips.append("set data.overlength: truncate (it keeps what fits of each answer)")
    if "special_text" in reasons:
        tips.append("set data.special_text: strip or escape (it keeps rows with special-token text)")
    if reasons.keys() - set(LENGTH_REASONS) - {"special_text"}:
        tips.append("fix the rows or data.chat_template (see the reasons in the config README)")
    if "no_labels" in reasons:
        tips.append("check data.train_on and the chat template's assistant turns")
    return ", ".join(tips)


def check_rejects(stats: dict, shard: Path, rejects: Path, max_fraction: float, kept: str) -> None:
    """Stop (one line naming the count, the reasons and what to change) when tokenization left out more
    than ``max_fraction`` of the shard, or all of it; warn when it left out any."""
    reasons = stats.get("rejected", {})
    n, rows = sum(reasons.values()), stats.get("rows", stats["examples"] + sum(reasons.values()))
    if not n:
        return
    why = ", ".join(f"{reason}: {count}" for reason, count in reasons.items())
    what = f"{n} of {rows} examples ({n / rows:.0%}) left out at tokenization ({why})"
    if stats["examples"] and n / rows <= max_fraction:
        log.warning("%s: %s; each is listed in %s", shard, what, rejects)
        return
    for r in stats.get("rejects", []) if stats.get("cache") == "hit" else []:  # a miss logged them already
        log.warning("%s: row %s rejected (%s): %s", r["source_file"], r["source_row"], r["reason"], r["detail"])
    others = sum(c for r, c in reasons.items() if r not in ("too_long", "prompt_too_long"))
    if stats["examples"]:
        allowed = int(max_fraction * rows) - others  # length rejects the fraction allows
        limit, fraction = f"above data.max_reject_fraction={max_fraction}", ", or raise data.max_reject_fraction"
    else:
        allowed, limit, fraction = n - others - 1, "no example left", ""  # keep one
    raise UserError(
        f"{shard}: {what}, {limit}: {advice(stats, rejects, allowed)}{fraction}; "
        f"every one is listed with its source file, row and reason in {kept}"
    )


def check_units(stats: dict, shard: Path, min_examples: int, min_bins: int) -> None:
    """Stop when the shard has fewer examples, or packed bins, than one micro-batch on every rank needs."""
    examples, bins = stats["examples"], stats.get("bins", 0)
    if examples >= min_examples and bins >= min_bins:
        return
    units, need = (
        (f"{bins} packed bins ({examples} examples)", min_bins)
        if bins < min_bins
        else (f"{examples} examples", min_examples)
    )
    raise UserError(
        f"{shard}: {units} after tokenization, fewer than the {need} that one micro-batch on every rank needs "
        "(training.micro_batch_size × procs_per_node): add rows, lower `nodes`, training.micro_batch_size or "
        "training.procs_per_node" + (", or set training.packing: false" if bins < min_bins else "")
    )


def template_name(cfg: TokenizeConfig, tokenizer: str) -> str:
    """The template tokenization renders with, as a message names it."""
    if cfg.format_template:
        return "data.format_template"
    return f"data.chat_template {cfg.chat_template}" if cfg.chat_template else f"{tokenizer}'s own chat template"


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="settings.TokenizeConfig as JSON (rules/common.smk)")
    p.add_argument("--shard", required=True, type=Path)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--pack-len", type=int, default=0, help="bin size of the packing plan (0 = data.max_seq_len)")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--packing", required=True, type=Path)
    p.add_argument("--stats", required=True, type=Path)
    p.add_argument("--rejects", type=Path, help="examples left out, with reasons (default: <output>.rejects.parquet)")
    p.add_argument("--min-examples", type=int, default=1, help="stop with fewer examples (a micro-batch per rank)")
    p.add_argument("--min-bins", type=int, default=0, help="stop with fewer packed bins (a micro-batch per rank)")
    p.add_argument("--both-sides", action="store_true",
                   help="preference pairs: both answers, chosen then rejected (DPO); else the chosen")  # fmt: skip
    a = p.parse_args(argv)
    a.tokenizer = model_location(a.tokenizer)  # a fetch record: its snapshot folder
    cfg = TokenizeConfig.from_json(a.config)
    a.rejects = a.rejects or a.output.with_suffix(".rejects.parquet")
    tokenizer = use_template(load_tokenizer(a.tokenizer), a.tokenizer, cfg.chat_template, cfg.format_template)
    fewer_gc_pauses()
    pack_len = a.pack_len or cfg.max_seq_len
    settings = {"max_seq_len": cfg.max_seq_len, "overlength": cfg.overlength, "pack_len": pack_len}
    settings |= {"train_on": cfg.train_on, "template_kwargs": cfg.template_kwargs, "special_text": cfg.special_text}
    # preference pairs: both answers (training.objective dpo, the held-out pairs) or the chosen one alone (the eval
    # set; SFT on the preferred answers); a key only for a shard of pairs, so any other's is as before
    pairs = has_pairs(a.shard)
    settings |= {"sides": "both" if a.both_sides else "chosen"} if pairs else {}
    chosen_only = pairs and not a.both_sides
    key = cache_key(a.shard, tokenizer_fingerprint(tokenizer, a.tokenizer), settings)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None

    def build(folder: Path) -> dict:
        lengths, stats = tokenize_shard(
            tokenizer,
            a.shard,
            folder / "tokens.parquet",
            cfg.max_seq_len,
            cfg.overlength,
            train_on=cfg.train_on,
            template_kwargs=cfg.template_kwargs,
            rejects_out=folder / "rejects.parquet",
            special=SpecialText(special_texts(tokenizer), cfg.special_text),
            template=template_name(cfg, a.tokenizer),
            chosen_only=chosen_only,
        )
        return stats | write_packing(lengths, pack_len, folder / "packing.parquet") | {"key": key, "settings": settings}

    outputs = {"tokens.parquet": a.output, "packing.parquet": a.packing, "rejects.parquet": a.rejects}
    stats = cached(cache_dir, key, outputs, build)
    # the guards come after the cache: their settings are no part of the key
    kept = f"{cache_dir / key / 'rejects.parquet'} (the cache entry)" if cache_dir else "this stage's log"
    check_rejects(stats, a.shard, a.rejects, cfg.max_reject_fraction, kept)
    check_units(stats, a.shard, a.min_examples, a.min_bins)
    write_json(a.stats, stats | {"shard": str(a.shard)})
    rejected = f", rejected {stats['rejected']}" if stats.get("rejected") else ""
    print(f"{a.shard}: {stats['examples']} examples, {stats['tokens']} tokens{rejected}, cache {stats['cache']}")


if __name__ == "__main__":
    main()
