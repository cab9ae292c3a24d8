"""Plain prompt formats for base models, and special-token text inside the data.

Light on imports: common.smk checks the config with it at parse time.

``data.format_template`` is a plain prompt format such as ``"### Question:\\n{question}\\n### Answer:\\n"``
for a base model without a chat template. It is turned into a small Jinja chat template
(``format_chat_template``) that renders conversations the same way, so tokenization, the
evaluation prompts and the template written into the exported model all come from one place:

- each user turn is the format with ``{question}`` = the turn's text and ``{system}`` = the system
  message (in the first user turn; empty in later turns and when there is none); ``{instruction}``
  and ``{input}`` are the record's own fields where the mapping keeps them (alpaca, nested: the
  turn's ``fields``), else the turn's text and "" (a conversation from elsewhere, as the exported
  model is given one);
- a list of formats: each user turn takes the first whose placeholders all have a non-empty value,
  else the last (Alpaca's prompt with an input, then the one without);
- each assistant turn is its text followed by the tokenizer's EOS, which ends the labels;
- several turns are concatenated in that layout; roles other than user and assistant (and a first
  system turn) are a ``template_error`` reject;
- the template writes ``bos_token`` first when the tokenizer puts a BOS before any text it encodes
  (Llama 2, Mistral), so ``apply_chat_template`` on the exported model gives the training ids;
- the generation prompt is the format itself: ``add_generation_prompt`` adds nothing.

``{{`` and ``}}`` are literal braces (Python ``str.format`` rules).

``data.special_text`` is what happens to a row with a special token's text (``<|endoftext|>``,
``<|im_end|>``, ``</s>``, ...) inside a field, which the tokenizer would read as that special token
(``SpecialText``).
"""

import json
import re
import string
from collections import Counter
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.data.tool_calls import TEXT_PARTS, map_strings, turn_text

FORMAT_FIELDS = ("system", "question", "instruction", "input")
SPECIAL_TEXT_POLICIES = ("reject", "strip", "escape")
ZERO_WIDTH_SPACE = "\u200b"


# ---------------------------------------------------------------- plain formats


def parse_format(fmt: str) -> list[tuple[str, str | None]]:
    """(literal text, placeholder or None) pieces of a format; a UserError naming data.format_template
    for an unknown placeholder, a conversion or format spec, no {question}, or a trailing space."""
    key = "data.format_template"
    try:
        pieces = [(literal, name, spec, conv) for literal, name, spec, conv in string.Formatter().parse(fmt)]
    except ValueError as e:
        raise UserError(f"{key} {fmt!r}: {e} (write {{{{ and }}}} for literal braces)") from None
    out, known = [], ", ".join("{" + f + "}" for f in FORMAT_FIELDS)
    for literal, name, spec, conv in pieces:
        if name is not None and (name not in FORMAT_FIELDS or spec or conv):
            written = name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "")
            raise UserError(f"{key} {fmt!r}: unknown placeholder {{{written}}}; the placeholders are {known}")
        out.append((literal, name))
    if not {"question", "instruction"} & {name for _, name in out}:
        raise UserError(f"{key} {fmt!r}: has no {{question}} (or {{instruction}}) placeholder")
    if fmt.endswith((" ", "\t")):
        raise UserError(
            f"{key} {fmt!r} ends with a space, which the answer's first token would merge with;"
            " end it with a newline instead"
        )
    return out


def format_list(value) -> list[str]:
    """data.format_template as a list of formats (a string is one); each checked by ``parse_format``."""
    formats = [value] if isinstance(value, str) else value
    if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
        raise UserError(f"data.format_template {value!r}: a format string or a non-empty list of them")
    for fmt in formats:
        parse_format(fmt)
    return formats


def format_prompt(fmt, question: str, system: str = "", fields: dict | None = None) -> str:
    """One user turn in the format (or the first of a list that fits), as Python renders it (what the
    Jinja template writes); ``fields``: the turn's instruction and input, where the mapping keeps them."""
    fields = fields or {}
    value = {"system": system, "question": question, "instruction": fields.get("instruction", question),
             "input": fields.get("input", "")}  # fmt: skip
    formats = [parse_format(f) for f in format_list(fmt)]
    chosen = next((f for f in formats[:-1] if all(value[name] for _, name in f if name)), formats[-1])
    return "".join(literal + (value[name] if name else "") for literal, name in chosen)


def _jinja_string(text: str) -> str:
    """A Jinja string literal of ``text``: JSON's escapes are Jinja's (it unescapes with unicode-escape)."""
    return json.dumps(text, ensure_ascii=False)


def _format_expression(pieces: list[tuple[str, str | None]]) -> str:
    """A Jinja expression writing one user turn in a parsed format, from the turn's ``value`` mapping."""
    parts, text = [], ""
    for literal, name in pieces:
        text += literal  # "{{" splits a literal in two: one string of both
        if name is None:
            continue
        if text:
            parts.append(_jinja_string(text))
            text = ""
        parts.append(f"value['{name}']")
    return " + ".join([*parts, *([_jinja_string(text)] if text else [])])


def format_chat_template(fmt, bos: bool = False) -> str:
    """The Jinja chat template that renders conversations in the plain format ``fmt`` (or a list of them:
    the first whose placeholders all have a value, else the last)."""
    formats = [parse_format(f) for f in format_list(fmt)]
    user = []
    for i, pieces in enumerate(formats):
        if i < len(formats) - 1:
            names = sorted({name for _, name in pieces if name})
            test = " and ".join(f"value['{name}']" for name in names)
            user.append(("{%- if " if i == 0 else "{%- elif ") + test + " -%}")
        elif len(formats) > 1:
            user.append("{%- else -%}")
        user.append("{{- " + _format_expression(pieces) + " -}}")
    if len(formats) > 1:
        user.append("{%- endif -%}")
    return "\n".join(
        [
            "{#- data.format_template as a chat template: each user turn in the format, each answer followed",
            "    by eos_token; the generation prompt is the format itself. -#}",
            "{%- set system = '' -%}",
            "{%- set turns = messages -%}",
            "{%- if messages and messages[0]['role'] == 'system' -%}",
            "{%- set system = messages[0]['content'] -%}",
            "{%- set turns = messages[1:] -%}",
            "{%- endif -%}",
            *(["{{- bos_token -}}"] if bos else []),
            "{%- for message in turns -%}",
            "{%- if message['role'] == 'user' -%}",
            "{%- set fields = message.get('fields') or {} -%}",
            "{%- set value = {'question': message['content'], 'system': system if loop.first else '',"
            " 'instruction': fields.get('instruction', message['content']), 'input': fields.get('input', '')} -%}",
            *user,
            "{%- elif message['role'] == 'assistant' -%}",
            "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}",
            "{%- else -%}",
            "{{- raise_exception('data.format_template renders user and assistant turns after an optional"
            " first system turn, not a ' + message['role'] + ' turn') -}}",
            "{%- endif -%}",
            "{%- endfor -%}",
        ]
    )


def has_chat_template(folder) -> bool | None:
    """Whether a local model folder's tokenizer has a chat template; None when that cannot be told
    from its files (not a folder, no tokenizer_config.json)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None


def chat_template_text(folder) -> str | None:
    """A local model folder's chat template text (chat_template.jinja, chat_template.json or tokenizer_config.json;
    named templates joined), None when its files hold none or cannot be read."""
    folder = Path(folder)
    try:
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text()
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                template = json.loads((folder / name).read_text()).get("chat_template")
                if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                    template = "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
                if template:
                    return template
    except (OSError, ValueError, AttributeError):
        return None
    return None


def no_template_message(source: str) -> str:
    return (
        f"{source}: the tokenizer has no chat template (a base model); set data.chat_template (a Jinja"
        ' chat template file) or data.format_template (a plain prompt format, e.g. "### Question:\\n{question}'
        '\\n### Answer:\\n")'
    )


# ---------------------------------------------------------------- special-token text in the data


def special_texts(tokenizer) -> list[str]:
    """The text of every special token of ``tokenizer`` (its named ones and every added token marked
    special), which it reads as that token wherever it appears in a string."""
    tokens = set(getattr(tokenizer, "all_special_tokens", ()))
    tokens |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return sorted(t for t in tokens if isinstance(t, str) and len(t) > 1)


def remove_special_text(text: str, tokens) -> str:
    """``text`` without any of ``tokens``' text (evaluation compares answers this way on both sides)."""
    for token in sorted(tokens, key=len, reverse=True):
        text = text.replace(token, "")
    return text


def with_text(turn: dict, fix) -> dict:
    """``turn`` with ``fix`` applied to its text: the content and, where the mapping keeps them, the record's
    own fields (the format template's {instruction} and {input}: parts of the content, so a search of the
    content finds what is in them), and a tool conversation's specs, calls and reasoning (tool_calls.turn_text)."""
    out = turn | {"content": fix(turn["content"])}
    if turn.get("fields"):
        out["fields"] = {k: fix(v) for k, v in turn["fields"].items()}
    for key in TEXT_PARTS if len(turn) > 2 else ():
        if key in turn:
            out[key] = map_strings(turn[key], fix)
    return out


class SpecialText:
    """data.special_text on a conversation: ``reject`` the row (reason ``special_text``), ``strip`` the
    tokens' text from every turn, or ``escape`` it (a zero-width space after its first character).
    Counts the rows and tokens found."""

    def __init__(self, tokens, policy: str = "reject"):
        if policy not in SPECIAL_TEXT_POLICIES:
            raise UserError(f"data.special_text must be one of {SPECIAL_TEXT_POLICIES}, not {policy!r}")
        self.tokens, self.policy = sorted(set(tokens), key=lambda t: (-len(t), t)), policy
        self.pattern = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None
        self.rows, self.found = 0, Counter()

    def __call__(self, messages: list[dict]) -> tuple[list[dict] | None, tuple | None]:
        """(the conversation as the policy leaves it, None), or (None, (reason, detail)) to reject it."""
        if self.pattern is None or not any(
            self.pattern.search(turn["content"] if len(turn) == 2 else turn_text(turn)) for turn in messages
        ):
            return messages, None
        hits = [(i, m.group()) for i, turn in enumerate(messages) for m in self.pattern.finditer(turn_text(turn))]
        self.rows += 1
        self.found.update(token for _, token in hits)
        if self.policy == "reject":
            i, token = hits[0]
            detail = (
                f"{messages[i]['role']} turn {i} contains {token} as text, which the tokenizer reads as that special"
                " token (data.special_text: strip or escape keeps such rows)"
            )
            return None, ("special_text", detail)
        new = ZERO_WIDTH_SPACE if self.policy == "escape" else ""
        fix = (lambda m: m.group()[0] + new + m.group()[1:]) if new else ""
        fixed = [with_text(turn, lambda text: self.pattern.sub(fix, text)) for turn in messages]
        if not fixed[-1]["content"].strip() and not fixed[-1].get("tool_calls"):
            return None, ("empty_response", "the answer is only special-token text (data.special_text: strip)")
        return fixed, None

    def summary(self) -> dict:
        return {"policy": self.policy, "tokens": self.tokens, "rows": self.rows, "by_token": dict(self.found)}
