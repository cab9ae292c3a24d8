"""Weight files: the dtype table, safetensors read (positioned, no memory map) and write (streamed,
tensor by tensor, in shards of Hugging Face's size), shared by training's loader (model_loading),
consolidation and model soups.

A *source* is anything with ``read(names) -> {name: tensor}`` and ``release(tensors)`` (which hands
back what a read mapped in): a strategy's checkpoint reader (parallel/), a model in memory, the
soup's mean of several models. ``stream`` reads one a batch at a time; ``write_sharded`` writes
what it streams.
"""

import json
import math
import os
import re
import struct
from pathlib import Path

import torch

from workflow_scripts.core.pipeline_io import UserError, atomic_path, write_json

# The one dtype table: the config's names (training.precision, consolidate.dtype) and the safetensors
# header codes of the torch dtypes.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETENSORS_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                     torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip
FROM_CODE = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}
READ_BYTES = 64 * 2**20  # bytes read per batch (a larger tensor is read alone)
MAX_SHARD_SIZE = "2GB"  # safetensors files written (consolidation, soups), as Hugging Face's default


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(shape, dtype: torch.dtype) -> int:
    return dtype.itemsize * math.prod(shape)


# ---------------------------------------------------------------- read


class CheckpointFiles:
    """A model's tensors by name, read from safetensors files (one file or an index) with positioned
    reads: a slice of rows, or a range of the flattened tensor, reads only its own bytes, and nothing
    is memory-mapped (mapped file pages would count in every rank's resident set)."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise UserError(
                f"{folder}: no model.safetensors or model.safetensors.index.json (sharded loading reads"
                " safetensors; convert the checkpoint with save_pretrained(safe_serialization=True))"
            )
        self.tensors = {}  # name -> (file descriptor, dtype, shape, offset of its first byte)
        for name in files:
            fd = os.open(folder / name, os.O_RDONLY)
            (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, size, 8))
            for key, meta in header.items():
                if key != "__metadata__":
                    dtype = FROM_CODE[meta["dtype"]]
                    self.tensors[key] = (fd, dtype, tuple(meta["shape"]), 8 + size + meta["data_offsets"][0])

    def names(self) -> set[str]:
        return set(self.tensors)

    def close(self) -> None:
        for fd in {fd for fd, *_ in self.tensors.values()}:
            os.close(fd)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][2]

    def read_flat(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the flattened tensor."""
        fd, dtype, _, offset = self.tensors[name]
        item = torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(count * item, dtype=torch.uint8)
        view, at = memoryview(buf.numpy()), 0
        while at < len(view):
            got = os.preadv(fd, [view[at:]], offset + start * item + at)
            if got == 0:
                raise UserError(f"{self.folder}: {name} is cut short (a truncated safetensors file)")
            at += got
        return buf.view(dtype)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice ``index`` (one slice per dimension) of a tensor: its rows are read, the rest cut in memory."""
        shape = self.shape(name)
        if not shape:
            return self.read_flat(name, 0, 1).view(())
        rows, width = index[0], math.prod(shape[1:])
        block = self.read_flat(name, rows.start * width, (rows.stop - rows.start) * width)
        return block.view(rows.stop - rows.start, *shape[1:])[(slice(None), *index[1:])]


def checkpoint_name(param_name: str, available: set[str], prefix: str) -> str | None:
    """The checkpoint key of a (possibly peft-wrapped) parameter name."""
    name = param_name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    for candidate in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
        if candidate in available:
            return candidate
    return None


def header_dtypes(folder: Path) -> dict[str, int]:
    """Bytes per safetensors dtype code ("BF16", "F32", ...) over every safetensors file in ``folder``."""
    total: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                total[entry["dtype"]] = total.get(entry["dtype"], 0) + end - start
    return total


def stored_dtype(name_or_path: str) -> torch.dtype:
    """The dtype a model's weights are stored in: its config.json's ``dtype`` (``torch_dtype`` in files
    written before transformers 4.56), else the floating dtype holding most bytes in its safetensors;
    fp32 when neither tells, or when it is none of fp32, bf16, fp16 (fp64, quantized formats)."""
    from workflow_scripts.core.fingerprint import local_model_folder

    folder = local_model_folder(name_or_path)
    config = json.loads((folder / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    by_name = {dtype_name(d): d for d in DTYPES.values()}
    if isinstance(name, str) and name != "auto":
        return by_name.get(name, torch.float32)
    by_code = {SAFETENSORS_CODES[d]: d for d in DTYPES.values()}
    floating = {code: n for code, n in header_dtypes(folder).items() if code in by_code}
    return by_code[max(floating, key=floating.get)] if floating else torch.float32


# ---------------------------------------------------------------- write


def parse_size(text: str | int) -> int:
    """'2GB' -> 2*10**9 bytes, '500MiB' -> 500*2**20, as Hugging Face's max_shard_size reads them."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m:
        raise UserError(f"max shard size {text!r}: expected a number and a unit, e.g. 2GB or 500MB")
    power = "_KMGT".index(m.group(2) or "_")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Consecutive names grouped into shards of at most ``max_bytes`` (a larger tensor gets its own)."""
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


def shard_files(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def stream(source, shapes: dict[str, torch.Size], batch_bytes: int = READ_BYTES):
    """Yield (name, tensor) in ``shapes`` order, a batch of reads at a time, releasing each batch."""
    for names in plan_shards({n: 4 * math.prod(s) for n, s in shapes.items()}, batch_bytes):
        tensors = source.read(names)
        for name in names:
            got, want = tuple(tensors[name].shape), tuple(shapes[name])
            if got != want:
                raise UserError(f"{name}: checkpoint has shape {got}, model {want}")
            yield name, tensors[name]
        source.release(tensors)


def write_safetensors(path: Path, shapes: dict[str, torch.Size], tensors, dtype: torch.dtype = torch.float32) -> None:
    """One safetensors file of ``dtype`` tensors written tensor by tensor: the header (names, shapes,
    offsets) is known up front from ``shapes``, so no more than one tensor is ever held for writing."""
    header, offset, code = {}, 0, SAFETENSORS_CODES[dtype]
    for name, shape in shapes.items():
        size = nbytes(shape, dtype)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in tensors:
            t = t.detach().to(dtype).contiguous()
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # numpy has no bf16: the bytes
        if f.tell() != 8 + len(raw) + offset:
            raise UserError(f"{path}: wrote {f.tell()} bytes, expected {8 + len(raw) + offset}")


def write_sharded(
    source, shapes: dict[str, torch.Size], output: Path, max_bytes: int, dtype: torch.dtype = torch.float32
) -> list[str]:
    """``dtype`` safetensors streamed from ``source``; an index when there are several files. Returns the files."""
    shards = plan_shards({n: nbytes(s, dtype) for n, s in shapes.items()}, max_bytes)
    files = shard_files(len(shards))
    for file, names in zip(files, shards, strict=True):
        part = {n: shapes[n] for n in names}
        write_safetensors(output / file, part, stream(source, part), dtype)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(nbytes(s, dtype) for s in shapes.values())},
            "weight_map": {n: f for f, names in zip(files, shards, strict=True) for n in names},
        }
        write_json(output / "model.safetensors.index.json", index)
    return files
