"""The worker side of bench_scale.py: what runs in the measured processes, not in the orchestrating one.

- part data: the synthetic shard writer, the list-based loader of before (legacy_load_examples) and the three
  one-thread measurements (CHILDREN: store, mmap, legacy) that ``bench_scale.py --child NAME PARAMS`` runs;
- parts load, world, step and zero3-host: WORKER, the script each torchrun rank runs (bench_scale.measure);
- part phases: PHASES_WORKER, FSDP2 + LoRA phase by phase (bench_scale.phases_part);
- the checkpoints the workers load: the Qwen3-0.6B shape (build_checkpoint) and the planner's reduced-layer
  model (build_planner_checkpoint, n_params).

The scripts are texts: bench_scale.py writes them into --workdir and starts them under torchrun.
"""

import time
from pathlib import Path

MB = 2**20
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=False, rope_theta=1000000.0)  # fmt: skip


def rss() -> dict:
    """This process's resident memory (MB): total, anonymous, file-backed, and its peak."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


# ---------------------------------------------------------------- part data


def legacy_load_examples(paths: list[Path]) -> list[tuple[list[int], list[int]]]:
    """The trainer's loader before the token store (batching.load_examples at 3081cb6), verbatim."""
    import pyarrow.parquet as pq

    examples = []
    for path in paths:
        table = pq.read_table(path, columns=["input_ids", "labels"])
        examples += zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist(), strict=True)
    return examples


def synthetic_shard(path: Path, tokens: int, seed: int = 0, chunk_rows: int = 2000) -> list[int]:
    """A tokenized shard of about ``tokens`` tokens in rows of 200-2000, written chunk by chunk; its lengths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflow_scripts.core.contracts import IGNORE
    from workflow_scripts.core.contracts import TOKENIZED_SCHEMA as SCHEMA

    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    with pq.ParquetWriter(path, SCHEMA) as writer:
        while total < tokens:
            n = rng.integers(200, 2001, chunk_rows)
            n = n[: np.searchsorted(np.cumsum(n), tokens - total, side="left") + 1]
            offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
            ids = rng.integers(0, 32000, offsets[-1], dtype=np.int32)
            prompt = (n * rng.uniform(0.1, 0.5, len(n))).astype(np.int32)
            labels = ids.copy()
            for start, p in zip(offsets[:-1], prompt, strict=True):
                labels[start : start + p] = IGNORE
            columns = {
                "input_ids": pa.ListArray.from_arrays(offsets, ids),
                "labels": pa.ListArray.from_arrays(offsets, labels),
                "length": pa.array(n, pa.int32()),
                "prompt_length": pa.array(prompt, pa.int32()),
                "response": pa.array(["r"] * len(n)),
                "content_hash": pa.array(["h"] * len(n)),
                "category": pa.array([""] * len(n)),
            }
            writer.write_table(pa.table(columns, schema=SCHEMA))
            lengths += n.tolist()
            total += int(n.sum())
    return lengths


def child_store(p: dict) -> dict:
    from workflow_scripts.data.token_store import open_store

    start, base = time.perf_counter(), rss()
    store = open_store(Path(p["shard"]), Path(p["root"]))
    size = sum(f.stat().st_size for f in store.folder.iterdir())
    return {"seconds": time.perf_counter() - start, "base": base, "peak": rss()["VmHWM"], "store_mb": size / MB}


def import_data_path() -> None:
    """What both loaders import, loaded before the first measurement: torch, numpy, pyarrow (its
    dataset module too, which pq.read_table loads: 40 MB that are not data)."""
    import pyarrow.dataset  # noqa: F401

    from workflow_scripts.core import settings  # noqa: F401
    from workflow_scripts.train import batching  # noqa: F401


def child_mmap(p: dict) -> dict:
    from workflow_scripts.core.settings import training_config
    from workflow_scripts.train.batching import TrainingData

    import_data_path()
    imported = rss()
    packing = p["packing"]
    cfg = training_config({"packing": packing, "micro_batch_size": 4 if packing else 8, "grad_accum": 1, "seed": 0,
                           "max_steps": p["micro_batches"]})  # fmt: skip
    plans = [Path(p["plan"])] if packing else None
    data = TrainingData(cfg, [Path(p["shard"])], plans, world=8, rank=0, store_root=Path(p["root"]))
    built = rss()
    data.bind(pad_id=0, one_row=False)
    seen = 0
    for step in range(p["micro_batches"]):
        for _, lengths in data.micro_batches(step):
            seen += sum(lengths)
    return {"imported": imported, "built": built, "after": rss(), "tokens": data.describe()["tokens"], "seen": seen}


def child_legacy(p: dict) -> dict:
    import_data_path()
    imported = rss()
    examples = legacy_load_examples([Path(p["shard"])])
    built = rss()
    return {"imported": imported, "built": built, "after": built, "tokens": sum(len(ids) for ids, _ in examples)}


CHILDREN = {"store": child_store, "mmap": child_mmap, "legacy": child_legacy}


WORKER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch, torch.distributed as dist, transformers, deepspeed, peft  # everything a rank imports
from workflow_scripts.core.settings import training_config
from workflow_scripts.train.parallel import build_strategy, load_model
dist.init_process_group("gloo")
if sys.argv[7] == "1":  # as train.py does first: every allocation over 1 MiB its own mapping
    from workflow_scripts.core.host_memory import map_large_allocations
    map_large_allocations()
if sys.argv[7] == "before":  # the trainer before issue 24: no malloc_trim after deepspeed.initialize
    from workflow_scripts.train.parallel import zero
    zero.trim = lambda: None
imports = status("VmRSS:")
base, config, legacy, out = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
cfg = training_config(config)
device = torch.device("cpu")
if legacy:  # the trainer before issue 13: a whole fp32 model on every rank
    from transformers import AutoModelForCausalLM
    from workflow_scripts.model import model_loading
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if cfg.peft == "lora":
        model = model_loading.add_lora(model, cfg, materialize=True)
else:
    model, _ = load_model(base, cfg, device)
loaded = status("VmHWM:")
strategy = build_strategy(cfg, model, device, total_steps=10)
record = {"rank": dist.get_rank(), "imports": imports, "load": loaded, "peak": status("VmHWM:"),
          "after": status("VmRSS:")}
if sys.argv[6] == "1":  # one optimizer step: gradients and optimizer states exist in every strategy now
    ids = torch.randint(0, 1000, (1, 32))
    strategy.model.train()
    strategy.forward_backward({"input_ids": ids, "labels": ids}, True)
    strategy.step()
    record["step"] = status("VmHWM:")
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, record)
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps(rows))
dist.barrier()
os._exit(0)
"""


PHASES_WORKER = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
def status():
    f = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    return {k: int(f[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
import torch, torch.distributed as dist, transformers, deepspeed, peft
from workflow_scripts.core.host_memory import map_large_allocations
from workflow_scripts.core.settings import training_config
from workflow_scripts.train.parallel import build_strategy, load_model
map_large_allocations()  # as train.py
dist.init_process_group("gloo")
base, cfg, out, tokens = sys.argv[2], training_config(json.loads(sys.argv[3])), Path(sys.argv[4]), int(sys.argv[5])
device, phases = torch.device("cpu"), []
def phase(name, fn):
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    before = status()["VmRSS"]
    result = fn()
    now = status()
    phases.append({"phase": name, "before": before, "peak": now["VmHWM"], "after": now["VmRSS"]})
    return result
phases.append({"phase": "imports", "before": 0, "peak": status()["VmRSS"], "after": status()["VmRSS"]})
model, _ = phase("load", lambda: load_model(base, cfg, device))
strategy = phase("wrap", lambda: build_strategy(cfg, model, device, total_steps=10))
ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
strategy.model.train()
for step in (1, 2):
    phase(f"forward+backward {step}", lambda: strategy.forward_backward({"input_ids": ids, "labels": ids}, True))
    phase(f"optimizer step {step}", strategy.step)
folder = out.parent / "ckpt" / "step"
folder.mkdir(parents=True, exist_ok=True)
phase("save", lambda: strategy.save(folder))
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, phases)
if dist.get_rank() == 0:
    out.write_text(json.dumps(rows))
dist.barrier()
os._exit(0)
"""


# ---------------------------------------------------------------- the checkpoints the workers load


def build_checkpoint(folder: Path) -> tuple[Path, int]:
    """The Qwen3-0.6B-shaped bf16 checkpoint (built once); its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**QWEN3_06B)
    if not (folder / "model.safetensors").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return folder, n


def build_planner_checkpoint(folder: Path, shape: dict) -> Path:
    """The reduced-layer checkpoint (bf16, random weights), built once; its config.json is the planner's input."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if not (folder / "model.safetensors").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def n_params(shape: dict) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(Qwen3Config(**shape)).parameters())
