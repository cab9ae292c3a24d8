"""The tokenization cache: content-addressed, shared between runs, and checking itself.

The key hashes the shard's bytes, the tokenizer files, the chat template, the length policy and
the packing settings (``cache_key``), so two runs with the same data and tokenizer share one entry
whatever their names or learning rates, and a changed tokenizer, template or shard is a miss.

An entry is built in a hidden folder, its files made read-only, their sizes and sha256 recorded
in ``manifest.json`` (written last), and the folder renamed onto its key, so a half-written entry
is never seen. Before an entry is used, every file is checked against the manifest; a damaged
entry (no manifest, a missing file, a size or hash that differs) is removed with a warning naming
it, and the shard is tokenized again. Runs get copies, never hard links (a reflink where the file
system has them), so damage to one run's files reaches neither the cache nor another run.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from workflow_scripts.core.pipeline_io import atomic_path, file_sha256, write_json

log = logging.getLogger("tokenize")
CACHE_VERSION = 5  # 5: data.special_text applied here, not in the split; 4: stats gained length_counts
MANIFEST = "manifest.json"  # sizes and sha256 of an entry's files; present only in a complete entry
ENTRY_FILES = ("tokens.parquet", "packing.parquet", "rejects.parquet", "stats.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_fingerprint(tokenizer, source: str) -> str:
    """Hash of the tokenizer's files and its chat template."""
    h = hashlib.sha256()
    folder = Path(source)
    if folder.is_dir():
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                h.update(name.encode() + file_sha256(folder / name).encode())
    else:  # a hub id: the resolved tokenizer's own serialization
        h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()


def cache_key(shard: Path, tokenizer_hash: str, settings: dict) -> str:
    text = json.dumps([CACHE_VERSION, file_sha256(shard), tokenizer_hash, settings], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class DamagedEntry(Exception):
    """A cache entry whose files do not match its manifest."""


def copy_file(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst``: a reflink where the file system can, else bytes; never a hard link."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:  # copy_file_range shares extents (a reflink) on btrfs/XFS and copies in the kernel elsewhere
            while os.copy_file_range(fin.fileno(), fout.fileno(), 1 << 30) > 0:
                pass
        except (AttributeError, OSError):  # not on this OS, file system or kernel: copy in user space
            fin.seek(0)
            fout.seek(0)
            fout.truncate()
            shutil.copyfileobj(fin, fout, 1 << 20)


def write_manifest(entry: Path) -> dict:
    """Make the entry's files read-only and record their sizes and hashes; the manifest is written last."""
    files = {}
    for name in ENTRY_FILES:
        path = entry / name
        path.chmod(0o444)
        files[name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    manifest = {"version": CACHE_VERSION, "files": files}
    write_json(entry / MANIFEST, manifest)
    (entry / MANIFEST).chmod(0o444)
    return manifest


def read_manifest(entry: Path) -> dict:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        raise DamagedEntry(f"no {MANIFEST} (an interrupted or older entry)") from None
    except (OSError, ValueError) as e:
        raise DamagedEntry(f"{MANIFEST} unreadable: {e}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or any(
        not isinstance(files.get(n), dict) or {"size", "sha256"} - files[n].keys() for n in ENTRY_FILES
    ):
        raise DamagedEntry(f"{MANIFEST} does not list {', '.join(ENTRY_FILES)}")
    return files


def check_size(path: Path, expected: dict) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DamagedEntry(f"{path.name} is missing") from None
    if size != expected["size"]:
        raise DamagedEntry(f"{path.name} has {size} bytes, the manifest says {expected['size']}")


def check_hash(path: Path, expected: dict, name: str) -> None:
    check_size(path, expected)
    digest = file_sha256(path)
    if digest != expected["sha256"]:
        raise DamagedEntry(f"{name} has sha256 {digest[:16]}…, the manifest says {expected['sha256'][:16]}…")


def deliver(entry: Path, files: dict, outputs: dict[str, Path]) -> dict:
    """Copy the entry's files to ``outputs``, each checked against the manifest before it replaces its output.

    The copy is what gets hashed, so what a run reads is exactly what the manifest recorded.
    Returns the entry's stats.
    """
    for name in ENTRY_FILES:  # sizes first: a truncated file is caught before anything is copied
        check_size(entry / name, files[name])
    stats_bytes = (entry / "stats.json").read_bytes()
    if hashlib.sha256(stats_bytes).hexdigest() != files["stats.json"]["sha256"]:
        raise DamagedEntry("stats.json does not match its sha256 in the manifest")
    for name, dst in outputs.items():
        with atomic_path(dst) as tmp:
            copy_file(entry / name, tmp)
            check_hash(tmp, files[name], name)
    return json.loads(stats_bytes)


def discard(entry: Path) -> None:
    """Take a damaged entry out of the cache: renamed away first (atomic), then deleted."""
    trash = entry.with_name(f".{entry.name}.{os.getpid()}.damaged")
    try:
        os.rename(entry, trash)
    except FileNotFoundError:  # another job removed it already
        return
    except OSError:
        trash = entry
    shutil.rmtree(trash, ignore_errors=True)


def from_cache(entry: Path, outputs: dict[str, Path]) -> tuple[dict | None, str | None]:
    """A verified entry's stats (its files copied to ``outputs``), or None and why the entry was unusable."""
    if not entry.exists():
        return None, None
    try:
        return deliver(entry, read_manifest(entry), outputs), None
    except DamagedEntry as e:
        log.warning("cache entry %s is damaged: %s; removing it and tokenizing the shard again", entry, e)
        discard(entry)
        return None, str(e)


def publish(build: Path, entry: Path) -> None:
    """Rename a complete build folder onto its key; if another job published the key first, keep theirs."""
    try:
        os.rename(build, entry)
    except OSError:
        shutil.rmtree(build, ignore_errors=True)


def build_folder(parent: Path, name: str) -> Path:
    """A fresh hidden folder in ``parent`` to build an entry in, with the permissions mkdir would give
    (not mkdtemp's 0700), so a published entry is readable as any other folder."""
    parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".build", dir=parent))
    umask = os.umask(0o022)
    os.umask(umask)
    build.chmod(0o777 & ~umask)
    return build


def cached(cache_dir: Path | None, key: str, outputs: dict[str, Path], build: Callable[[Path], dict]) -> dict:
    """The stats of the entry ``key`` under ``cache_dir``, its files copied to ``outputs`` (entry file name →
    path); on a miss, ``build(folder)`` writes the entry's files but stats.json into ``folder`` and returns
    the stats, and the entry is published. Without a cache the files are built beside the first output and
    moved into place. The stats say which: ``cache`` is hit, miss, rebuilt (a damaged entry) or off."""
    entry = cache_dir / key if cache_dir else None
    stats, damage = from_cache(entry, outputs) if entry else (None, None)
    if stats is not None:
        log.info("cache hit %s", entry)
        return stats | {"cache": "hit"}
    first = next(iter(outputs.values()))
    folder = build_folder(cache_dir if entry else first.parent, key if entry else first.stem)
    try:
        stats = build(folder)
        write_json(folder / "stats.json", stats)
        if entry:
            deliver(folder, write_manifest(folder)["files"], outputs)
            publish(folder, entry)
        else:
            for name, dst in outputs.items():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(folder / name, dst)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stats |= {"cache": ("rebuilt" if damage else "miss") if entry else "off"}
    return stats | ({"cache_damage": f"{entry}: {damage}"} if damage else {})
