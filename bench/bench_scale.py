"""Scale benchmarks: what a training rank's memory does as the data grows.

    .venv/bin/python bench/bench_scale.py --part data                       # the table in docs/benchmarks/data.md
    .venv/bin/python bench/bench_scale.py --part data --tokens 200000000     # a bigger shard (1.6 GB of int32)

Part data (issue 13, bench parts c and d): a synthetic tokenized shard with the tokenization stage's
schema (rows of 200-2000 tokens, random ids, the prompt's labels masked) and its packing plan (bins of
2048 tokens), then, each in its own process (one thread) so the numbers do not mix:
  store     the shard converted into its memory-mapped token store (time, peak RSS, size)
  mmap      batching.TrainingData as rank 0 of 8 over the store: RSS after the imports, after
            construction, after 100 micro-batches (packed: 4 bins; padded: 8 examples); the
            growth against the shard's int32 size (8 bytes a token: input_ids + labels)
  legacy    the list-based loader the trainer used before (legacy_load_examples, a copy) on a
            smaller shard: RSS per token, the "before" of the before/after
RSS is VmRSS from /proc/self/status, split into anonymous memory (the rank's own) and file pages
(the store's pages the rank has touched: page cache shared by every rank of the host, reclaimable).

    .venv/bin/python bench/bench_scale.py --part load --workdir /tmp/bench_scale   # (a) + (d): model loading
    .venv/bin/python bench/bench_scale.py --part load --workdir /tmp/bench_scale --only deepspeed-zero3  # some rows
    .venv/bin/python bench/bench_scale.py --part world --workdir /tmp/bench_scale  # (b): FSDP at 1, 2, 4 ranks
    .venv/bin/python bench/bench_scale.py --part step --workdir /tmp/bench_scale   # (e): FSDP2 vs ZeRO-3 through
                                                                                   # the first optimizer step
    .venv/bin/python bench/bench_scale.py --part zero3-host --workdir /tmp/bench_scale  # issue 24 item 7
    .venv/bin/python bench/bench_scale.py --part phases --workdir /tmp/bench_scale      # FSDP2 + LoRA per phase
    .venv/bin/python bench/bench_scale.py --part phases --workdir /tmp/bench_scale --own-loss  # without chunked_loss
    .venv/bin/python bench/bench_scale.py --part planner --workdir /tmp/bench_scale     # issue 24 item 8 (CPU)
    .venv/bin/python bench/bench_scale.py --part planner --workdir /tmp/bench_scale --case zero3 --fresh  # one case
    .venv/bin/python bench/bench_scale.py --part planner --device cuda --nproc 1 --precision bf16 \
        --vocab 151936 --layers 28 --seq 2048 --workdir /tmp/bench_gpu   # the GPU checklist (docs/benchmarks/gpu.md)

Parts load and world (issue 13, bench parts a, b and d): a Qwen3-0.6B-shaped checkpoint (28 layers,
hidden 1024, vocab 151936, untied head: 751.6M parameters) built once with random weights and saved in
bf16 (1.4 GiB; 2.8 GiB in fp32) under --workdir. Each row is one `torchrun --nproc_per_node N` run of the
trainer's own parallel.load_model + parallel.build_strategy (gloo, one thread per rank,
training.precision bf16, gradient checkpointing): every rank reports its resident set after imports,
its peak (VmHWM) after load, and after load + wrap; the table shows the largest rank's peaks above
imports and their ratio to the model's fp32 bytes (4 x parameters). "before" rows load as the trainer
did until issue 13: from_pretrained(dtype=float32) on every rank, then the same build_strategy.

Part planner (issue 24 item 8): for each --case (ddp, fsdp, fsdp-lora, zero3) at each --grad-accum, the
planner's per-GPU plan (preflight.py, plan_training's entry point, on a Qwen3-0.6B-wide checkpoint of
--layers layers and a --vocab vocabulary; micro-batch 1 x --seq packed tokens) without its GPU-only terms
(allocator headroom, CUDA context, NCCL buffers; the formula's fixed overhead), against the same two
optimizer steps run for real under torchrun by the trainer's own code (bench/planner_check.py: its
docstring says what is measured and why it is the plan's quantity). Rows are kept in --workdir's
planner_rows.jsonl with their settings, so a case can be measured alone and the table printed with the rest.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale_workers import (
    CHILDREN,
    MB,
    PHASES_WORKER,
    QWEN3_06B,
    WORKER,
    build_checkpoint,
    build_planner_checkpoint,
    n_params,
    synthetic_shard,
)

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(REPO))

BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- part data


def in_child(name: str, **params) -> dict:
    """Run CHILDREN[name](params) in a fresh one-thread process; its result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, __file__, "--child", name, json.dumps(params, default=str)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_row(variant: str, r: dict, micro_batches: int | None) -> dict:
    construction = r["built"]["VmRSS"] - r["imported"]["VmRSS"]
    growth = {k: r["after"][k] - r["built"][k] for k in ("VmRSS", "RssAnon", "RssFile")}
    int32_mb = 8 * r["tokens"] / MB
    return {
        "variant": variant,
        "tokens": r["tokens"],
        "int32 MB": int32_mb,
        "RSS imports MB": r["imported"]["VmRSS"],
        "construction +MB": construction,
        "bytes/token": construction * MB / r["tokens"],
        f"{micro_batches or '-'} micro-batches +MB (anon/file)": (
            f"{growth['VmRSS']:.1f} ({growth['RssAnon']:.1f}/{growth['RssFile']:.1f})" if micro_batches else "-"
        ),
        "growth / int32": growth["VmRSS"] / int32_mb if micro_batches else None,
    }


def data_part(args) -> list[dict]:
    """Part c: per-rank RSS of the memory-mapped data path; part d: bytes a token against the list-based loader."""
    work = args.workdir
    shards = {}
    for name, tokens in (("big", args.tokens), ("small", args.legacy_tokens)):
        shard, plan = work / f"{name}_{tokens}.parquet", work / f"{name}_{tokens}.packing.parquet"
        if not plan.exists():
            from workflow_scripts.data.packing import write_packing

            lengths = synthetic_shard(shard, tokens, seed=len(name))
            write_packing(lengths, 2048, plan)
        shards[name] = (shard, plan)
    root = work / "token-store"
    rows = []
    for name, (shard, _) in shards.items():
        r = in_child("store", shard=shard, root=work / f"fresh-store-{time.time_ns()}")
        rows.append({"variant": f"store build ({name} shard)", "seconds": r["seconds"], "store MB": r["store_mb"],
                     "peak RSS MB": r["peak"], "RSS imports MB": r["base"]["VmRSS"]})  # fmt: skip
        in_child("store", shard=shard, root=root)  # the store the trainer variants open (built here, not timed)
    n = args.micro_batches
    for name, (shard, plan) in shards.items():
        for packing in (True, False):
            r = in_child("mmap", shard=shard, plan=plan, root=root, packing=packing, micro_batches=n)
            what = "packed, 4 bins of 2048" if packing else "padded, 8 examples"
            rows.append(memory_row(f"memory-mapped ({name} shard, {what})", r, n))
    r = in_child("legacy", shard=shards["small"][0])
    rows.append(memory_row("list-based legacy_load_examples (small shard)", r, None))
    return rows


# ---------------------------------------------------------------- table


def print_table(rows: list[dict]) -> None:
    """One Markdown table per set of columns (rows with the same keys, in order)."""
    groups: list[list[dict]] = []
    for row in rows:
        if groups and list(groups[-1][0]) == list(row):
            groups[-1].append(row)
        else:
            groups.append([row])
    for group in groups:
        cols = list(group[0])
        cells = [[cell(row[c]) for c in cols] for row in group]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
        print("\n| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for r in cells:
            print("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) + " |")


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def data_summary(rows: list[dict]) -> None:
    legacy = next(r for r in rows if r["variant"].startswith("list-based"))
    small = next(r for r in rows if r["variant"].startswith("memory-mapped (small shard, packed"))
    big = [r for r in rows if r["variant"].startswith("memory-mapped (big")]
    ratio = legacy["bytes/token"] / max(small["bytes/token"], 1e-9)
    print(f"\nbytes/token of construction, list-based / memory-mapped (same shard): "
          f"{legacy['bytes/token']:.1f} / {small['bytes/token']:.3f} = {ratio:,.0f}x")  # fmt: skip
    for r in big:
        ok = "meets" if r["growth / int32"] <= 0.1 else "MISSES"
        print(f"{r['variant']}: RSS growth over the micro-batches = {r['growth / int32']:.4f}x the shard's int32 size "
              f"({ok} the target of 0.1x)")  # fmt: skip


LORA = {"peft": "lora", "lora": {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}


def measure(
    base: Path, training: dict, ranks: int, legacy: bool, workdir: Path, step: bool = False, malloc: str = "mallopt"
) -> dict:
    """One torchrun of WORKER. ``malloc``: "mallopt" as the trainer (host_memory.map_large_allocations at
    start), "default" glibc's dynamic mmap threshold, "env" MALLOC_MMAP_THRESHOLD_=1048576 in the environment,
    "before" the trainer before issue 24 (glibc's default, no malloc_trim after deepspeed.initialize)."""
    out = workdir / "rows.json"
    out.unlink(missing_ok=True)
    config = {"precision": "bf16", "gradient_checkpointing": True} | training
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    if malloc == "env":
        env["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    script = workdir / "worker.py"
    script.write_text(WORKER)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(ranks), str(script),
           str(REPO), str(base), json.dumps(config), "1" if legacy else "0", str(out),
           "1" if step else "0", {"mallopt": "1", "before": "before"}.get(malloc, "0")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode != 0:
        raise SystemExit(f"{training} x{ranks}: failed\n{proc.stderr[-3000:]}")
    rows = json.loads(out.read_text())
    worst = max(rows, key=lambda r: r["peak"] - r["imports"])
    load = max(r["load"] - r["imports"] for r in rows)
    step_peak = max((r["step"] - r["imports"] for r in rows), default=None) if step else None
    after = max(r["after"] - r["imports"] for r in rows)
    return {"imports": worst["imports"], "peak": worst["peak"], "load": load, "above": worst["peak"] - worst["imports"],
            "step": step_peak, "after": after}  # fmt: skip


def label(training: dict) -> str:
    name = training["strategy"] + (f"-zero{training['zero_stage']}" if training["strategy"] == "deepspeed" else "")
    return name + (" + LoRA" if training.get("peft") == "lora" else "")


def load_cases() -> list[tuple[dict, int, bool]]:
    """(a): every strategy, full and LoRA, 2 ranks; (d): the loading before this change, full fine-tuning."""
    strategies = [{"strategy": "ddp"}, {"strategy": "fsdp"}, {"strategy": "deepspeed", "zero_stage": 3},
                  {"strategy": "deepspeed", "zero_stage": 2}]  # fmt: skip
    rows = [(s, 2, False) for s in strategies]
    rows += [(s | LORA, 2, False) for s in strategies[:3]]
    rows += [(s, 2, True) for s in strategies[:3]]
    rows.append((strategies[2], 4, False))  # ZeRO-3's partitions shrink with the world size
    return rows


def world_cases() -> list[tuple[dict, int, bool]]:
    """(b): the FSDP row at 1, 2 and 4 ranks."""
    return [({"strategy": "fsdp"}, ranks, False) for ranks in (1, 2, 4)]


def step_cases() -> list[tuple[dict, int, bool]]:
    """(e): through the first optimizer step, 2 ranks, the sharded strategies: FSDP2 allocates its gradients
    and AdamW states in the step, DeepSpeed its fp32 master and gradient partitions in deepspeed.initialize;
    after one step both hold everything training holds, so the peaks compare like with like."""
    return [({"strategy": "fsdp"}, 2, False), ({"strategy": "deepspeed", "zero_stage": 3}, 2, False)]


def model_part(cases, args, step: bool = False) -> list[dict]:
    """Each case in its own torchrun; rows with the peaks above imports and their ratio to the fp32 bytes."""
    workdir = args.workdir
    base, n = build_checkpoint(workdir / "qwen3-0.6b-shape-bf16")
    fp32 = 4 * n
    print(f"checkpoint: {n / 1e6:.1f}M parameters, fp32 {fp32 / 2**30:.2f} GiB, bf16 file "
          f"{(base / 'model.safetensors').stat().st_size / 2**30:.2f} GiB", flush=True)  # fmt: skip
    rows = []
    for training, ranks, legacy in cases:
        if args.only and label(training) + (" (before)" if legacy else "") not in args.only:
            continue
        m = measure(base, training, ranks, legacy, workdir, step)
        rows.append({
            "run": label(training) + (" (before)" if legacy else ""), "ranks": ranks,
            "imports GiB": m["imports"] / 2**30, "load GiB": m["load"] / 2**30, "load x fp32": m["load"] / fp32,
            "load+wrap GiB": m["above"] / 2**30, "load+wrap x fp32": m["above"] / fp32,
        } | ({"first step GiB": m["step"] / 2**30, "first step x fp32": m["step"] / fp32} if step else {}))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


MALLOC_LABELS = {"before": "before: glibc default, no trim", "default": "glibc default + trim",
                 "env": "MALLOC_MMAP_THRESHOLD_=1048576 + trim", "mallopt": "mallopt + trim (train.py)"}  # fmt: skip


def zero3_host_part(args) -> list[dict]:
    """Issue 24 item 7: ZeRO-3's resident set after deepspeed.initialize against DeepSpeed's floor (the bf16
    partition, fp32 master and bf16 gradient partitions, 8 bytes a parameter over N ranks), at 2 and 4 ranks,
    as before issue 24, with glibc's default malloc, MALLOC_MMAP_THRESHOLD_ in the environment and the trainer's
    mallopt (each but "before" with the malloc_trim that follows deepspeed.initialize)."""
    base, n = build_checkpoint(args.workdir / "qwen3-0.6b-shape-bf16")
    rows = []
    for ranks in args.ranks:
        floor = 8 * n / ranks
        for malloc in args.malloc:
            m = measure(base, {"strategy": "deepspeed", "zero_stage": 3}, ranks, False, args.workdir, malloc=malloc)
            rows.append({
                "malloc": MALLOC_LABELS[malloc],
                "ranks": ranks, "floor GiB": floor / 2**30, "after initialize GiB": m["after"] / 2**30,
                "after / floor": m["after"] / floor, "peak GiB": m["above"] / 2**30, "peak / floor": m["above"] / floor,
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def phases_part(args) -> list[dict]:
    """Issue 24 item 7: FSDP2 + LoRA per phase (2 ranks, bf16, gradient checkpointing, one micro-batch of
    --tokens tokens): each phase's peak and what it leaves, the largest rank, x the model's fp32 bytes."""
    base, n = build_checkpoint(args.workdir / "qwen3-0.6b-shape-bf16")
    out = args.workdir / "phases.json"
    out.unlink(missing_ok=True)
    script = args.workdir / "phases_worker.py"
    script.write_text(PHASES_WORKER)
    config = {"precision": "bf16", "gradient_checkpointing": True, "strategy": "fsdp"} | LORA
    config["chunked_loss"] = not args.own_loss
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(script), str(REPO),
           str(base), json.dumps(config), str(out), str(args.phase_tokens)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=args.workdir)
    if proc.returncode != 0:
        raise SystemExit(f"phases failed\n{proc.stderr[-3000:]}")
    ranks = json.loads(out.read_text())
    fp32, rows = 4 * n, []
    for i, name in enumerate(p["phase"] for p in ranks[0]):
        worst = max((r[i] for r in ranks), key=lambda p: p["peak"])
        rows.append({
            "phase": name, "RSS before GiB": worst["before"] / 2**30, "phase peak GiB": worst["peak"] / 2**30,
            "peak - before GiB": (worst["peak"] - worst["before"]) / 2**30 if i else None,
            "RSS after GiB": worst["after"] / 2**30, "after x fp32": worst["after"] / fp32,
        })  # fmt: skip
    return rows


def zero3_host_summary(rows: list[dict]) -> None:
    for r in rows:
        ok = "meets" if r["after / floor"] <= 1.15 else "MISSES"
        print(f"ZeRO-3 x{r['ranks']}, {r['malloc']}: after initialize {r['after / floor']:.2f}x the floor ({ok} 1.15x)")


def load_part(args) -> list[dict]:
    return model_part(load_cases(), args)


def world_part(args) -> list[dict]:
    return model_part(world_cases(), args)


def step_part(args) -> list[dict]:
    return model_part(step_cases(), args, step=True)


def model_summary(rows: list[dict]) -> None:
    by = {(r["run"], r["ranks"]): r for r in rows}
    for name in ("ddp", "fsdp", "deepspeed-zero3"):
        if (f"{name} (before)", 2) in by:
            after, before = by[(name, 2)], by[(f"{name} (before)", 2)]
            print(f"{name}: load+wrap after / before = {after['load+wrap x fp32'] / before['load+wrap x fp32']:.2f}")
    if ("deepspeed-zero3", 2) in by and "first step x fp32" in by[("deepspeed-zero3", 2)]:
        zero3, fsdp = by[("deepspeed-zero3", 2)], by[("fsdp", 2)]
        print(f"first step, ZeRO-3 / FSDP2 per-rank peak = {zero3['first step GiB'] / fsdp['first step GiB']:.2f}")
    for (run, ranks), r in by.items():
        if run != "deepspeed-zero3":
            continue
        # what DeepSpeed keeps after initialize: bf16 partition, fp32 master, bf16 gradient partition (2 + 4 + 2 bytes)
        print(f"ZeRO-3 x{ranks}: load+wrap {r['load+wrap x fp32']:.2f}x fp32, its kept state {2 / ranks:.2f}x")
        if "first step x fp32" in r:  # + AdamW's two fp32 states; FSDP2's shard, gradient and states are as many
            print(f"ZeRO-3 x{ranks}: first step {r['first step x fp32']:.2f}x fp32, its kept state {4 / ranks:.2f}x")
    if ("fsdp", 4) in by:
        print(f"fsdp per-rank load+wrap peak, 4 ranks / 2 ranks = "
              f"{by[('fsdp', 4)]['load+wrap GiB'] / by[('fsdp', 2)]['load+wrap GiB']:.2f}")  # fmt: skip


# ---------------------------------------------------------------- part planner (issue 24 item 8)

PLANNER_CASES = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "fsdp-lora": {"strategy": "fsdp", "peft": "lora",
                  "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": LORA["lora"]["target_modules"]}},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}  # fmt: skip
# What the plan adds for a GPU beyond the live tensor bytes (memory_probe's stated constants, the formula's
# fixed overhead): left out of the comparison with a CPU run, whose tensors live in host memory.


def planner_shape(layers: int, vocab: int) -> dict:
    """Qwen3-0.6B's width (hidden 1024, 16 heads / 8 KV heads of 128, MLP 3072), tied embeddings as the
    released model, ``layers`` decoder layers and a ``vocab``-token vocabulary."""
    return QWEN3_06B | {"num_hidden_layers": layers, "vocab_size": vocab, "tie_word_embeddings": True}


def planner_keys(args, case: str, grad_accum: int) -> dict:
    """The planner's keys (settings.PlanConfig) of one case: micro-batch 1 × --seq packed tokens."""
    import dataclasses

    from workflow_scripts.core.settings import PlanConfig

    keys = {
        "precision": args.precision,
        "micro_batch_size": 1,
        "max_seq_len": args.seq,
        "grad_accum": grad_accum,
        "gradient_checkpointing": args.checkpointing,
        "procs_per_node": args.nproc,
        "gpu_memory_gb": 1000,
    }
    return dataclasses.asdict(PlanConfig.build(keys | PLANNER_CASES[case]))  # fmt: skip


def plan(base: Path, t: dict, workdir: Path) -> dict:
    """plan_training's public entry point (preflight.py) on the checkpoint's folder: plan/memory.json.
    Kept in --workdir's plans.jsonl under the checkpoint's name (its shape) and the keys: the plan reads nothing
    else, so plans made on a CPU machine (--plan-only) serve the measured runs on a GPU machine."""
    cache = workdir / "plans.jsonl"
    key = {"model": base.name, "keys": t}
    kept = [json.loads(line) for line in cache.read_text().splitlines()] if cache.exists() else []
    for k in kept:
        if k["key"] == key:
            return k["plan"] | {"_plan_s": k["seconds"]}
    start = time.perf_counter()
    est = run_preflight(base, t, workdir)
    with cache.open("a") as f:
        f.write(json.dumps({"key": key, "plan": est, "seconds": time.perf_counter() - start}) + "\n")
    return est | {"_plan_s": time.perf_counter() - start}


def run_preflight(base: Path, t: dict, workdir: Path) -> dict:
    out = workdir / "memory.json"
    cmd = [sys.executable, "-m", "workflow_scripts.plan.preflight", "--model", str(base), "--config",
           json.dumps(t), "--output", str(out), "--table", str(workdir / "memory.csv")]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # PYTHONPATH: REPO before what was there (above)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"preflight failed for {t['strategy']}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_case(base: Path, t: dict, args) -> dict:
    """planner_check.py under torchrun (--nproc ranks): every rank's measured peaks."""
    out = args.workdir / "measured.json"
    out.unlink(missing_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":  # a GPU machine's ranks on the CPU too
        env |= {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(args.nproc),
           str(REPO / "bench" / "planner_check.py"), str(base), json.dumps(t), str(out), args.device]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=args.workdir)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{t['strategy']}: the measured run failed\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def planned_live(est: dict) -> tuple[float, float]:
    """The plan's per-GPU bytes without its GPU-only terms (preflight.live_gb), and those terms' bytes."""
    from workflow_scripts.plan.preflight import live_gb

    return live_gb(est) * 2**30, (est["total_gb"] - live_gb(est)) * 2**30


def planner_part(args) -> list[dict]:
    """Issue 24 item 8: the planner's per-rank peak against the same training measured (see planner_check.py).
    Each row is kept in --workdir's planner_rows.jsonl with its settings: a later run with the same
    settings reuses it (--fresh measures again), so cases can be run one at a time (--case zero3)."""
    shape = planner_shape(args.layers, args.vocab)
    base = build_planner_checkpoint(args.workdir / f"qwen3-0.6b-width-{args.layers}-layers-{args.vocab}", shape)
    n = n_params(shape)
    kept_file = args.workdir / "planner_rows.jsonl"
    kept = [json.loads(line) for line in kept_file.read_text().splitlines()] if kept_file.exists() else []
    rows = []
    for case in args.case:
        for accum in args.grad_accum:
            settings = {"case": case, "grad_accum": accum, "layers": args.layers, "vocab": args.vocab, "seq": args.seq,
                        "precision": args.precision, "checkpointing": args.checkpointing, "nproc": args.nproc,
                        "device": args.device}  # fmt: skip
            old = [k["row"] for k in kept if k["settings"] == settings]
            if old and not args.fresh:
                rows.append(old[-1])
                print(f"kept: {old[-1]}", flush=True)
                continue
            t = planner_keys(args, case, accum)
            est = plan(base, t, args.workdir)
            plan_s = est.pop("_plan_s")
            if args.plan_only:
                print(f"planned {case}, grad_accum {accum} in {plan_s:.1f} s", flush=True)
                continue
            live, gpu_only = planned_live(est)
            try:
                m = run_case(base, t, args)
            except SystemExit as e:  # the other cases still run
                print(e, flush=True)
                continue
            row = {"case": f"{case}, grad_accum {accum}", "planned by": "probe" if est.get("probe") else "formula",
                   "planned MiB": live / MB}  # fmt: skip
            if args.device == "cpu":  # live tensor storages (the ratio), the allocator's events, the RSS
                tensors = max(r["storages_peak"] for r in m["ranks"])
                allocator = max(m["ranks"], key=lambda r: r["allocated_peak"])
                row |= {"measured MiB": tensors / MB, "planned / measured": live / tensors,
                        "allocator events MiB": allocator["allocated_peak"] / MB,
                        "RSS above start MiB": max(r["rss_peak"] for r in m["ranks"]) / MB,
                        "allocator peak in": allocator["peak_in"]}  # fmt: skip
            else:
                worst = max(r["allocated_peak"] for r in m["ranks"])
                row |= {"measured MiB": worst / MB, "planned / measured": live / worst}
                # the caching allocator's reserve against the plan's live bytes plus its stated headroom
                headroom = est["per_gpu_gb"].get("allocator_headroom", 0) * 2**30
                row["reserved MiB"] = max(r["reserved_peak"] for r in m["ranks"]) / MB
                row["planned + headroom MiB"] = (live + headroom) / MB
            row |= {"GPU-only terms left out MiB": gpu_only / MB, "fp32 gradient shard MiB": 4 * n / args.nproc / MB,
                    "plan s": plan_s, "run s": max(r["seconds"] for r in m["ranks"])}  # fmt: skip
            rows.append(row)
            with kept_file.open("a") as f:
                f.write(json.dumps({"settings": settings, "row": row, "plan": est, "measured": m}) + "\n")
            print(row, flush=True)
    return rows


def planner_summary(rows: list[dict]) -> None:
    ratios = [r["planned / measured"] for r in rows]
    inside = sum(abs(x - 1) <= 0.15 for x in ratios)
    print(f"\nplanned / measured: {min(ratios):.3f} to {max(ratios):.3f}; {inside} of {len(rows)} within ±15%")
    by = {r["case"]: r for r in rows}
    for case in PLANNER_CASES:
        one, two = by.get(f"{case}, grad_accum 1"), by.get(f"{case}, grad_accum 2")
        if one and two:
            extra, shard = two["measured MiB"] - one["measured MiB"], two["fp32 gradient shard MiB"]
            planned = two["planned MiB"] - one["planned MiB"]
            against = f"; one sharded fp32 gradient {shard:.1f} MiB (extra / shard {extra / shard:.2f})"
            against = against if case == "fsdp" else ""
            print(f"{case}: grad_accum 2 - 1 per rank: measured {extra:+.1f} MiB, planned {planned:+.1f} MiB{against}")


PARTS = {
    "data": (data_part, data_summary),
    "load": (load_part, model_summary),
    "world": (world_part, model_summary),
    "step": (step_part, model_summary),
    "zero3-host": (zero3_host_part, zero3_host_summary),
    "phases": (phases_part, lambda rows: None),
    "planner": (planner_part, planner_summary),
}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":  # a measurement in its own process (in_child)
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", required=True, choices=sorted(PARTS))
    p.add_argument("--tokens", type=int, default=50_000_000, help="data: the memory-mapped shard's tokens")
    p.add_argument("--legacy-tokens", type=int, default=5_000_000, help="data: the shard both loaders read")
    p.add_argument("--micro-batches", type=int, default=100)
    p.add_argument("--workdir", type=Path, default=None, help="kept: shards are reused by a later run")
    p.add_argument("--only", nargs="+", help="load/world/step: only these runs (as the table names them)")
    p.add_argument("--phase-tokens", type=int, default=512, help="phases: tokens of the one micro-batch")
    p.add_argument("--own-loss", action="store_true", help="phases: training.chunked_loss false (the model's own)")
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4], help="zero3-host: world sizes")
    p.add_argument(
        "--malloc",
        nargs="+",
        default=["before", "default", "env", "mallopt"],
        choices=["before", "default", "env", "mallopt"],
        help="zero3-host: before issue 24, glibc's default, MALLOC_MMAP_THRESHOLD_ in the env, the trainer's mallopt",
    )
    p.add_argument("--case", nargs="+", default=list(PLANNER_CASES), choices=list(PLANNER_CASES), help="planner")
    p.add_argument("--grad-accum", nargs="+", type=int, default=[1, 2], help="planner: each case at each")
    p.add_argument("--layers", type=int, default=4, help="planner: decoder layers of the Qwen3-0.6B-wide model")
    p.add_argument("--seq", type=int, default=512, help="planner: tokens of a micro-batch (micro_batch_size 1)")
    p.add_argument("--vocab", type=int, default=32768, help="planner: vocabulary (Qwen3-0.6B's: 151936)")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="planner: training.precision (fp32 on this CPU: its bf16 matmul runs at 0.12 GFLOP/s, fp32 at 17)",
    )
    p.add_argument("--checkpointing", action="store_true", help="planner: training.gradient_checkpointing")
    p.add_argument("--fresh", action="store_true", help="planner: measure again rows kept in --workdir")
    p.add_argument("--plan-only", action="store_true", help="planner: make the plans (kept in --workdir), measure none")
    p.add_argument("--nproc", type=int, default=2, help="planner: ranks (torchrun --nproc_per_node)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="planner: cuda measures "
        "torch.cuda.max_memory_allocated on GPUs (one per rank), cpu the profiler's allocator peak",
    )
    a = p.parse_args()
    a.workdir = (a.workdir or Path(tempfile.mkdtemp(prefix=f"bench_scale_{a.part}_"))).resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    run, summary = PARTS[a.part]
    rows = run(a)
    if rows:
        print_table(rows)
        summary(rows)
    print(f"work dir: {a.workdir}")


if __name__ == "__main__":
    main()
