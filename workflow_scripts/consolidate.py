"""consolidate_node: turn a node's final training checkpoint into a Hugging Face model folder.

DDP ``state.pt`` (memory-mapped), FSDP2 torch.distributed.checkpoint folders and
DeepSpeed ZeRO 1-3 checkpoints (DeepSpeed's ``zero_to_fp32`` in lazy mode) are each
read through their own APIs. The weights are written in ``--dtype``: ``base`` (the
default) is the base model's own dtype (``stored_dtype``: bf16 for most hub models, fp32
for the demo and from-scratch presets), or fp32/bf16/fp16. The training-side model is
rebuilt without weights (on the meta device) and its parameters are the checkpoint's
(fp32) tensors rounded once to that dtype, read a few megabytes at a time (in fp32 they
*are* the checkpoint's tensors, no copy); its logits on fixed inputs are the reference.
The weights are then streamed from that model to safetensors one tensor at a time
(``model-0000i-of-0000n.safetensors`` and an index when there is more than one),
handing the pages of memory-mapped files back to the kernel as it goes, so the peak
stays near one copy of the weights in the written dtype, not the three or four that
loading a whole state dict into a model and saving it takes. With LoRA the base is
loaded, the adapter merged into it layer by layer in fp32 and each merged weight rounded
to the written dtype; the adapter itself is saved in peft format (``adapter/``), fp32 as
trained, beside the merged model.

The stage checks its own result, one model in memory at a time: the saved folder,
reloaded with ``from_pretrained`` in the written dtype, gives the training-side model's
logits; every LoRA B matrix is present and non-zero; a short generation runs. A truncated
or corrupt checkpoint fails with one line naming it. Peak RSS per phase goes to
consolidation.json.

The check compares at the precision written. Both models hold their weights in the
written dtype and run in fp32 on the CPU (``fp32_compute`` upcasts each module's weights
for its own forward only), so the reference is the training-side model with its weights
rounded to the written dtype, and the reloaded folder should give bit-identical logits:
the tolerance (1e-5) stays the fp32 one. Comparing with the unrounded fp32 model instead
would need a tolerance as large as bf16 rounding moves the logits (7e-3 on the demo
model's logits, which are of order 1), large enough to hide a wrong tensor. In fp32
nothing is upcast and the path is the one fp32 consolidation always took.

The folder carries the template training used (data.chat_template, data.format_template, or the
base tokenizer's own) as the tokenizer's chat template, and a generation config that stops at the
end-of-turn tokens (``eos_token_id``), pads with the EOS when there is no pad token, and holds
data.template_kwargs as ``chat_template_kwargs``: ``apply_chat_template`` and ``pipeline`` on it
render and stop as training did.
"""

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import math
import os
import re
import struct
import sys
from pathlib import Path

import torch
from pipeline_io import UserError, atomic_path, cli, json_object, write_json
from settings import option
from strategies import DTYPES
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now; never loses data
READ_BYTES = 64 * 2**20  # tensors read from a checkpoint per batch (a larger tensor is read alone)
MAX_SHARD_SIZE = "2GB"  # safetensors files written (consolidation, soups), as Hugging Face's default


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


# ---------------------------------------------------------------- dtypes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    from fingerprint import local_model_folder

    folder = local_model_folder(name_or_path)
    config = json.loads((folder / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    by_name = {dtype_name(d): d for d in SAFETENSORS_DTYPES}
    if isinstance(name, str) and name != "auto":
        return by_name.get(name, torch.float32)
    by_code = {code: d for d, code in SAFETENSORS_DTYPES.items()}
    floating = {code: n for code, n in header_dtypes(folder).items() if code in by_code}
    return by_code[max(floating, key=floating.get)] if floating else torch.float32


@contextlib.contextmanager
def fp32_compute(model):
    """Run ``model`` in fp32 whatever dtype it holds its weights in: each module's own parameters and
    buffers that are bf16 or fp16 are replaced by fp32 copies for the time of its forward, and put back
    after. The logits are those of the model cast to fp32 (bit for bit), while at most one module's
    weights are held twice. A model held in fp32 gets no hooks at all."""
    stacks: dict[int, list] = {}

    def low(t) -> bool:
        return t is not None and t.is_floating_point() and t.dtype != torch.float32

    def upcast(module, args):
        held = []
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if low(t):
                    held.append((store, name, t))
                    up = t.detach().float()
                    store[name] = torch.nn.Parameter(up, requires_grad=False) if store is module._parameters else up
        stacks.setdefault(id(module), []).append(held)

    def restore(module, args, output):
        for store, name, t in stacks[id(module)].pop():
            store[name] = t

    handles = []
    for module in model.modules():
        if any(low(t) for t in [*module._parameters.values(), *module._buffers.values()]):
            handles += [module.register_forward_pre_hook(upcast), module.register_forward_hook(restore)]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------- memory


def _libc():
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def page_out(tensors) -> None:
    """Hand the resident pages behind memory-mapped tensors back to the kernel.

    They are re-read from the file if touched again. MADV_PAGEOUT cannot lose data:
    on anonymous memory without swap it does nothing. A no-op off Linux.
    """
    libc = _libc()
    if libc is None:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    for t in tensors:
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        start, end = -(-ptr // page) * page, (ptr + size) // page * page
        if end > start:
            libc.madvise(start, end - start, MADV_PAGEOUT)


def map_large_allocations(threshold: int = 2**20) -> None:
    """Give every allocation over ``threshold`` bytes its own mapping, returned to the kernel when freed.

    glibc otherwise raises its mmap threshold after the first large free, up to 32 MB, and
    serves tensors below it from a heap that keeps freed memory: DeepSpeed's reader for ZeRO 1/2
    loads the model-states file whole and frees it just before merging the fp32 partitions,
    which without this costs a second copy of the weights.
    """
    libc = _libc()
    with contextlib.suppress(AttributeError):
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD


def trim() -> None:
    """Return freed heap memory to the kernel (glibc keeps it otherwise)."""
    gc.collect()
    libc = _libc()
    with contextlib.suppress(AttributeError):
        libc.malloc_trim(0)


class PeakRSS:
    """Peak resident memory (MB) of each phase: /proc's high-water mark, reset between phases (Linux).

    The reset also lowers what getrusage reports for the process afterwards: the whole run's
    peak is the largest phase's (everything before the first phase is imports and metadata).
    """

    def __init__(self):
        self.phases: dict[str, int] = {}

    @staticmethod
    def _hwm() -> int | None:
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
        return None

    @contextlib.contextmanager
    def phase(self, name: str):
        trim()
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        yield
        if (peak := self._hwm()) is not None:
            self.phases[name] = peak


# ---------------------------------------------------------------- checkpoint readers
# Each reader has ``names`` (every tensor in the checkpoint), ``read(names) -> {name: tensor}``
# and ``release(tensors)``, which hands back the file pages a read mapped in.


class DDPSource:
    """Rank 0's ``state.pt``, memory-mapped: tensors are read from the file only when used."""

    def __init__(self, folder: Path):
        self.path = folder / "state.pt"
        try:
            self.tensors = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)["model"]
        except (FileNotFoundError, RuntimeError, EOFError, KeyError, ValueError) as e:
            raise UserError(f"{self.path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
        self.names = set(self.tensors)

    def read(self, names) -> dict:
        return {n: self.tensors[n] for n in names}

    def release(self, tensors: dict) -> None:
        page_out(tensors.values())


class FSDPSource:
    """A torch.distributed.checkpoint folder, read a batch of keys at a time without a process group."""

    def __init__(self, folder: Path, shapes: dict[str, torch.Size]):
        from torch.distributed.checkpoint import FileSystemReader

        self.path, self.shapes = folder / "dcp", shapes
        try:
            meta = FileSystemReader(str(self.path)).read_metadata()
        except Exception as e:  # DCP wraps reader errors in its own exception types
            raise UserError(f"{self.path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
        self.names = {k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")}

    def read(self, names) -> dict:
        import torch.distributed.checkpoint as dcp

        state = {"model": {n: torch.empty(self.shapes[n], dtype=torch.float32) for n in names}}
        try:
            dcp.load(state, checkpoint_id=str(self.path), no_dist=True)
        except Exception as e:
            raise UserError(f"{self.path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
        return state["model"]

    def release(self, tensors: dict) -> None:
        pass  # read into fresh tensors


class DeepSpeedSource:
    """DeepSpeed's own checkpoint parsers (``deepspeed.utils.zero_to_fp32``); every parameter is read
    lazily from the ranks' memory-mapped fp32 partitions. ZeRO-3 through DeepSpeed's lazy mode
    (``GatheredTensor``); ZeRO 1/2 through ``Zero2Param``, because DeepSpeed's lazy mode for them
    first concatenates each group's partitions into one vector, a second copy of the weights."""

    def __init__(self, folder: Path, exclude_frozen: bool):
        from deepspeed.utils import zero_to_fp32 as z

        self.folder, where = folder, str(folder)
        try:
            # no_grad: the saved partitions require grad, and an autograd graph from a gathered
            # tensor back to them would keep every memory-mapped partition file resident
            with torch.no_grad(), contextlib.redirect_stdout(sys.stderr), mapped_loads():  # they print progress
                models = z.parse_model_states(z.get_model_state_files(where))
                stage, _, flat_groups, paddings = z.parse_optim_states(z.get_optim_files(where), where)
                if stage <= 2:
                    self.tensors = zero2_state_dict(flat_groups, models, paddings, exclude_frozen)
                else:  # DeepSpeed's public lazy mode parses the (memory-mapped) files again: a second or two
                    self.tensors = z.get_fp32_state_dict_from_zero_checkpoint(
                        str(folder.parent), tag=folder.name, exclude_frozen_parameters=exclude_frozen, lazy_mode=True
                    )
        except UserError:
            raise
        except Exception as e:  # the parsers raise bare exceptions on missing or short files
            raise UserError(f"{folder}: unreadable DeepSpeed checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
        self.names = set(self.tensors)
        trim()

    @torch.no_grad()
    def read(self, names) -> dict:
        try:
            return {n: self.tensors[n].contiguous() for n in names}
        except Exception as e:
            raise UserError(f"{self.folder}: unreadable DeepSpeed checkpoint ({type(e).__name__}: {e})") from None

    def release(self, tensors: dict) -> None:
        page_out(chunk for n in tensors for chunk in partition_slices(self.tensors[n]))


@contextlib.contextmanager
def mapped_loads():
    """``torch.load`` memory-maps what it reads. DeepSpeed's ``parse_model_states`` loads each
    model-states file whole to find the buffers and shapes; for ZeRO 1/2 that file holds every weight
    again, in fp32: read whole it was a transient copy of the fp32 weights, twice the bf16 model."""
    load = torch.load
    torch.load = functools.partial(load, mmap=True)
    try:
        yield
    finally:
        torch.load = load


class Zero2Param:
    """A ZeRO 1/2 parameter: ``shape.numel()`` elements from ``start`` of its group's fp32 vector,
    which is the ranks' partitions back to back (memory-mapped; read when ``contiguous()`` is called)."""

    def __init__(self, partitions: list[torch.Tensor], start: int, shape: torch.Size):
        self.partitions, self.start, self.shape = partitions, start, torch.Size(shape)

    def slices(self):
        lo, hi, base = self.start, self.start + self.shape.numel(), 0
        for part in self.partitions:
            a, b = max(lo, base), min(hi, base + part.numel())
            if a < b:
                yield part[a - base : b - base]
            base += part.numel()

    def contiguous(self) -> torch.Tensor:
        return torch.cat(list(self.slices())).view(self.shape)


def zero2_state_dict(flat_groups, models, paddings, exclude_frozen: bool) -> dict:
    """ZeRO 1/2's state dict with the layout of DeepSpeed's ``_zero2_merge_trainable_params``, without
    concatenating the partitions: each group holds its parameters in order, each followed by its
    alignment padding, and the group's total is aligned to 2 x world size."""
    first = models[0]
    state = dict(first.buffers)
    if not exclude_frozen:
        state |= {name: first.frozen_param_fragments[name] for name in first.frozen_param_shapes or {}}
    align = 2 * len(flat_groups)
    for g, shapes in enumerate(first.param_shapes):
        parts = [rank[g] for rank in flat_groups]
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            state[name] = Zero2Param(parts, offset, shape)
            offset += math.prod(shape) + (paddings[g][i] if paddings is not None else 0)
        available = sum(p.numel() for p in parts)
        if -(-offset // align) != -(-available // align):
            raise UserError(f"parameter group {g} needs {offset} elements, the partitions hold {available}")
    for target, source in first.shared_params:
        if source in state:
            state[target] = state[source]
    return state


def partition_slices(t):
    """The slices of memory-mapped partitions a lazy DeepSpeed tensor reads (none for a real tensor)."""
    if isinstance(t, Zero2Param):
        yield from t.slices()
        return
    groups, bounds = getattr(t, "flat_groups", None), getattr(t, "flat_groups_offset", None)
    if groups is None:
        return
    start, end = t.offset, t.offset + t.partitioned_numel  # DeepSpeed's GatheredTensor (ZeRO-3)
    for rank in groups:
        for g, flat in enumerate(rank):
            lo, hi = max(start, int(bounds[g])), min(end, int(bounds[g + 1]))
            if lo < hi:
                yield flat[lo - int(bounds[g]) : hi - int(bounds[g])]


class ModelSource:
    """A model in memory, read like a checkpoint (the merged LoRA model, the training-side model)."""

    def __init__(self, model):
        self.tensors = model.state_dict()
        self.names = set(self.tensors)

    def read(self, names) -> dict:
        return {n: self.tensors[n] for n in names}

    def release(self, tensors: dict) -> None:
        page_out(tensors.values())  # tensors memory-mapped from a file (DDP's, the base model's)


def open_source(state: dict, folder: Path, shapes: dict[str, torch.Size]):
    if state["strategy"] == "ddp":
        return DDPSource(folder)
    if state["strategy"] == "fsdp":
        return FSDPSource(folder, shapes)
    return DeepSpeedSource(folder, exclude_frozen=state["peft"] == "lora")


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


# ---------------------------------------------------------------- models


def rebuild(state: dict, dtype: torch.dtype = torch.float32):
    """The LoRA model as training built it: the base weights, wrapped by peft (the adapter in fp32).

    The base is held in ``dtype``: training's fp32 copy of a bf16 base holds the same values."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(state["base_model"], dtype=dtype)
    cfg = state["config"]
    return get_peft_model(
        model,
        LoraConfig(
            r=cfg["lora_r"],
            lora_alpha=cfg["lora_alpha"],
            lora_dropout=cfg["lora_dropout"],
            target_modules=list(cfg["lora_target_modules"]),
            task_type="CAUSAL_LM",
        ),
    )


@torch.no_grad()
def merge_lora(model, dtype: torch.dtype):
    """The merged model, its weights in ``dtype``: each LoRA layer's base weight is merged in fp32 (the
    base weight upcast, plus B @ A x scale) and rounded once, one layer at a time; then the other
    parameters are cast to ``dtype`` (buffers such as the rotary tables stay as they are, as
    from_pretrained keeps them). In fp32 this is peft's merge_and_unload, nothing else."""
    import warnings

    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            weight.data = weight.data.float()
            module.merge()
            weight.data = weight.data.to(dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="All adapters are already merged")
        merged = model.merge_and_unload()  # every layer merged above: unwraps them
    cast_parameters(merged, dtype)
    return merged


@torch.no_grad()
def cast_parameters(model, dtype: torch.dtype) -> None:
    """Floating parameters to ``dtype`` one at a time, in place (a no-op for those already in it)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def empty_model(config, dtype: torch.dtype = torch.float32):
    """The architecture without weights: parameters on the meta device, buffers (rotary tables) real and
    made as ``from_pretrained(dtype=dtype)`` makes them (the reloaded folder's)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def hf_tensors(config) -> tuple[dict[str, torch.Size], set[str]]:
    """Shapes of the tensors a Hugging Face folder of ``config`` holds (tied weights once), and all state names."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes, seen, everything = {}, set(), set()
    for name, t in skeleton.state_dict(keep_vars=True).items():
        everything.add(name)
        if id(t) not in seen:
            seen.add(id(t))
            shapes[name] = t.shape
    return shapes, everything


def check_names(source, needed, allowed, where: str) -> None:
    """Every tensor the model needs is in the checkpoint, and the checkpoint has nothing the model lacks."""
    missing = sorted(set(needed) - source.names)
    if missing:
        raise UserError(f"{where}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    unexpected = sorted(source.names - set(allowed))
    if unexpected:
        raise UserError(f"{where}: checkpoint has tensors the model does not, e.g. {unexpected[0]}")


@torch.no_grad()
def assign(model, tensors, dtype: torch.dtype = torch.float32) -> None:
    """Make the checkpoint's tensors, in ``dtype``, the model's parameters (in fp32 the tensors themselves,
    no copy; else each rounded once), then re-tie shared weights."""
    for name, t in tensors:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        t = t.to(dtype)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[attr] = t
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise UserError(f"checkpoint left {len(left)} parameter(s) without weights, e.g. {left[0]}")


@torch.no_grad()
def copy_in(model, tensors) -> None:
    """Copy tensors into ``model``'s existing parameters (the LoRA adapter into the peft model)."""
    target = model.state_dict()
    for name, t in tensors:
        target[name].copy_(t)


def nbytes(shape, dtype: torch.dtype) -> int:
    return dtype.itemsize * math.prod(shape)


def write_safetensors(path: Path, shapes: dict[str, torch.Size], tensors, dtype: torch.dtype = torch.float32) -> None:
    """One safetensors file of ``dtype`` tensors written tensor by tensor: the header (names, shapes,
    offsets) is known up front from ``shapes``, so no more than one tensor is ever held for writing."""
    header, offset, code = {}, 0, SAFETENSORS_DTYPES[dtype]
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


def check_lora(model) -> int:
    """Every lora_B is present and non-zero (an all-zero B means the adapter never trained)."""
    bs = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    if not bs:
        raise UserError("LoRA adapter has no lora_B tensors")
    zero = [n for n, p in bs.items() if not torch.count_nonzero(p)]
    if zero:
        raise UserError(f"LoRA adapter: {len(zero)} of {len(bs)} lora_B tensors are all zero, e.g. {zero[0]}")
    return len(bs)


@torch.no_grad()
def logits_on(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits computed in fp32, whatever dtype the model holds its weights in (fp32_compute)."""
    model.eval()
    with fp32_compute(model):
        return model(input_ids=ids).logits.float()


def save_metadata(base: str, output: Path, template: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
    """config (its dtype the weights'), generation config and tokenizer of the base model, beside the
    weights, with the training's template (``template``: chat_template, format_template, template_kwargs;
    see tokenization_metadata)."""
    config = AutoConfig.from_pretrained(base)
    config.dtype = dtype_name(dtype)
    config.save_pretrained(output)
    try:
        generation = GenerationConfig.from_pretrained(base)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenization_metadata(tokenizer, generation, base, **(template or {}))
    generation.save_pretrained(output)
    tokenizer.save_pretrained(output)


def tokenization_metadata(
    tokenizer,
    generation,
    base: str,
    chat_template: str | None = None,
    format_template: str | None = None,
    template_kwargs: dict | None = None,
) -> None:
    """The tokenizer gets the chat template training used; the generation config stops at its
    end-of-turn tokens (and the base's own EOS ids), pads with the EOS when there is no pad token,
    and carries the template arguments as ``chat_template_kwargs``."""
    from chat_render import generation_settings, use_template

    use_template(tokenizer, base, chat_template, format_template, required=False)
    settings = generation_settings(tokenizer, template_kwargs)
    own = generation.eos_token_id
    own = [] if own is None else own if isinstance(own, list) else [own]
    stops = list(dict.fromkeys(settings["eos_token_id"] + own))
    if stops:
        generation.eos_token_id = stops if len(stops) > 1 else stops[0]
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [None])[0]
    if settings["chat_template_kwargs"]:
        generation.chat_template_kwargs = settings["chat_template_kwargs"]
    generation._from_model_config = False  # set here, not the model config's: loaded as written, extra keys kept


def consolidate(
    state: dict,
    output: Path,
    max_shard_size: str = MAX_SHARD_SIZE,
    peaks: PeakRSS | None = None,
    template: dict | None = None,
    dtype: str = "base",
):
    """Write the HF folder in ``dtype`` (consolidate.dtype); return (report, fixed input ids, the
    training-side model's logits on them, its weights rounded to the written dtype)."""
    peaks = peaks or PeakRSS()
    folder = Path(state["checkpoint"])
    if not (folder / "COMPLETE").is_file():
        raise UserError(f"{folder}: checkpoint is missing or incomplete (no COMPLETE marker)")
    max_bytes = parse_size(max_shard_size)
    report = {"checkpoint": str(folder), "strategy": state["strategy"], "peft": state["peft"], "step": state["step"]}
    base_dtype = stored_dtype(state["base_model"])
    target = base_dtype if dtype == "base" else DTYPES[dtype]
    report["dtype"] = dtype_name(target)
    output.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(state["base_model"])
    shapes, allowed = hf_tensors(config)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    with peaks.phase("training_side_model"):
        if state["peft"] == "lora":
            # the checkpoint holds the adapter only; the merged model is the base plus B @ A
            # the base in its own dtype holds what training's fp32 copy of it held; else in fp32
            model = rebuild(state, base_dtype if base_dtype == target else torch.float32)
            trainable = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
            source = open_source(state, folder, trainable)
            check_names(source, trainable, model.state_dict(), str(folder))
            copy_in(model, stream(source, trainable))
            report["lora_b_tensors"] = check_lora(model)
            model.save_pretrained(output / "adapter")
            model = merge_lora(model, target)
        else:
            # the checkpoint's tensors become the parameters of a weightless model of the base's architecture
            source = open_source(state, folder, shapes)
            check_names(source, shapes, allowed, str(folder))
            model = empty_model(config, target)
            assign(model, stream(source, shapes), target)
        expected = logits_on(model, ids)
    with peaks.phase("write"):
        report["weight_files"] = write_sharded(ModelSource(model), shapes, output, max_bytes, target)
        save_metadata(state["base_model"], output, template, target)
    return report, ids, expected


def verify(output: Path, ids: torch.Tensor, expected: torch.Tensor, tolerance: float) -> dict:
    """Reload what was written, in the dtype its config names (every safetensors header must say the
    same): the same logits as the training-side model (both computed in fp32 from the written precision,
    see the module's docstring), and a short generation runs."""
    dtype = AutoConfig.from_pretrained(output).dtype or torch.float32
    codes = sorted(header_dtypes(output))
    if codes != [SAFETENSORS_DTYPES[dtype]]:
        raise UserError(f"{output}: safetensors hold {', '.join(codes)}; config.json says {dtype_name(dtype)}")
    reloaded = AutoModelForCausalLM.from_pretrained(output, dtype=dtype)
    diff = (logits_on(reloaded, ids) - expected).abs().max().item()
    if not diff <= tolerance:  # a NaN fails too
        raise UserError(f"{output}: reloaded model's logits differ by {diff:.2e} (> {tolerance})")
    pad = reloaded.generation_config.pad_token_id
    with torch.no_grad(), fp32_compute(reloaded):
        sample = reloaded.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=pad)
    return {"max_logit_diff": diff, "generation_ok": sample.shape[1] > 4}


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", required=True, type=Path, help="train_state.json of the node")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, help="safetensors shard size, e.g. 2GB or 500MB")
    p.add_argument("--dtype", help="consolidate.dtype: the written weights' dtype", **option("consolidate.dtype"))
    p.add_argument("--chat-template", default=None, help="data.chat_template: the Jinja file training used")
    p.add_argument("--format-template", help="data.format_template", **option("data.format_template"))
    p.add_argument("--template-kwargs", type=json_object, **option("data.template_kwargs"))
    a = p.parse_args(argv)
    map_large_allocations()
    state = json.loads(a.state.read_text())
    peaks = PeakRSS()
    template = {"chat_template": a.chat_template, "format_template": a.format_template}
    template |= {"template_kwargs": a.template_kwargs}
    report, ids, expected = consolidate(state, a.output, a.max_shard_size, peaks, template, a.dtype)
    with peaks.phase("reload_check"):  # one model in memory at a time: the training side is gone
        report |= verify(a.output, ids, expected, a.tolerance)
    report["peak_rss_mb"] = peaks.phases
    write_json(a.output / "consolidation.json", report)
    print(
        f"{a.output}: consolidated from {report['checkpoint']} in {report['dtype']}"
        f" (max logit diff {report['max_logit_diff']:.1e})"
    )


if __name__ == "__main__":
    main()
