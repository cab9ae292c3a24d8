"""Checkpoint manifests: the size and sha256 of every file of a checkpoint, in its ``COMPLETE`` marker.

Each file is hashed as it is written: ``Writes.open`` gives a file object that hashes what passes
through it, and torch.save (DDP's ``state.pt``, DeepSpeed's engine, each tensor of a torch.distributed
checkpoint) and our own files (RNG state, metrics) are written through it. A file a library writes
some other way (DCP's ``.metadata`` is renamed into place, DeepSpeed copies ``zero_to_fp32.py``) is
read back once at commit, right after it was written (from the page cache as a rule; a few KB here).

Before a checkpoint is read (resume, consolidation) each file's size and sha256 are checked against
the marker; a marker without them (written before checkpoints were verified) is not trusted.

Cost, measured on this project's 2 shared CPU cores with a 1.07 GB torch.save: sha256 runs at 1.9 s/GB
(in memory or read back from the page cache); hashing while writing took torch.save from 2.3-5.0 s/GB
to 3.8-5.7 s/GB (noisy machine); the demo's 41 MB checkpoints commit in 0.02-0.06 s with nothing read
back (DDP, FSDP, DeepSpeed ZeRO-3). The check before a resume reads every file once, about 1.9 s/GB
split over the ranks.
"""

import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workflow_scripts.core.pipeline_io import file_sha256, free_bytes, is_disk_full

MARKER = "COMPLETE"
CHUNK = 1 << 22


class HashingFile(io.RawIOBase):
    """A file opened for writing that hashes every byte written through it. No ``fileno`` unless asked
    (``fileno=True``): torch.save would write a storage to the descriptor directly, past the hash."""

    def __init__(self, path: Path, on_close, fileno: bool = False, on_error=lambda e: None):
        super().__init__()
        self.path, self.on_close, self.on_error, self.has_fileno = Path(path), on_close, on_error, fileno
        self.raw = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.sha, self.size = hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        try:
            self.raw.write(view)
        except OSError as e:  # torch's writer reports it as "unexpected pos" or an iostream error
            self.on_error(e)
            raise
        self.sha.update(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        if not self.has_fileno:
            raise io.UnsupportedOperation("fileno")
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
            self.on_close(self.path, {"size": self.size, "sha256": self.sha.hexdigest()})
        super().close()


class Writes:
    """What this rank wrote into a checkpoint folder: {path relative to the folder: {size, sha256}}.
    ``error``: the last OSError a write raised (the real cause when a library reports another)."""

    def __init__(self, folder: Path):
        self.folder, self.files, self.error = Path(folder), {}, None

    def _record(self, path: Path, entry: dict) -> None:
        if Path(path).is_relative_to(self.folder):  # else not this checkpoint's (DeepSpeed's ``latest``)
            self.files[Path(path).relative_to(self.folder).as_posix()] = entry

    def open(self, path, fileno: bool = False) -> HashingFile:
        return HashingFile(Path(path), self._record, fileno, on_error=self._failed)

    def _failed(self, error: OSError) -> None:
        self.error = error

    def write_bytes(self, path, data: bytes) -> None:
        with self.open(path) as f:
            f.write(data)

    def copy(self, source: Path, path) -> None:
        with open(source, "rb") as src, self.open(path) as f:
            while block := src.read(CHUNK):
                f.write(block)

    def torch_save(self, obj, path, **kwargs) -> None:
        import torch

        with self.open(path) as f:
            torch.save(obj, f, **kwargs)

    def renamed(self, old, new) -> None:
        """A file written through ``open`` was renamed (DCP writes ``.metadata.tmp``, then renames it)."""
        key = Path(old).relative_to(self.folder).as_posix() if Path(old).is_relative_to(self.folder) else None
        if key in self.files:
            self._record(Path(new), self.files.pop(key))


def folder_files(folder: Path) -> list[str]:
    """The checkpoint's files, relative to ``folder`` (the marker and its temporary file excluded)."""
    skip = {MARKER, f".{MARKER}.tmp"}
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name not in skip)


def build_manifest(folder: Path, written: dict) -> tuple[dict, int]:
    """Every file of ``folder`` with its size and sha256: those ``written`` records (what the ranks hashed
    while writing), the others read back. Returns (manifest, bytes read back)."""
    files, read_back = {}, 0
    for name in folder_files(folder):
        entry = written.get(name)  # the writer's record: another host's stat may lag (NFS attribute cache)
        if entry is None:  # not written through a HashingFile
            size = (folder / name).stat().st_size
            entry = {"size": size, "sha256": file_sha256(folder / name)}
            read_back += size
        files[name] = entry
    return files, read_back


def marker_text(step: int, files: dict, when: float) -> str:
    return json.dumps({"step": step, "time": when, "files": files}, sort_keys=True) + "\n"


def read_marker(folder: Path) -> tuple[dict | None, str | None]:
    """(the marker, None), or (None, why it cannot be trusted)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable {MARKER} marker ({type(e).__name__})"
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict) or not marker["files"]:
        return None, f"its {MARKER} marker has no checksums (written before checkpoints were verified)"
    return marker, None


def check_files(folder: Path, files: dict, names, threads: int = 1) -> str | None:
    """Why the first of ``names`` whose size or sha256 differs from ``files`` (the manifest) is bad; None: all match."""
    for name in names:
        path, want = Path(folder) / name, files[name]
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size:,} bytes, {want['size']:,} were written"
    with ThreadPoolExecutor(threads) as pool:  # hashlib lets go of the GIL: files hash in parallel
        for name, sha in zip(names, pool.map(lambda n: file_sha256(Path(folder) / n), names), strict=True):
            if sha != files[name]["sha256"]:
                return f"{name}: sha256 differs from the one written"
    return None


def shares(files: dict, world: int) -> list[list[str]]:
    """The manifest's files split over ``world`` ranks by size (largest first to the least loaded), so the
    ranks check a checkpoint in parallel; the same split on every rank."""
    out, load = [[] for _ in range(world)], [0] * world
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += files[name]["size"]
    return out


def verify(folder: Path) -> str | None:
    """Why ``folder`` cannot be trusted (marker, a file missing, short, or changed), or None: one process,
    a few files hashed at a time."""
    marker, problem = read_marker(folder)
    threads = min(4, os.cpu_count() or 1)
    return problem or check_files(folder, marker["files"], sorted(marker["files"]), threads)


def space_message(folder: Path, error: BaseException) -> str:
    """A failed save, said with the folder and the free space on its filesystem (a full disk otherwise
    shows as ``basic_ios::clear: iostream error`` or a bare errno)."""
    where = Path(folder)
    while not where.exists() and where != where.parent:
        where = where.parent
    left = free_bytes(where)
    free = "free space unknown" if left is None else f"{left / 2**30:.2f} GiB free there"
    first = (str(error).strip().splitlines() or [""])[0][:200]
    full = is_disk_full(error, left)  # pipeline_io's rule, as for every other write
    return f"checkpoint {folder}: {'disk full: ' if full else ''}save failed ({type(error).__name__}: {first}); {free}"
