"""Every input row is accounted for from the split through tokenization: what tokenization leaves out is in
a rejects file with its reason and counts against data.max_reject_fraction; too little data stops before
training with one line."""

import json
import logging
from collections import Counter

import pyarrow.parquet as pq
import pytest
from conftest import tokenize_config
from data_formats import column_names, content_hash, to_examples
from demo_model import train_tokenizer

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
    from split import main

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
    from tokenization import main

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
    from data_report import main as data_report

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
    from pipeline_io import UserError

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
    from summarize import examples_trained

    assert examples_trained(plan) == {"examples_tokenized": 100, "examples_trained": trained}
