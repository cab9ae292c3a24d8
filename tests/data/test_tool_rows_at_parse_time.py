"""rules/common.smk's parse-time check of per-row tools: the first tool row among each data file's first rows
(mappings.first_tool_row), against every template known at parse time (tool_calls.check_tools_config)."""

import json

import pandas as pd
import pytest
from test_tools import GLAIVE, OPENAI, TEMPLATES, gpt, h, template, write_jsonl

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.data.tool_calls import check_tools_config


def test_parse_time_finds_the_first_tool_row_without_data_tools(tmp_path):
    """Per-row tools (no data.tools): the first tool-call conversation among each file's first rows is found at
    parse time (rules/common.smk), so a template that cannot render tools stops before any job runs, naming the
    template and that row; plain rows, or tool rows past the first rows, find nothing (tokenization checks them)."""
    from workflow_scripts.data.mappings import first_tool_row

    plain = [{"conversations": [h(f"Question {i}?"), gpt(f"Answer {i}.")]} for i in range(3)]
    data = write_jsonl(tmp_path / "glaive.jsonl", plain + GLAIVE)
    where = first_tool_row(str(data), "auto", "auto", {})
    assert where == f"{data}: row 3 is a tool-call conversation"
    openai = write_jsonl(tmp_path / "openai.jsonl", OPENAI)
    assert first_tool_row(str(openai), "auto", "auto", {}) == f"{openai}: row 0 is a tool-call conversation"
    assert first_tool_row(str(write_jsonl(tmp_path / "plain.jsonl", plain)), "auto", "auto", {}) is None
    assert first_tool_row(str(data), "auto", "auto", {}, rows=3) is None  # only the first rows are read
    # a CSV reader's batch is by bytes, many rows: still only the first ``rows`` are looked at
    csv = tmp_path / "glaive.csv"
    pd.DataFrame([{"conversations": json.dumps(r["conversations"]), "tools": r.get("tools", "")}
                  for r in plain * 20 + GLAIVE]).to_csv(csv, index=False)  # fmt: skip
    assert first_tool_row(str(csv), "auto", "auto", {}) == f"{csv}: row 60 is a tool-call conversation"
    assert first_tool_row(str(csv), "auto", "auto", {}, rows=60) is None
    with pytest.raises(UserError) as e:
        check_tools_config(None, None, "### Q:\n{question}\n### A:\n", where)
    assert str(e.value).startswith("data.format_template cannot render tools") and where in str(e.value)
    template("llama3_instruct.jinja")
    llama = str(TEMPLATES / "llama3_instruct.jinja")
    with pytest.raises(UserError) as e:
        check_tools_config(None, llama, None, where)
    assert str(e.value).startswith(f"data.chat_template {llama} cannot render tools") and "\n" not in str(e.value)
    check_tools_config(None, str(TEMPLATES / "qwen3.jinja"), None, where)  # Qwen3's renders tools
