"""Every input row is accounted for from the split through tokenization: what tokenization leaves out is in
a rejects file with its reason and counts against data.max_reject_fraction; too little data stops before
training with one line."""

import json
import logging
from collections import Counter

import pyarrow.parquet as pq
import pytest
from conftest import REPO, split_files, tokenize_config

from workflow_scripts.data.identity import content_hash
from workflow_scripts.data.mappings import column_names, to_examples
from workflow_scripts.model.demo_model import train_tokenizer

COLUMNS = {"prompt": None, "question": "prompt", "response": "completion"}  # T0-style prompt/completion
LONG = "alpha beta gamma delta " * 40  # ~160 tokens: the prompt alone fills max_seq_len 128


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    texts = ["alpha beta gamma delta question answer item system user assistant 0 1 2 3 4 5 6 7 8 9"] * 20
    train_tokenizer(texts, 300).save_pretrained(path)
    return path


def write_rows(path, n: int, long_every: int, extra: list[str] = ()) -> list[dict]:
    """``n`` prompt/completion rows, every ``long_every``-th with a prompt longer than max_seq_len."""
    rows = [
        {"prompt": (LONG if i % long_every == 0 else "") + f"question {i}", "completion": f"answer {i}"}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra))
    return rows


def split(tmp, data, tok_dir, nodes=2, *extra):
    from workflow_scripts.data.split import main

    paths = [str(tmp / f"node{i}.parquet") for i in range(nodes)]
    config = {"path": str(data), "columns": COLUMNS, "nodes": nodes, "eval_fraction": 0.2}
    main([
        "--config", json.dumps(config), "--tokenizer", str(tok_dir), "--splits", *paths,
        "--eval", str(tmp / "eval.parquet"), "--rejects", str(tmp / "rejects.parquet"),
        "--manifest", str(tmp / "manifest.json"), *extra,
    ])  # fmt: skip
    return [*paths, str(tmp / "eval.parquet")]


def tokenize(tmp, shard, tok_dir, *extra, **config):
    """tokenization.py on one split shard into tmp/tokenized/<shard>.*; returns its stats."""
    from workflow_scripts.data.tokenization import main

    name = shard.rsplit("/", 1)[-1].removesuffix(".parquet")
    out = tmp / "tokenized"
    config = {"max_seq_len": 128, "overlength": "truncate", "cache_dir": str(tmp / "cache")} | config
    main([
        "--shard", shard, "--tokenizer", str(tok_dir), "--config", tokenize_config(**config),
        "--output", str(out / f"{name}.parquet"),
        "--packing", str(out / f"{name}.packing.parquet"), "--stats", str(out / f"{name}.json"),
        "--rejects", str(out / f"{name}.rejects.parquet"), *extra,
    ])  # fmt: skip
    return json.loads((out / f"{name}.json").read_text())


def one_line_error(capsys, call) -> str:
    with pytest.raises(SystemExit) as stop:
        call()
    lines = capsys.readouterr().err.strip().splitlines()  # the stage's log, then the error
    assert stop.value.code == 2 and lines[-1].startswith("error: "), lines[-3:]
    assert not [line for line in lines[:-1] if line.startswith("error: ")], lines
    return lines[-1]


def hash_of(fields: dict) -> str | None:
    ((messages, problem),) = to_examples(fields, "columns", column_names("columns", COLUMNS))
    return None if problem else content_hash(messages)


def test_t0_like_prompts_too_long_stop_tokenization_naming_the_drop(tmp_path, tok_dir, capsys):
    """The issue's case: most prompts alone exceed max_seq_len under `overlength: truncate`."""
    data = tmp_path / "t0.jsonl"
    rows = [{"prompt": (LONG if i % 8 else "") + f"question {i}", "completion": f"answer {i}"} for i in range(120)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # 7 of 8 prompts too long
    node0 = split(tmp_path, data, tok_dir)[0]
    shard_rows = pq.read_metadata(node0).num_rows
    err = one_line_error(capsys, lambda: tokenize(tmp_path, node0, tok_dir, max_reject_fraction=0.5))
    dropped = sum(1 for r in pq.read_table(node0).to_pylist() if "alpha" in r["messages"])
    assert f"{dropped} of {shard_rows} examples" in err and "prompt_too_long" in err, err
    assert "raise data.max_seq_len to " in err and "data.max_reject_fraction" in err, err
    # the rejected rows are kept in the cache entry the message names
    listed = err.rsplit(" in ", 1)[1].removesuffix(" (the cache entry)")
    rejects = pq.read_table(listed).to_pylist()
    assert len(rejects) == dropped and {r["reason"] for r in rejects} == {"prompt_too_long"}
    # nothing left at all: a stop whatever the fraction
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in write_rows(tmp_path / "x", 30, 1)))
    only = split(tmp_path / "all", tmp_path / "all.jsonl", tok_dir, 1)[0]
    err = one_line_error(capsys, lambda: tokenize(tmp_path / "all", only, tok_dir, max_reject_fraction=1))
    assert "no example left" in err and "prompt_too_long" in err, err


def test_every_row_is_trained_or_rejected_with_its_reason(tmp_path, tok_dir, caplog):
    """rows in = tokenized + split rejects + tokenization rejects, by content hash; the report shows the funnel."""
    data = tmp_path / "d.jsonl"
    rows = write_rows(data, 120, long_every=4, extra=[json.dumps({"prompt": "question 1", "completion": "answer 1"}),
                                                     json.dumps({"prompt": "blank", "completion": " "}),
                                                     '{"prompt": "cut off'])  # fmt: skip
    shards = split(tmp_path, data, tok_dir)
    with caplog.at_level(logging.WARNING, logger="tokenize"):
        stats = {s: tokenize(tmp_path, s, tok_dir, max_reject_fraction=0.5) for s in shards}
    warned = [r.getMessage() for r in caplog.records if "left out at tokenization" in r.getMessage()]
    assert len(warned) == 3, warned  # below the fraction: a warning per shard
    tokenized = tmp_path / "tokenized"
    kept = [h for s in shards for h in pq.read_table(tokenized / s.rsplit("/", 1)[1], columns=["content_hash"])
            .column("content_hash").to_pylist()]  # fmt: skip
    dropped = [r for s in shards for r in pq.read_table(tokenized / s.rsplit("/", 1)[1].replace(".", ".rejects.", 1))
               .to_pylist()]  # fmt: skip
    split_rejects = pq.read_table(tmp_path / "rejects.parquet").to_pylist()
    # every long prompt, and only those, left out at tokenization, with source file, row and reason
    assert sorted(r["source_row"] for r in dropped) == [i for i in range(120) if i % 4 == 0]
    assert {(r["source_file"], r["reason"]) for r in dropped} == {(str(data), "prompt_too_long")}
    assert all(r["detail"] and r["content_hash"] and r["prompt_tokens"] >= 128 for r in dropped)
    assert sum(sum(s["rejected"].values()) for s in stats.values()) == len(dropped) == 30
    assert sorted(r["reason"] for r in split_rejects) == ["duplicate", "empty_response", "invalid_json"]
    # rows in = trained + every reject, by content hash (the invalid JSON row has none: counted by row)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["rows_in"] == len(rows) + 3 == len(kept) + len(dropped) + len(split_rejects)
    inputs = Counter(hash_of(r) for r in rows + [{"prompt": "question 1", "completion": "answer 1"},
                                                 {"prompt": "blank", "completion": " "}])  # fmt: skip
    rejected_by_split = [hash_of(json.loads(r["record"])) for r in split_rejects if r["reason"] != "invalid_json"]
    assert inputs == Counter(kept + [r["content_hash"] for r in dropped] + rejected_by_split)
    # a cache hit delivers the same rejects file
    again = tmp_path / "again"
    assert tokenize(again, shards[0], tok_dir, cache_dir=str(tmp_path / "cache"))["cache"] == "hit"
    name = "node0.rejects.parquet"
    assert (again / "tokenized" / name).read_bytes() == (tokenized / name).read_bytes()
    # the data report: rows in → split → left out → tokenized per shard, lengths before truncation
    from workflow_scripts.data.data_report import main as data_report

    names = [tokenized / s.rsplit("/", 1)[1] for s in shards]
    data_report(["--manifest", str(tmp_path / "manifest.json"), "--tokenized", *map(str, names),
                 "--json", str(tmp_path / "report.json"), "--plot", str(tmp_path / "o.png")])  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    funnel = report["funnel"]
    assert funnel["rows_in"] == manifest["rows_in"] and funnel["split_rejected"] == 3
    assert report["tokenize_rejects_by_reason"] == {"prompt_too_long": 30} and report["max_seq_len"] == 128
    for name, shard in funnel["shards"].items():
        assert shard["split"] == shard["tokenized"] + shard["left_out"], name
    assert sum(s["tokenized"] for s in funnel["shards"].values()) == funnel["tokenized"] == len(kept)
    assert (tmp_path / "o.png").stat().st_size > 10_000


def test_truncated_jsonl_stops_at_the_split_with_one_line(tmp_path, tok_dir, capsys):
    """The issue's case: a 2-line JSONL whose last line is cut off, nodes 2."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "question 1", "completion": "answer 1"}) + '\n{"prompt": "quest')
    err = one_line_error(capsys, lambda: split(tmp_path / "out", data, tok_dir))
    assert "d.jsonl: 1 usable row (1 rejected: {'invalid_json': 1}) make empty node0, node1 shards; " in err, err
    assert "add rows or lower `nodes` (now 2)" in err, err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # nothing half-written


def test_empty_eval_set_and_small_shards_stop_with_one_line(tmp_path, tok_dir):
    from conftest import split_files

    from workflow_scripts.core.pipeline_io import UserError

    data = tmp_path / "d.jsonl"
    write_rows(data, 40, long_every=99)
    with pytest.raises(UserError, match=r"40 usable rows make an empty eval set; raise data.eval_fraction"):
        split_files(tmp_path / "a", data, nodes=2, eval_fraction=1e-9, columns=COLUMNS, min_examples_per_shard=1)
    with pytest.raises(UserError, match=r"node\d \(\d+ rows\).* below the 30 rows one micro-batch on every rank"):
        split_files(tmp_path / "b", data, nodes=2, columns=COLUMNS, min_examples_per_shard=30)
    out = split_files(tmp_path / "c", data, nodes=2, columns=COLUMNS, min_examples_per_shard=5)
    assert all(n >= 5 for n in out["rows"][:2]) and out["rows"][2] >= 1


def test_a_shard_below_one_micro_batch_per_rank_stops_tokenization(tmp_path, tok_dir, capsys):
    data = tmp_path / "d.jsonl"
    write_rows(data, 12, long_every=99)
    node0 = split(tmp_path, data, tok_dir, 1)[0]
    stats = tokenize(tmp_path, node0, tok_dir)  # one example is enough by default
    n, bins = stats["examples"], stats["bins"]
    assert n > bins > 0
    err = one_line_error(capsys, lambda: tokenize(tmp_path, node0, tok_dir, "--min-bins", str(bins + 1)))
    assert f"{bins} packed bins ({n} examples) after tokenization, fewer than the {bins + 1}" in err, err
    assert "training.micro_batch_size" in err and "training.packing: false" in err, err
    err = one_line_error(capsys, lambda: tokenize(tmp_path, node0, tok_dir, "--min-examples", str(n + 1)))
    assert f"{n} examples after tokenization, fewer than the {n + 1}" in err and "packing" not in err, err
    assert tokenize(tmp_path, node0, tok_dir, "--min-examples", str(n), "--min-bins", str(bins))["examples"] == n


@pytest.mark.parametrize(
    "plan, trained",
    [
        ({"examples": 100, "packed_bins": None, "total_steps": 50, "global_batch": 2}, 100),  # whole epoch
        ({"examples": 100, "packed_bins": None, "total_steps": 12, "global_batch": 8}, 96),  # last partial batch
        ({"examples": 100, "packed_bins": None, "total_steps": 5, "global_batch": 4}, 20),  # max_steps
        ({"examples": 100, "packed_bins": 20, "total_steps": 5, "global_batch": 2}, 50),  # half the bins
    ],
)
def test_examples_trained_from_the_plan(plan, trained):
    from workflow_scripts.report.summarize import examples_trained

    assert examples_trained(plan) == {"examples_tokenized": 100, "examples_trained": trained}


# ---------------------------------------------------------------- formats and text users bring

SHARED = REPO.parent / "shared" / "data" / "self_instruct_seed_tasks.jsonl"


def tasks(n: int = 24) -> list[tuple[str, str, str]]:
    """(instruction, input, output) of the first ``n`` self-instruct tasks of ../shared/data (non-ASCII, empty
    inputs, multi-line outputs), or as many made-up ones where that folder is absent."""
    if not SHARED.exists():
        return [(f"Übersetze Satz {i}", f"line {i}\nzweite Zeile" * (i % 2), f"Antwort {i} — fertig") for i in range(n)]
    out = []
    for line in SHARED.open(encoding="utf-8"):
        task = json.loads(line)
        out.append((task["instruction"], task["instances"][0]["input"], task["instances"][0]["output"]))
    return out[:n]


def accounted(out, n: int) -> tuple[dict, dict]:
    """Rows in = rows out + rejects, row for row: each source row once, in a shard, the eval set or the
    rejects. Returns (kept rows, rejects) by source row."""
    kept = [r for p in [*out["splits"], out["eval"]] for r in pq.read_table(p).to_pylist()]
    rejects = pq.read_table(out["rejects"]).to_pylist()
    assert out["rows_in"] == n == len(kept) + len(rejects)
    assert sorted(r["source_row"] for r in kept + rejects) == list(range(n))
    return {r["source_row"]: r for r in kept}, {r["source_row"]: r for r in rejects}


def conversations(kept: dict) -> dict:
    return {row: json.loads(r["messages"]) for row, r in kept.items()}


def test_openai_content_parts_are_joined_and_other_parts_rejected(tmp_path):
    """The issue's case: a content list was trained as its Python repr. Text parts are joined with a newline
    (as vLLM joins them for a template that takes a string: Qwen3's and Llama 3's in ../shared/templates
    cannot take a list); an image or audio part rejects the row, naming the turn and the part's type."""
    rows = []
    for i, (instruction, extra, answer) in enumerate(tasks()):
        parts = [{"type": "text", "text": instruction}] + ([{"type": "text", "text": extra}] if extra else [])
        if i % 8 == 3:
            parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
        if i % 8 == 5:
            parts.insert(0, {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
        user = {"role": "user", "content": parts if i % 4 else instruction}  # every 4th a plain string
        system = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}] if i % 3 == 0 else []
        rows.append({"messages": [*system, user, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
    data = tmp_path / "openai.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    kept, rejects = accounted(split_files(tmp_path / "out", data, mapping="chat"), len(rows))
    for row, messages in conversations(kept).items():
        instruction, extra, answer = tasks()[row]
        user = instruction if row % 4 == 0 else "\n".join(filter(None, [instruction, extra]))
        system = [{"role": "system", "content": "Be brief."}] if row % 3 == 0 else []
        assert messages == [*system, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    assert set(rejects) == {i for i in range(len(rows)) if i % 8 in (3, 5)}
    for row, r in rejects.items():
        turn = 1 if row % 3 == 0 else 0
        kind = "image_url" if row % 8 == 3 else "input_audio"
        assert (r["reason"], r["detail"]) == (
            "unsupported_content",
            f"user turn {turn} has a '{kind}' part: only text parts are trained",
        )
        assert json.loads(r["record"]) == rows[row]  # the row itself, nothing lost


def test_sharegpt_read_named_or_detected_and_unknown_from_rejected(tmp_path):
    """ShareGPT `conversations` of {from, value}: human/gpt/system (and user/assistant) mapped to roles, by
    data.mapping: sharegpt or detected under chat; an unknown `from` rejected, naming it, and a tool result (an
    observation turn) with no call before it as bad_turn_order (well-formed tool turns: tests/data/test_tools.py)."""
    rows, roles = [], {}
    for i, (instruction, extra, answer) in enumerate(tasks()):
        user, bot = ("human", "gpt") if i % 2 else ("user", "assistant")
        turns = [
            {"from": user, "value": "\n\n".join(filter(None, [instruction, extra]))},
            {"from": bot, "value": answer},
        ]
        if i % 3 == 0:
            turns = [{"from": "system", "value": "You are helpful."}, *turns, {"from": user, "value": "Thanks!"},
                     {"from": bot, "value": "You are welcome."}]  # fmt: skip
        if i % 7 == 2:
            turns[-1]["from"] = "bing"
        if i % 7 == 4:
            turns[-1:-1] = [{"from": "observation", "value": "1"}]
        rows.append({"id": f"r{i}", "conversations": turns})
        roles[i] = [{"system": "system", "human": "user", "gpt": "assistant"}.get(t["from"], t["from"]) for t in turns]
    data = tmp_path / "sharegpt.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    named = split_files(tmp_path / "named", data, mapping="sharegpt")
    kept, rejects = accounted(named, len(rows))
    assert set(rejects) == {i for i in range(len(rows)) if i % 7 in (2, 4)}
    for row, messages in conversations(kept).items():
        assert [t["role"] for t in messages] == roles[row]
        assert [t["content"] for t in messages] == [t["value"] for t in rows[row]["conversations"]]
    for row, r in rejects.items():
        last = len(rows[row]["conversations"]) - 1
        if row % 7 == 2:
            assert r["reason"] == "unknown_role" and f"turn {last} is from 'bing'" in r["detail"], r
        else:
            assert (r["reason"], r["detail"]) == (
                "bad_turn_order",
                f"tool turn {last - 1} has no call before it to answer",
            )
    # the same file under data.mapping: chat (the default column, messages, absent): the same outputs
    detected = split_files(tmp_path / "detected", data, mapping="chat")
    for a, b in zip([*named["splits"], named["eval"], named["rejects"]],
                    [*detected["splits"], detected["eval"], detected["rejects"]], strict=True):  # fmt: skip
        assert pq.read_table(a).equals(pq.read_table(b)), a.name


def prompt_rows(n: int = 24) -> list[dict]:
    return [{"prompt": "\n".join(filter(None, [q, x])), "completion": a} for q, x, a in tasks(n)]


def test_bom_and_crlf_files_give_the_rows_of_the_plain_file(tmp_path):
    """A UTF-8 BOM (Excel, Notepad) lost the first JSONL row as invalid_json and stopped a JSON array; CRLF
    line ends left a CR inside multi-line CSV cells. Each variant: the plain file's rows, row for row."""
    import pandas as pd

    rows = prompt_rows()
    n = len(rows)
    jsonl = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    frame = pd.DataFrame(rows)
    variants = {
        "plain.jsonl": jsonl.encode(),
        "bom.jsonl": b"\xef\xbb\xbf" + jsonl.encode(),
        "crlf.jsonl": jsonl.replace("\n", "\r\n").encode(),  # JSON escapes a newline in a string: line ends only
        "bom.json": b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False).encode(),
        "plain.csv": frame.to_csv(index=False, lineterminator="\n").encode(),
        "bom_crlf.csv": b"\xef\xbb\xbf" + frame.to_csv(index=False, lineterminator="\n").replace("\n", "\r\n").encode(),
    }
    assert any("\n" in r["prompt"] + r["completion"] for r in rows)  # multi-line cells, CRLF inside the quotes
    outputs = {}
    for name, raw in variants.items():
        (tmp_path / name).write_bytes(raw)
        out = split_files(tmp_path / name.replace(".", "_"), tmp_path / name, columns=COLUMNS)
        kept, rejects = accounted(out, n)
        assert not rejects, (name, list(rejects.values())[:1])
        outputs[name] = {row: (r["messages"], r["content_hash"]) for row, r in kept.items()}
    for name, kept in outputs.items():
        assert kept == outputs["plain.jsonl"], name
    # a CRLF CSV with a cell that is not UTF-8: its batch decoded row by row, CRLF as LF all the same
    (tmp_path / "bad.csv").write_bytes(variants["bom_crlf.csv"] + b'x,"\xff"\r\n')
    kept, rejects = accounted(split_files(tmp_path / "bad_csv", tmp_path / "bad.csv", columns=COLUMNS), n + 1)
    assert rejects[n]["reason"] == "invalid_utf8" and len(rejects) == 1
    assert {row: (r["messages"], r["content_hash"]) for row, r in kept.items()} == outputs["plain.jsonl"]
    # a CRLF line that is not JSON: its reject holds the line without the CR
    (tmp_path / "bad.jsonl").write_bytes(variants["crlf.jsonl"] + b'{"prompt": "cut\r\n')
    kept, rejects = accounted(split_files(tmp_path / "bad", tmp_path / "bad.jsonl", columns=COLUMNS), n + 1)
    assert json.loads(rejects[n]["record"]) == {"line": '{"prompt": "cut'} and rejects[n]["reason"] == "invalid_json"


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_control_characters_rejected_or_stripped_and_counted(tmp_path, fmt):
    """NUL bytes were trained on unflagged. A C0 control character (not tab, LF, CR) in a turn: a
    control_chars reject, or stripped (data.control_chars: strip); counted in the result and the manifest."""
    import pandas as pd

    rows = prompt_rows()
    rows[1]["completion"] += "\u0000"  # JSONL: an escaped NUL
    rows[4]["prompt"] = "\x1b[31m" + rows[4]["prompt"]  # a terminal colour code
    rows[6]["completion"] = "a\tb\nc"  # tab, LF: text
    rows[9]["completion"] = "\x00\x00" + rows[9]["completion"]  # JSONL: raw NUL bytes inside a string
    data = tmp_path / f"nul.{fmt}"
    if fmt == "csv":
        data.write_bytes(pd.DataFrame(rows).to_csv(index=False).encode())
    else:
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
        lines[9] = lines[9].replace("\\u0000", "\x00")
        data.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert (b"\x00\x00" in data.read_bytes()) and data.read_bytes().count(b"\x00") == 2 + (fmt == "csv")
    rejected = split_files(tmp_path / "reject", data, columns=COLUMNS)
    kept, rejects = accounted(rejected, len(rows))
    assert {row: r["reason"] for row, r in rejects.items()} == dict.fromkeys([1, 4, 9], "control_chars")
    assert "assistant turn 1 contains the control character U+0000 (NUL)" in rejects[1]["detail"]
    assert "user turn 0 contains the control character U+001B" in rejects[4]["detail"]
    assert json.loads(kept[6]["messages"])[1]["content"] == "a\tb\nc"
    assert rejected["control_chars"] == {"policy": "reject", "rows": 3, "by_char": {"U+0000": 3, "U+001B": 1}}
    assert rejected["reasons"] == {"control_chars": 3}
    # strip: every row kept, without the characters; the manifest counts them
    from workflow_scripts.data.split import main

    out = tmp_path / "strip"
    config = {"path": str(data), "columns": COLUMNS, "nodes": 2, "eval_fraction": 0.2, "control_chars": "strip"}
    main([
        "--config", json.dumps(config), "--splits", str(out / "n0.parquet"), str(out / "n1.parquet"),
        "--eval", str(out / "e.parquet"), "--rejects", str(out / "r.parquet"), "--manifest", str(out / "m.json"),
    ])  # fmt: skip
    paths = {
        "splits": [out / "n0.parquet", out / "n1.parquet"],
        "eval": out / "e.parquet",
        "rejects": out / "r.parquet",
    }
    manifest = json.loads((out / "m.json").read_text())
    kept, rejects = accounted(paths | {"rows_in": manifest["rows_in"]}, len(rows))
    assert not rejects
    texts = conversations(kept)
    assert (
        texts[1][1]["content"] == rows[1]["completion"][:-1]
        and texts[4][0]["content"] == "[31m" + rows[4]["prompt"][5:]
    )
    assert texts[9][1]["content"] == rows[9]["completion"][2:]
    assert manifest["control_chars"] == {"policy": "strip", "rows": 3, "by_char": {"U+0000": 3, "U+001B": 1}}
