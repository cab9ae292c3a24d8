"""Tool-call conversations (issue 36): glaive-style ShareGPT and OpenAI rows read, checked row for row, and trained as
the base model's own template renders them.

Every tokenized row's ids are compared with ``apply_chat_template(messages, tools=tools)``; the labels are checked
token by token against the assistant turns found in that render. The templates are read in place from
../shared/templates (Qwen3's, Llama 3.1's); the tokenizers are small byte-level BPEs trained here with each
family's special tokens.
"""

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import bpe_tokenizer, split_files

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import SplitConfig
from workflow_scripts.data.chat_format import SpecialText, special_texts
from workflow_scripts.data.chat_render import ChatRenderer, encode_messages, use_template
from workflow_scripts.data.identity import content_hash
from workflow_scripts.data.mappings import ControlChars, column_names, to_examples
from workflow_scripts.data.split import REASONS
from workflow_scripts.data.tokenization import tokenize_shard
from workflow_scripts.data.tool_calls import (
    calls_in_text,
    check_tools_config,
    load_tools,
    renders_tools,
    template_inputs,
)

TEMPLATES = Path(__file__).resolve().parents[3] / "shared" / "templates"
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]  # fmt: skip

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {
    "name": "get_time",
    "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SPECS = [WEATHER, TIME]
OPENAI_SPECS = [{"type": "function", "function": spec} for spec in SPECS]


def call(name: str, **arguments) -> str:
    """A ShareGPT function_call turn's value: a JSON string of {name, arguments}."""
    return json.dumps({"name": name, "arguments": arguments})


def openai_call(name: str, arguments, id_: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def h(text):
    return {"from": "human", "value": text}


def gpt(text):
    return {"from": "gpt", "value": text}


def fc(value):
    return {"from": "function_call", "value": value}


def obs(value):
    return {"from": "observation", "value": value}


# glaive-style function calling as ShareGPT (LLaMA-Factory's layout): tools a JSON string of bare specs
GLAIVE = [
    # 0: one call
    {"conversations": [{"from": "system", "value": "You are a helpful assistant with access to functions."},
                       h("What is the weather in Oslo?"), fc(call("get_weather", city="Oslo")),
                       obs('{"temperature": 3, "unit": "C"}'), gpt("It is 3 degrees in Oslo.")],
     "tools": json.dumps(SPECS)},
    # 1: multi-turn, two calls in two user turns, a clarifying answer between
    {"conversations": [h("What is the weather?"), gpt("Which city?"), h("Bergen, please."),
                       fc(call("get_weather", city="Bergen")), obs('{"temperature": 5}'), gpt("5 degrees in Bergen."),
                       h("And the time there?"), fc(call("get_time", city="Bergen")), obs('{"time": "14:00"}'),
                       gpt("It is 14:00 in Bergen.")],
     "tools": json.dumps(SPECS)},
    # 2: the assistant says something, then calls (the call joins its turn), then reasons over the result
    {"conversations": [h("Time in Paris?"), gpt("Let me look that up."), fc(call("get_time", city="Paris")),
                       obs('{"time": "09:30"}'),
                       gpt("<think>\nThe tool says 09:30.\n</think>\n\nIt is 09:30 in Paris.")],
     "tools": json.dumps(SPECS)},
    # 3: arguments as glaive's raw data has them: a string with single quotes, no JSON
    {"conversations": [h("Weather in Rome?"), fc(json.dumps({"name": "get_weather", "arguments": "{'city': 'Rome'}"})),
                       obs("{}"), gpt("Unknown.")], "tools": json.dumps(SPECS)},
    # 4: a call to a function the row's tools do not name
    {"conversations": [h("Book me a flight to Oslo."), fc(call("book_flight", to="Oslo")), obs('{"ok": true}'),
                       gpt("Booked.")], "tools": json.dumps(SPECS)},
    # 5: a tool result with no call before it
    {"conversations": [h("Weather in Lima?"), obs('{"temperature": 20}'), gpt("20 degrees.")],
     "tools": json.dumps(SPECS)},
    # 6: a function_call that is no JSON at all
    {"conversations": [h("Weather in Kyiv?"), fc("get_weather(Kyiv)"), obs("{}"), gpt("No idea.")],
     "tools": json.dumps(SPECS)},
    # 7: no tools, no calls: a plain conversation, as before
    {"conversations": [h("Say hi."), gpt("Hi!")], "tools": ""},
    # 8: a call that ends the conversation (what the model should do next), no tools given: any name goes
    {"conversations": [h("Weather in Madrid?"), fc(call("get_weather", city="Madrid"))], "tools": ""},
]  # fmt: skip
GLAIVE_REJECTS = {3: "bad_tool_arguments", 4: "unknown_tool", 5: "bad_turn_order", 6: "bad_tool_arguments"}

# OpenAI chat rows: assistant tool_calls (arguments a JSON string or an object), tool messages, a tools list
OPENAI = [
    # 0: arguments as OpenAI writes them (a JSON string), content null
    {"messages": [{"role": "system", "content": "You answer travel questions."},
                  {"role": "user", "content": "What is the weather in Oslo?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [openai_call("get_weather", '{"city": "Oslo"}', "call_1")]},
                  {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temperature": 3}'},
                  {"role": "assistant", "content": "It is 3 degrees in Oslo."}],
     "tools": OPENAI_SPECS},
    # 1: reasoning_content with two parallel calls (objects), two results, then a second user turn and call
    {"messages": [{"role": "user", "content": "Weather and time in Bergen?"},
                  {"role": "assistant", "content": "", "reasoning_content": "Two questions: two calls.",
                   "tool_calls": [openai_call("get_weather", {"city": "Bergen"}, "a"),
                                  openai_call("get_time", {"city": "Bergen"}, "b")]},
                  {"role": "tool", "tool_call_id": "a", "content": '{"temperature": 5}'},
                  {"role": "tool", "tool_call_id": "b", "content": {"time": "14:00"}},
                  {"role": "assistant", "content": "<think>\nBoth known.\n</think>\n\nBergen: 5 degrees, 14:00."},
                  {"role": "user", "content": "And Oslo?"},
                  {"role": "assistant", "content": None, "reasoning_content": "Only the weather.",
                   "tool_calls": [openai_call("get_weather", {"city": "Oslo"}, "c")]},
                  {"role": "tool", "tool_call_id": "c", "content": '{"temperature": 3}'},
                  {"role": "assistant", "content": "Oslo: 3 degrees.", "reasoning_content": "Report it."}],
     "tools": OPENAI_SPECS},
    # 2: text and a call in one turn; bare specs in the tools list
    {"messages": [{"role": "user", "content": "Time in Paris?"},
                  {"role": "assistant", "content": "Let me check.",
                   "tool_calls": [openai_call("get_time", {"city": "Paris"}, "x")]},
                  {"role": "tool", "content": '{"time": "09:30"}'},
                  {"role": "assistant", "content": "09:30 in Paris."}],
     "tools": SPECS},
    # 3: arguments that are no JSON
    {"messages": [{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [openai_call("get_weather", '{"city": "Rome"', "r")]},
                  {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "Unknown."}],
     "tools": OPENAI_SPECS},
    # 4: a call to a function not in the row's tools
    {"messages": [{"role": "user", "content": "Book a flight."},
                  {"role": "assistant", "content": None, "tool_calls": [openai_call("book_flight", "{}", "f")]},
                  {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "Booked."}],
     "tools": OPENAI_SPECS},
    # 5: a tool message with no call before it
    {"messages": [{"role": "user", "content": "Weather in Lima?"}, {"role": "tool", "content": '{"temperature": 20}'},
                  {"role": "assistant", "content": "20 degrees."}],
     "tools": OPENAI_SPECS},
    # 6: tools given, none called: the model sees them and answers
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
     "tools": OPENAI_SPECS},
    # 7: no tools: a plain row, unchanged
    {"messages": [{"role": "user", "content": "Say bye."}, {"role": "assistant", "content": "Bye!"}]},
]  # fmt: skip
OPENAI_REJECTS = {3: "bad_tool_arguments", 4: "unknown_tool", 5: "bad_turn_order"}

PHRASES = [json.dumps(SPECS), *(json.dumps(r) for r in GLAIVE + OPENAI), "system user assistant tool"]
CORPUS = PHRASES * 5


def template(name: str) -> str:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (the shared chat templates are not checked out)")
    return path.read_text()


@pytest.fixture(scope="module")
def qwen3():
    return bpe_tokenizer(CORPUS, QWEN3_SPECIAL, template("qwen3.jinja"), added=QWEN3_ADDED,
                         eos_token="<|im_end|>", pad_token="<|endoftext|>")  # fmt: skip


@pytest.fixture(scope="module")
def llama31():
    """Llama 3.1 Instruct: Meta's template (tools in the first user turn, one call a turn), EOS <|eot_id|>."""
    return bpe_tokenizer(CORPUS, LLAMA3_SPECIAL, template("llama3_1_instruct.jinja"), bos="<|begin_of_text|>",
                         eos_token="<|eot_id|>")  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- labels, found independently of chat_render

QWEN3_TURN = ("<|im_start|>assistant\n", "<|im_end|>")
LLAMA3_TURN = ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")


def assistant_spans(text: str, turn: tuple[str, str], train_on: str) -> list[tuple[int, int]]:
    """The characters of each assistant turn in a render: after its header to its end-of-turn token, inclusive."""
    header, end = turn
    spans = []
    for m in re.finditer(re.escape(header), text):
        stop = text.index(end, m.end()) + len(end)
        spans.append((m.end(), stop))
    return spans if train_on == "all" else spans[-1:]


def expected_labels(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Each token of ``text`` labelled with its id inside a span, IGNORE outside; no token may cross a span's edge."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        inside = any(s <= a and b <= e for s, e in spans)
        assert inside or not any(a < s < b or a < e < b for s, e in spans), (text[a:b], spans)
        labels.append(token if inside else IGNORE)
    return labels


def check_example(tokenizer, messages: list[dict], ex: dict, turn: tuple[str, str], train_on: str, **kwargs) -> None:
    """ids: apply_chat_template(messages, tools=tools); labels: the assistant turns train_on selects, token by token
    (the last from the end of its generation prompt: Qwen3's empty think block under enable_thinking false is the
    prompt's)."""
    turns, tools = template_inputs(messages)
    assert ex["input_ids"] == tokenizer.apply_chat_template(turns, tools=tools, **kwargs)["input_ids"]
    text = tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, **kwargs)
    prompt_text = tokenizer.apply_chat_template(turns[:-1], tools=tools, add_generation_prompt=True, tokenize=False,
                                                **kwargs)  # fmt: skip
    *spans, (start, end) = assistant_spans(text, turn, train_on)
    assert text.startswith(prompt_text) and start <= len(prompt_text)
    assert ex["labels"] == expected_labels(tokenizer, text, [*spans, (len(prompt_text), end)])
    prompt = tokenizer.apply_chat_template(turns[:-1], tools=tools, add_generation_prompt=True, **kwargs)["input_ids"]
    assert ex["prompt_length"] == len(prompt) and ex["input_ids"][: len(prompt)] == prompt


def token_id(tokenizer, text: str) -> int:
    (k,) = tokenizer(text, add_special_tokens=False)["input_ids"]
    return k


# ---------------------------------------------------------------- mapping


def test_both_formats_map_to_openai_tool_turns():
    """A ShareGPT function_call/observation pair and an OpenAI tool_calls/tool pair become the same turns: the call
    on the assistant turn (arguments a JSON object, from a string or not), the result a tool turn, the specs on the
    first turn as OpenAI's {type: function, function} entries."""
    sharegpt = {"conversations": [h("Weather in Oslo?"), fc(call("get_weather", city="Oslo")), obs("3"), gpt("3.")],
                "tools": json.dumps(SPECS)}  # fmt: skip
    openai = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [openai_call("get_weather", '{"city":"Oslo"}', "1")]},
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "3."},
        ],
        "tools": OPENAI_SPECS,
    }
    ((a, problem_a),) = to_examples(sharegpt, "sharegpt", column_names("sharegpt", {}))
    ((b, problem_b),) = to_examples(openai, "chat", column_names("chat", {}))
    assert problem_a is problem_b is None
    expected_call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    assert a == [
        {"role": "user", "content": "Weather in Oslo?", "tools": OPENAI_SPECS},
        {"role": "assistant", "content": "", "tool_calls": [expected_call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3."},
    ]
    assert b[1]["tool_calls"] == [{"id": "1"} | expected_call]
    assert content_hash(a) == content_hash(b)  # the call's id is no part of the row's identity
    rome = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    other = [a[0], a[1] | {"tool_calls": [rome]}, *a[2:]]
    assert content_hash(other) != content_hash(a)  # the arguments are
    assert content_hash([{"role": "user", "content": "Weather in Oslo?"}, *a[1:]]) != content_hash(a)  # so are tools


def test_reasoning_is_kept_with_tool_calls_and_plain_rows_are_unchanged():
    (([_, call_turn, *_], _),) = to_examples(OPENAI[1], "chat", column_names("chat", {}))
    assert call_turn["reasoning_content"] == "Two questions: two calls."
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo",
                                                              "reasoning_content": "greet"}]}  # fmt: skip
    ((messages, _),) = to_examples(plain, "chat", column_names("chat", {}))
    assert messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]  # as before


def test_the_readme_examples_map_to_tool_conversations():
    """config/README.md's example row of each shape (its "Tool calls" section) reads without a reject."""
    readme = (Path(__file__).resolve().parents[2] / "config" / "README.md").read_text()
    section = readme[readme.index("### Tool calls") : readme.index("## Chat templates")]
    rows = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]
    assert len(rows) == 2
    shapes = zip(rows, ("chat", "sharegpt"), strict=True)
    mapped = [to_examples(row, mapping, column_names(mapping, {})) for row, mapping in shapes]
    (([a, *_], problem_a),), (([b, *_], problem_b),) = mapped
    assert problem_a is problem_b is None
    assert a["tools"][0]["function"]["name"] == b["tools"][0]["function"]["name"] == "get_weather"


def test_reason_codes_are_listed():
    assert {"bad_tool_arguments", "unknown_tool", "bad_turn_order"} <= set(REASONS)
    readme = (Path(__file__).resolve().parents[2] / "config" / "README.md").read_text()
    assert all(f"`{reason}`" in readme for reason in ("bad_tool_arguments", "unknown_tool"))


# ---------------------------------------------------------------- split and tokenization, row for row


def tokenize_all(tokenizer, out: dict, tmp: Path, train_on: str) -> dict:
    """Every output shard of a split through tokenize_shard: {content_hash: example}, and the rejects' reasons."""
    examples = {}
    for k, shard in enumerate([*out["splits"], out["eval"]]):
        if not pq.read_metadata(shard).num_rows:
            continue
        tokens, rejects = tmp / f"tokens{k}.parquet", tmp / f"rejects{k}.parquet"
        tokenize_shard(tokenizer, shard, tokens, 4096, "error", train_on=train_on, rejects_out=rejects)
        assert pq.read_table(rejects).num_rows == 0
        for row in pq.read_table(tokens).to_pylist():
            examples[row["content_hash"]] = row
    return examples


FILES = [(GLAIVE, GLAIVE_REJECTS, "sharegpt"), (OPENAI, OPENAI_REJECTS, "chat")]


@pytest.mark.parametrize("train_on", ["last", "all"])
@pytest.mark.parametrize(("rows", "reasons", "mapping"), FILES, ids=["glaive", "openai"])
def test_tool_rows_are_split_and_tokenized_as_qwen3_renders_them(qwen3, tmp_path, rows, reasons, mapping, train_on):
    """data.mapping auto detects each file (its tools column read); every row is tokenized or rejected with its
    reason; each tokenized row is apply_chat_template(messages, tools=tools), trained on the assistant turns
    (tool-call blocks included) and never on the tool specs, the system turn or the tool results."""
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    out = split_files(tmp_path / "split", data, nodes=2, eval_fraction=0.3)
    assert out["mapping"] == mapping and out["columns"]["tools"] == "tools"
    kept = [r for p in [*out["splits"], out["eval"]] for r in pq.read_table(p).to_pylist()]
    rejects = pq.read_table(out["rejects"]).to_pylist()
    assert out["rows_in"] == len(rows) == len(kept) + len(rejects)
    assert {r["source_row"]: r["reason"] for r in rejects} == reasons
    assert sorted(r["source_row"] for r in kept) == [i for i in range(len(rows)) if i not in reasons]
    examples = tokenize_all(qwen3, out, tmp_path, train_on)
    assert len(examples) == len(kept)  # tokenized + rejects = rows in
    call_open, call_close, response = (token_id(qwen3, t) for t in ("<tool_call>", "</tool_call>", "<tool_response>"))
    for row in kept:
        messages, ex = json.loads(row["messages"]), examples[row["content_hash"]]
        check_example(qwen3, messages, ex, QWEN3_TURN, train_on)
        trained = [y for y in ex["labels"] if y != IGNORE]
        calls = [c for t in messages if t["role"] == "assistant" for c in t.get("tool_calls", ())]
        if train_on == "all":  # every call's block is trained, open and close
            assert trained.count(call_open) == trained.count(call_close) == len(calls)
        assert response not in trained  # tool results never
        if calls or messages[0].get("tools"):
            assert response in ex["input_ids"] or not any(t["role"] == "tool" for t in messages)
            system_end = ex["input_ids"].index(token_id(qwen3, "<|im_end|>"))
            assert all(y == IGNORE for y in ex["labels"][: system_end + 1])  # the specs' turn
        if messages[0].get("tools"):
            assert qwen3("<tools>", add_special_tokens=False)["input_ids"][0] in ex["input_ids"]
        last = messages[-1]  # the held-out reference: a calling turn's calls, as the template renders them
        expected = [(c["function"]["name"], c["function"]["arguments"]) for c in last.get("tool_calls", ())]
        assert calls_in_text(ex["response"]) == expected and (expected or ex["response"] == last["content"])
    by_row = {r["source_row"]: json.loads(r["messages"]) for r in kept}
    plain = {"chat": [{"role": "user", "content": "Say bye."}, {"role": "assistant", "content": "Bye!"}],
             "sharegpt": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}  # fmt: skip
    assert by_row[len(rows) - 1 if mapping == "chat" else 7] == plain[mapping]  # a plain row: as before


def test_llama3_1_renders_tool_calls_in_its_own_layout(llama31):
    """Llama 3.1's template puts the tools in the first user turn and a call as {"name", "parameters"}: the ids and
    labels follow it. Its one call a turn: a turn with two calls is the template's raise, a template_error reject."""
    for row in (OPENAI[0], OPENAI[2]):
        ((messages, problem),) = to_examples(row, "chat", column_names("chat", {}))
        assert problem is None
        for train_on in ("last", "all"):
            (ex,) = encode_messages(llama31, [messages], ChatRenderer(llama31), train_on)
            calling = next(t for t in messages if t.get("tool_calls"))
            if calling["content"] and train_on == "all":  # Llama 3.1 drops a calling turn's text
                assert ex["reject"][0] == "turn_not_found", ex
                continue
            check_example(llama31, messages, ex, LLAMA3_TURN, train_on)
    ((parallel, _),) = to_examples(OPENAI[1], "chat", column_names("chat", {}))
    (ex,) = encode_messages(llama31, [parallel], ChatRenderer(llama31), "all")
    assert ex["reject"][0] == "template_error" and "single tool-calls" in ex["reject"][1]


# ---------------------------------------------------------------- the template must render tools


@pytest.mark.parametrize("which", ["format_template", "chat_template"])
def test_a_template_without_tools_stops_with_one_line(qwen3, tmp_path, which):
    """A plain format_template, or a Jinja template that never reads tools (Llama 3's), stops tokenization at the
    first tool row, with one line naming the template and the row: never a silent flattening."""
    out = split_files(tmp_path / "split", write_jsonl(tmp_path / "glaive.jsonl", GLAIVE), nodes=1, eval_fraction=0.01)
    tok = bpe_tokenizer(CORPUS, QWEN3_SPECIAL, None, eos_token="<|im_end|>")
    if which == "format_template":
        use_template(tok, "m", format_template="### Question:\n{question}\n### Answer:\n")
        name = "data.format_template"
    else:
        use_template(tok, "m", chat_template=str(TEMPLATES / "llama3_instruct.jinja"))
        name = "data.chat_template llama3_instruct.jinja"
    assert not renders_tools(tok.chat_template) and renders_tools(qwen3.chat_template)
    shard = out["splits"][0]
    first = min(r["source_row"] for r in pq.read_table(shard).to_pylist() if r["source_row"] != 7)  # 7: plain
    with pytest.raises(UserError) as e:
        tokenize_shard(tok, shard, tmp_path / "t.parquet", 4096, "error", template=name)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{name} cannot render tools")
    assert f"{tmp_path / 'glaive.jsonl'}: row {first} is a tool-call conversation" in message


# ---------------------------------------------------------------- data.tools: one file of specs for every row


def test_dataset_tools_file_is_given_to_rows_without_their_own(qwen3, tmp_path):
    assert SplitConfig.build({"path": "x", "tools": "specs.json"}).tools == "specs.json"  # the schema's key
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps(SPECS))
    rows = [{"conversations": [h(f"Weather in city {i}?"), fc(call("get_weather", city=f"c{i}")), obs("1"),
                               gpt(f"It is 1 degree in city {i}.")]} for i in range(4)]  # fmt: skip
    rows.append({"conversations": [h("Fly?"), fc(call("book_flight")), obs("1"), gpt("Done.")]})  # not in the file
    rows.append({"conversations": [h("Time?"), fc(call("clock")), obs("1"), gpt("Noon.")],
                 "tools": json.dumps([{"name": "clock", "parameters": {}}])})  # its own tools win  # fmt: skip
    out = split_files(tmp_path / "split", write_jsonl(tmp_path / "d.jsonl", rows), nodes=1, tools=str(specs))
    kept = [r for p in [*out["splits"], out["eval"]] for r in pq.read_table(p).to_pylist()]
    rejects = pq.read_table(out["rejects"]).to_pylist()
    assert [(r["source_row"], r["reason"]) for r in rejects] == [(4, "unknown_tool")]
    for row in kept:
        messages = json.loads(row["messages"])
        own = row["source_row"] == 5
        assert messages[0]["tools"] == ([{"type": "function", "function": {"name": "clock", "parameters": {}}}]
                                        if own else OPENAI_SPECS)  # fmt: skip
    examples = tokenize_all(qwen3, out, tmp_path, "all")
    for row in kept:
        check_example(qwen3, json.loads(row["messages"]), examples[row["content_hash"]], QWEN3_TURN, "all")


def test_a_bad_tools_file_is_one_line(tmp_path):
    for text, why in (
        ("{", "is not JSON"),
        ('{"name": "f"}', "not a list"),
        ('[{"description": "x"}]', "no function name"),
    ):
        path = tmp_path / "t.json"
        path.write_text(text)
        with pytest.raises(UserError, match=why) as e:
            load_tools(str(path))
        assert str(e.value).startswith("data.tools: ") and "\n" not in str(e.value)
    with pytest.raises(UserError, match="cannot read"):
        load_tools(str(tmp_path / "absent.json"))


def test_parse_time_check_of_data_tools(tmp_path):
    """At parse time (rules/common.smk): data.tools read, and a template known without the tokenizer checked."""
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps(SPECS))
    check_tools_config(None, None, "### Q:\n{question}\n### A:\n")  # no data.tools: nothing to check
    check_tools_config(str(specs), str(TEMPLATES / "qwen3.jinja"), None)
    check_tools_config(str(specs), None, None)  # the tokenizer's own: tokenization checks it at the first tool row
    for chat, fmt, name in ((None, "### Q:\n{question}\n### A:\n", "data.format_template"),
                            (str(TEMPLATES / "llama3_instruct.jinja"), None, "data.chat_template")):  # fmt: skip
        if chat:
            template(Path(chat).name)
        with pytest.raises(UserError) as e:
            check_tools_config(str(specs), chat, fmt)
        assert str(e.value).startswith(name) and f"data.tools ({specs})" in str(e.value)


def test_parse_time_check_of_the_base_models_own_template(tmp_path):
    """With data.tools, the base model's own template (its folder's tokenizer_config.json or chat_template.jinja)
    is checked at parse time too: Llama 3's cannot render tools, Qwen3's can; a folder without one says nothing."""
    from workflow_scripts.data.chat_format import chat_template_text
    from workflow_scripts.data.tool_calls import check_model_template_renders_tools

    def check(tools, folder, source):
        check_model_template_renders_tools(tools, chat_template_text(folder), source)

    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps(SPECS))
    qwen, llama, bare = (tmp_path / name for name in ("qwen", "llama", "bare"))
    for folder in (qwen, llama, bare):
        folder.mkdir()
    (qwen / "chat_template.jinja").write_text((TEMPLATES / "qwen3.jinja").read_text())
    template_text = (TEMPLATES / "llama3_instruct.jinja").read_text()
    (llama / "tokenizer_config.json").write_text(json.dumps({"chat_template": template_text}))
    (bare / "tokenizer_config.json").write_text("{}")
    check(str(specs), qwen, "model.name_or_path q")
    check(str(specs), bare, "model.name_or_path b")
    check(None, llama, "model.name_or_path l")  # no data.tools: nothing to check
    with pytest.raises(UserError) as e:
        check(str(specs), llama, "model.name_or_path meta/llama3")
    assert str(e.value).startswith("model.name_or_path meta/llama3's chat template cannot render tools")
    assert f"data.tools ({specs})" in str(e.value) and "\n" not in str(e.value)


def test_special_and_control_text_in_calls_and_specs_is_found(qwen3):
    """data.special_text and data.control_chars look into the calls, the specs and the reasoning too: a literal
    <|im_end|> in a call's arguments would be read as the end of the turn."""
    bad = openai_call("get_weather", {"city": "Oslo<|im_end|>"}, "1")
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "", "tool_calls": [bad]},
                        {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3."}],
           "tools": OPENAI_SPECS}  # fmt: skip
    ((messages, _),) = to_examples(row, "chat", column_names("chat", {}))
    assert SpecialText(special_texts(qwen3), "reject")(messages)[1] == (
        "special_text",
        "assistant turn 1 contains <|im_end|> as text, which the tokenizer reads as that special token"
        " (data.special_text: strip or escape keeps such rows)",
    )
    stripped, _ = SpecialText(special_texts(qwen3), "strip")(messages)
    assert stripped[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert stripped[0]["tools"] == OPENAI_SPECS and stripped[2:] == messages[2:]
    spec = [{"type": "function", "function": {"name": "f\x00", "parameters": {}}}]
    nul = [messages[0] | {"tools": spec}, *messages[1:]]
    assert ControlChars("reject")(nul)[1][0] == "control_chars"
    assert ControlChars("strip")(nul)[0][0]["tools"][0]["function"]["name"] == "f"


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}


@pytest.mark.parametrize(
    ("roles", "detail"),
    [
        (["assistant"], "assistant turn 0 opens the conversation: a user turn comes first"),
        (
            ["user", "calls", "user"],
            "user turn 2 follows a call with no tool result, which the assistant has not answered",
        ),
        (["user", "calls", "tool", "tool", "assistant"], "tool turn 3 has no call before it to answer"),
        (["user", "calls", "tool"], "the conversation does not end with an assistant turn"),
        (["user", "assistant", "assistant"], "assistant turn 2 follows an answer"),
        (["system", "user", "system"], "system turn 2: only the first turn may be a system turn"),
        (["system", "user", "calls"], None),  # a conversation may end with a call
        (["user", "calls", "assistant"], "assistant turn 2 follows a call with no tool result"),
    ],
)
def test_turn_order_of_tool_conversations(roles, detail):
    from workflow_scripts.data.tool_calls import check_order

    turns = [{"role": "assistant", "content": "", "tool_calls": [CALL]} if r == "calls" else {"role": r, "content": "x"}
             for r in roles]  # fmt: skip
    assert check_order(turns) == (detail and ("bad_turn_order", detail))


@pytest.mark.parametrize("key", ["format_template", "chat_template"])
def test_the_stop_from_the_command_line_is_one_line(qwen3, tmp_path, key):
    """tokenization.py's main (as the rule runs it) names the template by its config key: exit 2, one line."""
    from conftest import run_main, tokenize_config

    from workflow_scripts.data.tokenization import main

    out = split_files(tmp_path / "split", write_jsonl(tmp_path / "glaive.jsonl", GLAIVE), nodes=1, eval_fraction=0.01)
    qwen3.save_pretrained(tmp_path / "tok")
    value = "### Q:\n{question}\n### A:\n" if key == "format_template" else str(TEMPLATES / "llama3_instruct.jinja")
    argv = ["--shard", str(out["splits"][0]), "--tokenizer", str(tmp_path / "tok"),
            "--config", tokenize_config(**{key: value}), "--output", str(tmp_path / "t.parquet"),
            "--packing", str(tmp_path / "p.parquet"), "--stats", str(tmp_path / "s.json")]  # fmt: skip
    proc = run_main(main, argv)
    name = "data.format_template" if key == "format_template" else f"data.chat_template {value}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{name} cannot render tools" in lines[0] and "is a tool-call conversation" in lines[0]


def test_a_tool_chain_without_thinking(qwen3):
    """enable_thinking false: each turn's generation prompt ends in an empty think block the whole render gives no
    earlier turn, and an earlier chain's reasoning is dropped once the user speaks again; every turn is still found
    where the conversation renders it (after its header), the last after its generation prompt."""
    row = json.loads(json.dumps(OPENAI[1]))
    for turn in row["messages"][6:]:
        turn.pop("reasoning_content", None)  # reasoning in the last query's turns: a prompt_mismatch without thinking
    ((messages, problem),) = to_examples(row, "chat", column_names("chat", {}))
    assert problem is None and messages[1]["reasoning_content"]
    for train_on in ("last", "all"):
        (ex,) = encode_messages(qwen3, [messages], ChatRenderer(qwen3, {"enable_thinking": False}), train_on)
        check_example(qwen3, messages, ex, QWEN3_TURN, train_on, enable_thinking=False)
