"""Memory benchmarks of issue 24: FSDP2's gradient accumulation, and the planner's fake-tensor probe.

    .venv/bin/python bench/bench_memory.py --part accum      # FSDP2 grad_accum 1 / 2 / 2 no-sync, per rank
    .venv/bin/python bench/bench_memory.py --part planner    # the probe's time for the demo and Llama-3-8B

Part accum: one `torchrun --nproc_per_node 2` run (gloo, CPU, real tensors) of the workflow's own FSDP2
load, wrap and train.py's train_step (memory_probe.measure: two optimizer steps, micro-batch 1 × 128
tokens, bf16 compute, fp32 master weights) on a Qwen3-0.6B-shaped model cut to --layers decoder layers
(hidden 1024, 16 heads / 8 KV heads of 128, MLP 3072, vocab 151936, tied embeddings; random weights), at
grad_accum 1 (the baseline, measured in the same run), grad_accum 2 (reduce-scatter every micro-batch,
the default) and grad_accum 2 with training.fsdp_no_sync (the behaviour before issue 24). The per-rank peak
is the live tensor bytes torch's FSDPMemTracker records (what the CPU allocator holds for tensors). The
ratio is each run's extra over grad_accum 1 against one sharded fp32 gradient (4 B × parameters / ranks):
at most 1.0 means accumulation holds no more than the gradient shard it accumulates into. The same three
rows come from the fake-tensor probe at the full 28-layer shape (no weights allocated).

Part planner: wall time of one memory_probe.probe call (fake tensors, fake process group) for the demo
model's shape (preset demo) and a Llama-3-8B-shaped config (config.json only) at world 8, 4 × 2048 tokens.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(REPO))

MiB = 2**20
BIN = Path(sys.executable).parent
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=True)  # fmt: skip
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, tie_word_embeddings=False)  # fmt: skip
ACCUM_ROWS = {
    "grad_accum 1 (baseline)": {"grad_accum": 1},
    "grad_accum 2, reduce-scatter each micro-batch (default)": {"grad_accum": 2},
    "grad_accum 2, fsdp_no_sync (before)": {"grad_accum": 2, "fsdp_no_sync": True},
}


def plan_keys(**keys):
    from workflow_scripts.core.settings import PlanConfig

    return PlanConfig.build({"strategy": "fsdp", "max_seq_len": 128, "micro_batch_size": 1} | keys)


def worker(shape: dict, out: Path) -> None:
    """Under torchrun: every accum row measured on real tensors; rank 0 writes them."""
    import torch.distributed as dist
    from transformers import Qwen3Config

    from workflow_scripts.plan.memory_probe import measure

    dist.init_process_group("gloo")
    results = {}
    for name, keys in ACCUM_ROWS.items():
        start = time.perf_counter()
        results[name] = measure(Qwen3Config(**shape), plan_keys(**keys)) | {"seconds": time.perf_counter() - start}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def n_params(shape: dict) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(Qwen3Config(**shape)).parameters())


def table(title: str, peaks: dict, params: int, world: int) -> None:
    shard = 4 * params / world
    base = peaks["grad_accum 1 (baseline)"]
    print(f"\n{title}: {params / 1e6:.1f}M parameters, sharded fp32 gradient {shard / MiB:.1f} MiB per rank")
    print("| run | per-rank peak (MiB) | extra over grad_accum 1 (MiB) | extra / gradient shard |")
    print("|---|---:|---:|---:|")
    for name, peak in peaks.items():
        extra = peak - base
        print(f"| {name} | {peak / MiB:.1f} | {extra / MiB:.1f} | {extra / shard:.2f} |")


def part_accum(layers: int) -> None:
    from transformers import Qwen3Config

    from workflow_scripts.plan.memory_probe import probe

    shape = QWEN3_06B | {"num_hidden_layers": layers}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "accum.json"
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", __file__, "--worker", json.dumps(shape),
               str(out)]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, cwd=tmp)
        real = json.loads(out.read_text())
    print(f"torchrun, 2 ranks: {time.perf_counter() - start:.0f} s")
    table(f"measured (real tensors, {layers} layers)", {k: v["Total"] for k, v in real.items()}, n_params(shape), 2)
    fake = {
        name: probe(Qwen3Config(**QWEN3_06B), plan_keys(**keys), 2)["peak_bytes"] for name, keys in ACCUM_ROWS.items()
    }
    table("fake-tensor probe (28 layers)", fake, n_params(QWEN3_06B), 2)


def part_planner() -> None:
    from transformers import LlamaConfig

    from workflow_scripts.model.presets import preset_config
    from workflow_scripts.plan.memory_probe import probe

    demo = plan_keys(strategy="ddp", max_seq_len=128, micro_batch_size=4)
    cases = [
        ("demo (preset demo), ddp, world 2", preset_config("demo", 1024, 128), demo, 2),
        ("Llama-3-8B shape, fsdp, world 8, 4 × 2048, grad_accum 2", LlamaConfig(**LLAMA3_8B),
         plan_keys(max_seq_len=2048, micro_batch_size=4, grad_accum=2), 8),
        ("Llama-3-8B shape, fsdp, world 8, 1 × 4096, checkpointing", LlamaConfig(**LLAMA3_8B),
         plan_keys(max_seq_len=4096, micro_batch_size=1, gradient_checkpointing=True), 8),
    ]  # fmt: skip
    print("| case | probe time (s) | live peak per rank (GiB) |")
    print("|---|---:|---:|")
    for name, config, t, world in cases:
        start = time.perf_counter()
        result = probe(config, t, world)
        print(f"| {name} | {time.perf_counter() - start:.1f} | {result['peak_bytes'] / 2**30:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["accum", "planner"])
    p.add_argument("--layers", type=int, default=8, help="part accum: decoder layers of the measured model")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(json.loads(a.worker[0]), Path(a.worker[1]))
    elif a.part == "accum":
        part_accum(a.layers)
    else:
        part_planner()


if __name__ == "__main__":
    main()
