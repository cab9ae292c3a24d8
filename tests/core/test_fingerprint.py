"""The base model's content hash (the resume key covers it) and the one-line model path errors."""

import os

import pytest

from workflow_scripts.core.fingerprint import local_model_folder, model_fingerprint
from workflow_scripts.core.pipeline_io import UserError


def model_folder(root, weights=b"weights-1"):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "qwen3"}')
    (root / "model.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text("{}")
    return root


def test_fingerprint_follows_content_not_path(tmp_path):
    cache = tmp_path / "hashes.json"
    a = model_fingerprint(str(model_folder(tmp_path / "a")), cache)
    assert model_fingerprint(str(model_folder(tmp_path / "b")), cache) == a  # same files elsewhere
    # overwritten in place, same size: a new fingerprint
    (tmp_path / "a" / "model.safetensors").write_bytes(b"weights-2")
    assert model_fingerprint(str(tmp_path / "a"), cache) != a
    # the tokenizer and template count too
    (tmp_path / "b" / "chat_template.jinja").write_text("{{ messages }}")
    assert model_fingerprint(str(tmp_path / "b"), cache) != a


def test_digests_are_cached_by_size_and_mtime(tmp_path, monkeypatch):
    folder, cache = model_folder(tmp_path / "m"), tmp_path / "hashes.json"
    first = model_fingerprint(str(folder), cache)
    calls = []
    from workflow_scripts.core import fingerprint

    real = fingerprint.file_sha256
    monkeypatch.setattr(fingerprint, "file_sha256", lambda p: calls.append(p) or real(p))
    assert model_fingerprint(str(folder), cache) == first and calls == []  # nothing read again
    weights = folder / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"weights-9")  # same size; a new mtime
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert model_fingerprint(str(folder), cache) != first and calls == [weights]


def test_hub_cache_blobs_are_named_by_their_hash(tmp_path, monkeypatch):
    """A hub snapshot's files link to blobs named by their sha256: the name is the digest, nothing is read."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for name, sha in (("config.json", "1" * 64), ("model.safetensors", "2" * 64)):
        (blobs / sha).write_text(name)
        (snap / name).symlink_to(blobs / sha)
    from workflow_scripts.core import fingerprint

    monkeypatch.setattr(fingerprint, "file_sha256", lambda p: pytest.fail(f"read {p}"))
    before = model_fingerprint(str(snap), tmp_path / "hashes.json")
    (snap / "model.safetensors").unlink()
    (blobs / ("3" * 64)).write_text("new weights")
    (snap / "model.safetensors").symlink_to(blobs / ("3" * 64))
    assert model_fingerprint(str(snap), tmp_path / "hashes.json") != before


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("{tmp}/no-config", "folder has no config.json"),
        ("{tmp}/does-not-exist", "no such model folder"),
        ("./relative/missing", "no such model folder"),
        ("nobody/no-such-model-xyz", "not in the local Hugging Face cache"),
    ],
)
def test_bad_model_paths_are_one_line_errors(tmp_path, monkeypatch, name, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "no-config").mkdir()
    name = name.format(tmp=tmp_path)
    with pytest.raises(UserError, match=message) as e:
        local_model_folder(name)
    assert str(e.value).startswith(f"model.name_or_path {name}:") and "\n" not in str(e.value)


def test_an_uncached_hub_id_is_fine_while_online(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from workflow_scripts.core.fingerprint import check_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    check_model("nobody/no-such-model-xyz")  # the jobs download it
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        check_model("nobody/no-such-model-xyz")
    with pytest.raises(UserError, match="no such model folder"):
        check_model(str(tmp_path / "missing"))
