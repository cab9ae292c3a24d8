"""Evaluation throughput: evaluate_model's greedy generation with the hf and the vLLM backend (issue 14).

    .venv/bin/python bench/bench_eval.py --shape qwen3-0.6b --vllm-python .venv-vllm/bin/python   # on a GPU
    .venv/bin/python bench/bench_eval.py --shape tiny --examples 64 --vllm-python .venv-vllm/bin/python  # CPU

A randomly initialised model of the shape (bench_gpu.py's SHAPES, bf16 safetensors) with a word-level
tokenizer covering its whole vocabulary ("t0" ... "tN", EOS "t2"), and a synthetic held-out set of
--examples prompts of --prompt random tokens. Each backend runs in its own process (vLLM in its own venv,
as the rule runs it with EVAL_VLLM_PYTHON): evaluation.py's load_model (bf16 on a GPU, fp32 on the CPU,
--batch-size for hf, vLLM's own scheduling) and the held-out generation task through lm-eval, greedy, at
most --new-tokens tokens. Tokens/s counts generated tokens (re-tokenized answers) over the generation
task's wall time; model loading (and vLLM's engine start) is reported apart. The ratio is vLLM / hf,
measured in the same run.
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
sys.path.insert(0, str(REPO / "bench"))

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])


def main():
    import pandas as pd
    from workflow_scripts.evals.evaluation import load_model
    from workflow_scripts.evals.heldout import evaluate_model
    from workflow_scripts.evals.metrics import HELDOUT
    from lm_eval.tasks import TaskManager

    backend, model, data, new_tokens, batch = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    frame = pd.read_parquet(data)
    start = time.perf_counter()
    lm = load_model(backend, model, "bf16", batch)
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    out = evaluate_model(lm, frame, [], TaskManager(include_defaults=False), new_tokens, False, {}, heldout=(HELDOUT,))
    seconds = time.perf_counter() - start
    answers = [s["exact_match"][0] for s in out["samples"]["heldout"]]
    tokens = sum(len(lm.tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
    print("RESULT " + json.dumps({"load_s": loaded, "generate_s": seconds, "tokens": tokens, "answers": len(answers)}))


if __name__ == "__main__":  # vLLM starts its engine by spawn
    main()
"""


def build(work: Path, shape: str, examples: int, prompt: int) -> None:
    """The model, its word-level tokenizer (every id a word) and the synthetic held-out set."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from bench_gpu import SHAPES
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = SHAPES[shape]["vocab_size"]
    if not (work / "model" / "config.json").exists():
        torch.manual_seed(0)
        config = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)  # fmt: skip
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(work / "model")
        words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t3"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", bos_token="t1", eos_token="t2",
                                            unk_token="t3")  # fmt: skip
        tokenizer.save_pretrained(work / "model")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, vocab, (prompt + 1,), generator=g).tolist() for _ in range(examples)]
    pq.write_table(pa.table({
        "input_ids": ids, "labels": [[-100] * prompt + x[prompt:] for x in ids], "prompt_length": [prompt] * examples,
        "length": [prompt + 1] * examples, "response": [f"t{x[-1]}" for x in ids], "category": [""] * examples,
    }), work / "eval.parquet")  # fmt: skip


def run(python: str, backend: str, work: Path, a) -> dict:
    script = work / "worker.py"
    script.write_text(WORKER)
    cmd = [python, str(script), str(REPO), backend, str(work / "model"),
           str(work / "eval.parquet"), str(a.new_tokens), str(a.batch_size)]  # fmt: skip
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{backend}: failed\n{proc.stderr[-4000:]}")
    r = json.loads(lines[-1].removeprefix("RESULT "))
    return r | {"tokens_per_s": r["tokens"] / r["generate_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="bench_gpu.py's SHAPES")
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per example")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64, help="hf's batch (vLLM schedules its own)")
    p.add_argument("--vllm-python", help="a venv's python with vLLM (docs/evaluation.md); hf only without")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    import torch

    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench_eval_"))
    work.mkdir(parents=True, exist_ok=True)
    build(work, a.shape, a.examples, a.prompt)
    start, rows = time.perf_counter(), []
    for backend, python in (("hf", sys.executable), ("vllm", a.vllm_python)):
        if python:
            rows.append((backend, run(python, backend, work, a)))
            print(backend, rows[-1][1], flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{a.shape}, {a.examples} prompts of {a.prompt} tokens, at most {a.new_tokens} new tokens, {device}, "
          f"{time.perf_counter() - start:.0f} s\n")  # fmt: skip
    print("| backend | load s | generate s | generated tokens | tokens/s |\n|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['load_s']:.1f} | {r['generate_s']:.1f} | {r['tokens']:,} | {r['tokens_per_s']:,.1f} |")
    if len(rows) == 2:
        print(f"\nratio vLLM / hf tokens/s: {rows[1][1]['tokens_per_s'] / rows[0][1]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
