"""Tool calls: function-calling conversations read, checked, and rendered by the model's own template.

A tool conversation is held as OpenAI's chat format holds it, which is what chat templates read:

- an assistant turn that calls functions carries ``tool_calls``: ``[{"type": "function", "function": {"name",
  "arguments"}}]`` (an ``id`` kept where the data has one), its arguments a JSON object (parsed from the JSON string
  OpenAI writes, as vLLM parses them before it renders), its ``content`` "" when it only calls;
- a tool result is a ``{"role": "tool", "content"}`` turn (with the data's ``name`` and ``tool_call_id``);
- the function specs the model is given ride on the conversation's first turn, under ``tools``, each as
  OpenAI's ``{"type": "function", "function": spec}`` (a bare spec, as glaive-style sets ship them, is wrapped), so
  the split's schema and every conversation without tools stay as they were, and any leading slice of the
  conversation (a generation prompt) keeps them. ``template_inputs`` takes them off again for the template.

``check_order`` and ``unknown_call`` are the row checks (reasons ``bad_turn_order``, ``unknown_tool``;
``bad_tool_arguments`` comes from ``parse_call``); ``check_template`` stops, with one line naming the template and
the row, where a conversation with tools meets a template that cannot render them (no ``tools`` in its Jinja, or
data.format_template).
"""

import contextlib
import json
import re
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError

TOOLS = "tools"  # the first turn's key holding the conversation's function specs
TOOL_ROLE = "tool"
REASONING = "reasoning_content"
TEMPLATE_TOOLS = re.compile(r"\btools\b")  # a template that reads the tools variable names it


def _json(value):
    """``value`` parsed when it is a string (ValueError when that is no JSON), else as it is."""
    return json.loads(value) if isinstance(value, str) else value


def normalize_tools(value, where: str = "tools") -> tuple[list | None, tuple | None]:
    """A row's function specs (a list, or a JSON string of one: glaive-style sets ship a string) as OpenAI's
    ``{"type": "function", "function": spec}`` entries; (None, None) when there are none, or (None, (reason,
    detail))."""
    if value is None or (isinstance(value, float) and value != value) or value == "":
        return None, None
    try:
        specs = _json(value)
    except ValueError:
        return None, ("invalid_json", f"{where} is a string that is not JSON")
    if not isinstance(specs, list):
        return None, ("missing_field", f"{where} is not a list of function specs")
    out = []
    for k, spec in enumerate(specs):
        if isinstance(spec, dict) and isinstance(spec.get("function"), dict):
            spec = {"type": spec.get("type", "function"), **spec}  # OpenAI's form already
        elif isinstance(spec, dict):
            spec = {"type": "function", "function": spec}
        else:
            return None, ("missing_field", f"{where}[{k}] is not an object")
        if not isinstance(spec["function"].get("name"), str) or not spec["function"]["name"]:
            return None, ("missing_field", f"{where}[{k}] has no function name")
        out.append(spec)
    return out or None, None


def load_tools(path: str) -> list:
    """data.tools: a JSON file holding a list of function specs, given to every conversation without its own; a
    one-line UserError naming the file where it is none."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"data.tools: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UserError(f"data.tools: {path} is not JSON ({e})") from None
    tools, problem = normalize_tools(value, path)
    if problem or not tools:
        why = problem[1] if problem else f"{path} holds no function spec"
        raise UserError(f"data.tools: {why} (a JSON list of function specs, each with a name)")
    return tools


def tool_names(tools: list | None) -> list[str]:
    return [spec["function"]["name"] for spec in tools or ()]


def parse_call(value, i: int) -> tuple[dict | None, tuple | None]:
    """One call of assistant turn ``i``: an OpenAI tool call ``{id?, type, function: {name, arguments}}`` or a bare
    ``{name, arguments}`` (a ShareGPT function_call's), as ``{"type": "function", "function": {name, arguments}}``
    with its arguments a JSON object; or (None, (reason, detail))."""
    if not isinstance(value, dict):
        return None, ("missing_field", f"assistant turn {i}: a tool call is not an object")
    function = value.get("function") if isinstance(value.get("function"), dict) else value
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return None, ("missing_field", f"assistant turn {i}: a tool call has no function name")
    arguments = function.get("arguments", function.get("parameters", {}))
    try:
        arguments = _json(arguments)
    except ValueError:
        return None, ("bad_tool_arguments", f"assistant turn {i}: the arguments of {name!r} are not JSON")
    if not isinstance(arguments, dict):
        what = type(arguments).__name__
        detail = f"assistant turn {i}: the arguments of {name!r} are a {what}, not an object"
        return None, ("bad_tool_arguments", detail)
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return ({"id": value["id"]} | call if isinstance(value.get("id"), str) else call), None


def parse_calls(value, i: int) -> tuple[list | None, tuple | None]:
    """A ShareGPT ``function_call`` turn's value (a JSON string of one call ``{name, arguments}`` or a list of
    them), or an OpenAI turn's ``tool_calls`` list, as calls (``parse_call``)."""
    try:
        value = _json(value)
    except ValueError:
        return None, ("bad_tool_arguments", f"turn {i}: the function call is not JSON")
    calls = []
    for item in value if isinstance(value, list) else [value]:
        call, problem = parse_call(item, i)
        if problem:
            return None, problem
        calls.append(call)
    if not calls:
        return None, ("missing_field", f"turn {i}: an empty list of tool calls")
    return calls, None


TEXT_PARTS = (TOOLS, "tool_calls", REASONING)  # a turn's text beside its content: what special text may hide in


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def turn_text(turn: dict) -> str:
    """All of a turn's text: its content and, in a tool conversation, every string of its specs, calls (names,
    argument keys and values) and reasoning, one a line (data.special_text and data.control_chars search it)."""
    extra = [text for key in TEXT_PARTS if key in turn for text in _strings(turn[key])]
    return "\n".join([turn["content"], *extra]) if extra else turn["content"]


def map_strings(value, fix):
    """``value`` with ``fix`` applied to every string in it, keys included (a call's arguments, a spec)."""
    if isinstance(value, str):
        return fix(value)
    if isinstance(value, dict):
        return {fix(k) if isinstance(k, str) else k: map_strings(v, fix) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, fix) for v in value]
    return value


def is_tool_conversation(messages: list[dict]) -> bool:
    """Whether the conversation has function specs, a call or a tool result (the template must render tools)."""
    return bool(messages) and (
        TOOLS in messages[0] or any("tool_calls" in t or t["role"] == TOOL_ROLE for t in messages)
    )


def merge_calls(turns: list[dict]) -> list[dict]:
    """Calls in turns of their own (ShareGPT's function_call after a gpt turn, parallel calls one turn each) joined
    to the assistant turn before them: one assistant turn says its text and makes its calls."""
    out: list[dict] = []
    for turn in turns:
        prev = out[-1] if out else None
        if turn.get("tool_calls") and not turn["content"] and prev is not None and prev["role"] == "assistant":
            out[-1] = prev | {"tool_calls": [*prev.get("tool_calls", ()), *turn["tool_calls"]]}
        else:
            out.append(turn)
    return out


AFTER = {"user": "a user turn", "answer": "an answer", "calls": "a call with no tool result", "tool": "a tool result"}


def check_order(turns: list[dict]) -> tuple | None:
    """A tool conversation's turn order: an optional system turn, a user turn, then the assistant answering each
    user turn or tool result; a turn that calls is followed by one result per call at most (a result with no call
    before it is ``bad_turn_order``), and the conversation ends with the assistant."""
    body = turns[1:] if turns[0]["role"] == "system" else turns
    state, pending = "start", 0  # the last turn: start, user, calls (an assistant that called), tool, answer
    for k, turn in enumerate(body, len(turns) - len(body)):
        role = turn["role"]
        if role == TOOL_ROLE:
            if state not in ("calls", "tool") or pending == 0:
                return "bad_turn_order", f"tool turn {k} has no call before it to answer"
            state, pending = "tool", pending - 1
        elif role == "assistant":
            if state == "start":
                return "bad_turn_order", f"assistant turn {k} opens the conversation: a user turn comes first"
            if state not in ("user", "tool"):
                return "bad_turn_order", f"assistant turn {k} follows {AFTER[state]}"
            calls = len(turn.get("tool_calls") or ())
            state, pending = ("calls", calls) if calls else ("answer", 0)
        elif role == "user":
            if state not in ("start", "answer"):
                return "bad_turn_order", f"user turn {k} follows {AFTER[state]}, which the assistant has not answered"
            state = "user"
        else:
            return "bad_turn_order", f"{role} turn {k}: only the first turn may be a system turn"
    if state not in ("answer", "calls"):
        return "bad_turn_order", "the conversation does not end with an assistant turn"
    return None


def unknown_call(turns: list[dict], tools: list | None) -> tuple | None:
    """``unknown_tool`` for the first call to a function the conversation's specs do not name (none given: any)."""
    if not tools:
        return None
    names = tool_names(tools)
    for k, turn in enumerate(turns):
        for call in turn.get("tool_calls") or ():
            if (name := call["function"]["name"]) not in names:
                return "unknown_tool", f"assistant turn {k} calls {name!r}, which is not in its tools {names}"
    return None


def with_tools(messages: list[dict], tools: list | None) -> tuple[list[dict] | None, tuple | None]:
    """data.tools on a conversation: ``tools`` on its first turn where it has none of its own, its calls checked
    against them (``unknown_call``); (messages, None) or (None, (reason, detail))."""
    if not tools or messages[0].get(TOOLS):
        return messages, None
    messages = [messages[0] | {TOOLS: tools}, *messages[1:]]
    problem = unknown_call(messages, tools)
    return (None, problem) if problem else (messages, None)


def template_inputs(messages: list[dict]) -> tuple[list[dict], list | None]:
    """(the turns, the function specs) as ``apply_chat_template(messages, tools=tools)`` takes them: the specs off
    the first turn, and a turn's ``reasoning_content`` under the other names transformers gives it (``thinking``),
    as apply_chat_template does before it renders."""
    first = messages[0]
    tools = first.get(TOOLS)
    turns = [{k: v for k, v in first.items() if k != TOOLS}, *messages[1:]] if TOOLS in first else list(messages)
    for k, turn in enumerate(turns):
        if turn.get(REASONING) is not None:
            turns[k] = {"thinking": turn[REASONING], **turn}
    return turns, tools


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (a template that cannot render specs has no use for it)."""
    return bool(template) and TEMPLATE_TOOLS.search(template) is not None


def check_template(template: str | None, name: str, where: str) -> None:
    """A one-line UserError when ``template`` (called ``name``) cannot render tools; ``where`` says which data
    has them (the first tool row, or data.tools)."""
    if renders_tools(template):
        return
    plain = name.startswith("data.format_template")
    why = "a plain prompt format has no place for specs, calls or results" if plain else "its Jinja never reads `tools`"
    raise UserError(
        f"{name} cannot render tools ({why}), and {where}: set data.chat_template to a template that renders tools"
        " and tool calls (the model family's own), or leave the tool rows out"
    )


def row_where(source_file, source_row) -> str:
    return f"{source_file}: row {source_row} is a tool-call conversation"


def tools_where(tools: str | None, tool_row: str | None) -> str | None:
    """What in the data needs a template that renders tools: data.tools, else the first tool row found at parse
    time (mappings.first_tool_row); None: nothing."""
    return f"data.tools ({tools}) gives every conversation function specs" if tools else tool_row


def check_tools_config(tools: str | None, chat_template: str | None, format_template, tool_row=None) -> None:
    """At parse time: data.tools read and checked (``load_tools``), and, where the template is known without the
    tokenizer (data.format_template, a data.chat_template file), that it renders tools where data.tools or a tool
    row (``tool_row``, where it is) needs it; one line each."""
    if tools:
        load_tools(tools)
    where = tools_where(tools, tool_row)
    if not where:
        return
    if format_template:
        check_template(None, "data.format_template", where)
    elif chat_template and Path(chat_template).is_file():
        check_template(Path(chat_template).read_text(), f"data.chat_template {chat_template}", where)


def check_model_template_renders_tools(tools: str | None, template: str | None, source: str, tool_row=None) -> None:
    """At parse time, with data.tools set or a tool row found (``tool_row``): the base model's own chat template
    (``template``, read from its local folder: chat_format.chat_template_text) renders tools; one line naming it.
    Nothing where there is none to read."""
    where = tools_where(tools, tool_row)
    if where and template is not None:
        check_template(template, f"{source}'s chat template", where)


# ---------------------------------------------------------------- calls in generated text (the tool_call score)

JSON_DECODER = json.JSONDecoder()


def calls_in_text(text: str) -> list[tuple[str, object]]:
    """The tool calls a text makes, whatever the template's layout: each outermost JSON object in it with a string
    ``name`` and an ``arguments`` (Qwen3's ``<tool_call>`` blocks, Hermes') or ``parameters`` (Llama 3.1's) value,
    as (name, arguments), the arguments parsed where they are a JSON string; a text with none gives []."""
    calls, at = [], text.find("{")
    while at >= 0:
        try:
            value, end = JSON_DECODER.raw_decode(text, at)
        except ValueError:
            at = text.find("{", at + 1)
            continue
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = value.get("arguments", value.get("parameters"))
            if isinstance(arguments, str):
                with contextlib.suppress(ValueError):  # not JSON: kept as text, which equals no reference's
                    arguments = json.loads(arguments)
            if arguments is not None:
                calls.append((value["name"], arguments))
        at = text.find("{", end)
    return calls


def json_equal(a, b) -> bool:
    """Equal as JSON values: numbers by value (1 and 1.0), but true is no 1; objects by their keys, lists in order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def same_calls(answer: list[tuple[str, object]], reference: list[tuple[str, object]]) -> bool:
    """The answer makes the reference's calls, no more and no fewer: names equal and arguments equal as JSON values
    (``json_equal``), in any order (parallel calls)."""
    left = list(answer)
    if len(left) != len(reference):
        return False
    for name, arguments in reference:
        match = next((k for k, (n, a) in enumerate(left) if n == name and json_equal(a, arguments)), None)
        if match is None:
            return False
        left.pop(match)
    return True
