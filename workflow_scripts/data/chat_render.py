"""Chat rendering: a conversation → the text the model is trained on, its labels and its prompt.

A conversation is rendered once and tokenized as one string, so special tokens and merges are
what the tokenizer gives for the whole text; the trained turns are found in that render (see
``render_conversation``) and mapped to tokens by the fast tokenizer's character offsets. The
first ``prompt_length`` ids are checked to be exactly the ids of ``apply_chat_template(
messages[:-1], add_generation_prompt=True, **template_kwargs)`` (with the BOS the model family
wants, when the template does not write it; see ``prompt_tokens``). Labels cover the last
assistant turn (``train_on: all``: every one) from the end of its header to its end-of-turn token
inclusive: the tokenizer's EOS and whichever of ``END_OF_TURN`` the tokenizer has as added
tokens. A row the template cannot render that way is a reject with a reason.

The template is data.chat_template's file, data.format_template (a plain prompt format, turned
into a chat template by ``chat_format.format_chat_template``) or the tokenizer's own; without
any, one line naming both keys (``use_template``).

Used by tokenize_shard (ids and labels), by the split (``render_lengths``, for ``balance:
tokens``), and by consolidation and evaluation (``use_template``, ``generation_settings``).
"""

import bisect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.data.chat_format import format_chat_template, no_template_message
from workflow_scripts.data.tool_calls import is_tool_conversation, template_inputs

TRAIN_ON = ("last", "all")
# Tokens that close a turn in the common chat formats (ChatML/Qwen, Llama 3, Gemma, Phi-3): those the
# tokenizer has as added tokens, and its EOS, end an assistant turn's labels.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")


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


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)``; in a process that has imported neither torch nor transformers
    (the tokenization and split CLIs), with torch kept out of it: a tokenizer needs none, and transformers
    imports it through its config classes (1.5 s of CPU and 180 MB a job, measured: docs/benchmarks/data.md).
    ``sys.modules["torch"] = None`` is Python's way to make a module unimportable, and transformers'
    availability check reads it; its advice that PyTorch was not found is silenced for that import."""
    if "torch" not in sys.modules and "transformers" not in sys.modules:
        sys.modules["torch"] = None
        quiet = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
        try:
            import transformers  # noqa: F401
        finally:
            if quiet is None:
                del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


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
    than the rendering itself; the output is the same (a test checks it). Jinja's own
    ``render`` builds each call's context from the template's globals, a ChainMap read key
    by key, which costs as much again: the globals and the fixed variables are merged into
    a plain dict once (``base``) and each call's context starts from a copy of it. The
    renderer also knows what closes an assistant turn (``end_of_turn``) and whether the
    model family wants a BOS token the template does not write (``bos``).
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
        else:  # Template.render's context, less the per-call merge: globals, then the variables
            self.globals = dict(self.compiled.globals)
            self.base = self.globals | self.variables
        self.end_of_turn = end_of_turn_tokens(tokenizer)
        self.end_of_turn_ids = [tokenizer.convert_tokens_to_ids(t) for t in self.end_of_turn]
        # BOS: prepended where the template does not write it (see wants_bos)
        self.bos_id = tokenizer.bos_token_id
        self.bos = tokenizer.bos_token if wants_bos(tokenizer) else None

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The render of ``apply_chat_template(messages, tools=tools, ...)``, a tool conversation's ``tools`` the
        specs on its first turn (tool_calls.template_inputs)."""
        tools = None
        if any(len(turn) > 2 for turn in messages):  # a turn with more than role and content: maybe a tool one
            messages, tools = template_inputs(messages)
        if self.compiled is None:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
                **self.template_kwargs,
            )  # fmt: skip
        t = self.compiled
        parent = self.base | {"messages": messages, "tools": tools, "documents": None}
        parent["add_generation_prompt"] = add_generation_prompt
        context = t.environment.context_class(t.environment, parent, t.name, t.blocks, globals=self.globals)
        return t.environment.concat(t.root_render_func(context))

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
    tools = train_on == "all" and is_tool_conversation(messages)
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
        if tools and i != last and start < done:
            start = tool_turn_start(render, messages, i, text, prompt, done)
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


def tool_turn_start(render: ChatRenderer, messages: list[dict], i: int, text: str, prompt: str, done: int) -> int:
    """Where assistant turn ``i`` of a tool conversation starts in its render when its generation prompt differs
    before the turn before it ends (``done``), under ``train_on: all``: just past the first assistant header after
    ``done`` (what ``add_generation_prompt`` adds, or its first line alone where the turn is rendered without the
    rest: Qwen3's empty think block under enable_thinking false); -1 (a turn_not_found) where there is none.
    A template may render history otherwise once later turns come (Qwen3 drops a tool chain's reasoning once the
    user speaks again): the turn is trained as the whole conversation renders it."""
    try:
        before = render(messages[:i])
    except Exception as e:
        raise Reject("template_error", f"the chat template raised {type(e).__name__}: {e}") from None
    header = prompt[len(before) :] if prompt.startswith(before) else ""
    if not header.strip():
        return -1
    first = header[: header.index("\n") + 1] if "\n" in header.rstrip("\n") else header
    found = [(at, -len(h)) for h in dict.fromkeys((header, first)) if (at := text.find(h, done)) >= 0]
    if not found:
        return -1
    at, minus = min(found)  # the earliest; at one place, the whole header
    return at - minus


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


def rust_backend(tokenizer):
    """The Rust tokenizer under a fast tokenizer, set to neither truncate nor pad; None for a slow one.
    Called directly: transformers' per-encoding wrapper costs ~15%."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and (backend.truncation or backend.padding):
        backend.no_truncation()
        backend.no_padding()
    return backend


def tokenize_texts(tokenizer, texts: list[str]) -> list:
    """Encodings (ids, character offsets) of each text, no special tokens added, in one batch call."""
    if not texts:
        return []
    if (backend := rust_backend(tokenizer)) is not None:
        return backend.encode_batch(texts, add_special_tokens=False)
    out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [Offsets(i, o) for i, o in zip(out["input_ids"], out["offset_mapping"], strict=True)]


def text_lengths(tokenizer, texts: list[str]) -> list[int]:
    """How many tokens each text has, no special tokens added: the fast path, without offsets."""
    if not texts:
        return []
    if (backend := rust_backend(tokenizer)) is not None:
        fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [len(e.ids) for e in fast(texts, add_special_tokens=False)]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def render_lengths(render: "ChatRenderer", conversations: list[list[dict]]) -> list[int]:
    """Each conversation's length in tokens as tokenize_shard makes it before the length policy, measured
    the cheap way (``balance: tokens``): one render and a batch encode without offsets, no labels and
    none of encode_messages' checks, so a row tokenization will reject still counts its length; a row
    the template raises on counts 0."""
    texts = []
    for messages in conversations:
        try:
            texts.append(render(messages))
        except Exception:  # a template's raise_exception: tokenize_shard rejects the row
            texts.append(None)
    counts = iter(text_lengths(render.tokenizer, [t for t in texts if t is not None]))
    return [0 if t is None else len(render.bos_ids(t)) + next(counts) for t in texts]


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
    ids, b = enc.ids, 0
    if render.bos and not conv.text.startswith(render.bos):  # render.bos_ids, without a second list
        ids.insert(0, render.bos_id)
        b = 1
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
