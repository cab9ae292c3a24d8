"""check_environment: what stops a run on the node (problems), the benchmark's bandwidth and rate formulas,
and reading its results."""

import json
import re

import pytest

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.ops.environment import benchmark_summary, bus_bandwidth, matmul_rate, parse_benchmark, problems


def test_bus_bandwidth_is_nccl_tests_definition():
    # nccl-tests: busbw = algbw * 2 (n - 1) / n; 1 GB in 1 s over 8 ranks -> 1.75 GB/s
    assert bus_bandwidth(10**9, 1.0, 8) == pytest.approx(1.75)
    assert bus_bandwidth(10**9, 0.5, 2) == pytest.approx(2.0)
    assert bus_bandwidth(10**9, 1.0, 1) == 0.0  # one rank moves nothing
    with pytest.raises(ValueError):
        bus_bandwidth(10**9, 0.0, 2)


def test_matmul_rate_counts_two_n_cubed_per_matmul():
    assert matmul_rate(1000, 2.0, 10) == pytest.approx(2 * 1000**3 * 10 / 2.0)


def result(ranks=2, value=10.0, time_s=0.01):
    return {
        "matmul": [{"rank": r, "device": "cpu:x", "dtype": "float32", "n": 512, "value": value, "unit": "GFLOP/s"}
                   for r in range(ranks)],
        "allreduce": {"backend": "gloo", "ranks": ranks, "bytes": 2**20, "time_s": time_s,
                      "algbw_gb_s": 0.1, "busbw_gb_s": 0.1},
    }  # fmt: skip


def test_parse_benchmark_accepts_a_complete_result():
    parsed = parse_benchmark(json.dumps(result()), 2)
    assert parsed == result()
    summary = benchmark_summary(parsed)
    assert "10.0, 10.0 GFLOP/s per rank on cpu:x" in summary and "over 2 rank(s) (gloo)" in summary


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "unreadable result"),
        (json.dumps({"matmul": []}), "unreadable result"),
        (json.dumps(result(ranks=1)), "expected results of 2 rank(s), got 1"),
        (json.dumps(result(value=0.0)), "non-positive"),
        (json.dumps(result(time_s=-1.0)), "non-positive"),
    ],
)
def test_parse_benchmark_rejects_incomplete_results(text, message):
    with pytest.raises(UserError, match=re.escape(message)):
        parse_benchmark(text, 2)


def report(gpus=("Tesla T4", "Tesla T4"), bf16=False, cuda=True, **packages):
    """A collect() result as check_environment would see it on a node with these GPUs."""
    pkgs = {"torch": "2.13.0", "deepspeed": "0.19.0", "peft": "0.17.0"} | packages
    listed = [{"name": name, "memory_gb": 15.0, "capability": "7.5"} for name in gpus] if cuda else []
    gpu = {"cuda_available": cuda, "gpu_count": len(listed), "bf16_supported": bf16 and cuda, "gpus": listed}
    return {"packages": pkgs, "fsdp2_available": True, "gpu": gpu}


def test_bf16_on_a_gpu_without_it_names_fp16():
    found = problems(report(), "ddp", "lora", 2, "bf16")
    assert found == ["training.precision is bf16 but Tesla T4 has no bf16: use training.precision: fp16"]
    # fp16 and fp32 run there; bf16 runs where the GPU has it, and on the CPU (slowly)
    assert problems(report(), "ddp", "lora", 2, "fp16") == []
    assert problems(report(), "ddp", "lora", 2, "fp32") == []
    assert problems(report(("NVIDIA A100-SXM4-80GB",) * 2, bf16=True), "ddp", "lora", 2, "bf16") == []
    assert problems(report(cuda=False), "ddp", "lora", 2, "bf16") == []


def test_each_problem_is_one_line_naming_its_key():
    found = problems(report(("Tesla V100-SXM2-16GB",), deepspeed=None), "deepspeed", "none", 2, "bf16")
    assert found == [
        "training.strategy is deepspeed but deepspeed is not installed",
        "training.procs_per_node is 2 but this node has 1 GPU(s)",
        "training.precision is bf16 but Tesla V100-SXM2-16GB has no bf16: use training.precision: fp16",
    ]


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla T4", "fp16", 65.0),
        ("NVIDIA H100 80GB HBM3", "fp32", None),  # TF32 or not depends on settings: no MFU
        ("Some Future GPU", "bf16", None),
    ],
)
def test_the_peak_for_the_mfu_is_the_data_sheets_for_the_gpu_found(name, precision, peak):
    from workflow_scripts.ops.environment import peak_tflops

    assert peak_tflops(name, precision) == peak
