"""check_environment: record what this machine has, and stop early if the configured strategy cannot run.

Then a quick benchmark under torchrun with the job's procs_per_node ranks (seed 001: "test
communication before long runs"): matmul throughput of every rank's device (bf16 TFLOP/s on a GPU,
fp16 on one without bf16, fp32 GFLOP/s on the CPU) and all-reduce bus bandwidth across the ranks
(NCCL on GPUs, gloo on CPU).

    python environment.py --config '{"strategy": "ddp", "procs_per_node": 2}' --output env/check.json
"""

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError, cli, module_env, write_json
from workflow_scripts.core.settings import EnvironmentConfig

RANKS = Path(__file__).parents[1] / "train" / "ranks.py"

PACKAGES = ["torch", "transformers", "deepspeed", "peft", "accelerate", "pandas", "pyarrow", "evaluate", "tensorboard",
            "wandb", "mlflow-skinny", "mlflow"]  # fmt: skip


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# Peak dense 16-bit (bf16, or fp16 where the GPU has no bf16) tensor TFLOP/s of one GPU, from the vendors'
# data sheets, for training.peak_tflops: null (MFU). Matched in order on torch's device name, so a longer name
# comes before a name it contains ("H100 PCIe" before "H100", "L40S" before "L40" before "L4").
PEAK_TFLOPS_16BIT = (
    ("B200", 2250), ("B100", 1750), ("H100 PCIE", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989),
    ("H800", 989), ("A100", 312), ("A800", 312), ("L40S", 362), ("L40", 181), ("L4", 121),
    ("V100", 125), ("T4", 65), ("MI300X", 1307), ("MI250X", 383),
)  # fmt: skip


def peak_tflops(name: str, precision: str) -> float | None:
    """The data sheet's peak of a GPU named ``name`` in ``precision``; None for fp32 (TF32 or not depends on
    settings) or a GPU not in PEAK_TFLOPS_16BIT."""
    if precision not in ("bf16", "fp16"):
        return None
    upper = name.upper()
    return next((float(peak) for key, peak in PEAK_TFLOPS_16BIT if key in upper), None)


def gpu_report() -> dict:
    import torch

    info = {"cuda_available": torch.cuda.is_available(), "gpu_count": 0, "gpus": [], "bf16_supported": False}
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        for i in range(info["gpu_count"]):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "name": props.name,
                    "memory_gb": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
        # native bf16 (compute capability 8.0+); by default torch also says yes where it only emulates it (T4, V100)
        info["bf16_supported"] = torch.cuda.is_bf16_supported(including_emulation=False)
        info["cuda_version"] = torch.version.cuda
        nccl = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    else:
        info["nccl_version"] = None
        info["cpu_bf16"] = True  # torch runs bf16 on CPU (slowly); the demo trains in fp32
    return info


def attention_backend(gpu: dict, precision: str) -> dict:
    """The attention implementation training will get on this node's first GPU, and why
    (model_loading.choose_attention: flash-attn 2 needs compute capability 8.0+ and fp16/bf16)."""
    from workflow_scripts.model import varlen_attention
    from workflow_scripts.model.model_loading import choose_attention, flash_attn_version, forced_attention
    from workflow_scripts.model.weights import DTYPES

    if forced := forced_attention():  # what model_loading.attention_implementation will take
        return {"attention": forced, "attention_reason": "TRAIN_ATTENTION"}
    gpus = gpu.get("gpus") or []
    capability = tuple(int(v) for v in gpus[0]["capability"].split(".")) if gpus else None
    installed = flash_attn_version() if capability else version("flash-attn")
    impl, reason = choose_attention(installed, capability, DTYPES[precision], varlen_attention.available())
    return {"attention": impl, "attention_reason": reason}


def problems(report: dict, strategy: str, peft: str, procs_per_node: int, precision: str, trackers=()) -> list[str]:
    """What keeps the configured training from running here; empty when it can run."""
    from workflow_scripts.train.trackers import missing

    out = missing(trackers)  # logging.trackers' optional packages, and how to install them
    pkgs = report["packages"]
    if pkgs.get("torch") is None:
        out.append("torch is not installed")
    else:  # what the strategy itself needs besides torch
        from workflow_scripts.train.parallel import strategy_for

        out += strategy_for(strategy).unmet(report)
    if peft == "lora" and pkgs.get("peft") is None:
        out.append("training.peft is lora but peft is not installed")
    gpu = report["gpu"]
    if gpu["cuda_available"] and procs_per_node > gpu["gpu_count"]:
        out.append(f"training.procs_per_node is {procs_per_node} but this node has {gpu['gpu_count']} GPU(s)")
    if precision == "bf16" and gpu["cuda_available"] and not gpu["bf16_supported"]:
        name = gpu["gpus"][0]["name"] if gpu.get("gpus") else "the GPU"
        out.append(f"training.precision is bf16 but {name} has no bf16: use training.precision: fp16")
    return out


def collect() -> dict:
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: version(name) for name in PACKAGES},
    }
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401

        report["fsdp2_available"] = True
    except ImportError:
        report["fsdp2_available"] = False
    report["gpu"] = gpu_report() if report["packages"]["torch"] else {"cuda_available": False}
    return report


# ---------------------------------------------------------------- benchmark

# GPU / CPU: matrix size, all-reduce message size, timed repetitions. CPU sizes keep it to seconds.
BENCH = {
    "cuda": {"matmul_n": 8192, "allreduce_bytes": 256 * 2**20, "iters": 20},
    "cpu": {"matmul_n": 512, "allreduce_bytes": 8 * 2**20, "iters": 5},
}


def bus_bandwidth(size_bytes: int, seconds: float, ranks: int) -> float:
    """All-reduce bus bandwidth in GB/s as nccl-tests define it: size * 2 (n - 1) / n / time."""
    if seconds <= 0:
        raise ValueError(f"all-reduce time must be positive, got {seconds}")
    return size_bytes * 2 * (ranks - 1) / ranks / seconds / 1e9


def matmul_rate(n: int, seconds: float, iters: int) -> float:
    """FLOP/s of ``iters`` n x n matmuls (2 n^3 each) in ``seconds``."""
    return 2 * n**3 * iters / seconds


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bench_rank(output: Path) -> None:
    """One rank of the benchmark (under torchrun); rank 0 writes every rank's results to ``output``."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    size = BENCH[device.type]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # the GPU's 16-bit tensor-core rate: bf16, or fp16 where bf16 is only emulated
    half = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    dtype = half if cuda else torch.float32
    a = torch.randn(size["matmul_n"], size["matmul_n"], device=device, dtype=dtype)
    b = torch.randn_like(a)
    a @ b  # warm-up
    sync()
    dist.barrier()  # all ranks compute at once, as in training
    start = time.perf_counter()
    for _ in range(size["iters"]):
        a @ b
    sync()
    seconds = time.perf_counter() - start
    rate = matmul_rate(size["matmul_n"], seconds, size["iters"])
    name = torch.cuda.get_device_name(device) if cuda else cpu_name()
    matmul = {
        "rank": rank,
        "device": f"{device.type}:{name}",
        "dtype": str(dtype).removeprefix("torch."),
        "n": size["matmul_n"],
        "value": rate / 1e12 if cuda else rate / 1e9,
        "unit": "TFLOP/s" if cuda else "GFLOP/s",
    }

    x = torch.ones(size["allreduce_bytes"] // 4, device=device, dtype=torch.float32)
    dist.all_reduce(x)  # warm-up, connections set up
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(size["iters"]):
        dist.all_reduce(x)
    sync()
    per_call = (time.perf_counter() - start) / size["iters"]
    # the slowest rank's time is the collective's time
    t = torch.tensor([per_call], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    per_call = t.item()

    gathered = [None] * world
    dist.all_gather_object(gathered, matmul)
    if rank == 0:
        allreduce = {
            "backend": dist.get_backend(),
            "ranks": world,
            "bytes": x.numel() * 4,
            "time_s": per_call,
            "algbw_gb_s": x.numel() * 4 / per_call / 1e9,
            "busbw_gb_s": bus_bandwidth(x.numel() * 4, per_call, world),
        }
        output.write_text(json.dumps({"matmul": gathered, "allreduce": allreduce}))
    dist.destroy_process_group()


def parse_benchmark(text: str, ranks: int) -> dict:
    """The benchmark's JSON, checked: one matmul result per rank, positive rates and times."""
    try:
        result = json.loads(text)
        matmul, allreduce = result["matmul"], result["allreduce"]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"benchmark: unreadable result ({e})") from None
    if sorted(m["rank"] for m in matmul) != list(range(ranks)) or allreduce["ranks"] != ranks:
        raise UserError(f"benchmark: expected results of {ranks} rank(s), got {len(matmul)}")
    if any(m["value"] <= 0 for m in matmul) or allreduce["time_s"] <= 0:
        raise UserError("benchmark: a non-positive rate or time")
    return result


def run_benchmark(ranks: int, workdir: Path, timeout: float = 600) -> dict:
    """Start the benchmark under torchrun with ``ranks`` processes, as train_node starts the trainer (train/ranks.py:
    on a machine without GPUs the ranks fork from it, torch imported); its results."""
    out = workdir / "benchmark.json"
    out.unlink(missing_ok=True)
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, str(RANKS), "--standalone", f"--nproc_per_node={ranks}", script, "--bench-rank", str(out)]
    env = module_env() | {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // ranks))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not out.exists():
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"benchmark with {ranks} rank(s) failed (exit {proc.returncode}): {tail[0]}")
    result = parse_benchmark(out.read_text(), ranks)
    out.unlink()
    return result


def benchmark_summary(bench: dict) -> str:
    mm, ar = bench["matmul"], bench["allreduce"]
    rates = ", ".join(f"{m['value']:.1f}" for m in sorted(mm, key=lambda m: m["rank"]))
    return (
        f"{mm[0]['dtype']} matmul {rates} {mm[0]['unit']} per rank on {mm[0]['device']}; "
        f"all-reduce of {ar['bytes'] / 2**20:.0f} MiB over {ar['ranks']} rank(s) ({ar['backend']}): "
        f"bus bandwidth {ar['busbw_gb_s']:.2f} GB/s"
    )


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", help="settings.EnvironmentConfig as JSON (a key left out: its default)")
    p.add_argument("--output", type=Path)
    p.add_argument("--no-benchmark", action="store_true", help="only the checks")
    p.add_argument("--bench-rank", type=Path, help=argparse.SUPPRESS)  # one torchrun rank of the benchmark
    a = p.parse_args(argv)
    if a.bench_rank:
        bench_rank(a.bench_rank)
        return
    if a.output is None or a.config is None:
        raise UserError("--config and --output are required")
    c = EnvironmentConfig.from_json(a.config)
    report = collect()
    gpus = report["gpu"]["gpus"]
    # for training.peak_tflops: null (the MFU of metrics.jsonl) and the plan's record of the GPU it planned for
    report["gpu"]["peak_tflops"] = peak_tflops(gpus[0]["name"], c.precision) if gpus else None
    if report["packages"]["torch"]:
        report |= attention_backend(report["gpu"], c.precision)
    found = problems(report, c.strategy, c.peft, c.procs_per_node, c.precision, c.trackers)
    report["ok"], report["problems"] = not found, found
    if found:
        raise UserError("; ".join(found))
    gpu, attn = report["gpu"], f"attention {report.get('attention')} ({report.get('attention_reason')})"
    print(f"environment ok: torch {report['packages']['torch']}, {gpu.get('gpu_count', 0)} GPU(s), {attn}")
    if not a.no_benchmark:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        report["benchmark"] = run_benchmark(c.procs_per_node, a.output.parent)
        print(benchmark_summary(report["benchmark"]))
    write_json(a.output, report)


if __name__ == "__main__":
    main()
