"""split_dataset: readers, validation, deterministic and stable assignment, one-line errors."""

import json
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO, tool_env
from pipeline_io import UserError
from split import assign, check_columns, content_hash, map_columns, read_table, split_rows

COLUMNS = {"prompt": "prompt", "question": "question", "response": "response"}


def frame(rows):
    return map_columns(pd.DataFrame(rows, columns=["prompt", "question", "response"]), COLUMNS, "t.csv")


def test_content_hash_ignores_whitespace_only():
    assert content_hash("s", "what  is\n1+1?", "2") == content_hash(" s", "what is 1+1?", "2 ")
    assert content_hash("s", "what is 1+1?", "2") != content_hash("s", "what is 1+1?", "3")


def test_assign_is_deterministic_and_respects_fraction():
    hashes = [content_hash("", f"q{i}", "a") for i in range(4000)]
    first = [assign(h, 7, 0.1, 3) for h in hashes]
    assert first == [assign(h, 7, 0.1, 3) for h in hashes]
    share = sum(d == "eval" for d in first) / len(first)
    assert 0.08 < share < 0.12
    assert {d for d in first if d != "eval"} == {0, 1, 2}
    assert first != [assign(h, 8, 0.1, 3) for h in hashes]  # the seed matters


def test_every_row_ends_in_exactly_one_place_with_reasons():
    rows = [["p", f"q{i}", f"a{i}"] for i in range(50)]
    rows += [["p", "q1", "a1"], ["p", "q 1 ", " a1"], ["p", "x", ""], ["p", "", "y"], ["p", None, "z"]]
    shards, evalset, rejects = split_rows(frame(rows), 3, 0.2, 0, "t.csv")
    assert sum(map(len, shards)) + len(evalset) + len(rejects) == len(rows)
    assert rejects["reason"].value_counts().to_dict() == {"duplicate": 1, "empty_response": 1, "missing_field": 2}
    assert set(rejects["source_file"]) == {"t.csv"}
    kept = pd.concat([*shards, evalset])["content_hash"]
    assert kept.is_unique


def test_appending_rows_keeps_assignments():
    rows = [["p", f"q{i}", f"a{i}"] for i in range(200)]
    before = split_rows(frame(rows), 4, 0.1, 3)
    after = split_rows(frame(rows + [["p", f"new{i}", "n"] for i in range(100)]), 4, 0.1, 3)
    for old, new in zip([*before[0], before[1]], [*after[0], after[1]], strict=True):
        assert set(old["content_hash"]) <= set(new["content_hash"])


def test_readers_agree_across_formats(tmp_path):
    data = pd.DataFrame({"instruction": ["a", "b\nwith newline, comma"], "output": ["007", "x"]})
    data.to_csv(tmp_path / "d.csv", index=False)
    data.to_json(tmp_path / "d.jsonl", orient="records", lines=True)
    data.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.jsonl", "d.parquet"):
        got = read_table(tmp_path / name)
        assert got["instruction"].tolist() == ["a", "b\nwith newline, comma"]
        assert got["output"].tolist() == ["007", "x"]  # text stays text


def test_missing_column_and_file_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match=r"column 'answer' \(data.columns.response\) not found"):
        check_columns(REPO / "resources/demo/instructions.csv", "auto", COLUMNS | {"response": "answer"})
    with pytest.raises(UserError, match="file not found"):
        check_columns(tmp_path / "nope.csv", "auto", COLUMNS)


def test_cli_writes_outputs_and_exits_2_with_one_line(tmp_path):
    def run(columns):
        cmd = [
            sys.executable, str(REPO / "workflow_scripts/split.py"),
            "--data", str(REPO / "resources/demo/instructions.csv"), "--columns", json.dumps(columns),
            "--nodes", "2", "--eval-fraction", "0.1",
            "--splits", str(tmp_path / "n0.parquet"), str(tmp_path / "n1.parquet"),
            "--eval", str(tmp_path / "e.parquet"), "--rejects", str(tmp_path / "r.parquet"),
            "--manifest", str(tmp_path / "m.json"),
        ]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, env=tool_env())

    bad = run(COLUMNS | {"question": "q"})
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "'q'" in bad.stderr
    assert not list(tmp_path.iterdir())  # nothing half-written

    ok = run(COLUMNS)
    assert ok.returncode == 0, ok.stderr
    manifest = json.loads((tmp_path / "m.json").read_text())
    total = sum(n["rows"] for n in manifest["nodes"]) + manifest["eval"]["rows"] + manifest["rejects"]["rows"]
    assert total == manifest["source"]["rows"] == 2003
