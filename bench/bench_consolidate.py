"""Consolidation benchmark: peak RSS of consolidate.py against the size of the weights it writes, per strategy.

    .venv/bin/python bench/bench_consolidate.py                       # the table in docs/benchmarks/consolidation.md
    .venv/bin/python bench/bench_consolidate.py --presets demo --strategies deepspeed-zero2
    .venv/bin/python bench/bench_consolidate.py --presets 350m --dtypes bf16   # a bf16 base

For each preset (the demo model and a larger from-scratch one) and base dtype (``--dtypes``: fp32,
as the presets are built, and bf16, the base saved in bf16 as hub models are; consolidate.py writes
the base's dtype) a base model is built (demo tokenizer, random init), then for each strategy a
2-rank torchrun (gloo, CPU, fp32) builds the model through train.py's own load_model/build_strategy/Checkpointer,
trains ``--steps`` optimizer steps on random tokens (``--large-steps`` for the larger
preset: DDP's Adam state for 350M parameters on two ranks would need ~11 GB of this
shared 24 GB machine, so it is saved right after initialization) and writes a
checkpoint with train_state.json. Then, each in a fresh process whose peak RSS is read
from getrusage (bench_data.rss_of):
  ours       consolidate.py: training-side model from the checkpoint (zero-copy where the reader
             allows), logits, streamed sharded write, reload and logits check
  baseline   the usual full-state-dict path: the strategy's reader loads every tensor
             (DeepSpeed: get_fp32_state_dict_from_zero_checkpoint), the base model loads in the
             base's dtype, load_state_dict, save_pretrained. No checks.
  ds-script  DeepSpeed's own convert_zero_checkpoint_to_fp32_state_dict (lazy, sharded
             safetensors), weights only (deepspeed rows of fp32 bases only: it writes fp32)
  imports    a process that only imports torch, transformers, deepspeed and peft: the floor
Prints a table: strategy, parameters, size of the written weights, peak RSS, (peak - imports) / that
size, seconds.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
SCRIPTS = REPO / "workflow_scripts"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_data import rss_of  # noqa: E402

SHARD = "500MB"

# run under torchrun: one checkpoint the way train.py writes it
MAKE_CHECKPOINT = r"""
import dataclasses, json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from workflow_scripts.train.checkpoint import Checkpointer
from workflow_scripts.train.parallel import build_strategy, load_model
from workflow_scripts.core.settings import TrainConfig
cfg, base, root, steps = TrainConfig.from_json(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo")
torch.manual_seed(0)
device = torch.device("cpu")
model, _ = load_model(base, cfg, device)
vocab = model.config.vocab_size
strategy = build_strategy(cfg, model, device, max(steps, 1))
for _ in range(steps):
    ids = torch.randint(0, vocab, (cfg.micro_batch_size, 32))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    strategy.forward_backward(batch, last_micro=True)
    strategy.step()
folder = Checkpointer(root, strategy, dist.get_rank(), 2, cfg.checkpoint_every, root / "metrics.jsonl").save(steps)
if dist.get_rank() == 0:
    state = {"checkpoint": str(folder), "step": steps, "strategy": cfg.strategy, "zero_stage": cfg.zero_stage,
             "peft": cfg.peft, "base_model": base, "config": dataclasses.asdict(cfg)}
    (root / "train_state.json").write_text(json.dumps(state))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # DeepSpeed's CPU backend can abort in interpreter teardown
"""

# the usual way: the whole state dict in memory, loaded into the model, saved
BASELINE = r"""
import json, sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
state, out, shard = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), sys.argv[3]
dtype = getattr(torch, sys.argv[4])
folder = Path(state["checkpoint"])
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(state["base_model"], dtype=dtype)
if state["strategy"] == "ddp":
    weights = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)["model"]
elif state["strategy"] == "fsdp":
    import torch.distributed.checkpoint as dcp
    full = {"model": {k: torch.empty_like(v) for k, v in model.named_parameters()}}
    dcp.load(full, checkpoint_id=str(folder / "dcp"), no_dist=True)
    weights = full["model"]
else:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    weights = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
model.load_state_dict(weights, strict=False)
model.save_pretrained(out, max_shard_size=shard)
AutoTokenizer.from_pretrained(state["base_model"]).save_pretrained(out)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

DS_SCRIPT = r"""
import sys
from pathlib import Path
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
folder = Path(sys.argv[1])
convert_zero_checkpoint_to_fp32_state_dict(str(folder.parent), sys.argv[2], max_shard_size=sys.argv[3],
                                           safe_serialization=True, tag=folder.name)
"""

IMPORTS = "import torch, transformers, deepspeed, peft, safetensors; from transformers import AutoModelForCausalLM"


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def build_base(preset: str, out: Path, dtype: str = "fp32") -> int:
    """The demo tokenizer and a randomly initialized model of ``preset``, saved in ``dtype``; returns its
    parameter count."""
    import torch

    from workflow_scripts.model.demo_model import build_model, texts_from, train_tokenizer

    tokenizer = train_tokenizer(texts_from(str(REPO / "resources" / "demo" / "instructions.csv")), 1024)
    model = build_model(tokenizer, 128, seed=0, size=preset).to(getattr(torch, DTYPES[dtype]))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


STRATEGIES = {
    "ddp": ("ddp", 0),
    "fsdp": ("fsdp", 0),
    "deepspeed-zero2": ("deepspeed", 2),
    "deepspeed-zero3": ("deepspeed", 3),
}


def training_config(label: str) -> str:
    strategy, stage = STRATEGIES[label]
    cfg = {
        "strategy": strategy,
        "precision": "fp32",
        "micro_batch_size": 1,
        "lr": 1e-3,
        "schedule": "constant",
        "warmup_steps": 0,
    }
    return json.dumps(cfg | ({"zero_stage": stage} if stage else {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["demo", "350m"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="base model dtypes")
    p.add_argument("--steps", type=int, default=2, help="training steps before the checkpoint (demo)")
    p.add_argument("--large-steps", type=int, default=0, help="training steps for presets other than demo")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs (gigabytes at 350m)")
    a = p.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench_consolidate_"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    py = sys.executable
    (work / "make_checkpoint.py").write_text(MAKE_CHECKPOINT)
    (work / "baseline.py").write_text(BASELINE)
    (work / "ds_script.py").write_text(DS_SCRIPT)

    _, floor, _ = rss_of([py, "-c", IMPORTS], env)
    rows, failed, phases = [], [], []
    for preset, dtype in [(p, d) for p in a.presets for d in a.dtypes]:
        base = work / preset / f"base-{dtype}"
        params = build_base(preset, base, dtype)
        mb = params * (4 if dtype == "fp32" else 2) / 2**20  # what consolidate.py writes: the base's dtype
        steps = a.steps if preset == "demo" else a.large_steps
        for label in a.strategies:
            root = work / preset / f"{label}-{dtype}"
            cmd = [
                str(Path(py).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
                str(work / "make_checkpoint.py"), str(REPO), training_config(label), str(base),
                str(root / "ckpt"), str(steps),
            ]  # fmt: skip
            rss_of(cmd, env)
            state = root / "ckpt" / "train_state.json"
            ours = [py, "-m", "workflow_scripts.export.consolidate", "--state", str(state),
                    "--output", str(root / "ours"), "--max-shard-size", SHARD]  # fmt: skip
            secs, rss, _ = rss_of(ours, env)
            report = json.loads((root / "ours" / "consolidation.json").read_text())
            assert report["dtype"] == DTYPES[dtype], report["dtype"]
            written = sum(f.stat().st_size for f in (root / "ours").glob("*.safetensors")) / 2**20
            phases.append((preset, dtype, label, mb, report["peak_rss_mb"]))
            rss = max(rss, *report["peak_rss_mb"].values())  # its phase resets lower getrusage's peak
            rows.append((preset, dtype, label, "ours (consolidate.py, with checks)", params, mb, rss, secs,
                         len(report["weight_files"]), written, report["max_logit_diff"]))  # fmt: skip
            baseline = [py, str(work / "baseline.py"), str(state), str(root / "base_out"), SHARD, DTYPES[dtype]]
            secs, rss, _ = rss_of(baseline, env)
            files = list((root / "base_out").glob("*.safetensors"))
            rows.append((preset, dtype, label, "baseline: full state dict + save_pretrained", params, mb, rss, secs,
                         len(files), sum(f.stat().st_size for f in files) / 2**20, None))  # fmt: skip
            if label.startswith("deepspeed") and dtype == "fp32":
                folder = json.loads(state.read_text())["checkpoint"]
                what = "DeepSpeed convert_zero_checkpoint_to_fp32_state_dict"
                try:
                    secs, rss, _ = rss_of([py, str(work / "ds_script.py"), folder, str(root / "ds_out"), SHARD], env)
                    files = list((root / "ds_out").glob("*.safetensors"))
                    rows.append((preset, dtype, label, what, params, mb, rss, secs, len(files),
                                 sum(f.stat().st_size for f in files) / 2**20, None))  # fmt: skip
                except SystemExit as e:  # tied weights: safetensors refuses tensors that share memory
                    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                    reason = next((x for x in lines if "share memory" in x), lines[-1])
                    failed.append(f"{preset} {label}: {what} failed: {reason[:200]}")
            if not a.keep:
                shutil.rmtree(root)  # the larger preset's checkpoints take gigabytes

    print(f"\n2 ranks (gloo, CPU, fp32 training); shards of at most {SHARD}; imports alone: {floor:.0f} MB peak RSS\n")
    head = ["preset", "base dtype", "strategy", "consolidation", "params", "weights MB", "peak RSS MB",
            "(peak - imports) / weights", "seconds", "files", "files MB", "max logit diff"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for preset, dtype, label, what, params, mb, rss, secs, files, written, diff in rows:
        diff = f"{diff:.1e}" if diff is not None else "-"
        print(f"| {preset} | {dtype} | {label} | {what} | {params / 1e6:.1f}M | {mb:,.0f} | {rss:,.0f} | "
              f"{(rss - floor) / mb:.2f} | {secs:.1f} | {files} | {written:,.1f} | {diff} |")  # fmt: skip
    print("\npeak RSS ours / baseline:")
    for i in range(0, len(rows)):
        if rows[i][3].startswith("ours"):
            ours, base = rows[i], rows[i + 1]
            print(f"  {ours[0]} {ours[1]} {ours[2]}: {ours[6] / base[6]:.2f}x  (above the imports: "
                  f"{(ours[6] - floor) / (base[6] - floor):.2f}x)")  # fmt: skip
    print("\nours, peak RSS MB of each phase (in brackets: (peak - imports) / weights):")
    for preset, dtype, label, mb, peaks in phases:
        print(f"  {preset} {dtype} {label}: "
              + ", ".join(f"{k} {v:,} ({(v - floor) / mb:.2f})" for k, v in peaks.items()))  # fmt: skip
    for line in failed:
        print(line)
    print(f"work dir: {work}")


if __name__ == "__main__":
    main()
