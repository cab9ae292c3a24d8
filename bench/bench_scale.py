"""Scale proxies on CPU: what one rank holds in memory when the trainer loads a real-shaped model.

    .venv/bin/python bench/bench_scale.py --part load     # (a) each strategy, full and LoRA, 2 ranks; (d) before
    .venv/bin/python bench/bench_scale.py --part world    # (b) FSDP at 1, 2 and 4 ranks

A Qwen3-0.6B-shaped checkpoint (28 layers, hidden 1024, vocab 151936, untied head: 751.6M parameters)
is built once with random weights and saved in bf16 (1.5 GB; 3.0 GB in fp32) under --workdir. Each
row is one `torchrun --nproc_per_node N` run of the trainer's own `model_loading.load_model` +
`strategies.build_strategy` (gloo, one thread per rank, training.precision bf16): every rank reports
its resident set after imports, its peak (VmHWM) after load, and after load + wrap; the table shows
the largest rank's peaks above imports, and their ratio to the model's fp32 bytes (4 x parameters).

"before" rows load as the trainer did until this change: `from_pretrained(dtype=float32)` on every
rank, then the same build_strategy (FSDP then shards a whole model; DeepSpeed partitions it in
initialize).

Targets (issue 13): FSDP and ZeRO-3 at 2 ranks <= 0.6x the fp32 bytes, lower at 4 ranks than at 2;
DDP <= 1.1x; FSDP/ZeRO-3 + LoRA with a bf16 base <= 0.3x.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=False, rope_theta=1000000.0)  # fmt: skip
LORA = {"peft": "lora", "lora": {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}

WORKER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch, torch.distributed as dist, transformers, deepspeed, peft  # everything a rank imports
from settings import training_config
from strategies import build_strategy
from model_loading import load_model
dist.init_process_group("gloo")
imports = status("VmRSS:")
base, config, legacy, out = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
cfg = training_config(config)
device = torch.device("cpu")
if legacy:  # the trainer before issue 13: a whole fp32 model on every rank
    from transformers import AutoModelForCausalLM
    import model_loading
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if cfg.peft == "lora":
        model = model_loading.add_lora(model, cfg, materialize=True)
else:
    model, _ = load_model(base, cfg, device)
loaded = status("VmHWM:")
strategy = build_strategy(cfg, model, device, total_steps=10)
record = {"rank": dist.get_rank(), "imports": imports, "load": loaded, "peak": status("VmHWM:")}
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, record)
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps(rows))
dist.barrier()
os._exit(0)
"""


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


def measure(base: Path, training: dict, ranks: int, legacy: bool, workdir: Path) -> dict:
    out = workdir / "rows.json"
    out.unlink(missing_ok=True)
    config = {"precision": "bf16", "gradient_checkpointing": True} | training
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    script = workdir / "worker.py"
    script.write_text(WORKER)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(ranks), str(script),
           str(REPO / "workflow_scripts"), str(base), json.dumps(config), "1" if legacy else "0", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode != 0:
        raise SystemExit(f"{training} x{ranks}: failed\n{proc.stderr[-3000:]}")
    rows = json.loads(out.read_text())
    worst = max(rows, key=lambda r: r["peak"] - r["imports"])
    load = max(r["load"] - r["imports"] for r in rows)
    return {"imports": worst["imports"], "peak": worst["peak"], "load": load, "above": worst["peak"] - worst["imports"]}


def label(training: dict) -> str:
    name = training["strategy"] + (f"-zero{training['zero_stage']}" if training["strategy"] == "deepspeed" else "")
    return name + (" + LoRA" if training.get("peft") == "lora" else "")


def load_rows() -> list[tuple[dict, int, bool]]:
    """(a): every strategy, full and LoRA, 2 ranks; (d): the loading before this change, full fine-tuning."""
    strategies = [{"strategy": "ddp"}, {"strategy": "fsdp"}, {"strategy": "deepspeed", "zero_stage": 3},
                  {"strategy": "deepspeed", "zero_stage": 2}]  # fmt: skip
    rows = [(s, 2, False) for s in strategies]
    rows += [(s | LORA, 2, False) for s in strategies[:3]]
    rows += [(s, 2, True) for s in strategies[:3]]
    return rows


def world_rows() -> list[tuple[dict, int, bool]]:
    """(b): the FSDP row at 1, 2 and 4 ranks."""
    return [({"strategy": "fsdp"}, ranks, False) for ranks in (1, 2, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["load", "world"], required=True)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_scale")
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    base, n = build_checkpoint(a.workdir / "qwen3-0.6b-shape-bf16")
    fp32 = 4 * n
    print(f"checkpoint: {n / 1e6:.1f}M parameters, fp32 {fp32 / 2**30:.2f} GiB, bf16 file "
          f"{(base / 'model.safetensors').stat().st_size / 2**30:.2f} GiB")  # fmt: skip
    rows = load_rows() if a.part == "load" else world_rows()
    print(f"{'run':28} {'ranks':>5} {'imports GiB':>12} {'load GiB':>9} {'x fp32':>7} {'load+wrap GiB':>14} {'x fp32':>7}")
    results = []
    for training, ranks, legacy in rows:
        m = measure(base, training, ranks, legacy, a.workdir)
        name = label(training) + (" (before)" if legacy else "")
        ratio = m["above"] / fp32
        results.append({"run": name, "ranks": ranks, **m, "ratio": ratio})
        print(f"{name:28} {ranks:>5} {m['imports'] / 2**30:>12.2f} {m['load'] / 2**30:>9.2f} {m['load'] / fp32:>7.2f} "
              f"{m['above'] / 2**30:>14.2f} {ratio:>7.2f}", flush=True)  # fmt: skip
    by = {(r["run"], r["ranks"]): r["ratio"] for r in results}
    for name in ("ddp", "fsdp", "deepspeed-zero3"):
        if (f"{name} (before)", 2) in by:
            print(f"{name}: after / before = {by[(name, 2)] / by[(f'{name} (before)', 2)]:.2f}")
    if a.part == "world":
        print(f"fsdp per-rank peak, 4 ranks / 2 ranks = {by[('fsdp', 4)] / by[('fsdp', 2)]:.2f}")
    (a.workdir / f"{a.part}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
