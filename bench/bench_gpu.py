"""GPU training throughput: our train.py (packed, padding-free) against the Hugging Face Trainer (padded).

    .venv/bin/python bench/bench_gpu.py --shape qwen3-0.6b --seq 4096 --steps 30      # on one H100
    .venv/bin/python bench/bench_gpu.py --shape llama-8b --lora --seq 4096 --steps 10  # LoRA, ours only
    .venv/bin/python bench/bench_gpu.py --shape tiny --seq 256 --steps 6               # CPU smoke check

Both sides train the same randomly initialised model on the same synthetic conversations (log-normal
lengths, the first 30% of each sequence masked as the prompt), one process, bf16 autocast over fp32
master weights, AdamW, the same number of real tokens per optimizer step. Ours feeds bins of `--seq`
tokens from the best-fit-decreasing packing plan; the Trainer pads each batch of examples to its
longest (as DataCollatorForSeq2Seq does), which is what a user gets from it without packing.

Tokens/s counts real (non-pad) tokens, after `--warmup` steps. MFU = model FLOPs / time / peak, with
model FLOPs = 6 N s + 12 L d s^2 per sequence of length s (PaLM's convention; N without the input
embedding), over `--peak-tflops` (989: H100 SXM dense bf16).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(REPO))

SHAPES = {
    # Qwen3-0.6B: 28 layers, GQA 16/8 heads of 128, tied embeddings, 151,936-token vocabulary
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # Llama 3 8B
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}  # fmt: skip


def synthetic_lengths(n: int, seq: int, seed: int = 0) -> list[int]:
    """Long-tailed conversation lengths: log-normal around seq/8, clipped to [32, seq]."""
    import random

    rng = random.Random(seed)
    return [max(32, min(seq, int(rng.lognormvariate(math.log(seq / 8), 0.9)))) for _ in range(n)]


def write_data(work: Path, lengths: list[int], vocab: int, seq: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from workflow_scripts.data.packing import write_packing

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    labels = [[-100] * int(0.3 * len(x)) + x[int(0.3 * len(x)) :] for x in ids]
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), work / "tokens.parquet")
    write_packing(lengths, seq, work / "packing.parquet")


def build_model(work: Path, shape: str, seq: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=max(seq, 512), pad_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(work / "model")


def run_ours(work: Path, a, bins_per_step: int, chunked_loss: bool = True, attention: str | None = None) -> dict:
    """train.py on the packed bins; ``attention``: TRAIN_ATTENTION (None: what train.py chooses)."""
    logs = work / ("ours" if chunked_loss else "ours-own-loss")
    logs = logs.with_name(f"{logs.name}-{attention}") if attention else logs
    cfg = {
        "chunked_loss": chunked_loss,
        "precision": "bf16" if a.device == "cuda" else "fp32", "lr": 1e-4, "micro_batch_size": 1,
        "grad_accum": bins_per_step, "max_steps": a.steps, "log_every": 1, "checkpoint_every": 10**9,
        "warmup_steps": 0, "gradient_checkpointing": a.gradient_checkpointing, "peak_tflops": a.peak_tflops,
        "peft": "lora" if a.lora else "none", "lora": {"r": 16, "alpha": 32},
    }  # fmt: skip
    cmd = [
        str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "1",
        "-m", "workflow_scripts.train.train", "--config", json.dumps(cfg), "--data", str(work / "tokens.parquet"),
        "--packing", str(work / "packing.parquet"), "--base-model", str(work / "model"),
        "--log-dir", str(logs), "--checkpoint-root", str(logs / "ckpt"), "--state", str(logs / "state.json"),
    ]  # fmt: skip
    env = os.environ | ({"TRAIN_PROFILE_STEPS": a.profile_steps} if a.profile_steps else {})
    env |= {"TRAIN_ATTENTION": attention} if attention else {}
    run_logged(cmd, logs.with_suffix(".log"), env)
    if a.profile_steps:  # where the step's time went (workflow_scripts/train/profiler.py)
        print(f"profile of {logs.name}:\n" + (logs / "profile" / "rank0.txt").read_text(), flush=True)
    rows = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()][a.warmup :]
    plan = json.loads((logs / "plan.json").read_text())
    return {
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rows),
        "tflops": statistics.mean(r["tflops_per_rank"] for r in rows),
        "peak_gb": max(r["peak_memory_gb"] or 0 for r in rows),
        "attention": plan["attention"],
    }


TRAINER = r"""
import json, sys, time
import pyarrow.parquet as pq, torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
work, steps, batch, bf16, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
t = pq.read_table(f"{work}/tokens.parquet")
rows = [{"input_ids": i, "labels": l, "attention_mask": [1] * len(i)}
        for i, l in zip(t.column("input_ids").to_pylist(), t.column("labels").to_pylist())]
model = AutoModelForCausalLM.from_pretrained(f"{work}/model", dtype=torch.float32, attn_implementation="sdpa")

class Clock(TrainerCallback):
    def __init__(self): self.times, self.t0 = [], None
    def on_step_begin(self, args, state, control, **kw):
        if torch.cuda.is_available(): torch.cuda.synchronize()
        self.t0 = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        if torch.cuda.is_available(): torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)

clock, seen = Clock(), []
def pad(features):
    # pad to the longest example of the batch; record the real lengths
    seen.append([len(f["input_ids"]) for f in features])
    w = max(len(f["input_ids"]) for f in features)
    out = {k: torch.full((len(features), w), v, dtype=torch.long) for k, v in
           (("input_ids", 0), ("labels", -100), ("attention_mask", 0))}
    for j, f in enumerate(features):
        for k in out: out[k][j, : len(f[k])] = torch.tensor(f[k])
    return out
args = TrainingArguments(output_dir=f"{work}/trainer", per_device_train_batch_size=batch, max_steps=steps,
                         gradient_accumulation_steps=accum,
                         learning_rate=1e-4, bf16=bf16, logging_steps=10**9, save_strategy="no", report_to=[],
                         dataloader_num_workers=0, remove_unused_columns=False, seed=0, use_cpu=not bf16)
Trainer(model=model, args=args, train_dataset=rows, data_collator=pad, callbacks=[clock]).train()
peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
steps_seen = [sum(seen[i : i + accum], []) for i in range(0, len(seen), accum)]  # each optimizer step's examples
print(json.dumps({"times": clock.times, "lengths": steps_seen, "peak_gb": peak}))
"""


def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> str:
    """Run ``cmd`` with its output streamed to ``log`` (what a run stopped by a time limit leaves); its output."""
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env).returncode
    text = log.read_text()
    if code:
        raise SystemExit(f"{cmd[0]} ... failed ({code}), {log}:\n{text[-4000:]}")
    return text


def run_trainer(work: Path, a, batch: int, flops_of) -> dict:
    """The Trainer's step is ``batch`` examples: micro-batches of at most --trainer-micro-batch, accumulated
    (23 padded examples of 4,096 at once need more than an H200's 139 GiB for the 151,936-token logits)."""
    script = work / "trainer.py"
    script.write_text(TRAINER)
    bf16 = "1" if a.device == "cuda" else "0"
    micro = min(batch, a.trainer_micro_batch)
    accum = max(1, round(batch / micro))  # micro × accum examples a step, the nearest to ``batch``
    cmd = [sys.executable, str(script), str(work), str(a.steps), str(micro), bf16, str(accum)]
    out = run_logged(cmd, work / "trainer.log")
    result = json.loads([x for x in out.splitlines() if x.startswith('{"times"')][-1])
    times, lengths = result["times"][a.warmup :], result["lengths"][a.warmup : len(result["times"])]
    secs = sum(times)
    return {
        "tokens_per_s": sum(sum(x) for x in lengths) / secs,
        "tflops": sum(flops_of(x) for x in lengths) / secs / 1e12,
        "peak_gb": result["peak_gb"],
        "attention": f"sdpa (padded), {accum} x {micro} examples",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the means")
    p.add_argument("--bins-per-step", type=int, default=4, help="packed bins of --seq tokens per optimizer step")
    p.add_argument("--lora", action="store_true", help="LoRA r=16 on q/k/v/o; ours only")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--own-loss-too", action="store_true", help="ours again with training.chunked_loss: false")
    p.add_argument("--attention-too", help="ours again with this TRAIN_ATTENTION (e.g. sdpa: the baseline of ours)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--trainer-micro-batch", type=int, default=4, help="the Trainer's examples per forward")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--profile-steps", help="TRAIN_PROFILE_STEPS for our runs (e.g. 8-9): their profile printed")
    p.add_argument("--no-trainer", action="store_true", help="ours only (no Hugging Face Trainer run)")
    a = p.parse_args()
    import torch

    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    lengths = synthetic_lengths(a.bins_per_step * (a.steps + 2) * max(1, a.seq * 8 // 4096) * 4, a.seq)
    write_data(work, lengths, SHAPES[a.shape]["vocab_size"], a.seq)
    build_model(work, a.shape, a.seq)
    start = time.perf_counter()
    ours = run_ours(work, a, a.bins_per_step)
    results = [("ours: packed, padding-free, " + ours["attention"] + ", chunked loss", ours)]
    print(f"done: {results[-1]}", flush=True)  # each run's numbers as soon as it ends (a time limit keeps them)
    if a.own_loss_too:  # what training.chunked_loss costs in time and saves in memory
        own = run_ours(work, a, a.bins_per_step, chunked_loss=False)
        results.append(("ours, the model's own loss (training.chunked_loss: false)", own))
        print(f"done: {results[-1]}", flush=True)
    if a.attention_too:  # the same run with another attention implementation
        other = run_ours(work, a, a.bins_per_step, attention=a.attention_too)
        results.append((f"ours, TRAIN_ATTENTION={a.attention_too}", other))
        print(f"done: {results[-1]}", flush=True)
    ratio = None
    if not a.lora and not a.no_trainer:
        from transformers import AutoModelForCausalLM

        from workflow_scripts.train.metrics_logger import flops_per_sequence_fn

        model = AutoModelForCausalLM.from_pretrained(work / "model")
        flops_of = flops_per_sequence_fn(model, sum(t.numel() for t in model.parameters()))
        del model
        # the same real tokens per step: examples of the mean length filling the packed bins
        batch = max(1, round(a.bins_per_step * a.seq * 0.99 / statistics.mean(lengths)))
        base = run_trainer(work, a, batch, flops_of)
        results.append((f"HF Trainer: {base['attention'].split(', ')[-1]} a step, padded to longest", base))
        print(f"done: {results[-1]}", flush=True)
        ratio = ours["tokens_per_s"] / base["tokens_per_s"]

    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    lora = " + LoRA r=16" if a.lora else ""
    print(f"\n{a.shape}{lora}, seq {a.seq}, {a.steps} steps ({a.warmup} warm-up), {device}, "
          f"{time.perf_counter() - start:.0f} s\n")  # fmt: skip
    print("| run | tokens/s | model TFLOP/s | MFU | peak GB |\n|---|---|---|---|---|")
    for name, r in results:
        mfu = f"{r['tflops'] / a.peak_tflops:.1%}" if a.device == "cuda" else "n/a (CPU)"
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] else "n/a"
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | {peak} |")
    if ratio is not None:
        print(f"\nratio ours / Trainer tokens/s: {ratio:.2f}x (target >= 1.3x; MFU target >= 40%)")
    if a.attention_too:
        print(f"{ours['attention']} / {a.attention_too}: tokens/s {ours['tokens_per_s'] / other['tokens_per_s']:.3f}x, "
              f"peak {ours['peak_gb'] or 0:.2f} / {other['peak_gb'] or 0:.2f} GB")  # fmt: skip
    if a.own_loss_too:
        print(f"chunked / own loss: tokens/s {ours['tokens_per_s'] / own['tokens_per_s']:.3f}x, "
              f"peak {ours['peak_gb'] or 0:.2f} / {own['peak_gb'] or 0:.2f} GB")  # fmt: skip


if __name__ == "__main__":
    main()
