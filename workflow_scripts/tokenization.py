"""tokenize_shard: render conversations with the chat template, tokenize, mask, pack, cache.

One Parquet row per example: ``input_ids``, ``labels`` (-100 everywhere but the
assistant turns, so the loss is on the answers only), ``length`` and
``prompt_length`` (the ids evaluation feeds the model before it generates the last
answer). Training and evaluation read the same ids from this cache.

A conversation is rendered once and cut at the assistant turns; each piece is
tokenized on its own (all pieces of a batch in one call of the fast tokenizer),
so a turn's tokens never depend on what follows it.

The cache is content-addressed: the key hashes the shard's bytes, the tokenizer
files, the chat template, the length policy and the packing settings, so two runs
with the same data and tokenizer share one entry whatever their names or learning
rates, and a changed tokenizer, template or shard is a miss.

The cache checks itself. An entry is built in a hidden folder, its files made
read-only, their sizes and sha256 recorded in ``manifest.json`` (written last), and
the folder renamed onto its key, so a half-written entry is never seen. Before an
entry is used, every file is checked against the manifest; a damaged entry (no
manifest, a missing file, a size or hash that differs) is removed with a warning
naming it, and the shard is tokenized again. Runs get copies, never hard links
(a reflink where the file system has them), so damage to one run's files reaches
neither the cache nor another run.
"""

import argparse
import bisect
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pipeline_io import UserError, atomic_path, cli, file_sha256, write_json
from settings import option
from tqdm import tqdm
from transformers import AutoTokenizer

log = logging.getLogger("tokenize")
IGNORE = -100
CACHE_VERSION = 2
MANIFEST = "manifest.json"  # sizes and sha256 of an entry's files; present only in a complete entry
ENTRY_FILES = ("tokens.parquet", "packing.parquet", "stats.json")
PAD_BATCH = 8  # micro-batch size of the pad-to-longest comparison
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("length", pa.int32()),
        ("prompt_length", pa.int32()),
        ("response", pa.string()),
        ("content_hash", pa.string()),
        ("category", pa.string()),
    ]
)


def messages_for(prompt: str, question: str, response: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": prompt}] if prompt else []
    messages.append({"role": "user", "content": question})
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    return messages


class ChatRenderer:
    """The tokenizer's chat template, compiled once and rendered directly.

    ``apply_chat_template`` re-validates its arguments on every call, which costs more
    than the rendering itself; the output is the same (a test checks it).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.extra = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self.compiled = _compile_jinja_template(tokenizer.chat_template)
        except (ImportError, AttributeError):  # a transformers without the helper: the slow path
            self.compiled = None

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self.compiled is None:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        return self.compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **self.extra
        )


def segments(render, messages: list[dict]) -> list[tuple[str, bool]]:
    """Cut the rendered conversation into (text, is_answer) pieces at each assistant turn."""
    full = render(messages)
    pieces, pos = [], 0
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        start = len(render(messages[:i], add_generation_prompt=True))
        end = len(full) if i == len(messages) - 1 else len(render(messages[: i + 1]))
        if not (pos <= start <= end <= len(full)):
            raise UserError("chat template: a conversation does not render as a prefix of its continuation")
        pieces += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    if pos < len(full):
        pieces.append((full[pos:], False))
    return pieces


def encode_messages(tokenizer, conversations: list[list[dict]], render: ChatRenderer | None = None) -> list[dict]:
    """Tokenize a batch of conversations; labels cover each answer up to and including EOS."""
    render = render or ChatRenderer(tokenizer)
    cut = [segments(render, m) for m in conversations]
    flat = [text for pieces in cut for text, _ in pieces]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: transformers' per-encoding wrapper costs ~15%
        if backend.truncation or backend.padding:
            backend.no_truncation()
            backend.no_padding()
        ids = [e.ids for e in backend.encode_batch(flat, add_special_tokens=False)] if flat else []
    else:
        ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    eos, out, k = tokenizer.eos_token_id, [], 0
    for pieces in cut:
        input_ids, labels, prompt_length = [], [], 0
        for _, is_answer in pieces:
            piece = ids[k]
            k += 1
            if is_answer:
                prompt_length = len(input_ids)  # ends up at the last answer
                end = piece.index(eos) + 1 if eos in piece else len(piece)
                labels += piece[:end] + [IGNORE] * (len(piece) - end)
            else:
                labels += [IGNORE] * len(piece)
            input_ids += piece
        out.append({"input_ids": input_ids, "labels": labels, "prompt_length": prompt_length})
    return out


def encode(tokenizer, prompts, questions, responses) -> list[dict]:
    """Single-turn convenience over encode_messages."""
    convs = [messages_for(p, q, r) for p, q, r in zip(prompts, questions, responses, strict=True)]
    return encode_messages(tokenizer, convs)


def fit_length(example: dict, max_len: int, policy: str) -> dict | None:
    """Apply the over-length policy: keep, truncate, drop (None) or raise."""
    if len(example["input_ids"]) <= max_len:
        return example
    if policy == "error":
        raise UserError(f"an example has {len(example['input_ids'])} tokens, above data.max_seq_len={max_len}")
    if policy == "drop" or example["prompt_length"] >= max_len:
        return None
    return {k: v[:max_len] if isinstance(v, list) else v for k, v in example.items()}


# ---------------------------------------------------------------- packing


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each sequence, longest first, into the fullest bin it still fits.

    Bins are kept in buckets by space left, and the distinct space values (at most
    ``capacity``) in a sorted list, so each placement costs O(log capacity).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # space left -> bins with exactly that space
    spaces: list[int] = []  # sorted keys of the non-empty buckets
    for i in order:
        n = min(lengths[i], capacity)
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):
            space = spaces[at]
            b = buckets[space].pop()
            if not buckets[space]:
                del buckets[space]
                spaces.pop(at)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = space - n
        if left > 0:
            if left not in buckets:
                buckets[left] = []
                bisect.insort(spaces, left)
            buckets[left].append(b)
    return bins


def packing_stats(lengths: list[int], bins: list[list[int]], capacity: int, seed: int = 0) -> dict:
    real = sum(lengths)
    shuffled = lengths[:]
    random.Random(seed).shuffle(shuffled)
    padded = sum(
        max(shuffled[i : i + PAD_BATCH]) * len(shuffled[i : i + PAD_BATCH]) for i in range(0, len(shuffled), PAD_BATCH)
    )
    return {
        "bins": len(bins),
        "packing_efficiency": real / (len(bins) * capacity) if bins else 0.0,
        "pad_to_longest_efficiency": real / padded if padded else 0.0,
        "pad_batch": PAD_BATCH,
    }


# ---------------------------------------------------------------- cache


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


# ---------------------------------------------------------------- stage


def tokenize_shard(tokenizer, shard: Path, tokens_out: Path, max_len: int, policy: str, batch_rows: int = 2048):
    """Stream the shard through render → tokenize → mask → fit, writing as it goes."""
    file = pq.ParquetFile(shard)
    render = ChatRenderer(tokenizer)
    lengths, dropped, truncated = [], 0, 0
    with atomic_path(tokens_out) as tmp, pq.ParquetWriter(tmp, SCHEMA) as writer:
        bar = tqdm(total=file.metadata.num_rows, desc=f"tokenize {shard.name}", unit="ex", mininterval=5)
        for batch in file.iter_batches(batch_size=batch_rows, columns=["messages", "content_hash", "category"]):
            rows = batch.to_pylist()
            encoded = encode_messages(tokenizer, [json.loads(r["messages"]) for r in rows], render)
            out = {name: [] for name in SCHEMA.names}
            for row, ex in zip(rows, encoded, strict=True):
                fitted = fit_length(ex, max_len, policy)
                if fitted is None:
                    dropped += 1
                    continue
                truncated += fitted is not ex
                messages = json.loads(row["messages"])
                for key in ("input_ids", "labels", "prompt_length"):
                    out[key].append(fitted[key])
                out["length"].append(len(fitted["input_ids"]))
                out["response"].append(messages[-1]["content"])
                out["content_hash"].append(row["content_hash"])
                out["category"].append(row["category"] or "")
            lengths += out["length"]
            writer.write_table(pa.Table.from_pydict(out, schema=SCHEMA))
            bar.update(len(rows))
        bar.close()
    return lengths, {
        "examples": len(lengths),
        "tokens": sum(lengths),
        "dropped_too_long": dropped,
        "truncated": truncated,
    }


def write_packing(lengths: list[int], capacity: int, path: Path) -> dict:
    bins = pack_best_fit_decreasing(lengths, capacity)
    table = pa.table({"bin": pa.array(range(len(bins)), pa.int32()), "examples": pa.array(bins, pa.list_(pa.int32()))})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return packing_stats(lengths, bins, capacity)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard", required=True, type=Path)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file replacing the tokenizer's")
    p.add_argument("--max-seq-len", type=int, required=True)
    p.add_argument("--overlength", **option("data.overlength"))
    p.add_argument("--pack-len", type=int, default=0, help="bin size of the packing plan (0 = max-seq-len)")
    p.add_argument("--cache-dir", type=Path, default=None, help="content-addressed cache shared between runs")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--packing", required=True, type=Path)
    p.add_argument("--stats", required=True, type=Path)
    a = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    if a.chat_template:
        tokenizer.chat_template = Path(a.chat_template).read_text()
    if tokenizer.chat_template is None:
        raise UserError(f"{a.tokenizer}: the tokenizer has no chat template; set data.chat_template")
    pack_len = a.pack_len or a.max_seq_len
    settings = {"max_seq_len": a.max_seq_len, "overlength": a.overlength, "pack_len": pack_len}
    key = cache_key(a.shard, tokenizer_fingerprint(tokenizer, a.tokenizer), settings)
    outputs = {"tokens.parquet": a.output, "packing.parquet": a.packing}
    entry = (a.cache_dir / key) if a.cache_dir else None
    stats, damage = from_cache(entry, outputs) if entry else (None, None)
    if stats is not None:
        stats |= {"cache": "hit"}
        log.info("cache hit %s", entry)
    else:
        parent = a.cache_dir if entry else a.output.parent
        parent.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f".{key if entry else a.output.stem}.", suffix=".build", dir=parent))
        umask = os.umask(0o022)
        os.umask(umask)
        build.chmod(0o777 & ~umask)  # an entry folder as mkdir would make it, not mkdtemp's 0700
        try:
            lengths, stats = tokenize_shard(tokenizer, a.shard, build / "tokens.parquet", a.max_seq_len, a.overlength)
            stats |= write_packing(lengths, pack_len, build / "packing.parquet") | {"key": key, "settings": settings}
            write_json(build / "stats.json", stats)
            if entry:
                deliver(build, write_manifest(build)["files"], outputs)
                publish(build, entry)
            else:
                for name, dst in outputs.items():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(build / name, dst)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        stats |= {"cache": ("rebuilt" if damage else "miss") if entry else "off"}
        if damage:
            stats |= {"cache_damage": f"{entry}: {damage}"}
    write_json(a.stats, stats | {"shard": str(a.shard)})
    print(f"{a.shard}: {stats['examples']} examples, {stats['tokens']} tokens, cache {stats['cache']}")


if __name__ == "__main__":
    main()
