"""consolidate_node: turn a node's final training checkpoint into a Hugging Face model folder.

DDP ``state.pt`` (memory-mapped), FSDP2 torch.distributed.checkpoint folders and
DeepSpeed ZeRO 1-3 checkpoints (DeepSpeed's ``zero_to_fp32`` in lazy mode) are each
read through their own APIs, a shard of tensors at a time: each shard is written as
fp32 safetensors (``model-0000i-of-0000n.safetensors`` and an index when there is
more than one) and the pages it read are handed back to the kernel, so peak memory
stays near one copy of the fp32 weights instead of the three or four that loading
a whole state dict into a model and saving it takes. With LoRA the adapter is saved
in peft format (``adapter/``) and the merged model beside it.

The stage checks its own result, one model in memory at a time: the training-side
model (the base rebuilt as training built it, the checkpoint's tensors copied in)
and the saved folder, reloaded, give the same logits on fixed inputs; every LoRA B
matrix is present and non-zero; a short generation runs. A truncated or corrupt
checkpoint fails with one line naming it.
"""

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import re
import sys
from pathlib import Path

import torch
from pipeline_io import UserError, atomic_path, cli, write_json
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

log = logging.getLogger("consolidate")
MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now; never loses data


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


def page_out(tensors) -> None:
    """Hand the resident pages behind memory-mapped tensors back to the kernel.

    They are re-read from the file if touched again. MADV_PAGEOUT cannot lose data:
    on anonymous memory without swap it does nothing. A no-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    seen = set()
    for t in tensors:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr in seen or size < page:
            continue
        seen.add(ptr)
        start, end = -(-ptr // page) * page, (ptr + size) // page * page
        if end > start:
            libc.madvise(start, end - start, MADV_PAGEOUT)


# ---------------------------------------------------------------- checkpoint readers


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

    def release(self) -> None:
        page_out(self.tensors.values())


class FSDPSource:
    """A torch.distributed.checkpoint folder, read a shard of keys at a time without a process group."""

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

    def release(self) -> None:
        pass  # read into fresh tensors, freed by the caller


class DeepSpeedSource:
    """DeepSpeed's own converter in lazy mode: ZeRO-3 parameters are gathered from the ranks' memory-mapped
    fp32 partitions one at a time (ZeRO 1/2 partitions are merged by DeepSpeed into one flat vector)."""

    def __init__(self, folder: Path, exclude_frozen: bool):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        self.folder = folder
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the converter prints progress
                self.tensors = get_fp32_state_dict_from_zero_checkpoint(
                    str(folder.parent), tag=folder.name, exclude_frozen_parameters=exclude_frozen, lazy_mode=True
                )
        except Exception as e:  # the converter raises bare exceptions on missing or short files
            raise UserError(f"{folder}: unreadable DeepSpeed checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
        self.names = set(self.tensors)

    def read(self, names) -> dict:
        try:
            return {n: self.tensors[n].contiguous() for n in names}
        except Exception as e:
            raise UserError(f"{self.folder}: unreadable DeepSpeed checkpoint ({type(e).__name__}: {e})") from None

    def release(self) -> None:
        flat = []
        for t in self.tensors.values():
            groups = getattr(t, "flat_groups", None)  # deepspeed's GatheredTensor: per rank, per group
            flat += [g for rank in groups for g in rank] if groups else [t]
        page_out(flat)


def open_source(state: dict, folder: Path, shapes: dict[str, torch.Size]):
    if state["strategy"] == "ddp":
        return DDPSource(folder)
    if state["strategy"] == "fsdp":
        return FSDPSource(folder, shapes)
    return DeepSpeedSource(folder, exclude_frozen=state["peft"] == "lora")


# ---------------------------------------------------------------- models


def rebuild(state: dict):
    """The model as training built it (base weights, plus the LoRA wrapper when used)."""
    model = AutoModelForCausalLM.from_pretrained(state["base_model"], dtype=torch.float32)
    cfg = state["config"]
    if state["peft"] == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=cfg["lora_r"],
                lora_alpha=cfg["lora_alpha"],
                lora_dropout=cfg["lora_dropout"],
                target_modules=list(cfg["lora_target_modules"]),
                task_type="CAUSAL_LM",
            ),
        )
    return model


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
    if source.names is None:
        return
    missing = sorted(set(needed) - source.names)
    if missing:
        raise UserError(f"{where}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    unexpected = sorted(source.names - set(allowed))
    if unexpected:
        raise UserError(f"{where}: checkpoint has tensors the model does not, e.g. {unexpected[0]}")


def write_sharded(source, shapes: dict[str, torch.Size], output: Path, max_bytes: int) -> list[str]:
    """fp32 safetensors, one shard in memory at a time; an index when there are several. Returns the files."""
    from safetensors.torch import save_file

    sizes = {n: 4 * s.numel() for n, s in shapes.items()}
    shards = plan_shards(sizes, max_bytes)
    files = shard_files(len(shards))
    for file, names in zip(files, shards, strict=True):
        tensors = {}
        for name, t in source.read(names).items():
            t = t.to(torch.float32) if t.is_floating_point() else t
            # views into a larger buffer (ZeRO 1/2's merged vector) must not share memory in safetensors
            tensors[name] = t.contiguous() if t.untyped_storage().nbytes() == t.nbytes else t.clone()
        with atomic_path(output / file) as tmp:
            save_file(tensors, tmp, metadata={"format": "pt"})
        del tensors
        source.release()
        gc.collect()
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {n: f for f, names in zip(files, shards, strict=True) for n in names},
        }
        write_json(output / "model.safetensors.index.json", index)
    return files


@torch.no_grad()
def copy_in(model, source, names: list[str], max_bytes: int) -> None:
    """Copy the checkpoint's tensors into ``model`` a shard at a time (the training-side model)."""
    target = model.state_dict()
    for shard in plan_shards({n: 4 * target[n].numel() for n in names}, max_bytes):
        for name, t in source.read(shard).items():
            target[name].copy_(t)
        source.release()


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
    model.eval()
    return model(input_ids=ids).logits.float()


def save_metadata(base: str, output: Path) -> None:
    """config (fp32), generation config and tokenizer of the base model, beside the weights."""
    config = AutoConfig.from_pretrained(base)
    config.dtype = "float32"
    config.save_pretrained(output)
    try:
        generation = GenerationConfig.from_pretrained(base)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(output)
    AutoTokenizer.from_pretrained(base).save_pretrained(output)


def consolidate(state: dict, output: Path, max_shard_size: str = "2GB") -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Write the HF folder; return (report, fixed input ids, the training-side model's logits on them)."""
    folder = Path(state["checkpoint"])
    if not (folder / "COMPLETE").is_file():
        raise UserError(f"{folder}: checkpoint is missing or incomplete (no COMPLETE marker)")
    max_bytes = parse_size(max_shard_size)
    report = {"checkpoint": str(folder), "strategy": state["strategy"], "peft": state["peft"], "step": state["step"]}
    output.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(state["base_model"])
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    if state["peft"] == "lora":
        # the checkpoint holds the adapter only; the merged model is the base plus B @ A
        model = rebuild(state)
        trainable = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
        source = open_source(state, folder, trainable)
        check_names(source, trainable, model.state_dict(), str(folder))
        copy_in(model, source, list(trainable), max_bytes)
        report["lora_b_tensors"] = check_lora(model)
        model.save_pretrained(output / "adapter")
        model = model.merge_and_unload()
        expected = logits_on(model, ids)
        model.save_pretrained(output, max_shard_size=max_bytes)
        report["weight_files"] = sorted(p.name for p in output.glob("*.safetensors"))
        save_metadata(state["base_model"], output)
        return report, ids, expected

    shapes, allowed = hf_tensors(config)
    source = open_source(state, folder, shapes)
    check_names(source, shapes, allowed, str(folder))
    report["weight_files"] = write_sharded(source, shapes, output, max_bytes)
    save_metadata(state["base_model"], output)
    # the training-side model: the base rebuilt as training built it, the checkpoint copied in
    model = rebuild(state)
    copy_in(model, source, list(shapes), max_bytes)
    expected = logits_on(model, ids)
    return report, ids, expected


def verify(output: Path, ids: torch.Tensor, expected: torch.Tensor, tolerance: float) -> dict:
    """Reload what was written: same logits as the training-side model, and a short generation runs."""
    reloaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    diff = (logits_on(reloaded, ids) - expected).abs().max().item()
    if diff > tolerance:
        raise UserError(f"{output}: reloaded model's logits differ by {diff:.2e} (> {tolerance})")
    pad = reloaded.generation_config.pad_token_id
    sample = reloaded.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=pad)
    return {"max_logit_diff": diff, "generation_ok": sample.shape[1] > 4}


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", required=True, type=Path, help="train_state.json of the node")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--max-shard-size", default="2GB", help="safetensors shard size, e.g. 2GB or 500MB")
    a = p.parse_args(argv)
    state = json.loads(a.state.read_text())
    report, ids, expected = consolidate(state, a.output, a.max_shard_size)
    gc.collect()  # one model in memory at a time
    report |= verify(a.output, ids, expected, a.tolerance)
    write_json(a.output / "consolidation.json", report)
    print(f"{a.output}: consolidated from {report['checkpoint']} (max logit diff {report['max_logit_diff']:.1e})")


if __name__ == "__main__":
    main()
