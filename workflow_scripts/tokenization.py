"""tokenize_shard: render conversations with the chat template, tokenize, mask, pack, cache.

One Parquet row per example: ``input_ids``, ``labels`` (-100 everywhere but the
trained assistant turns, so the loss is on the answers only), ``length`` and
``prompt_length`` (the ids evaluation feeds the model before it generates the last
answer). Training and evaluation read the same ids from this cache.

A conversation is rendered once and tokenized as one string, so special tokens and
merges are what the tokenizer gives for the whole text; the trained turns are found
in that render (see ``render_conversation``) and mapped to tokens by the fast
tokenizer's character offsets. The first ``prompt_length`` ids are checked to be
exactly the ids of ``apply_chat_template(messages[:-1], add_generation_prompt=True,
**template_kwargs)`` (with the BOS the model family wants, when the template does
not write it; see ``prompt_tokens``). Labels cover the last assistant turn (``train_on: all``: every one)
from the end of its header to its end-of-turn token inclusive: the tokenizer's EOS
and whichever of ``END_OF_TURN`` the tokenizer has as added tokens. A row the
template cannot render that way is rejected with a reason, and its source file and
row, in the stats; the stage goes on. The template is data.chat_template's file, data.format_template
(a plain prompt format, turned into a chat template by ``chat_format.format_chat_template``) or the
tokenizer's own; without any, one line naming both keys (``use_template``).

Every example the stage leaves out (a template reject, one too long for ``overlength:
drop``, one whose prompt alone fills ``max_seq_len`` under ``truncate``, one with every
label masked) is written to the shard's rejects file with its source file, row, content
hash and reason, and counted in the stats; above ``data.max_reject_fraction`` of the
shard, or with no example left, the stage stops with one line saying what to change.

The cache is content-addressed: the key hashes the shard's bytes, the tokenizer
files, the chat template, the length policy and the packing settings, so two runs
with the same data and tokenizer share one entry whatever their names or learning
rates, and a changed tokenizer, template or shard is a miss.

The cache checks itself. An entry is built in a hidden folder, its files made
read-only, their sizes and sha256 recorded in ``manifest.json`` (written last), and
the folder renamed onto its key, so a half-written entry is never seen. Before an
entry is used, every file is checked against the manifest; a damaged entry (no
manifest, a missing file, a size or hash that differs) is removed with a warning
naming it, and the shard is tokenized again. Runs get copies, never hard links
(a reflink where the file system has them), so damage to one run's files reaches
neither the cache nor another run.
"""

import argparse
import bisect
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from chat_format import format_chat_template, no_template_message
from pipeline_io import Progress, UserError, atomic_path, cli, file_sha256, json_object, write_json
from settings import option
from transformers import AutoTokenizer

log = logging.getLogger("tokenize")
IGNORE = -100
CACHE_VERSION = 3
MANIFEST = "manifest.json"  # sizes and sha256 of an entry's files; present only in a complete entry
ENTRY_FILES = ("tokens.parquet", "packing.parquet", "rejects.parquet", "stats.json")
PAD_BATCH = 8  # micro-batch size of the pad-to-longest comparison
TRAIN_ON = ("last", "all")
# Tokens that close a turn in the common chat formats (ChatML/Qwen, Llama 3, Gemma, Phi-3): those the
# tokenizer has as added tokens, and its EOS, end an assistant turn's labels.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
SHOWN_REJECTS = 100  # rejected rows listed in the stats and the log (all are in the rejects file)
# Reasons tokenization leaves an example out for its length or labels (the others are the template's)
LENGTH_REASONS = ("too_long", "prompt_too_long", "no_labels")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("length", pa.int32()),
        ("prompt_length", pa.int32()),
        ("response", pa.string()),
        ("content_hash", pa.string()),
        ("category", pa.string()),
    ]
)
# The shard's rejects file: split's rejects.parquet columns where they apply, plus the content hash,
# the lengths (null for a template reject) and the conversation, so a dropped row can be looked at
REJECT_SCHEMA = pa.schema(
    [
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("content_hash", pa.string()),
        ("tokens", pa.int32()),
        ("prompt_tokens", pa.int32()),
        ("messages", pa.string()),
    ]
)


def messages_for(prompt: str, question: str, response: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": prompt}] if prompt else []
    messages.append({"role": "user", "content": question})
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    return messages


class Reject(Exception):
    """A row the chat template cannot turn into a training example: a reason code and a detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def end_of_turn_tokens(tokenizer) -> tuple[str, ...]:
    """What closes an assistant turn: the EOS and whichever of END_OF_TURN the tokenizer has as added tokens."""
    added = tokenizer.get_added_vocab()
    eos = [tokenizer.eos_token] if tokenizer.eos_token else []
    return tuple(dict.fromkeys(eos + [t for t in END_OF_TURN if t in added]))


def wants_bos(tokenizer) -> bool:
    """Whether the tokenizer puts its BOS in front of any text it encodes with special tokens
    (Llama 2 and 3, Mistral; Qwen has no BOS)."""
    bos_id = tokenizer.bos_token_id
    return bos_id is not None and tokenizer("a")["input_ids"][:1] == [bos_id]


def use_template(
    tokenizer, source: str, chat_template: str | None = None, format_template: str | None = None, required: bool = True
):
    """Give ``tokenizer`` the template the workflow trains with: data.chat_template (a Jinja file),
    data.format_template (a plain format, as a chat template: chat_format.format_chat_template), or its
    own. Without any, a one-line UserError naming both keys (``required``). Returns the tokenizer."""
    if chat_template and format_template:
        raise UserError("data.chat_template and data.format_template are both set; set one")
    if chat_template:
        tokenizer.chat_template = Path(chat_template).read_text()
    elif format_template:
        if not tokenizer.eos_token:
            raise UserError(f"{source}: data.format_template ends each answer with the EOS; the tokenizer has none")
        tokenizer.chat_template = format_chat_template(format_template, bos=wants_bos(tokenizer))
    if required and not tokenizer.chat_template:
        raise UserError(no_template_message(source))
    return tokenizer


class ChatRenderer:
    """The tokenizer's chat template, compiled once and rendered directly, with ``template_kwargs``.

    ``apply_chat_template`` re-validates its arguments on every call, which costs more
    than the rendering itself; the output is the same (a test checks it). The renderer
    also knows what closes an assistant turn (``end_of_turn``) and whether the model
    family wants a BOS token the template does not write (``bos``).
    """

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        self.variables = special | self.template_kwargs  # as apply_chat_template: kwargs win
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self.compiled = _compile_jinja_template(tokenizer.chat_template)
        except (ImportError, AttributeError):  # a transformers without the helper: the slow path
            self.compiled = None
        self.end_of_turn = end_of_turn_tokens(tokenizer)
        self.end_of_turn_ids = [tokenizer.convert_tokens_to_ids(t) for t in self.end_of_turn]
        # BOS: prepended where the template does not write it (see wants_bos)
        self.bos_id = tokenizer.bos_token_id
        self.bos = tokenizer.bos_token if wants_bos(tokenizer) else None

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self.compiled is None:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs
            )
        return self.compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **self.variables
        )

    def bos_ids(self, text: str) -> list[int]:
        """The BOS id to put before ``text``'s tokens, if the family wants one and the template wrote none."""
        return [self.bos_id] if self.bos and not text.startswith(self.bos) else []


@dataclass
class Rendered:
    """A conversation rendered once: the text, the last answer's generation prompt, the trained spans."""

    text: str
    prompt: str  # render(messages[:-1], add_generation_prompt=True): a prefix of text
    spans: list[tuple[int, int]]  # characters of text trained on; the last one starts at len(prompt)


def common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def render_conversation(render: ChatRenderer, messages: list[dict], train_on: str = "last") -> Rendered:
    """Render the whole conversation once and find each trained assistant turn in it.

    A turn's span starts where the conversation stops agreeing with that turn's
    generation prompt (``render(messages[:i], add_generation_prompt=True)``), which is
    where the template's assistant header ends, and runs to the first end-of-turn token
    after it, inclusive. No shorter render is assumed to be a prefix of a longer one,
    except the last answer's generation prompt, which must be (it is the evaluation
    prompt): templates render history differently from the last turn (Qwen3 drops
    earlier turns' reasoning and gives the last one a ``<think>`` block).
    """
    try:
        text = render(messages)
    except Exception as e:  # a template's raise_exception, or any error while rendering
        raise Reject("template_error", f"the chat template raised {type(e).__name__}: {e}") from None
    answers = [i for i, turn in enumerate(messages) if turn["role"] == "assistant"]
    last = len(messages) - 1
    if not answers or answers[-1] != last:
        raise Reject("template_error", "the conversation does not end with an assistant turn")
    spans, prompt, done = [], "", 0
    for i in answers if train_on == "all" else answers[-1:]:
        content = messages[i]["content"]
        if marker := next((t for t in render.end_of_turn if t in content), None):
            raise Reject("control_token", f"assistant turn {i} contains the end-of-turn token {marker} as text")
        try:
            prompt = render(messages[:i], add_generation_prompt=True)
        except Exception as e:
            raise Reject("template_error", f"the chat template raised {type(e).__name__}: {e}") from None
        start = common_prefix(prompt, text)
        if i == last and start < len(prompt):
            raise Reject(
                "prompt_mismatch",
                f"the conversation does not render with the last answer's generation prompt as its start "
                f"(they differ at character {start}: {text[start : start + 30]!r} vs {prompt[start : start + 30]!r})",
            )
        if start < done:
            raise Reject("turn_not_found", f"assistant turn {i}: its generation prompt differs before turn {i} starts")
        stops = [(at, t) for t in render.end_of_turn if (at := text.find(t, start)) >= 0]
        if not stops:
            raise Reject("turn_not_found", f"assistant turn {i}: no end-of-turn token {render.end_of_turn} after it")
        at, stop = min(stops)
        if content.split("</think>")[-1].strip() not in text[start:at]:
            raise Reject("turn_not_found", f"assistant turn {i}: its text is not between its header and {stop}")
        done = at + len(stop)
        spans.append((start, done))
    return Rendered(text, prompt, spans)


class Offsets:
    """Ids and character offsets of one text, for a tokenizer without a Rust backend: the part
    of ``tokenizers.Encoding`` used here."""

    def __init__(self, ids: list[int], offsets: list[tuple[int, int]]):
        self.ids, self.offsets, self.starts = ids, offsets, [a for a, _ in offsets]

    def char_to_token(self, pos: int) -> int | None:
        k = bisect.bisect_right(self.starts, pos) - 1
        return k if k >= 0 and self.offsets[k][0] <= pos < self.offsets[k][1] else None

    def token_to_chars(self, k: int) -> tuple[int, int]:
        return self.offsets[k]


def tokenize_texts(tokenizer, texts: list[str]) -> list:
    """Encodings (ids, character offsets) of each text, no special tokens added, in one batch call."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: transformers' per-encoding wrapper costs ~15%
        if backend.truncation or backend.padding:
            backend.no_truncation()
            backend.no_padding()
        return backend.encode_batch(texts, add_special_tokens=False)
    out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [Offsets(i, o) for i, o in zip(out["input_ids"], out["offset_mapping"], strict=True)]


def token_at(enc, pos: int, end: int) -> int:
    """The first token holding a character of text[pos:end] (offsets may skip trimmed whitespace)."""
    for c in range(pos, end):
        if (k := enc.char_to_token(c)) is not None:
            return k
    raise Reject("turn_not_found", f"no token covers characters {pos}-{end} of the render")


def first_token(enc, pos: int, end: int) -> int:
    """The first token of text[pos:end]: one that crosses ``pos`` counts, and so does whitespace
    before the first character's token whose offsets were trimmed to start after ``pos``."""
    k = token_at(enc, pos, end)
    while k > 0 and enc.token_to_chars(k - 1)[0] >= pos:
        k -= 1
    return k


def prompt_tokens(tokenizer, enc, prompt: str) -> int | None:
    """How many of the render's tokens are the prompt's: None when they are not its own tokens.

    The render's tokens up to a token boundary at the prompt's end are the prompt's own
    tokens (pre-tokenization and merges never reach across a boundary no token crosses);
    where the offsets show no such boundary, the prompt is tokenized alone and compared.
    """
    end = len(prompt)
    k = enc.char_to_token(end)
    if k is not None and enc.token_to_chars(k)[0] == end and (k == 0 or enc.token_to_chars(k - 1)[1] == end):
        return k
    alone = tokenize_texts(tokenizer, [prompt])[0].ids
    return len(alone) if enc.ids[: len(alone)] == alone else None


def label(render: ChatRenderer, conv: Rendered, enc) -> dict:
    """Ids of the whole render, labels on its trained spans, and the prompt length, checked."""
    bos = render.bos_ids(conv.text)
    ids, b = bos + enc.ids, len(bos)
    n = prompt_tokens(render.tokenizer, enc, conv.prompt)
    if n is None:
        raise Reject(
            "prompt_mismatch",
            "tokenized whole, the conversation does not start with its generation prompt's tokens "
            f"(a token merges across the end of the prompt: {conv.text[len(conv.prompt) - 10 :][:20]!r})",
        )
    labels = [IGNORE] * len(ids)
    *earlier, (_, end) = conv.spans
    spans = [(first_token(enc, s, e), e) for s, e in earlier] + [(n, end)]
    for lo, e in spans:  # from the token at the span's start to the end-of-turn token, inclusive
        hi = b + token_at(enc, e - 1, e) + 1
        labels[b + lo : hi] = ids[b + lo : hi]
    return {"input_ids": ids, "labels": labels, "prompt_length": b + n}


def encode_messages(
    tokenizer, conversations: list[list[dict]], render: ChatRenderer | None = None, train_on: str = "last"
) -> list[dict]:
    """Tokenize a batch of conversations: ``input_ids``, ``labels``, ``prompt_length``.

    Labels cover the last assistant turn (``train_on="all"``: every assistant turn)
    from the end of its header to its end-of-turn token, inclusive. A row the template
    cannot render into that is ``{"reject": (reason, detail)}`` instead.
    """
    if train_on not in TRAIN_ON:
        raise UserError(f"train_on must be one of {TRAIN_ON}, not {train_on!r}")
    render = render or ChatRenderer(tokenizer)
    rendered = []
    for messages in conversations:
        try:
            rendered.append(render_conversation(render, messages, train_on))
        except Reject as e:
            rendered.append(e)
    encoded = iter(tokenize_texts(tokenizer, [r.text for r in rendered if isinstance(r, Rendered)]))
    out = []
    for r in rendered:
        if isinstance(r, Rendered):
            try:
                r = label(render, r, next(encoded))
            except Reject as e:
                r = e
        out.append({"reject": (r.reason, r.detail)} if isinstance(r, Reject) else r)
    return out


def encode(tokenizer, prompts, questions, responses, **kwargs) -> list[dict]:
    """Single-turn convenience over encode_messages."""
    convs = [messages_for(p, q, r) for p, q, r in zip(prompts, questions, responses, strict=True)]
    return encode_messages(tokenizer, convs, **kwargs)


def generation_settings(tokenizer, template_kwargs: dict | None = None) -> dict:
    """What a model fine-tuned here should be generated with: stop at any end-of-turn token the
    template uses, and render prompts with the same template arguments (for generation_config).
    Needs no chat template: the end-of-turn tokens are the tokenizer's."""
    stops = [tokenizer.convert_tokens_to_ids(t) for t in end_of_turn_tokens(tokenizer)]
    return {"eos_token_id": stops, "chat_template_kwargs": dict(template_kwargs or {})}


def fit_length(example: dict, max_len: int, policy: str) -> dict | None:
    """Apply the over-length policy: keep, truncate, drop (None) or raise."""
    if len(example["input_ids"]) <= max_len:
        return example
    if policy == "error":
        raise UserError(f"an example has {len(example['input_ids'])} tokens, above data.max_seq_len={max_len}")
    if policy == "drop" or example["prompt_length"] >= max_len:
        return None
    return {k: v[:max_len] if isinstance(v, list) else v for k, v in example.items()}


def length_reject(example: dict, fitted: dict | None, max_len: int, policy: str) -> tuple[str, str] | None:
    """Why ``fit_length`` left an example out, or emptied it: (reason, detail); None when it is trained."""
    n, p = len(example["input_ids"]), example["prompt_length"]
    if fitted is None and policy == "drop":
        return "too_long", f"{n} tokens > data.max_seq_len {max_len} (data.overlength: drop)"
    if fitted is None:
        return "prompt_too_long", f"the prompt alone has {p} tokens: data.max_seq_len {max_len} leaves no answer token"
    if all(x == IGNORE for x in fitted["labels"]):
        return "no_labels", "every label is masked: nothing of the answer is trained"
    return None


# ---------------------------------------------------------------- packing


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each sequence, longest first, into the fullest bin it still fits.

    Bins are kept in buckets by space left, and the distinct space values (at most
    ``capacity``) in a sorted list, so each placement costs O(log capacity).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # space left -> bins with exactly that space
    spaces: list[int] = []  # sorted keys of the non-empty buckets
    for i in order:
        n = min(lengths[i], capacity)
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):
            space = spaces[at]
            b = buckets[space].pop()
            if not buckets[space]:
                del buckets[space]
                spaces.pop(at)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = space - n
        if left > 0:
            if left not in buckets:
                buckets[left] = []
                bisect.insort(spaces, left)
            buckets[left].append(b)
    return bins


def packing_stats(lengths: list[int], bins: list[list[int]], capacity: int, seed: int = 0) -> dict:
    real = sum(lengths)
    shuffled = lengths[:]
    random.Random(seed).shuffle(shuffled)
    padded = sum(
        max(shuffled[i : i + PAD_BATCH]) * len(shuffled[i : i + PAD_BATCH]) for i in range(0, len(shuffled), PAD_BATCH)
    )
    return {
        "bins": len(bins),
        "packing_efficiency": real / (len(bins) * capacity) if bins else 0.0,
        "pad_to_longest_efficiency": real / padded if padded else 0.0,
        "pad_batch": PAD_BATCH,
    }


# ---------------------------------------------------------------- cache


def tokenizer_fingerprint(tokenizer, source: str) -> str:
    """Hash of the tokenizer's files and its chat template."""
    h = hashlib.sha256()
    folder = Path(source)
    if folder.is_dir():
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                h.update(name.encode() + file_sha256(folder / name).encode())
    else:  # a hub id: the resolved tokenizer's own serialization
        h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()


def cache_key(shard: Path, tokenizer_hash: str, settings: dict) -> str:
    text = json.dumps([CACHE_VERSION, file_sha256(shard), tokenizer_hash, settings], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class DamagedEntry(Exception):
    """A cache entry whose files do not match its manifest."""


def copy_file(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst``: a reflink where the file system can, else bytes; never a hard link."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:  # copy_file_range shares extents (a reflink) on btrfs/XFS and copies in the kernel elsewhere
            while os.copy_file_range(fin.fileno(), fout.fileno(), 1 << 30) > 0:
                pass
        except (AttributeError, OSError):  # not on this OS, file system or kernel: copy in user space
            fin.seek(0)
            fout.seek(0)
            fout.truncate()
            shutil.copyfileobj(fin, fout, 1 << 20)


def write_manifest(entry: Path) -> dict:
    """Make the entry's files read-only and record their sizes and hashes; the manifest is written last."""
    files = {}
    for name in ENTRY_FILES:
        path = entry / name
        path.chmod(0o444)
        files[name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    manifest = {"version": CACHE_VERSION, "files": files}
    write_json(entry / MANIFEST, manifest)
    (entry / MANIFEST).chmod(0o444)
    return manifest


def read_manifest(entry: Path) -> dict:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        raise DamagedEntry(f"no {MANIFEST} (an interrupted or older entry)") from None
    except (OSError, ValueError) as e:
        raise DamagedEntry(f"{MANIFEST} unreadable: {e}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or any(
        not isinstance(files.get(n), dict) or {"size", "sha256"} - files[n].keys() for n in ENTRY_FILES
    ):
        raise DamagedEntry(f"{MANIFEST} does not list {', '.join(ENTRY_FILES)}")
    return files


def check_size(path: Path, expected: dict) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DamagedEntry(f"{path.name} is missing") from None
    if size != expected["size"]:
        raise DamagedEntry(f"{path.name} has {size} bytes, the manifest says {expected['size']}")


def check_hash(path: Path, expected: dict, name: str) -> None:
    check_size(path, expected)
    digest = file_sha256(path)
    if digest != expected["sha256"]:
        raise DamagedEntry(f"{name} has sha256 {digest[:16]}…, the manifest says {expected['sha256'][:16]}…")


def deliver(entry: Path, files: dict, outputs: dict[str, Path]) -> dict:
    """Copy the entry's files to ``outputs``, each checked against the manifest before it replaces its output.

    The copy is what gets hashed, so what a run reads is exactly what the manifest recorded.
    Returns the entry's stats.
    """
    for name in ENTRY_FILES:  # sizes first: a truncated file is caught before anything is copied
        check_size(entry / name, files[name])
    stats_bytes = (entry / "stats.json").read_bytes()
    if hashlib.sha256(stats_bytes).hexdigest() != files["stats.json"]["sha256"]:
        raise DamagedEntry("stats.json does not match its sha256 in the manifest")
    for name, dst in outputs.items():
        with atomic_path(dst) as tmp:
            copy_file(entry / name, tmp)
            check_hash(tmp, files[name], name)
    return json.loads(stats_bytes)


def discard(entry: Path) -> None:
    """Take a damaged entry out of the cache: renamed away first (atomic), then deleted."""
    trash = entry.with_name(f".{entry.name}.{os.getpid()}.damaged")
    try:
        os.rename(entry, trash)
    except FileNotFoundError:  # another job removed it already
        return
    except OSError:
        trash = entry
    shutil.rmtree(trash, ignore_errors=True)


def from_cache(entry: Path, outputs: dict[str, Path]) -> tuple[dict | None, str | None]:
    """A verified entry's stats (its files copied to ``outputs``), or None and why the entry was unusable."""
    if not entry.exists():
        return None, None
    try:
        return deliver(entry, read_manifest(entry), outputs), None
    except DamagedEntry as e:
        log.warning("cache entry %s is damaged: %s; removing it and tokenizing the shard again", entry, e)
        discard(entry)
        return None, str(e)


def publish(build: Path, entry: Path) -> None:
    """Rename a complete build folder onto its key; if another job published the key first, keep theirs."""
    try:
        os.rename(build, entry)
    except OSError:
        shutil.rmtree(build, ignore_errors=True)


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
):
    """Stream the shard through render → tokenize → mask → fit, writing as it goes.

    Rows left out (the chat template cannot render them into a training example, too long,
    no trained token left) are counted in the stats (``rejected`` by reason, ``rejects``:
    the first ones with file, row and detail) and, all of them, written to ``rejects_out``.
    """
    file = pq.ParquetFile(shard)
    render = ChatRenderer(tokenizer, template_kwargs)
    present = set(file.schema_arrow.names)
    columns = [c for c in ("messages", "content_hash", "category", "source_file", "source_row") if c in present]
    lengths, dropped, truncated, reasons, rejects = [], 0, 0, Counter(), []
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(pq.ParquetWriter(stack.enter_context(atomic_path(tokens_out)), SCHEMA))
        rejected = RejectWriter(shard, stack.enter_context(atomic_path(rejects_out)) if rejects_out else None)
        stack.callback(rejected.close)
        progress = Progress(f"tokenize {shard.name}", file.metadata.num_rows)
        for batch in file.iter_batches(batch_size=batch_rows, columns=columns):
            rows = batch.to_pylist()
            conversations = [json.loads(r["messages"]) for r in rows]
            encoded = encode_messages(tokenizer, conversations, render, train_on)
            out = {name: [] for name in SCHEMA.names}
            for row, messages, ex in zip(rows, conversations, encoded, strict=True):
                if "reject" in ex:
                    rejected.add(row, *ex["reject"])
                    continue
                fitted = fit_length(ex, max_len, policy)
                if why := length_reject(ex, fitted, max_len, policy):
                    rejected.add(row, *why, tokens=len(ex["input_ids"]), prompt_tokens=ex["prompt_length"])
                    dropped += why[0] != "no_labels"
                    continue
                truncated += fitted is not ex
                for key in ("input_ids", "labels", "prompt_length"):
                    out[key].append(fitted[key])
                out["length"].append(len(fitted["input_ids"]))
                out["response"].append(messages[-1]["content"])
                out["content_hash"].append(row["content_hash"])
                out["category"].append(row["category"] or "")
            lengths += out["length"]
            writer.write_table(pa.Table.from_pydict(out, schema=SCHEMA))
            rejected.flush()
            progress.update(len(rows), tokens=sum(out["length"]))
        progress.done()
        reasons, rejects = rejected.reasons, rejected.shown
        if rejects and not lengths and not reasons.keys() & set(LENGTH_REASONS):
            first = rejects[0]
            raise UserError(
                f"{shard}: every row was rejected by the chat template ({dict(reasons)}), e.g. "
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
    }


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


def write_packing(lengths: list[int], capacity: int, path: Path) -> dict:
    bins = pack_best_fit_decreasing(lengths, capacity)
    table = pa.table({"bin": pa.array(range(len(bins)), pa.int32()), "examples": pa.array(bins, pa.list_(pa.int32()))})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return packing_stats(lengths, bins, capacity)


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
    if reasons.keys() - set(LENGTH_REASONS):
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


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard", required=True, type=Path)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file replacing the tokenizer's")
    p.add_argument(
        "--format-template", help="a plain prompt format (see chat_format)", **option("data.format_template")
    )
    p.add_argument("--max-seq-len", type=int, required=True)
    p.add_argument("--overlength", **option("data.overlength"))
    p.add_argument("--train-on", help="assistant turns trained on", **option("data.train_on"))
    p.add_argument(
        "--template-kwargs",
        type=json_object,
        help="JSON object of chat template arguments, e.g. '{\"enable_thinking\": false}'",
        **option("data.template_kwargs"),
    )
    p.add_argument("--pack-len", type=int, default=0, help="bin size of the packing plan (0 = max-seq-len)")
    p.add_argument("--cache-dir", type=Path, default=None, help="content-addressed cache shared between runs")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--packing", required=True, type=Path)
    p.add_argument("--stats", required=True, type=Path)
    p.add_argument("--rejects", type=Path, help="examples left out, with reasons (default: <output>.rejects.parquet)")
    p.add_argument(
        "--max-reject-fraction",
        type=float,
        help="stop when more of the shard's examples are left out",
        **option("data.max_reject_fraction"),
    )
    p.add_argument("--min-examples", type=int, default=1, help="stop with fewer examples (a micro-batch per rank)")
    p.add_argument("--min-bins", type=int, default=0, help="stop with fewer packed bins (a micro-batch per rank)")
    a = p.parse_args(argv)
    a.rejects = a.rejects or a.output.with_suffix(".rejects.parquet")
    tokenizer = use_template(
        AutoTokenizer.from_pretrained(a.tokenizer), a.tokenizer, a.chat_template, a.format_template
    )
    pack_len = a.pack_len or a.max_seq_len
    settings = {"max_seq_len": a.max_seq_len, "overlength": a.overlength, "pack_len": pack_len}
    settings |= {"train_on": a.train_on, "template_kwargs": a.template_kwargs}
    key = cache_key(a.shard, tokenizer_fingerprint(tokenizer, a.tokenizer), settings)
    outputs = {"tokens.parquet": a.output, "packing.parquet": a.packing, "rejects.parquet": a.rejects}
    entry = (a.cache_dir / key) if a.cache_dir else None
    stats, damage = from_cache(entry, outputs) if entry else (None, None)
    if stats is not None:
        stats |= {"cache": "hit"}
        log.info("cache hit %s", entry)
    else:
        parent = a.cache_dir if entry else a.output.parent
        parent.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f".{key if entry else a.output.stem}.", suffix=".build", dir=parent))
        umask = os.umask(0o022)
        os.umask(umask)
        build.chmod(0o777 & ~umask)  # an entry folder as mkdir would make it, not mkdtemp's 0700
        try:
            lengths, stats = tokenize_shard(
                tokenizer,
                a.shard,
                build / "tokens.parquet",
                a.max_seq_len,
                a.overlength,
                train_on=a.train_on,
                template_kwargs=a.template_kwargs,
                rejects_out=build / "rejects.parquet",
            )
            stats |= write_packing(lengths, pack_len, build / "packing.parquet") | {"key": key, "settings": settings}
            write_json(build / "stats.json", stats)
            if entry:
                deliver(build, write_manifest(build)["files"], outputs)
                publish(build, entry)
            else:
                for name, dst in outputs.items():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(build / name, dst)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        stats |= {"cache": ("rebuilt" if damage else "miss") if entry else "off"}
        if damage:
            stats |= {"cache_damage": f"{entry}: {damage}"}
    # the guards come after the cache: their settings are no part of the key
    kept = f"{entry / 'rejects.parquet'} (the cache entry)" if entry else "this stage's log"
    check_rejects(stats, a.shard, a.rejects, a.max_reject_fraction, kept)
    check_units(stats, a.shard, a.min_examples, a.min_bins)
    write_json(a.stats, stats | {"shard": str(a.shard)})
    rejected = f", rejected {stats['rejected']}" if stats.get("rejected") else ""
    print(f"{a.shard}: {stats['examples']} examples, {stats['tokens']} tokens{rejected}, cache {stats['cache']}")


if __name__ == "__main__":
    main()
