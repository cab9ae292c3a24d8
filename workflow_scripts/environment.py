"""check_environment: record what this machine has, and stop early if the configured strategy cannot run."""

import argparse
import importlib
import importlib.metadata
import platform
import sys
from pathlib import Path

from pipeline_io import UserError, cli, write_json

PACKAGES = ["torch", "transformers", "deepspeed", "peft", "accelerate", "pandas", "pyarrow", "evaluate", "tensorboard"]


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_report() -> dict:
    import torch

    info = {"cuda_available": torch.cuda.is_available(), "gpu_count": 0, "gpus": [], "bf16_supported": False}
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        for i in range(info["gpu_count"]):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": props.name, "memory_gb": round(props.total_memory / 2**30, 1)})
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
        info["cuda_version"] = torch.version.cuda
        nccl = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    else:
        info["nccl_version"] = None
        info["cpu_bf16"] = True  # torch runs bf16 on CPU (slowly); the demo trains in fp32
    return info


def attention_backend() -> str:
    try:
        importlib.import_module("flash_attn")
        return f"flash_attention_2 (flash-attn {version('flash-attn')})"
    except ImportError:
        return "SDPA fallback (flash-attn not installed)"


def problems(report: dict, strategy: str, peft: str, procs_per_node: int, precision: str) -> list[str]:
    """What keeps the configured training from running here; empty when it can run."""
    out = []
    pkgs = report["packages"]
    if pkgs.get("torch") is None:
        out.append("torch is not installed")
    if strategy == "deepspeed" and pkgs.get("deepspeed") is None:
        out.append("training.strategy is deepspeed but deepspeed is not installed")
    if peft == "lora" and pkgs.get("peft") is None:
        out.append("training.peft is lora but peft is not installed")
    if strategy == "fsdp" and not report.get("fsdp2_available"):
        out.append("training.strategy is fsdp but torch.distributed.fsdp.fully_shard is missing (torch >= 2.6)")
    gpu = report["gpu"]
    if gpu["cuda_available"] and procs_per_node > gpu["gpu_count"]:
        out.append(f"training.procs_per_node is {procs_per_node} but this node has {gpu['gpu_count']} GPU(s)")
    if precision == "bf16" and gpu["cuda_available"] and not gpu["bf16_supported"]:
        out.append("training.precision is bf16 but the GPU does not support bf16")
    return out


def collect() -> dict:
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: version(name) for name in PACKAGES},
        "attention": attention_backend(),
    }
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401

        report["fsdp2_available"] = True
    except ImportError:
        report["fsdp2_available"] = False
    report["gpu"] = gpu_report() if report["packages"]["torch"] else {"cuda_available": False}
    return report


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategy", required=True)
    p.add_argument("--peft", default="none")
    p.add_argument("--procs-per-node", type=int, default=1)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--output", required=True, type=Path)
    a = p.parse_args(argv)
    report = collect()
    found = problems(report, a.strategy, a.peft, a.procs_per_node, a.precision)
    report["ok"], report["problems"] = not found, found
    if found:
        raise UserError("; ".join(found))
    write_json(a.output, report)
    gpu = report["gpu"]
    print(
        f"environment ok: torch {report['packages']['torch']}, {gpu.get('gpu_count', 0)} GPU(s), {report['attention']}"
    )


if __name__ == "__main__":
    main()
