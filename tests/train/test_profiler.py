"""TRAIN_PROFILE_STEPS: the profiler's step selection, its arithmetic on a trace, and a real profile of a CPU loop."""

import json

import pytest
import torch

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.train.profiler import (
    StepProfiler,
    kind_of,
    parse_steps,
    self_seconds,
    summarize,
    union_us,
)


def test_steps_parse_and_bad_values_name_the_variable(monkeypatch, tmp_path):
    assert parse_steps(None) is None and parse_steps("  ") is None
    assert parse_steps("7") == (7, 7) and parse_steps(" 6 - 9 ") == (6, 9)
    for bad in ("0", "9-6", "a", "3-", "1,2"):
        with pytest.raises(ValueError, match="TRAIN_PROFILE_STEPS"):
            parse_steps(bad)
    monkeypatch.setenv("TRAIN_PROFILE_STEPS", "5-3")
    with pytest.raises(UserError, match=r"TRAIN_PROFILE_STEPS='5-3': expected FIRST-LAST"):
        StepProfiler.from_env(tmp_path, 0, torch.device("cpu"))
    monkeypatch.delenv("TRAIN_PROFILE_STEPS")
    assert StepProfiler.from_env(tmp_path, 0, torch.device("cpu")).steps is None


def test_busy_time_counts_overlaps_once_and_own_time_leaves_out_nested_calls():
    assert union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert union_us([]) == 0
    # a backward node (0-100) calling a matmul (10-60) and an add (70-80); another thread's op apart
    events = [
        {"name": "MmBackward0", "ts": 0, "dur": 100, "tid": 1},
        {"name": "aten::mm", "ts": 10, "dur": 50, "tid": 1},
        {"name": "aten::add", "ts": 70, "dur": 10, "tid": 1},
        {"name": "aten::mm", "ts": 20, "dur": 30, "tid": 2},
    ]
    assert self_seconds(events) == pytest.approx([40e-6, 50e-6, 10e-6, 30e-6])


def test_kernels_are_sorted_into_kinds():
    assert kind_of("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert kind_of("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert kind_of("pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matrix products"
    assert kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "matrix products"
    assert kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == (
        "optimizer"
    )
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == (
        "elementwise"
    )
    assert kind_of("something_new") == "other"


def test_a_gpu_trace_is_summarized_by_kernel_and_busy_fraction():
    kernels = [
        ("sm90_xmma_gemm_bf16", 0, 400),
        ("fmha_cutlassB_bf16", 400, 200),
        ("sm90_xmma_gemm_bf16", 700, 200),
        ("Memcpy HtoD (Pageable -> Device)", 950, 50),
    ]
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel" if "Memcpy" not in n else "gpu_memcpy", "name": n, "ts": ts, "dur": d, "tid": 7}
            for n, ts, d in kernels
        ]  # fmt: skip
        + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000, "tid": 1}]
    }
    text = summarize(trace, wall_s=0.002, steps=(3, 4), device="H200")
    # 850 us of kernels in 2 ms: the CPU operator (5 ms) is not device time where there are kernels
    assert "steps 3-4 on H200: 0.002 s wall (0.001 s a step), device busy 0.001 s (42% of the wall time" in text
    assert "| matrix products | 0.001 | 70.6% |" in text and "| attention | 0.000 | 23.5% |" in text
    assert "| sm90_xmma_gemm_bf16 | 2 | 0.0006 | 70.6% |" in text
    assert "| copies | 0.000 | 5.9% |" in text


def test_a_profile_of_two_steps_of_a_cpu_loop(tmp_path, caplog):
    profiler = StepProfiler(tmp_path, 1, torch.device("cpu"), (2, 3))
    profiler.check_reachable(0, 4)
    w = torch.randn(64, 64, requires_grad=True)
    for step in range(1, 5):
        with profiler.step(step):
            (torch.randn(32, 64) @ w).square().sum().backward()
    report = (tmp_path / "profile" / "rank1.txt").read_text()
    assert report.startswith("steps 2-3 on cpu: ")
    assert "| matrix products |" in report and "aten::mm" in report
    trace = json.loads((tmp_path / "profile" / "rank1.pt.trace.json").read_text())
    marks = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"step 2", "step 3"} <= marks and "step 1" not in marks and "step 4" not in marks

    late = StepProfiler(tmp_path / "late", 0, torch.device("cpu"), (2, 3))
    late.check_reachable(5, 10)  # a resumed job starting past the steps: said, and nothing profiled
    assert late.steps is None and "nothing is profiled" in caplog.text
