"""Verified checkpoints without torchrun: the manifest hashed while writing and checked before reading,
the choice of the checkpoint to resume, pruning, the RNG state without pickle, the non-finite rule and
a full disk's message. The trainer's own resume over damaged checkpoints is in test_resume.py."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from workflow_scripts.core.pipeline_io import file_sha256
from workflow_scripts.train.checkpoint import choose, rng_files, safetensors_bytes, set_rng_state, to_prune
from workflow_scripts.train.divergence import non_finite
from workflow_scripts.train.manifest import MARKER, Writes, build_manifest, marker_text, shares, space_message, verify


def saved_folder(tmp_path) -> Path:
    """A checkpoint folder as the Checkpointer leaves it: files written through Writes, one written
    around it (as DeepSpeed copies zero_to_fp32.py), the marker with the manifest."""
    folder = tmp_path / "step-4"
    (folder / "dcp").mkdir(parents=True)
    writes = Writes(folder)
    writes.torch_save({"w": torch.arange(50_000, dtype=torch.float32)}, folder / "state.pt")
    writes.torch_save({"w": torch.ones(10)}, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    with writes.open(folder / "dcp" / ".metadata.tmp", fileno=True) as f:
        f.write(b"metadata")
    (folder / "dcp" / ".metadata.tmp").rename(folder / "dcp" / ".metadata")
    writes.renamed(folder / "dcp" / ".metadata.tmp", folder / "dcp" / ".metadata")
    (folder / "zero_to_fp32.py").write_text("# copied by the library\n")
    files, read_back = build_manifest(folder, writes.files)
    (folder / MARKER).write_text(marker_text(4, files, 0.0))
    assert read_back == len("# copied by the library\n")  # only the file written around Writes is read back
    return folder


def test_the_manifest_is_what_was_written_and_a_damaged_file_is_named(tmp_path):
    folder = saved_folder(tmp_path)
    files = json.loads((folder / MARKER).read_text())["files"]
    assert sorted(files) == ["dcp/.metadata", "legacy.pt", "state.pt", "zero_to_fp32.py"]
    assert all(file_sha256(folder / n) == e["sha256"] and (folder / n).stat().st_size == e["size"]
               for n, e in files.items())  # fmt: skip
    assert verify(folder) is None
    assert torch.load(folder / "state.pt", weights_only=True)["w"][-1] == 49_999  # written through the hash intact

    state = folder / "state.pt"
    original = state.read_bytes()
    data = bytearray(original)
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 4096])
    state.write_bytes(bytes(data))
    assert verify(folder) == "state.pt: sha256 differs from the one written"
    state.write_bytes(original[: len(original) // 2])
    assert verify(folder) == f"state.pt has {len(original) // 2:,} bytes, {len(original):,} were written"
    state.unlink()
    assert verify(folder) == "state.pt is missing"


def test_a_marker_without_checksums_is_not_trusted(tmp_path):
    folder = saved_folder(tmp_path)
    (folder / MARKER).write_text(json.dumps({"step": 4, "time": 0.0}))  # as written before manifests
    assert "no checksums" in verify(folder)
    (folder / MARKER).write_text("{not json")
    assert "unreadable COMPLETE marker" in verify(folder)


def test_shares_split_the_files_over_the_ranks_by_size():
    files = {f"f{i}": {"size": size} for i, size in enumerate([100, 90, 50, 40, 10, 5])}
    split = shares(files, 2)
    assert sorted(n for part in split for n in part) == sorted(files)  # each file checked by exactly one rank
    assert [sum(files[n]["size"] for n in part) for part in split] == [150, 145]
    assert shares(files, 2) == split and shares(files, 1) == [sorted(files, key=lambda n: -files[n]["size"])]


def test_choose_takes_the_newest_good_checkpoint():
    folders = [Path(f"step-{s}") for s in (2, 4, 6, 8)]
    problems = {"step-8": "state.pt: sha256 differs", "step-6": "could not be loaded (EOFError)"}
    tried = []

    def check(folder):
        tried.append(folder.name)
        return problems.get(folder.name)

    chosen, bad = choose(folders, check)
    assert chosen == Path("step-4") and tried == ["step-8", "step-6", "step-4"]  # step-2 is not read at all
    assert bad == [(Path("step-8"), problems["step-8"]), (Path("step-6"), problems["step-6"])]
    assert choose(folders, lambda f: "bad") == (None, [(f, "bad") for f in reversed(folders)])
    assert choose([], check) == (None, [])


def test_pruning_keeps_the_newest_k_and_never_the_protected_one():
    complete = [Path(f"step-{s}") for s in (2, 4, 6, 8)]
    partial = [Path("step-5"), Path("step-10")]
    assert to_prune(complete, partial, 2, protect=Path("step-8")) == [Path("step-2"), Path("step-4"), Path("step-5")]
    assert to_prune(complete, partial, 2, protect=Path("step-4")) == [Path("step-2"), Path("step-5")]
    assert to_prune([], partial, 2, protect=None) == []


def test_the_rng_state_round_trips_through_safetensors(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    name, tensors, metadata = rng_files(1)
    (tmp_path / name).write_bytes(safetensors_bytes(tensors, metadata))
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(tmp_path / name)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected
    assert name == "rng-1.safetensors" and (tmp_path / name).read_bytes()[8:9] == b"{"  # a safetensors header


@pytest.mark.parametrize(
    ("loss", "norm", "skipped", "stops"),
    [
        (2.0, 1.0, False, False),
        (float("nan"), 1.0, False, True),
        (float("inf"), float("nan"), False, True),
        (2.0, float("nan"), False, True),
        (2.0, float("inf"), True, False),  # fp16 skipped the overflowing step: its norm is expected
        (float("nan"), float("inf"), True, True),  # a NaN loss is never an overflow
    ],
)
def test_non_finite(loss, norm, skipped, stops):
    assert non_finite(loss, norm, skipped) is stops


def test_a_full_disk_names_the_folder_and_the_free_space(tmp_path):
    writes = Writes(Path("/dev"))
    with pytest.raises((OSError, RuntimeError)):  # /dev/full: every write fails with ENOSPC, as on a full disk
        writes.torch_save({"w": torch.ones(1_000_000)}, "/dev/full")
    assert writes.error.errno == 28  # what torch may report as "unexpected pos" or an iostream error
    message = space_message(tmp_path / "ckpt" / "step-8", writes.error)
    assert message.startswith(f"checkpoint {tmp_path / 'ckpt' / 'step-8'}: disk full: save failed (OSError: ")
    assert message.endswith(" GiB free there") and "iostream" not in message


def test_the_gpus_description_is_no_part_of_the_checkpoints_key():
    """A plan re-made for another GPU (training.gpu_memory_gb, peak_tflops) resumes the same checkpoints; a run
    keyed when they were part of it is found by its legacy key (the schema's defaults then: 80 and 989)."""
    import dataclasses

    from workflow_scripts.core.settings import TrainConfig
    from workflow_scripts.train.checkpoint import run_key

    cfg = TrainConfig.from_json(json.dumps({"procs_per_node": 2}))
    assert cfg.gpu_memory_gb is None and cfg.peak_tflops is None
    key = run_key(cfg, 2, "d", "b", None)
    assert run_key(dataclasses.replace(cfg, gpu_memory_gb=40.0, peak_tflops=312.0), 2, "d", "b", None) == key
    assert run_key(dataclasses.replace(cfg, lr=cfg.lr * 2), 2, "d", "b", None) != key
    legacy = run_key(cfg, 2, "d", "b", None, legacy=True)
    assert legacy != key
    assert (
        run_key(dataclasses.replace(cfg, gpu_memory_gb=80, peak_tflops=989), 2, "d", "b", None, legacy=True) == legacy
    )


def test_a_dead_model_is_steps_in_a_row_of_a_zero_norm_or_a_uniform_loss():
    import math

    from workflow_scripts.train.divergence import DeadModel

    uniform = math.log(1024)
    dead = DeadModel(3, 1024, trainable=True)
    assert [dead.update(uniform, 0.0) for _ in range(3)] == [False, False, True]  # the third in a row stops
    dead = DeadModel(3, 1024, trainable=True)
    steps = [(uniform + 1e-6, 0.3), (2.5, 0.0), (2.4, 1.2), (uniform, 0.0), (uniform, 0.0), (uniform, 0.0)]
    assert [dead.update(loss, norm) for loss, norm in steps] == [False, False, False, False, False, True]
    assert not DeadModel(3, 1024, trainable=True).dead(uniform + 0.01, 0.5)  # a random model's first steps
    assert not DeadModel(3, 1024, trainable=False).dead(2.0, 0.0)  # nothing to train: a zero norm is no sign
    off = DeadModel(0, 1024, trainable=True)
    assert not any(off.update(uniform, 0.0) for _ in range(100))


def test_checkpoints_held_for_scoring_are_not_pruned_until_scored(tmp_path):
    from workflow_scripts.train.checkpoint import HOLD_FILE, held_for_scoring

    root = tmp_path / "checkpoints" / "node0" / "abc123"
    complete = [root / f"step-{s}" for s in (100, 200, 300, 400)]
    assert held_for_scoring(root, complete) == ()  # eval.checkpoints last: no hold file
    scores = tmp_path / "eval" / "checkpoints" / "node0"
    (root.parent).mkdir(parents=True)
    (root.parent / HOLD_FILE).write_text(json.dumps({"mode": "all", "every": 1000, "scores": str(scores)}))
    (scores / "abc123").mkdir(parents=True)
    (scores / "abc123" / "step-100.json").write_text("{}")  # scored: may go
    held = held_for_scoring(root, complete)
    assert held == tuple(complete[1:])
    assert to_prune(complete, [], 2, protect=complete[-1], held=held) == [complete[0]]  # step-200 waits
    assert to_prune(complete, [], 2, protect=complete[-1]) == complete[:2]
    (root.parent / HOLD_FILE).write_text(json.dumps({"mode": "every_n", "every": 200, "scores": str(scores)}))
    assert held_for_scoring(root, complete) == (complete[1], complete[3])  # 100 and 300 are no multiples of 200
    (root.parent / HOLD_FILE).write_text("not json")
    assert held_for_scoring(root, complete) == ()
