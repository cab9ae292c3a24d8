"""The trainer's memory-mapped data: token stores built once per shard content, checked on every open,
and micro-batches equal, bit for bit, to those of the list-based loader they replace."""

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from workflow_scripts.core.contracts import TOKENIZED_SCHEMA as SCHEMA
from workflow_scripts.core.pipeline_io import UserError, file_sha256
from workflow_scripts.core.settings import training_config
from workflow_scripts.data import token_store
from workflow_scripts.data.packing import write_packing
from workflow_scripts.data.token_store import OFFSETS_FILE, TOKEN_FILES, StoreError, check_store, open_store
from workflow_scripts.train.batching import IGNORE, TrainingData, covers_once, epoch_order, load_bins, load_examples


def write_tokenized(path, lengths, seed, row_group_size=16):
    """A shard with the tokenization stage's schema: prompt labels masked, several row groups."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 30000, n).tolist() for n in lengths]
    prompts = [int(rng.integers(0, n)) for n in lengths]
    labels = [[IGNORE] * p + x[p:] for x, p in zip(ids, prompts, strict=True)]
    table = pa.Table.from_pydict(
        {"input_ids": ids, "labels": labels, "length": lengths, "prompt_length": prompts,
         "response": ["r"] * len(lengths), "content_hash": ["h"] * len(lengths), "category": [""] * len(lengths)},
        schema=SCHEMA,
    )  # fmt: skip
    pq.write_table(table, path, row_group_size=row_group_size)


def shard_rows(path) -> list[tuple[list[int], list[int]]]:
    """The reference: the shard's rows as Python lists, as the trainer once held them."""
    rows = pq.read_table(path, columns=["input_ids", "labels"]).to_pylist()
    return [(r["input_ids"], r["labels"]) for r in rows]


@pytest.fixture
def shards(tmp_path):
    """Two shards (joint mode concatenates them) and their packing plans (bins of up to 64 tokens)."""
    out = []
    for k, count in enumerate((37, 29)):
        lengths = np.random.default_rng(10 + k).integers(1, 40, count).tolist()
        shard, plan = tmp_path / f"node{k}.parquet", tmp_path / f"node{k}.packing.parquet"
        write_tokenized(shard, lengths, seed=k)
        write_packing(lengths, 64, plan)
        out.append((shard, plan))
    return out


@pytest.fixture
def builds(monkeypatch):
    """Counts the stores written."""
    calls = []
    original = token_store.write_store

    def counting(shard, folder, sha256, batch_rows=1024):
        calls.append(folder)
        return original(shard, folder, sha256, batch_rows=5)  # several record batches per shard

    monkeypatch.setattr(token_store, "write_store", counting)
    return calls


def test_a_store_holds_the_shards_rows_and_is_built_once(tmp_path, shards, builds):
    shard = shards[0][0]
    store = open_store(shard, tmp_path / "store")
    assert store.folder == tmp_path / "store" / file_sha256(shard) and builds == [store.folder]
    reference = shard_rows(shard)
    assert store.rows == len(reference) and store.tokens == sum(len(ids) for ids, _ in reference)
    assert store.input_ids.dtype == store.labels.dtype == np.int32 and not store.input_ids.flags.owndata
    for i, (ids, labels) in enumerate(reference):
        got_ids, got_labels = store.row(i)
        assert got_ids.tolist() == ids and got_labels.tolist() == labels
    again = open_store(shard, tmp_path / "store")
    assert builds == [store.folder]  # reused, not rebuilt
    assert np.array_equal(again.offsets, store.offsets)


def mapped_kb(path) -> int:
    """How much of ``path`` this process has in its memory through mappings (Rss in /proc/self/smaps)."""
    kb, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            kb += int(line.split()[1])
    return kb


def test_rows_read_leave_the_ranks_memory(tmp_path):
    """Each micro-batch's pages are dropped from the rank's mappings once copied: its RSS stays flat."""
    shard = tmp_path / "big.parquet"
    write_tokenized(shard, [4000] * 300, seed=1, row_group_size=100)  # 4.6 MB of input_ids
    store = open_store(shard, tmp_path / "store")
    ids_file = store.folder / TOKEN_FILES["input_ids"]
    assert mapped_kb(ids_file) == 0  # opening reads none of it
    total = sum(int(store.row(i)[0].sum()) for i in range(store.rows))
    assert mapped_kb(ids_file) >= 0.9 * ids_file.stat().st_size / 1024
    store.release()
    assert mapped_kb(ids_file) == 0
    assert sum(int(store.row(i)[0].sum()) for i in range(store.rows)) == total  # read again from the page cache


def corrupt_offsets(folder):
    offsets = np.fromfile(folder / OFFSETS_FILE, np.int64)
    offsets[3], offsets[4] = offsets[4], offsets[3] - 1
    offsets.tofile(folder / OFFSETS_FILE)


def truncate_ids(folder):
    path = folder / TOKEN_FILES["input_ids"]
    path.write_bytes(path.read_bytes()[:-4])


def miscount_rows(folder):
    meta = json.loads((folder / "store.json").read_text())
    (folder / "store.json").write_text(json.dumps(meta | {"rows": meta["rows"] + 1}))


def drop_meta(folder):
    (folder / "store.json").unlink()


def garble_meta(folder):
    (folder / "store.json").write_text("[1, 2]")


@pytest.mark.parametrize(
    "damage,message",
    [
        (truncate_ids, "input_ids.int32 holds .* input_ids, the offsets end at"),
        (corrupt_offsets, "offsets.int64 does not rise from 0"),
        (miscount_rows, "token store holds 38 rows, the shard 37"),
        (drop_meta, "incomplete token store"),
        (garble_meta, "incomplete token store .store.json is not a JSON object"),
    ],
)
def test_a_damaged_store_is_named_and_rebuilt_never_used(tmp_path, shards, builds, caplog, damage, message):
    shard = shards[0][0]
    folder = open_store(shard, tmp_path / "store").folder
    damage(folder)
    with pytest.raises(StoreError, match=message) as error:
        check_store(folder, file_sha256(shard), 37)
    assert str(error.value).startswith(str(folder)) and "\n" not in str(error.value)
    with caplog.at_level(logging.WARNING, logger="token_store"):
        store = open_store(shard, tmp_path / "store")
    assert builds == [folder, folder] and f"{folder}: " in caplog.text and "rebuilding it" in caplog.text
    assert [store.row(i)[0].tolist() for i in range(store.rows)] == [ids for ids, _ in shard_rows(shard)]


def test_a_store_that_comes_out_bad_is_an_error_naming_it(tmp_path, shards, monkeypatch):
    original = token_store.write_store

    def truncating(shard, folder, sha256, batch_rows=1024):
        original(shard, folder, sha256)
        truncate_ids(folder)

    monkeypatch.setattr(token_store, "write_store", truncating)
    with pytest.raises(UserError, match=r"store/[0-9a-f]{64}: input_ids.int32 holds"):
        open_store(shards[0][0], tmp_path / "store")


def test_a_changed_shard_gets_a_new_store(tmp_path, shards, builds):
    shard = shards[0][0]
    old = open_store(shard, tmp_path / "store")
    write_tokenized(shard, [5, 6, 7], seed=99)
    new = open_store(shard, tmp_path / "store")
    assert new.folder != old.folder and new.folder.name == file_sha256(shard) and len(builds) == 2
    assert new.rows == 3 and [new.row(i)[0].tolist() for i in range(3)] == [ids for ids, _ in shard_rows(shard)]
    assert check_store(old.folder, old.folder.name, 37).rows == 37  # the old one is left as it was


def test_a_shard_that_cannot_be_stored_is_named(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3, 4]]}), bad)
    with pytest.raises(UserError, match="bad.parquet: row 1 has 1 input_ids but 2 labels"):
        open_store(bad, tmp_path / "store")
    pq.write_table(pa.table({"input_ids": [[1, 2**40]], "labels": [[1, 2]]}), bad)
    with pytest.raises(UserError, match="bad.parquet: column input_ids holds values that do not fit int32"):
        open_store(bad, tmp_path / "store")
    pq.write_table(pa.table({"input_ids": [[1]]}), bad)
    with pytest.raises(UserError, match="bad.parquet: no column labels"):
        open_store(bad, tmp_path / "store")
    assert not [p for p in (tmp_path / "store").iterdir() if p.is_dir()]  # no half-written store left


def test_packing_plans_are_arrays_and_their_check_is_exact(tmp_path, shards):
    (s0, p0), (s1, p1) = shards
    bins = load_bins([p0, p1], [s0, s1])
    plans = [pq.read_table(p).column("examples").to_pylist() for p in (p0, p1)]
    assert [b.tolist() for b in bins] == plans[0] + [[i + 37 for i in b] for b in plans[1]]
    assert bins.examples.dtype == bins.offsets.dtype == np.int64
    assert covers_once(np.array([2, 0, 1]), 3)
    assert not covers_once(np.array([0, 0, 2]), 3) and not covers_once(np.array([0, 1]), 3)
    duplicate = tmp_path / "plan.parquet"
    pq.write_table(pa.table({"bin": [0, 1], "examples": [list(range(36)), [0]]}), duplicate)
    with pytest.raises(UserError, match="plan.parquet: packing plan does not cover the 37 examples of node0.parquet"):
        load_bins([duplicate], [s0])


def test_the_epoch_order_is_torchs_permutation_as_an_array():
    order = epoch_order(1000, 7)
    assert isinstance(order, np.ndarray) and not order.flags.writeable
    assert order.tolist() == torch.randperm(1000, generator=torch.Generator().manual_seed(7)).tolist()


# ---------------------------------------------------------------- the list-based reference


def reference_padded(examples, pad_id):
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def reference_packed(rows, pad_id):
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for ids, lab in row:
            n = len(ids)
            input_ids[r, at : at + n] = torch.tensor(ids)
            labels[r, at + 1 : at + n] = torch.tensor(lab[1:])
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions}


def reference_micro_batches(examples, bins, cfg, world, rank, step, pad_id, one_row):
    units = len(bins) if bins is not None else len(examples)
    steps_per_epoch = max(1, units // (cfg.micro_batch_size * world * cfg.grad_accum))
    epoch, pos = divmod(step, steps_per_epoch)
    order = torch.randperm(units, generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
    for micro in range(cfg.grad_accum):
        start = (pos * cfg.grad_accum + micro) * cfg.micro_batch_size * world + rank * cfg.micro_batch_size
        indices = [order[(start + i) % units] for i in range(cfg.micro_batch_size)]
        if bins is None:
            items = [examples[i] for i in indices]
            yield reference_padded(items, pad_id), [len(ids) for ids, _ in items]
            continue
        rows = [[examples[j] for j in bins[i]] for i in indices]
        rows = [[seq for row in rows for seq in row]] if one_row else rows
        yield reference_packed(rows, pad_id), [len(ids) for row in rows for ids, _ in row]


@pytest.mark.parametrize(
    "packing,one_row", [(False, False), (True, False), (True, True)], ids=["padded", "packed", "one-row"]
)
def test_micro_batches_equal_the_list_based_loaders(tmp_path, shards, packing, one_row):
    paths, plans = [s for s, _ in shards], [p for _, p in shards]
    examples = shard_rows(paths[0]) + shard_rows(paths[1])
    bins = pq.read_table(plans[0]).column("examples").to_pylist()
    bins += [[i + 37 for i in b] for b in pq.read_table(plans[1]).column("examples").to_pylist()]
    cfg = training_config({"packing": packing, "micro_batch_size": 2, "grad_accum": 2, "seed": 5, "epochs": 3})
    world, compared = 2, 0
    for rank in range(world):
        data = TrainingData(cfg, paths, plans if packing else None, world, rank, tmp_path / "store")
        data.bind(pad_id=3, one_row=one_row)
        assert data.describe()["tokens"] == sum(len(ids) for ids, _ in examples)
        assert data.describe()["examples"] == 66 and data.plan.total_steps > data.plan.steps_per_epoch  # 2+ epochs
        for step in range(data.plan.total_steps):
            got = list(data.micro_batches(step))
            want = list(reference_micro_batches(examples, bins if packing else None, cfg, world, rank, step, 3,
                                                one_row))  # fmt: skip
            assert len(got) == len(want) == 2
            for (batch, lengths), (ref, ref_lengths) in zip(got, want, strict=True):
                assert lengths == ref_lengths and batch.keys() == ref.keys()
                assert all(batch[k].dtype == torch.long and torch.equal(batch[k], ref[k]) for k in ref)
                compared += 1
    assert compared >= 16


def test_the_examples_of_several_stores_are_one_sequence(tmp_path, shards):
    paths = [s for s, _ in shards]
    examples = load_examples(paths, tmp_path / "store")
    reference = shard_rows(paths[0]) + shard_rows(paths[1])
    assert len(examples) == len(reference) == 66 and examples.tokens == sum(len(i) for i, _ in reference)
    assert [examples[i][1].tolist() for i in range(66)] == [lab for _, lab in reference]
    assert examples[-1][0].tolist() == reference[-1][0]
    with pytest.raises(IndexError):
        examples[66]
