"""One packed micro-batch's forward + backward under each attention implementation, and the optimizer step.

    python3 bench/bench_attention.py --shape qwen3-0.6b --seq 4096           # on a GPU
    .venv/bin/python bench/bench_attention.py --shape tiny --seq 256 --iters 2 # CPU smoke check

What train.py's packed step costs in its parts, on the model bench_gpu.py trains (randomly initialised, fp32
weights under bf16 autocast on a GPU, as training runs): one row of ``--seq`` tokens holding several
conversations back to back, position ids restarting at each (collate_packed), labels on every token, and

- ``sdpa``: what training uses without flash-attn: transformers builds a block-diagonal causal mask from the
  position ids and SDPA runs a masked kernel;
- ``flex_attention``: the same mask as a block mask, PyTorch's compiled flex attention (skips empty blocks);
- ``torch_varlen``: what training uses on such a GPU without flash-attn since 2026-11-29
  (model/varlen_attention.py): PyTorch's variable-length flash kernel over each conversation's own triangle;
- ``sdpa, one causal sequence``: the row as one sequence (position ids 0..seq-1, no mask; is_causal lets SDPA
  take its flash kernel). Wrong for training (conversations attend to each other): the ceiling the others
  are measured against, the baseline of the ratio column;
- the optimizer: ``clip_grad_norm_`` and a fused AdamW step over every parameter, as base.Strategy.step.

Each is the mean of ``--iters`` timed repetitions after ``--warmup`` (compilation happens there). Before
timing, each implementation's loss and gradients are compared with SDPA's (the block-diagonal mask: the
reference): an implementation that is fast but attends differently shows there.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES, synthetic_lengths  # noqa: E402


def packed_row(seq: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """input ids and position ids of one row of ``seq`` tokens: conversations back to back, the last cut to fit."""
    lengths, total = [], 0
    for n in synthetic_lengths(10 * max(1, seq // 64), seq, seed):
        n = min(n, seq - total)
        lengths.append(n)
        total += n
        if total == seq:
            break
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, seq), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, positions, lengths


def timed(fn, warmup: int, iters: int, device: torch.device) -> tuple[float, float]:
    """Mean seconds of ``fn()`` over ``iters`` after ``warmup`` calls; peak GB allocated during them."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.mean(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--impls", nargs="+", default=["sdpa", "torch_varlen", "flex_attention"])
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from workflow_scripts.model import varlen_attention
    from workflow_scripts.train.metrics_logger import flops_per_sequence_fn

    varlen_attention.register()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[a.shape], max_position_embeddings=max(a.seq, 512), pad_token_id=0)
    model = Qwen3ForCausalLM(config).to(device)
    model.config.use_cache = False
    flops_of = flops_per_sequence_fn(model, sum(t.numel() for t in model.parameters()))
    ids, positions, lengths = packed_row(a.seq, config.vocab_size)
    ids, positions = ids.to(device), positions.to(device)
    flops = sum(flops_of([n]) for n in lengths)  # the packed conversations' model FLOPs (each attends to itself)
    print(f"{a.shape}, one row of {a.seq} tokens: {len(lengths)} conversations (mean {statistics.mean(lengths):.0f}),"
          f" {device.type} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}, torch {torch.__version__}",
          flush=True)  # fmt: skip

    def step(impl: str, pos: torch.Tensor):
        model.set_attn_implementation(impl)

        def run():
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    def loss_and_grads(impl: str, pos: torch.Tensor):
        model.set_attn_implementation(impl)
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
        loss.backward()
        grads = torch.cat([t.grad.float().flatten() for t in model.parameters() if t.grad is not None])
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    ref_loss, ref_grads = loss_and_grads("sdpa", positions)
    for impl in a.impls[1:]:
        try:
            loss, grads = loss_and_grads(impl, positions)
        except Exception as e:  # noqa: BLE001
            print(f"check {impl}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        rel = ((grads - ref_grads).norm() / ref_grads.norm()).item()
        print(f"check {impl} against sdpa (block-diagonal mask): loss {loss:.6f} vs {ref_loss:.6f} "
              f"(|diff| {abs(loss - ref_loss):.2e}), gradients' relative difference {rel:.2e}", flush=True)  # fmt: skip
    del ref_grads

    rows = []
    one_sequence = torch.arange(a.seq, device=device).unsqueeze(0)
    cases = [(impl, positions) for impl in a.impls] + [("sdpa, one causal sequence", one_sequence)]
    for name, pos in cases:
        try:
            secs, peak = timed(step(name.split(",")[0], pos), a.warmup, a.iters, device)
        except Exception as e:  # noqa: BLE001 (one implementation missing or failing is a row, not the end)
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        rows.append((name, secs, peak))
        print(f"done: {name} {secs * 1e3:.1f} ms", flush=True)

    params = list(model.parameters())
    for t in params:
        t.grad = torch.randn_like(t) * 1e-3
    fused = device.type == "cuda" or None
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused)

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    opt_s, _ = timed(optimizer_step, a.warmup, a.iters, device)

    base = next((s for n, s, _ in rows if n.startswith("sdpa, one")), None)
    print(f"\n| forward + backward of one packed row | ms | tokens/s | model TFLOP/s | MFU (of {a.peak_tflops:.0f}) "
          "| peak GB (allocated) | time / one causal sequence's |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name, secs, peak in rows:
        ratio = f"{secs / base:.2f}" if base else "n/a"
        print(f"| {name} | {secs * 1e3:.1f} | {a.seq / secs:,.0f} | {flops / secs / 1e12:.1f} "
              f"| {flops / secs / 1e12 / a.peak_tflops:.1%} | {peak:.1f} | {ratio} |")  # fmt: skip
    n = sum(t.numel() for t in params)
    print(
        f"\noptimizer (clip + {'fused ' if fused else ''}AdamW, {n / 1e6:.0f}M fp32 parameters): "
        f"{opt_s * 1e3:.1f} ms a step ({16 * n / opt_s / 1e9:.0f} GB/s of parameters, gradients and moments read)"
    )


if __name__ == "__main__":
    main()
