"""split_dataset: readers, mappings, validation with quarantine, stable assignment, one-line errors."""

import json
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import REPO, split_files, tokenize_config, tool_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.data.identity import content_hash, is_eval, node_by_hash
from workflow_scripts.data.mappings import CONTROL_CHARS, check_columns, column_names, to_examples
from workflow_scripts.data.readers import iter_records

SHARED = REPO.parent / "shared" / "data"


def read(paths) -> pd.DataFrame:
    return pd.concat([pq.read_table(p).to_pandas() for p in paths], ignore_index=True)


def kept_and_rejected(out) -> tuple[pd.DataFrame, pd.DataFrame]:
    return read([*out["splits"], out["eval"]]), pq.read_table(out["rejects"]).to_pandas()


def assert_accounted(out, rows_in: int) -> None:
    kept, rejects = kept_and_rejected(out)
    assert out["rows_in"] == rows_in == len(kept) + len(rejects)
    assert kept["content_hash"].is_unique


# ---------------------------------------------------------------- hashing and assignment


def test_content_hash_ignores_whitespace_only():
    a = [{"role": "user", "content": "what  is\n1+1?"}, {"role": "assistant", "content": "2"}]
    b = [{"role": "user", "content": "what is 1+1? "}, {"role": "assistant", "content": " 2"}]
    c = [{"role": "user", "content": "what is 1+1?"}, {"role": "assistant", "content": "3"}]
    assert content_hash(a) == content_hash(b) != content_hash(c)


def test_assignment_is_deterministic_and_respects_fraction():
    hashes = [f"{i:064x}" for i in range(4000)]
    share = sum(is_eval(h, 7, 0.1) for h in hashes) / len(hashes)
    assert 0.08 < share < 0.12
    assert {node_by_hash(h, 7, 3) for h in hashes} == {0, 1, 2}
    assert [node_by_hash(h, 7, 3) for h in hashes] == [node_by_hash(h, 7, 3) for h in hashes]
    assert [node_by_hash(h, 7, 3) for h in hashes] != [node_by_hash(h, 8, 3) for h in hashes]


# ---------------------------------------------------------------- formats and mappings


def test_readers_agree_across_formats(tmp_path):
    data = pd.DataFrame({"question": ["a", 'b\nwith newline, comma "quoted"'], "response": ["007", "x"]})
    data.to_csv(tmp_path / "d.csv", index=False)
    data.to_csv(tmp_path / "d.tsv", index=False, sep="\t")
    data.to_csv(tmp_path / "semi.txt", index=False, sep=";")
    data.to_json(tmp_path / "d.jsonl", orient="records", lines=True)
    data.to_json(tmp_path / "d.json", orient="records")
    data.to_parquet(tmp_path / "d.parquet")
    cases = [("d.csv", "auto", None), ("d.tsv", "auto", None), ("semi.txt", "csv", ";")]
    cases += [("d.jsonl", "auto", None), ("d.json", "auto", None), ("d.parquet", "auto", None)]
    for name, fmt, delim in cases:
        (batch,) = list(iter_records(str(tmp_path / name), fmt, delim))
        assert [r.fields["question"] for r in batch] == ["a", 'b\nwith newline, comma "quoted"'], name
        assert [r.fields["response"] for r in batch] == ["007", "x"], name  # text stays text


def test_json_arrays_stream_in_batches(tmp_path):
    rows = [{"question": f"q{i}", "response": f"r{i}", "score": i / 2} for i in range(10)]
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}))
    batches = list(iter_records(str(tmp_path / "wrapped.json"), batch_rows=4))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [r.fields["question"] for b in batches for r in b] == [f"q{i}" for i in range(10)]
    # streamed: the batches before a broken tail arrive before the error
    (tmp_path / "broken.json").write_text(json.dumps(rows)[:-40])
    records = iter_records(str(tmp_path / "broken.json"), batch_rows=4)
    assert len(next(records)) == 4
    with pytest.raises(UserError, match=r"broken.json: cannot read as JSON"):
        list(records)
    (tmp_path / "scalar.json").write_text('{"data": 3}')
    with pytest.raises(UserError, match=r"scalar.json: a JSON file must hold an array of objects"):
        list(iter_records(str(tmp_path / "scalar.json")))


def test_folder_and_glob_read_every_file_in_order(tmp_path):
    for i in range(3):
        pd.DataFrame({"question": [f"q{i}"], "response": ["r"]}).to_csv(tmp_path / f"part{i}.csv", index=False)
    by_folder = [r.fields["question"] for b in iter_records(str(tmp_path)) for r in b]
    by_glob = [r.fields["question"] for b in iter_records(str(tmp_path / "part*.csv")) for r in b]
    assert by_folder == by_glob == ["q0", "q1", "q2"]


@pytest.mark.parametrize(
    "mapping,fields,expected",
    [
        ("columns", {"prompt": "Be brief.", "question": "2+2?", "response": "4"},
         [("system", "Be brief."), ("user", "2+2?"), ("assistant", "4")]),
        ("columns", {"prompt": "", "question": "2+2?", "response": "4"}, [("user", "2+2?"), ("assistant", "4")]),
        ("alpaca", {"instruction": "Add.", "input": "2 and 2", "output": "4"},
         [("user", "Add.\n\n2 and 2"), ("assistant", "4")]),
        ("alpaca", {"instruction": "Say hi.", "input": "", "output": "hi"}, [("user", "Say hi."), ("assistant", "hi")]),
        ("chat", {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                               {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                               {"role": "assistant", "content": "d"}]},
         [("system", "S"), ("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]),
    ],
    ids=["seed000", "seed000-no-system", "alpaca", "alpaca-no-input", "chat-multiturn"],
)  # fmt: skip
def test_mappings(mapping, fields, expected):
    ((messages, problem),) = to_examples(fields, mapping, column_names(mapping, {}))
    assert problem is None
    assert [(t["role"], t["content"]) for t in messages] == expected


def test_prompt_completion_is_a_columns_mapping():
    names = column_names("columns", {"prompt": None, "question": "prompt", "response": "completion"})
    ((messages, _),) = to_examples({"prompt": "Q", "completion": "A"}, "columns", names)
    assert [(t["role"], t["content"]) for t in messages] == [("user", "Q"), ("assistant", "A")]


def test_nested_instances_expand_to_one_example_each():
    fields = {"instruction": "Translate.", "instances": [{"input": "hola", "output": "hello"},
                                                        {"input": "", "output": "hi"}, {"input": "x"}]}  # fmt: skip
    out = to_examples(fields, "nested", column_names("nested", {}))
    assert out[0][0][0]["content"] == "Translate.\n\nhola" and out[0][0][1]["content"] == "hello"
    assert out[1][0][0]["content"] == "Translate."
    assert out[2] == (None, ("missing_field", "an instance has no 'output'"))


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/data not present")
def test_shared_self_instruct_data_splits_with_every_row_accounted(tmp_path):
    rows = sum(len(json.loads(line)["instances"]) for line in (SHARED / "self_instruct_seed_tasks.jsonl").open())
    out = split_files(tmp_path, SHARED / "self_instruct_seed_tasks.jsonl", mapping="nested")
    assert_accounted(out, rows)
    kept, _ = kept_and_rejected(out)
    assert any("\u2019" in m or "é" in m for m in kept["messages"])  # non-ASCII survives


# ---------------------------------------------------------------- rejects


def test_every_reject_reason_is_recorded(tmp_path):
    good = [{"question": f"q{i}", "response": f"a{i}"} for i in range(40)]
    lines = [json.dumps(r) for r in good]
    lines += [
        json.dumps({"question": "q1", "response": "a1"}),  # duplicate
        json.dumps({"question": "blank", "response": "  "}),  # empty_response
        json.dumps({"question": "no answer"}),  # missing_field
        '{"question": "broken json",',  # invalid_json
        json.dumps({"question": "long " * 400, "response": "x"}),  # too_long
    ]
    data = tmp_path / "d.jsonl"
    data.write_bytes("\n".join(lines).encode() + b'\n{"question": "bad \xff", "response": "x"}\n')  # invalid_utf8
    chat = tmp_path / "chat.jsonl"
    good_chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat.write_text(
        json.dumps({"messages": [{"role": "assistant", "content": "first"}]})
        + "\n"
        + json.dumps({"messages": good_chat})
    )
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps({"question": "q3", "response": "something else"}) + "\n")

    from workflow_scripts.model.demo_model import train_tokenizer

    tok_dir = tmp_path / "tok"
    train_tokenizer(["long q a x system user assistant"] * 10, 300).save_pretrained(tok_dir)
    out = split_files(tmp_path / "o", data, tokenizer=str(tok_dir), eval_data=str(held_out))
    assert_accounted(out, len(lines) + 1 + 1)  # + the invalid UTF-8 row + the eval file's row
    _, rejects = kept_and_rejected(out)
    reasons = rejects.set_index("source_row")["reason"].to_dict()
    assert reasons == {3: "eval_overlap", 40: "duplicate", 41: "empty_response", 42: "missing_field",
                       43: "invalid_json", 45: "invalid_utf8"}  # fmt: skip
    assert rejects["record"].notna().all()  # the rejected input is kept
    assert set(rejects["source_file"]) == {str(data)}
    # the length policy is tokenization's: the long row is left out there as too_long, with its file and row
    from workflow_scripts.data.tokenization import main as tokenize

    node = next(p for p in out["splits"] if "long " in str(pq.read_table(p).column("messages").to_pylist()))
    stats = tmp_path / "t.json"
    tokenize(["--config", tokenize_config(max_seq_len=200, overlength="drop"), "--shard", str(node),
              "--tokenizer", str(tok_dir), "--output", str(tmp_path / "t.parquet"),
              "--packing", str(tmp_path / "t.packing.parquet"), "--stats", str(stats)])  # fmt: skip
    (too_long,) = pq.read_table(tmp_path / "t.rejects.parquet").to_pylist()
    assert (too_long["source_file"], too_long["source_row"], too_long["reason"]) == (str(data), 44, "too_long")
    chat_out = split_files(tmp_path / "c", chat, mapping="chat")
    assert pq.read_table(chat_out["rejects"]).column("reason").to_pylist() == ["bad_turn_order"]


def test_truncate_keeps_and_error_stops(tmp_path):
    from workflow_scripts.data.tokenization import tokenize_shard
    from workflow_scripts.model.demo_model import train_tokenizer

    tok = train_tokenizer(["long q a x system user assistant"] * 10, 300)
    data = tmp_path / "d.csv"
    pd.DataFrame({"question": ["short", "long"], "response": ["a", "long " * 300]}).to_csv(data, index=False)
    out = split_files(tmp_path / "t", data, nodes=1, eval_fraction=1e-9)
    assert out["rows_in"] == 2 and out["rows"][0] == 2  # the split keeps both: the length policy is tokenization's
    _, stats = tokenize_shard(tok, out["splits"][0], tmp_path / "t" / "tok.parquet", 100, "truncate")
    assert stats["examples"] == 2 and stats["truncated"] == 1
    with pytest.raises(UserError, match=r"d.csv: row 1 has \d+ tokens, above data.max_seq_len=100"):
        tokenize_shard(tok, out["splits"][0], tmp_path / "e" / "tok.parquet", 100, "error")
    assert not list((tmp_path / "e").iterdir())  # nothing half-written


def test_max_reject_fraction_names_the_reasons(tmp_path):
    data = tmp_path / "d.csv"
    pd.DataFrame({"question": ["a", "b", "c", "d"], "response": ["1", "", "", "4"]}).to_csv(data, index=False)
    with pytest.raises(UserError, match=r"2 of 4 rows rejected \(\{'empty_response': 2\}\), above"):
        split_files(tmp_path / "o", data, max_reject_fraction=0.25)
    assert not list((tmp_path / "o").iterdir())


# ---------------------------------------------------------------- splitting


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(
        st.tuples(st.sampled_from(["", "sys"]), st.text(max_size=12), st.text(max_size=6)), min_size=1, max_size=60
    ),
    nodes=st.integers(1, 4),
    balance=st.sampled_from(["rows", "tokens"]),
)
def test_no_row_is_lost_or_duplicated(tmp_path_factory, rows, nodes, balance):
    tmp = tmp_path_factory.mktemp("prop")
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "question": q, "response": r}) + "\n" for p, q, r in rows))
    out = split_files(tmp, data, nodes=nodes, balance=balance, eval_fraction=0.3) if any(
        q.strip() and r.strip() and not CONTROL_CHARS.search(q + r) for _, q, r in rows
    ) else None  # fmt: skip
    if out is None:
        with pytest.raises(UserError, match="no usable rows"):
            split_files(tmp / "none", data, nodes=nodes)
        return
    kept, rejects = kept_and_rejected(out)
    assert len(kept) + len(rejects) == len(rows)
    assert sorted(kept["source_row"].tolist() + rejects["source_row"].tolist()) == list(range(len(rows)))


@pytest.mark.parametrize("balance", ["rows", "tokens"])
def test_appending_rows_keeps_assignments(tmp_path, balance):
    rows = [{"question": f"q{i}", "response": f"a{i}"} for i in range(300)]
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    before.write_text("".join(json.dumps(r) + "\n" for r in rows))
    after.write_text(
        "".join(json.dumps(r) + "\n" for r in rows + [{"question": f"n{i}", "response": "n"} for i in range(200)])
    )
    a = split_files(tmp_path / "a", before, nodes=3, balance=balance)
    b = split_files(tmp_path / "b", after, nodes=3, balance=balance)
    for old, new in zip([*a["splits"], a["eval"]], [*b["splits"], b["eval"]], strict=True):
        old_hashes = set(pq.read_table(old).column("content_hash").to_pylist())
        assert old_hashes <= set(pq.read_table(new).column("content_hash").to_pylist())


def test_token_balance_evens_out_tokens(tmp_path):
    from workflow_scripts.model.demo_model import train_tokenizer

    tok_dir = tmp_path / "tok"
    train_tokenizer(["word " * 10, "system user assistant"] * 10, 300).save_pretrained(tok_dir)
    rows = [{"question": "word " * (1 + (i * 37) % 50), "response": "x"} for i in range(400)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = split_files(tmp_path / "o", data, nodes=4, balance="tokens", tokenizer=str(tok_dir))
    tokens = out["tokens"][:4]
    assert max(tokens) - min(tokens) <= 60  # within one long row


# ---------------------------------------------------------------- errors


def test_missing_column_and_file_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match=r"column 'answer' \(data.columns.response\) not found"):
        check_columns(str(REPO / "resources/demo/instructions.csv"), "auto", "columns", {"response": "answer"})
    with pytest.raises(UserError, match="file not found"):
        check_columns(str(tmp_path / "nope.csv"), "auto", "columns", {})
    with pytest.raises(UserError, match="no file matches"):
        check_columns(str(tmp_path / "*.jsonl"), "auto", "columns", {})
    (tmp_path / "x.bin").write_text("?")
    with pytest.raises(UserError, match="cannot tell the format"):
        check_columns(str(tmp_path / "x.bin"), "auto", "columns", {})
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="bad.parquet: cannot read as Parquet"):
        check_columns(str(tmp_path / "bad.parquet"), "auto", "columns", {})


@pytest.mark.parametrize("sep, hint", [(";", 'set data.delimiter: ";"'), ("\t", "set data.delimiter: tab")])
def test_a_csv_split_on_the_wrong_delimiter_names_data_delimiter(tmp_path, sep, hint):
    """A ';' (European Excel) or tab CSV read with ',': its header is one column; the error says which key to set."""
    data = tmp_path / "d.csv"
    data.write_text(f"prompt{sep}question{sep}response\nsys{sep}q{sep}a\n")
    with pytest.raises(UserError, match="column 'question' .*not found") as err:
        check_columns(str(data), "auto", "columns", {})
    assert str(err.value).endswith(hint + ")"), err.value
    check_columns(str(data), "auto", "columns", {}, sep)  # with the delimiter set: found
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt;question": "x"}) + "\n")  # not a CSV: no hint
    with pytest.raises(UserError, match=r"the file has \['prompt;question'\]$"):
        check_columns(str(tmp_path / "d.jsonl"), "auto", "columns", {})


def test_cli_writes_outputs_and_exits_2_with_one_line(tmp_path):
    def run(columns):
        config = {"path": str(REPO / "resources/demo/instructions.csv"), "columns": columns, "nodes": 2}
        cmd = [
            sys.executable, "-m", "workflow_scripts.data.split", "--config", json.dumps(config),
            "--splits", str(tmp_path / "n0.parquet"), str(tmp_path / "n1.parquet"),
            "--eval", str(tmp_path / "e.parquet"), "--rejects", str(tmp_path / "r.parquet"),
            "--manifest", str(tmp_path / "m.json"),
        ]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, env=tool_env())

    bad = run({"question": "q"})
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "'q'" in bad.stderr
    assert not list(tmp_path.iterdir())  # nothing half-written

    ok = run({})
    assert ok.returncode == 0, ok.stderr
    manifest = json.loads((tmp_path / "m.json").read_text())
    total = sum(n["rows"] for n in manifest["nodes"]) + manifest["eval"]["rows"] + manifest["rejects"]["rows"]
    assert total == manifest["rows_in"] == 2003
    assert "INFO split: done, 2,003 rows, " in ok.stderr  # the progress line in the rule's log


def test_estimate_rows_for_progress(tmp_path):
    from workflow_scripts.data.readers import estimate_rows

    pd.DataFrame({"question": ["a", "b\nc", "d"], "response": ["x", "y", "z"]}).to_parquet(tmp_path / "p.parquet")
    assert estimate_rows(str(tmp_path / "p.parquet")) == (3, True)  # from the metadata
    (tmp_path / "d.jsonl").write_text('{"question": "a"}\n\n{"question": "b"}')  # a blank line, no final newline
    (tmp_path / "d.csv").write_text("question,response\na,x\nb,y\n")
    assert estimate_rows(str(tmp_path / "d.jsonl")) == (3, False)
    assert estimate_rows(str(tmp_path / "d.csv")) == (2, False)  # less the header
    assert estimate_rows(str(tmp_path / "*.*")) == (8, False)  # a glob: the sum
    (tmp_path / "d.json").write_text('[{"question": "a"}]')
    assert estimate_rows(str(tmp_path / "d.json")) == (None, False)


# ---------------------------------------------------------------- data.mapping: auto

AUTO_CASES = [  # (the file's rows, what auto reads them as, the conversation of the first row)
    ([{"instruction": "Add", "input": "2 and 3", "output": "5"}], "alpaca",
     [{"role": "user", "content": "Add\n\n2 and 3", "fields": {"instruction": "Add", "input": "2 and 3"}},
      {"role": "assistant", "content": "5"}]),
    ([{"instruction": "Say hi", "context": "", "response": "hi", "category": "open_qa"}], "alpaca",
     [{"role": "user", "content": "Say hi", "fields": {"instruction": "Say hi", "input": ""}},
      {"role": "assistant", "content": "hi"}]),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}], "chat",
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
    ([{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}], "sharegpt",
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
    ([{"prompt": "q", "completion": "a"}], "columns",
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
    ([{"system": "Be brief.", "question": "q", "answer": "a"}], "columns",
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}]),
    ([{"prompt": "Be brief.", "question": "q", "response": "a"}], "columns",
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}]),
    ([{"instruction": "Name it", "instances": [{"input": "", "output": "x"}]}], "nested",
     [{"role": "user", "content": "Name it", "fields": {"instruction": "Name it", "input": ""}},
      {"role": "assistant", "content": "x"}]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "mapping", "first"), AUTO_CASES, ids=[c[1] + str(i) for i, c in enumerate(AUTO_CASES)]
)
def test_auto_mapping_reads_each_format_by_its_columns(tmp_path, rows, mapping, first):
    data = tmp_path / "d.json"
    data.write_text(json.dumps(rows))
    out = split_files(tmp_path / "s", data, nodes=1, eval_fraction=1e-9)
    kept = read(out["splits"])
    assert out["mapping"] == mapping and out["rows_in"] == 1 and out["reasons"] == {}
    assert json.loads(kept["messages"][0]) == first


def test_auto_mapping_without_a_fit_and_a_wrong_mapping_say_which_key(tmp_path):
    from workflow_scripts.data.mappings import resolve_mapping

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "Add", "input": "2 and 3", "output": "5"}) + "\n")
    with pytest.raises(UserError, match=r"column 'question' .*\(its columns fit data.mapping: alpaca\)"):
        resolve_mapping(str(data), "auto", "columns", {})
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "x", "label": 1}) + "\n")
    with pytest.raises(UserError, match=r"data.mapping auto knows no format with the columns \['text', 'label'\]"):
        resolve_mapping(str(odd), "auto", "auto", {})
    # data.columns set under auto: the columns mapping, as when it was the default
    renamed = tmp_path / "r.jsonl"
    renamed.write_text(json.dumps({"q": "x", "a": "y"}) + "\n")
    mapping, names = resolve_mapping(str(renamed), "auto", "auto", {"prompt": None, "question": "q", "response": "a"})
    assert mapping == "columns" and names == {"prompt": None, "question": "q", "response": "a"}


# ---------------------------------------------------------------- a new user's mistakes (issue 37)


def test_a_row_nested_too_deep_is_an_invalid_json_reject_with_its_line(tmp_path):
    data = tmp_path / "d.jsonl"
    good = [json.dumps({"question": f"q{i}", "response": f"a{i}"}) for i in range(20)]
    deep = '{"question": ' + "[" * 10_000 + "]" * 10_000 + ', "response": "x"}'
    data.write_text("\n".join([*good[:3], "", deep, *good[3:]]) + "\n")  # a blank line before it
    out = split_files(tmp_path / "o", data)
    assert_accounted(out, 21)
    (row,) = pq.read_table(out["rejects"]).to_pylist()
    assert (row["reason"], row["source_row"], row["line"]) == ("invalid_json", 3, 5)
    assert "nested deeper" in row["detail"]
    array = tmp_path / "d.json"  # a JSON array's item: read (ijson), then too deep for the mapping
    array.write_text("[" + ",".join([*good, deep]) + "]")
    out = split_files(tmp_path / "a", array)
    assert_accounted(out, 21)
    (row,) = pq.read_table(out["rejects"]).to_pylist()
    assert (row["reason"], row["source_row"]) == ("invalid_json", 20) and "nested deeper" in row["detail"]


def test_reject_lines_are_the_files_1_based_lines(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('\n{"question": "a", "response": "1"}\n\n{"question": "b", "response": ""}\n')
    csv = tmp_path / "d.csv"
    csv.write_text("question,response\na,1\nb,\n")
    for data in (jsonl, csv):
        (row,) = pq.read_table(split_files(tmp_path / data.suffix[1:], data)["rejects"]).to_pylist()
        assert (row["source_row"], row["line"]) == (1, 4 if data is jsonl else 3), data


def test_a_binary_file_named_csv_is_one_line_naming_it(tmp_path):
    data = tmp_path / "d.csv"
    data.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(UserError) as e:
        check_columns(str(data), "auto", "columns", {})
    assert str(e.value).startswith(f"{data}: not a text file (")
    assert str(e.value).isprintable()
    data.write_text("question,response\n" + "".join(f"q{i},a{i}\n" for i in range(40)), encoding="utf-16")
    with pytest.raises(UserError, match="not a text file .* a UTF-16 export"):
        check_columns(str(data), "auto", "columns", {})


def test_a_split_stopped_for_its_rejects_keeps_them_outside_its_outputs(tmp_path):
    data = tmp_path / "d.csv"
    pd.DataFrame({"question": ["a", "b", "c", "d"], "response": ["1", "", "", "4"]}).to_csv(data, index=False)
    kept = tmp_path / "logs" / "split_dataset.rejects.jsonl"
    with pytest.raises(UserError, match=f"above data.max_reject_fraction=0.25; the rejects are in {kept}$"):
        split_files(tmp_path / "o", data, max_reject_fraction=0.25, kept_rejects=kept)
    assert not list((tmp_path / "o").iterdir())
    rows = [json.loads(line) for line in kept.read_text().splitlines()]
    assert [(r["reason"], r["line"]) for r in rows] == [("empty_response", 3), ("empty_response", 4)]
    split_files(tmp_path / "o", data, kept_rejects=kept)  # a split that does not stop removes the old ones
    assert not kept.exists()


def test_rows_that_cannot_fill_the_nodes_are_refused_by_a_line_count(tmp_path):
    from workflow_scripts.data.mappings import check_rows_fill_nodes
    from workflow_scripts.data.readers import rows_at_most

    csv = tmp_path / "d.csv"
    csv.write_text("question,response\n" + "".join(f"q{i},a{i}\n" for i in range(100)))
    with pytest.raises(UserError, match=r"^data.path \S+d.csv: at most 100 rows \(its line count\) for nodes: 10000;"):
        check_rows_fill_nodes(str(csv), "auto", "columns", 10_000, separate_eval=False)
    check_rows_fill_nodes(str(csv), "auto", "columns", 99, separate_eval=False)  # 99 shards and the eval set
    with pytest.raises(UserError, match="for nodes: 100; .* each node's shard and one for the eval set"):
        check_rows_fill_nodes(str(csv), "auto", "columns", 100, separate_eval=False)
    check_rows_fill_nodes(str(csv), "auto", "columns", 100, separate_eval=True)
    check_rows_fill_nodes(str(csv), "auto", "nested", 10_000, separate_eval=False)  # a row is several examples
    assert rows_at_most(str(csv), "auto", 3, chunk=16) <= 10  # stops counting soon after the limit
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"question": "q", "response": "a"}')  # no line end
    assert rows_at_most(str(jsonl), "auto", 5) == 1


def test_the_schemas_format_and_mapping_enums_are_the_registries_keys():
    """data.format and data.mapping accept exactly the readers and mappings there are (and auto)."""
    from workflow_scripts.core.settings import schema_property
    from workflow_scripts.data.mappings import MAPPINGS
    from workflow_scripts.data.readers import READERS

    assert schema_property("data.format")["enum"] == ["auto", *READERS]
    assert schema_property("data.mapping")["enum"] == ["auto", *MAPPINGS]
