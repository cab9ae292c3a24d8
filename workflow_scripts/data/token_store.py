"""The trainer's token store: a tokenized shard as memory-mapped int32 arrays.

Parquet is compressed and cannot be mapped, and Python lists of its rows cost about 156 bytes a
token on every rank. So each shard is converted once, streamed record batch by record batch, into
a folder named by the shard's sha256 (a changed shard gets a new folder, never a stale one):

    <root>/<sha256>/input_ids.int32   every row's input_ids back to back
                    labels.int32      every row's labels back to back
                    offsets.int64     rows + 1 of them: row i is [offsets[i], offsets[i + 1])
                    store.json        format, shard, rows, tokens

The folder is written under a temporary name and renamed into place, under a file lock: one
process builds it, the others wait for the lock and reuse it. Every open checks it (format, row
count equal to the shard's, offsets from 0 never decreasing, last offset equal to the arrays'
length): a store that fails is rebuilt, and a fresh one that fails is an error naming it. Ranks
map the files read-only, so a host's page cache holds one copy, and each micro-batch's pages are
dropped from the rank's mappings once copied into the batch (``release``): a rank's RSS stays flat
through the epoch, and SLURM, which sums its processes' RSS, does not count the store once per rank.
"""

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from workflow_scripts.core.contracts import batches
from workflow_scripts.core.pipeline_io import UserError, file_sha256, locked

log = logging.getLogger("token_store")

FORMAT = 1
COLUMNS = ("input_ids", "labels")
TOKEN_FILES = {"input_ids": "input_ids.int32", "labels": "labels.int32"}
OFFSETS_FILE = "offsets.int64"
META_FILE = "store.json"


class StoreError(UserError):
    """A token store on disk that cannot be used as it is."""


def store_root_for(checkpoint_root: Path) -> Path:
    """Where the token stores live: beside every node's checkpoints of the run (outside Snakemake's
    outputs, on the shared file system), shared by the nodes, as they are named by content."""
    return Path(os.path.abspath(checkpoint_root)).parent / "token-store"


@dataclasses.dataclass(frozen=True)
class TokenStore:
    """One shard's tokens, memory-mapped: row i is input_ids[offsets[i]:offsets[i + 1]] (same for labels)."""

    folder: Path
    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32
    offsets: np.ndarray  # int64, rows + 1
    maps: tuple[mmap.mmap, ...] = dataclasses.field(default=(), repr=False)

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i's input_ids and labels: views into the mapped arrays, nothing read until used."""
        start, end = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[start:end], self.labels[start:end]

    def release(self) -> None:
        """Drop the pages read so far from this process's mappings; they stay in the page cache, and a
        later read maps them again."""
        for m in self.maps:
            m.madvise(mmap.MADV_DONTNEED)


def list_column(batch: pa.RecordBatch, name: str, shard: Path) -> tuple[np.ndarray, np.ndarray]:
    """A list column of a record batch: every row's values back to back as int32, and the row lengths."""
    column = batch.column(name)
    if column.null_count:
        raise UserError(f"{shard}: column {name} has {column.null_count} null row(s)")
    try:
        values = pc.cast(column.flatten(), pa.int32()).to_numpy()
    except pa.ArrowInvalid as e:
        raise UserError(f"{shard}: column {name} holds values that do not fit int32 ({e})") from None
    return values, pc.list_value_length(column).to_numpy().astype(np.int64)


def record_batches(file: pq.ParquetFile, batch_rows: int):
    """The token columns, a few rows at a time (contracts.batches: one reader per row group)."""
    return batches(file, batch_rows, list(COLUMNS))


def write_store(shard: Path, folder: Path, sha256: str, batch_rows: int = 1024) -> None:
    """Convert ``shard`` into a store at ``folder``: streamed by record batch (about a row group in
    memory at a time), written under a temporary name and renamed into place."""
    file = pq.ParquetFile(shard)
    missing = [c for c in COLUMNS if c not in file.schema_arrow.names]
    if missing:
        raise UserError(f"{shard}: no column {', '.join(missing)} (not a tokenized shard)")
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        rows = tokens = 0
        with contextlib.ExitStack() as stack:
            out = {name: stack.enter_context(open(tmp / f, "wb")) for name, f in TOKEN_FILES.items()}
            offsets = stack.enter_context(open(tmp / OFFSETS_FILE, "wb"))
            np.zeros(1, np.int64).tofile(offsets)
            for batch in record_batches(file, batch_rows):
                (ids, lengths), (labels, label_lengths) = (list_column(batch, c, shard) for c in COLUMNS)
                if not np.array_equal(lengths, label_lengths):
                    r = int(np.flatnonzero(lengths != label_lengths)[0])
                    raise UserError(f"{shard}: row {rows + r} has {lengths[r]} input_ids but {label_lengths[r]} labels")
                ids.tofile(out["input_ids"])
                labels.tofile(out["labels"])
                (tokens + np.cumsum(lengths)).tofile(offsets)
                rows, tokens = rows + len(lengths), tokens + int(lengths.sum())
        meta = {"format": FORMAT, "sha256": sha256, "shard": str(shard), "rows": rows, "tokens": tokens}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if folder.exists():  # a bad store: moved aside, then replaced
            old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
            os.rename(folder, old)
            shutil.rmtree(old)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        pa.default_memory_pool().release_unused()  # Arrow's allocator keeps what the batches took


def mapped(path: Path, dtype) -> tuple[np.ndarray, tuple[mmap.mmap, ...]]:
    """A file of ``dtype`` values memory-mapped read-only, and its mapping (none for an empty file,
    which cannot be mapped)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return np.zeros(0, dtype), ()
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(m, dtype), (m,)


def check_store(folder: Path, sha256: str, rows: int) -> TokenStore:
    """The store at ``folder``, mapped, if it is whole and holds ``rows`` rows; else a StoreError naming it."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"{META_FILE} is not a JSON object")
        sizes = {f: (folder / f).stat().st_size for f in (*TOKEN_FILES.values(), OFFSETS_FILE)}
    except (OSError, ValueError) as e:
        raise StoreError(f"{folder}: incomplete token store ({e})") from None
    if meta.get("format") != FORMAT or meta.get("sha256") != sha256:
        raise StoreError(f"{folder}: token store of another format or shard ({META_FILE}: {meta})")
    if meta.get("rows") != rows:
        raise StoreError(f"{folder}: token store holds {meta.get('rows')} rows, the shard {rows}")
    if sizes[OFFSETS_FILE] != 8 * (rows + 1):
        raise StoreError(f"{folder}: {OFFSETS_FILE} holds {sizes[OFFSETS_FILE]} bytes, not {8 * (rows + 1)}")
    offsets, maps = mapped(folder / OFFSETS_FILE, np.int64)
    if offsets[0] != 0 or np.any(offsets[1:] < offsets[:-1]):
        raise StoreError(f"{folder}: {OFFSETS_FILE} does not rise from 0")
    tokens = int(offsets[-1])
    for name, f in TOKEN_FILES.items():
        if sizes[f] != 4 * tokens:
            raise StoreError(f"{folder}: {f} holds {sizes[f] // 4} {name}, the offsets end at {tokens}")
    (ids, ids_map), (labels, labels_map) = (mapped(folder / f, np.int32) for f in TOKEN_FILES.values())
    store = TokenStore(folder, ids, labels, offsets, maps + ids_map + labels_map)
    store.release()  # the offsets just checked
    return store


def open_store(shard: Path, root: Path, sha256: str | None = None) -> TokenStore:
    """``shard``'s token store under ``root``, built on first use (or rebuilt when bad), under a lock."""
    sha256 = sha256 or file_sha256(shard)
    rows = pq.ParquetFile(shard).metadata.num_rows
    folder = Path(root) / sha256
    with locked(folder):
        if folder.exists():
            try:
                return check_store(folder, sha256, rows)
            except StoreError as e:
                log.warning("%s; rebuilding it", e)
        start = time.perf_counter()
        write_store(shard, folder, sha256)
        store = check_store(folder, sha256, rows)
        log.info("token store %s: %d rows, %d tokens of %s (%.1f s)", folder, rows, store.tokens, shard,
                 time.perf_counter() - start)  # fmt: skip
        return store
