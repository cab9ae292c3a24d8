"""The tokenization cache checks itself: damaged entries are rebuilt, runs never share files with it."""

import json
import logging
import os
import stat

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import split_files, tokenize_config

from workflow_scripts.core.pipeline_io import file_sha256
from workflow_scripts.data.token_cache import ENTRY_FILES, MANIFEST, read_manifest
from workflow_scripts.data.tokenization import main
from workflow_scripts.model.demo_model import train_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    texts = ["What is 3 + 4? 7 Answer with the number only. system user assistant"] * 20
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, 400).save_pretrained(path)
    return path


@pytest.fixture
def shard(tmp_path):
    data = tmp_path / "d.csv"
    pd.DataFrame({"question": [f"What is {i} + 4?" for i in range(50)], "response": ["7"] * 50}).to_csv(
        data, index=False
    )
    return split_files(tmp_path / "split", data, nodes=1)["splits"][0]


def run(tmp_path, shard, tok_dir, name):
    """One tokenize_shard job of run ``name`` (in-process: no interpreter start-up per call)."""
    out = tmp_path / name / "data" / "tokenized"
    main([
        "--shard", str(shard), "--tokenizer", str(tok_dir),
        "--config", tokenize_config(max_seq_len=64, cache_dir=str(tmp_path / "cache")),
        "--output", str(out / "node0.parquet"),
        "--packing", str(out / "node0.packing.parquet"), "--stats", str(out / "node0.json"),
    ])  # fmt: skip
    return out, json.loads((out / "node0.json").read_text())


def ids(out):
    return pq.read_table(out / "node0.parquet", columns=["input_ids", "labels"]).to_pydict()


def snapshot(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: min(1000, len(data) // 2)])  # the case: a Parquet cut to 1,000 bytes


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_sound(entry):
    """Every file of the entry matches its manifest and is read-only."""
    files = read_manifest(entry)
    for name in ENTRY_FILES:
        assert file_sha256(entry / name) == files[name]["sha256"]
        assert stat.S_IMODE((entry / name).stat().st_mode) == 0o444


@pytest.mark.parametrize(
    "name, damage",
    [
        ("tokens.parquet", truncate),
        ("tokens.parquet", flip),
        ("packing.parquet", flip),
        ("rejects.parquet", flip),
        ("stats.json", truncate),
        (MANIFEST, os.unlink),
    ],
    ids=["truncated", "byte-flipped", "packing-flipped", "rejects-flipped", "stats-truncated", "no-manifest"],
)
def test_damaged_entry_is_rebuilt_with_a_warning_and_other_runs_untouched(
    tmp_path, shard, tok_dir, caplog, name, damage
):
    first, stats = run(tmp_path, shard, tok_dir, "runA")
    assert stats["cache"] == "miss"
    entry = tmp_path / "cache" / stats["key"]
    assert_sound(entry)
    before, fresh = snapshot(first), ids(first)
    victim = entry / name
    size = victim.stat().st_size
    victim.chmod(0o644)  # the read-only guard has to be lifted to damage it
    damage(victim)
    if damage is flip:
        assert victim.stat().st_size == size  # same size: only the hash can tell
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenize"):
        second, stats = run(tmp_path, shard, tok_dir, "runB")
    assert stats["cache"] == "rebuilt"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0] and name in warnings[0], warnings
    assert str(entry) in stats["cache_damage"]
    assert ids(second) == fresh  # the same ids as a fresh tokenization
    assert snapshot(first) == before  # the first run's files are untouched
    assert_sound(entry)  # the entry was written again, whole
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name != entry.name]  # no leftovers
    third, stats = run(tmp_path, shard, tok_dir, "runC")
    assert stats["cache"] == "hit" and ids(third) == fresh


def test_outputs_are_copies_and_a_verified_entry_is_a_hit(tmp_path, shard, tok_dir, caplog):
    first, stats = run(tmp_path, shard, tok_dir, "runA")
    entry = tmp_path / "cache" / stats["key"]
    with caplog.at_level(logging.WARNING, logger="tokenize"):
        second, stats = run(tmp_path, shard, tok_dir, "runB")
    assert stats["cache"] == "hit"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for out in (first, second):
        for output, cached in (("node0.parquet", "tokens.parquet"), ("node0.packing.parquet", "packing.parquet")):
            o, c = (out / output).stat(), (entry / cached).stat()
            assert o.st_nlink == 1 and c.st_nlink == 1
            assert (o.st_dev, o.st_ino) != (c.st_dev, c.st_ino)
            assert (out / output).read_bytes() == (entry / cached).read_bytes()
    # damage one run's output in place: neither the cache nor the other run sees it
    before = snapshot(second)
    flip(first / "node0.parquet")
    assert snapshot(second) == before
    assert_sound(entry)
    third, stats = run(tmp_path, shard, tok_dir, "runC")
    assert stats["cache"] == "hit"
    for output in ("node0.parquet", "node0.packing.parquet"):
        assert (third / output).read_bytes() == before[output]


def test_without_a_cache_dir_nothing_is_left_behind(tmp_path, shard, tok_dir):
    out = tmp_path / "run" / "data" / "tokenized"
    main([
        "--shard", str(shard), "--tokenizer", str(tok_dir), "--config", tokenize_config(max_seq_len=64),
        "--output", str(out / "node0.parquet"), "--packing", str(out / "node0.packing.parquet"),
        "--stats", str(out / "node0.json"),
    ])  # fmt: skip
    assert json.loads((out / "node0.json").read_text())["cache"] == "off"
    expected = ["node0.json", "node0.packing.parquet", "node0.parquet", "node0.rejects.parquet"]
    assert sorted(p.name for p in out.iterdir()) == expected
