"""Mappings: a record of any common instruction format in, one conversation out.

A mapping turns a record into a conversation (a list of ``{"role", "content"}`` turns ending with the assistant)
or into a reject reason. MAPPINGS holds them by data.mapping's name (the schema's enum is its keys and ``auto``;
tests/test_split.py holds them equal):

- ``columns``: system / user / assistant columns (seed 000's ``prompt, question,
  response``; ``prompt, completion`` with ``prompt: null``...).
- ``alpaca``: ``instruction``, optional ``input``, ``output``.
- ``chat``: a ``messages`` list of ``{role, content}`` turns (multi-turn, optional system). A turn's
  content may be a list of OpenAI-style parts: its text parts are joined with a newline (what vLLM
  and other OpenAI-compatible servers give a template that takes a string, as Qwen3's and Llama 3's
  do); any other part (``image_url``, ``input_audio``...) rejects the row, naming the part's type.
- ``sharegpt``: a ``conversations`` list of ``{from, value}`` turns, ``from`` human/user, gpt/assistant
  or system. Each mapping reads both turn forms, and, when its column is absent, the other's
  (``messages`` <-> ``conversations``): a ShareGPT file read with ``chat`` works.
- Both read tool-call conversations (tool_calls.py): an assistant turn's ``tool_calls`` and a ``tool`` turn,
  ShareGPT's ``function_call`` and ``observation`` turns, and the row's function specs (a ``tools`` column).
- ``nested``: one ``instruction`` with a list of ``instances`` ``{input, output}``,
  one example per instance (the self-instruct format of ../shared/data).

To add a mapping, write its function ``(fields, names, get) -> [(messages, None) | (None, (reason, detail))]``
and add a ``Mapping`` entry to MAPPINGS (its data.columns keys with their default names, the required ones),
then the name to config/schema.yaml's data.mapping enum; a row in DETECTED lets data.mapping auto find it.
data_readers.py reads the files; a conversation's identity (its hashes) and where it goes are identity.py's.
"""

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.data.chat_format import with_text
from workflow_scripts.data.preference_pairs import preference_examples
from workflow_scripts.data.readers import delimiter_hint, iter_records, peek_columns, resolve_paths, rows_at_most
from workflow_scripts.data.tool_calls import (
    REASONING,
    TOOL_ROLE,
    TOOLS,
    check_order,
    is_tool_conversation,
    merge_calls,
    normalize_tools,
    parse_calls,
    row_where,
    turn_text,
    unknown_call,
)

CHAT_COLUMNS = {"messages": "conversations", "conversations": "messages"}  # chat and sharegpt read either


def _text(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, float) and value != value:  # NaN from pandas-written files
        return None
    return value if isinstance(value, str) else str(value)


def _join(instruction: str, extra: str | None) -> str:
    return f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction


def _fields(instruction: str, extra: str | None) -> dict:
    """The record's own fields, kept beside the joined content for data.format_template's {instruction}
    and {input} (Alpaca's prompt with an input, or the one without)."""
    return {"instruction": instruction, "input": extra if extra and extra.strip() else ""}


def _missing(names: dict, field: str, what: str = "is missing or null") -> list[tuple[None, tuple]]:
    return [(None, ("missing_field", f"{names[field]} {what}"))]


def _columns(fields: dict, names: dict, get) -> list:
    system, user, answer = get("prompt"), get("question"), get("response")
    if user is None or answer is None:
        return _missing(names, "question" if user is None else "response")
    turns = [{"role": "system", "content": system}] if system and system.strip() else []
    return [(turns + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], None)]


def _alpaca(fields: dict, names: dict, get) -> list:
    instruction, extra, answer, system = get("instruction"), get("input"), get("output"), get("system")
    if instruction is None or answer is None:
        return _missing(names, "instruction" if instruction is None else "output")
    turns = [{"role": "system", "content": system}] if system and system.strip() else []
    user = {"role": "user", "content": _join(instruction, extra), "fields": _fields(instruction, extra)}
    return [(turns + [user, {"role": "assistant", "content": answer}], None)]


def _conversation(key: str) -> Callable:
    """The chat (``messages``) or sharegpt (``conversations``) mapping: either reads the other's column too, and
    the row's function specs (``tools``: a list, or a JSON string of one) where it has them."""

    def mapping(fields: dict, names: dict, get) -> list:
        column = names[key]
        if column not in fields and CHAT_COLUMNS.get(column) in fields:
            column = CHAT_COLUMNS[column]  # a ShareGPT file read with chat, or the reverse
        tools = fields.get(names["tools"]) if names.get("tools") else None
        return [_chat(fields.get(column), column, tools, names.get("tools"))]

    return mapping


def _nested(fields: dict, names: dict, get) -> list:
    instruction, instances = get("instruction"), fields.get(names["instances"])
    if instruction is None:
        return _missing(names, "instruction")
    if not isinstance(instances, list) or not instances:
        return _missing(names, "instances", "is not a non-empty list")
    out = []
    for inst in instances:
        if not isinstance(inst, dict) or _text(inst.get(names["output"])) is None:
            out.append((None, ("missing_field", f"an instance has no {names['output']!r}")))
            continue
        extra = _text(inst.get(names["input"]))
        user = {"role": "user", "content": _join(instruction, extra), "fields": _fields(instruction, extra)}
        out.append(([user, {"role": "assistant", "content": _text(inst[names["output"]])}], None))
    return out


def _preference(fields: dict, names: dict, get) -> list:
    """A chosen and a rejected answer to one prompt (preference_pairs.py), its turns read as the chat mapping's."""
    return preference_examples(fields, names, get, _chat)


@dataclass(frozen=True)
class Mapping:
    """A record format. ``columns``: its data.columns keys and their default names; ``required``: the keys a
    record must have; ``examples(fields, names, get)`` maps a record (``get(key)``: the text of its column);
    ``inner``: keys that name keys inside a column's values, not columns (not checked in the header);
    ``alternates``: a column name and the one read when it is absent; ``one_per_row``: a row is at most one
    example (the parse-time row count can bound the examples)."""

    columns: dict
    required: tuple[str, ...]
    examples: Callable[[dict, dict, Callable], list]
    inner: tuple[str, ...] = ()
    alternates: dict = field(default_factory=dict)
    one_per_row: bool = True


# data.mapping's names (the schema's enum less auto), each with its mapping; a new mapping is one entry here
MAPPINGS = {
    "columns": Mapping({"prompt": "prompt", "question": "question", "response": "response"}, ("question", "response"),
                       _columns),
    "alpaca": Mapping({"instruction": "instruction", "input": "input", "output": "output", "system": None},
                      ("instruction", "output"), _alpaca),
    "chat": Mapping({"messages": "messages", "tools": "tools"}, ("messages",), _conversation("messages"),
                    alternates=CHAT_COLUMNS),
    "sharegpt": Mapping({"conversations": "conversations", "tools": "tools"}, ("conversations",),
                        _conversation("conversations"), alternates=CHAT_COLUMNS),
    "nested": Mapping({"instruction": "instruction", "instances": "instances", "input": "input", "output": "output"},
                      ("instruction", "instances"), _nested, inner=("input", "output"), one_per_row=False),
    "preference": Mapping({"prompt": "prompt", "chosen": "chosen", "rejected": "rejected",
                           "conversations": "conversations"}, ("chosen", "rejected"), _preference),
}  # fmt: skip


def column_names(mapping: str, columns: dict) -> dict:
    """The mapping's column names: its defaults, overridden by data.columns where it names them."""
    if mapping not in MAPPINGS:
        raise UserError(f"data.mapping: unknown mapping {mapping!r} ({', '.join(MAPPINGS)}, or auto)")
    names = dict(MAPPINGS[mapping].columns)
    names.update({k: v for k, v in columns.items() if k in names})
    return names


# What data.mapping: auto reads a file as, by its columns, the first that fits: (mapping, the columns that
# tell it, its column names where they are not the mapping's defaults)
DETECTED = (
    ("preference", ("chosen", "rejected"), {}),  # before sharegpt: a ShareGPT pair has conversations too
    ("chat", ("messages",), {}),
    ("sharegpt", ("conversations",), {}),
    ("nested", ("instruction", "instances"), {}),
    ("alpaca", ("instruction", "output"), {}),
    ("alpaca", ("instruction", "context", "response"), {"input": "context", "output": "response"}),  # Dolly
    ("columns", ("question", "response"), {}),
    ("columns", ("prompt", "completion"), {"prompt": None, "question": "prompt", "response": "completion"}),
    ("columns", ("question", "answer"), {"prompt": None, "response": "answer"}),
    ("columns", ("instruction", "response"), {"prompt": None, "question": "instruction"}),
)


def detect_mapping(present: list[str]) -> tuple[str, dict] | None:
    """The mapping and column names a file with columns ``present`` fits (DETECTED), or None. A ``system``
    column is the system turn of a columns mapping that has no ``prompt``."""
    for mapping, needs, names in DETECTED:
        if set(needs) <= set(present):
            if mapping == "columns" and names.get("prompt", "prompt") not in present and "system" in present:
                names = names | {"prompt": "system"}
            return mapping, dict(names)
    return None


def resolve_mapping(spec: str, fmt: str, mapping: str, columns: dict, delimiter: str | None = None):
    """(mapping, column names) as ``spec`` is read, its mapped columns checked (``check_columns``).
    ``auto``: the mapping the first file's columns fit, with that format's own names; data.columns set
    away from the columns mapping's defaults under ``auto`` mean the columns mapping (the default before
    ``auto``); no fit is a one-line UserError naming the columns found."""
    if mapping == "auto":
        if any(MAPPINGS["columns"].columns.get(k) != v for k, v in columns.items()):
            mapping = "columns"
        else:
            path, present = peek_columns(spec, fmt, delimiter)
            found = detect_mapping(present)
            if found is None:
                raise UserError(
                    f"{path}: data.mapping auto knows no format with the columns {present}; set data.mapping"
                    f" ({', '.join(MAPPINGS)}) and data.columns" + delimiter_hint(path, fmt, present)
                )
            mapping, columns = found
    check_columns(spec, fmt, mapping, columns, delimiter)
    return mapping, column_names(mapping, columns)


def mapping_hint(present: list[str], mapping: str) -> str:
    """For a column not found: the mapping the file's columns fit, when it is another."""
    found = detect_mapping(present)
    return f" (its columns fit data.mapping: {found[0]})" if found and found[0] != mapping else ""


def check_columns(spec: str, fmt: str, mapping: str, columns: dict, delimiter: str | None = None) -> None:
    """Fail early, from the first file's header, when a mapped column is absent."""
    path, present = peek_columns(spec, fmt, delimiter)
    names = column_names(mapping, columns)
    entry = MAPPINGS[mapping]
    for key in entry.required + tuple(k for k in names if k not in entry.required):
        name = names.get(key)
        if name is None:
            if key in entry.required:
                raise UserError(f"data.columns.{key} is not set (needed by data.mapping {mapping})")
            continue
        if key in entry.inner:
            continue  # keys inside each value, not columns
        # an optional key under its default name may be absent; a name the user chose may not
        optional_default = key not in entry.required and name == entry.columns.get(key)
        alternate = entry.alternates.get(name) in present
        if present and name not in present and not optional_default and not alternate:
            raise UserError(
                f"{path}: column {name!r} (data.columns.{key}) not found; the file has {present}"
                + (delimiter_hint(path, fmt, present) or mapping_hint(present, mapping))
            )


def check_rows_fill_nodes(spec: str, fmt: str, mapping: str, nodes: int, separate_eval: bool) -> None:
    """At parse time, before the DAG of ``nodes`` shards is built: a UserError (one line) when ``spec`` cannot
    have the rows the split needs (split.check_shards at the rule's --min-examples-per-shard 1): one for each
    node's shard and, without data.eval_path, one for the eval set. A line count, not a parse: it refuses only
    what is certain (data.mapping nested makes several examples of a row: not checked)."""
    need = nodes + (not separate_eval)
    if not MAPPINGS[mapping].one_per_row or nodes < 1:
        return
    found = rows_at_most(spec, fmt, need)
    if found is not None and found < need:
        eval_part = "" if separate_eval else " and one for the eval set"
        raise UserError(
            f"data.path {spec}: at most {found} row{'s' * (found != 1)} (its line count) for nodes: {nodes}; the split"
            f" needs a row for each node's shard{eval_part}: lower nodes or add rows"
        )


def first_tool_row(spec: str, fmt: str, mapping: str, columns: dict, delimiter: str | None = None, rows: int = 64):
    """Where the first tool-call conversation is among the first ``rows`` rows of each file ``spec`` names (as
    tool_calls.row_where says it; None: none there). At parse time, read from the files' starts only: a template
    that cannot render tools stops before any job runs where tool rows come early, as in a tool-call set; a tool
    row further in still stops at tokenization."""
    mapping, names = resolve_mapping(spec, fmt, mapping, columns, delimiter)
    for path in resolve_paths(spec):
        for batch in iter_records(str(path), fmt, delimiter, batch_rows=rows):
            for rec in batch[:rows]:  # a reader's batch may hold more (CSV's are by bytes)
                examples = [] if rec.error else to_examples(rec.fields, mapping, names)
                if any(isinstance(m, list) and is_tool_conversation(m) for m, _ in examples):
                    return row_where(rec.source_file, rec.source_row)
            break  # the first batch only
    return None


def to_examples(fields: dict, mapping: str, names: dict) -> list[tuple[list[dict], None] | tuple[None, tuple]]:
    """Map one record to ``[(messages, None)]`` or ``[(None, (reason, detail))]`` (several for nested)."""

    def get(key):
        return _text(fields.get(names[key])) if names.get(key) else None

    return MAPPINGS[mapping].examples(fields, names, get)


def _chat(messages, column: str, tools=None, tools_column: str | None = None):
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            return None, ("invalid_json", f"{column} is a string that is not JSON")
    if not isinstance(messages, list) or not messages:
        return None, ("missing_field", f"{column} is missing or not a list")
    turns = []
    for i, m in enumerate(messages):
        turn, problem = _turn(m, i)
        if problem:
            return None, problem
        turns.append(turn)
    tools, problem = normalize_tools(tools, tools_column or "tools")
    if problem:
        return None, problem
    if tools or any(len(t) > 2 or t["role"] == TOOL_ROLE for t in turns):  # a call, a result, reasoning kept
        return _tool_chat(turns, tools)
    return _chat_order(turns)


def _tool_chat(turns: list[dict], tools: list | None):
    """A conversation with function specs, calls or tool results: its calls joined to their assistant turns, its
    order and its calls checked, the specs on its first turn (tool_calls.py)."""
    if not any(t.get("tool_calls") or t["role"] == TOOL_ROLE for t in turns) and not tools:
        turns = [{"role": t["role"], "content": t["content"]} for t in turns]  # reasoning alone: as it always was
        return _chat_order(turns)
    turns = merge_calls(turns)
    problem = check_order(turns) or unknown_call(turns, tools)
    if problem:
        return None, problem
    if tools:
        turns[0] = turns[0] | {TOOLS: tools}
    return turns, None


def _chat_order(turns: list[dict]):
    roles = [t["role"] for t in turns]
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * (len(body) // 2)
    if len(body) < 2 or body != expected:
        return None, ("bad_turn_order", f"roles {roles}: expected optional system, then user/assistant pairs")
    return turns, None


# ShareGPT's `from` values, and the role each is trained as; function_call (a call: the assistant's) and
# observation (its result) are LLaMA-Factory's tool turns (tool_calls.py)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CALL_TURNS = ("function_call",)
RESULT_TURNS = ("observation", "tool", "function", "function_response")


def _turn(m, i: int) -> tuple[dict | None, tuple | None]:
    """Turn ``i`` of a conversation as ``{role, content}``: an OpenAI ``{role, content}`` (content a string or a
    list of parts; an assistant's ``tool_calls`` and ``reasoning_content``, a tool result's ``name`` and
    ``tool_call_id`` kept) or a ShareGPT ``{from, value}`` (function_call and observation turns as a call and a
    tool result); or (None, (reason, detail))."""
    if not isinstance(m, dict):
        return None, ("missing_field", f"turn {i} is not an object")
    extra = {}
    if "role" in m or "from" not in m:
        role, content = _text(m.get("role")), m.get("content")
        if role == "assistant" and m.get("tool_calls"):
            calls, problem = parse_calls(m["tool_calls"], i)
            if problem:
                return None, problem
            extra, content = {"tool_calls": calls}, "" if content is None else content
        elif role in RESULT_TURNS:
            role = TOOL_ROLE
            extra = {k: m[k] for k in ("name", "tool_call_id") if isinstance(m.get(k), str)}
        if role == "assistant" and isinstance(m.get(REASONING), str):
            extra[REASONING] = m[REASONING]
    else:
        source = _text(m.get("from"))
        if source in CALL_TURNS:
            calls, problem = parse_calls(m.get("value"), i)
            if problem:
                return None, problem
            return {"role": "assistant", "content": "", "tool_calls": calls}, None
        if source in RESULT_TURNS:
            role, content = TOOL_ROLE, m.get("value")
        elif source not in SHAREGPT_ROLES:
            known = ", ".join([*SHAREGPT_ROLES, *CALL_TURNS, *RESULT_TURNS])
            return None, ("unknown_role", f"turn {i} is from {source!r}; a ShareGPT turn is from {known}")
        else:
            role, content = SHAREGPT_ROLES[source], m.get("value")
    if role == TOOL_ROLE and isinstance(content, list | dict) and not _is_parts(content):
        content = json.dumps(content, ensure_ascii=False)  # a result given as JSON, not as OpenAI parts
    if isinstance(content, list):
        content, problem = _parts(content, i, role)
        if problem:
            return None, problem
    else:
        content = _text(content)
    if role is None or content is None:
        return None, ("missing_field", f"turn {i} lacks {'role' if role is None else 'content'}")
    return {"role": role, "content": content, **extra}, None


def _is_parts(content) -> bool:
    return isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content)


def _parts(parts: list, i: int, role) -> tuple[str | None, tuple | None]:
    """An OpenAI content list's text parts, joined with a newline (as vLLM joins them for a template that takes
    a string); any other part is an ``unsupported_content`` reject naming its type."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if kind != "text" else "a text part without text"
            return None, ("unsupported_content", f"{role} turn {i} has {what}: only text parts are trained")
        texts.append(part["text"])
    return "\n".join(texts), None


# ---------------------------------------------------------------- control characters

# C0 controls but tab, LF and CR: a NUL or an escape sequence in a field is a broken export, not text
CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")
CONTROL_POLICIES = ("reject", "strip")


class ControlChars:
    """data.control_chars on a conversation: ``reject`` a row with a control character in a turn (reason
    ``control_chars``) or ``strip`` them. Counts the rows and characters found, for the manifest."""

    def __init__(self, policy: str = "reject"):
        if policy not in CONTROL_POLICIES:
            raise UserError(f"data.control_chars must be one of {CONTROL_POLICIES}, not {policy!r}")
        self.policy, self.rows, self.found = policy, 0, Counter()

    def __call__(self, messages: list[dict]) -> tuple[list[dict] | None, tuple | None]:
        """(the conversation as the policy leaves it, None), or (None, (reason, detail)) to reject it."""
        for turn in messages:  # a loop, not any(): this runs on every row
            if CONTROL_CHARS.search(turn["content"] if len(turn) == 2 else turn_text(turn)):
                break
        else:
            return messages, None
        hits = [(i, c) for i, turn in enumerate(messages) for c in CONTROL_CHARS.findall(turn_text(turn))]
        self.rows += 1
        self.found.update(f"U+{ord(c):04X}" for _, c in hits)
        if self.policy == "reject":
            i, c = hits[0]
            name = f"U+{ord(c):04X}" + (" (NUL)" if c == "\0" else "")
            role = messages[i]["role"]
            detail = f"{role} turn {i} contains the control character {name} (data.control_chars: strip keeps the row)"
            return None, ("control_chars", detail)
        return [with_text(turn, lambda text: CONTROL_CHARS.sub("", text)) for turn in messages], None

    def summary(self) -> dict:
        return {"policy": self.policy, "rows": self.rows, "by_char": dict(sorted(self.found.items()))}
