"""The planner's fake-tensor probe of bench_gpu.py's training run, by attention implementation.

    .venv/bin/python bench/plan_attention.py sdpa torch_varlen

The run bench_gpu.py trains on a GPU (Qwen3-0.6B shape, DDP, one rank, bf16, one packed row of 4,096 tokens a
micro-batch, grad_accum 4, the chunked loss), planned as preflight plans it when check_environment found SDPA or a
variable-length flash kernel: GiB live at the peak, by component, to set beside the GPU's max_memory_allocated
(docs/benchmarks/gpu.md). Each takes about a minute on a CPU.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from workflow_scripts.core.settings import PlanConfig  # noqa: E402
from workflow_scripts.plan.memory_probe import probe  # noqa: E402

GIB = 2**30


def main() -> None:
    keys = {"strategy": "ddp", "precision": "bf16", "max_seq_len": 4096, "micro_batch_size": 1, "grad_accum": 4}
    t = PlanConfig.build(keys)
    config = Qwen3Config(**SHAPES["qwen3-0.6b"], max_position_embeddings=4096, pad_token_id=0)
    print("| attention | planned peak GiB | activations | params | grads | optimizer | probe s |")
    print("|---|---|---|---|---|---|---|")
    for attention in sys.argv[1:] or ["sdpa", "torch_varlen"]:
        r = probe(config, t, 1, attention=attention)
        parts = r["components_bytes"]
        gib = {k: f"{v / GIB:.3f}" for k, v in parts.items()}
        print(f"| {attention} | {r['peak_bytes'] / GIB:.3f} | {gib['activations']} | {gib['params']} | {gib['grads']} "
              f"| {gib['optimizer']} | {r['seconds']:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
