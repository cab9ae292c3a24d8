"""The GPU-only paths made to run, or decided, without a GPU: FSDP2's CPU offload (its process group and a
clipped step, under torchrun on CPU), the attention implementation a GPU gets, and DeepSpeed's CPU Adam."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, check_ranks_command, tool_env, trainer_env

from workflow_scripts.core.settings import training_config
from workflow_scripts.train.train import process_group_backend


def test_fsdp_offload_on_gpus_adds_gloo_for_the_cpu_shards():
    fsdp = training_config({"strategy": "fsdp", "offload": "optimizer"})
    assert process_group_backend(fsdp, "cuda") == "cpu:gloo,cuda:nccl"
    assert (
        process_group_backend(training_config({"strategy": "fsdp", "offload": "all"}), "cuda") == "cpu:gloo,cuda:nccl"
    )
    assert process_group_backend(training_config({"strategy": "fsdp"}), "cuda") == "nccl"
    # DeepSpeed's offload steps on the host without torch.distributed collectives on CPU tensors
    zero = training_config({"strategy": "deepspeed", "zero_stage": 3, "offload": "optimizer"})
    assert process_group_backend(zero, "cuda") == "nccl"
    assert process_group_backend(fsdp, "cpu") == "gloo"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    root = tmp_path_factory.mktemp("offload") / "base"
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.float32).save_pretrained(root)
    return root


@pytest.mark.torchrun
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_fsdp_cpu_offload_path_runs_a_clipped_step_on_cpu(tiny_qwen3, tmp_path, peft):
    """CPUOffloadPolicy on every FSDP module, the shards and gradients on the host, a finite clipped norm."""
    config = {"strategy": "fsdp", "offload": "all", "precision": "fp32", "max_grad_norm": 1e-3}
    if peft == "lora":
        config |= {"peft": "lora", "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}
    result = offload_check(tiny_qwen3, config, tmp_path)
    assert result["policies"] == ["CPUOffloadPolicy"], result
    assert result["shard_devices"] == ["cpu"] and result["grad_devices"] == ["cpu"]
    assert result["backend"] == "gloo"
    assert result["grad_norm"] > 1e-3 and result["grad_norm"] == pytest.approx(result["grad_norm"])  # finite
    assert result["optimizer"] == "AdamW"


def offload_check(base, config: dict, tmp_path) -> dict:
    out = tmp_path / "check.json"
    cmd = [*check_ranks_command(config), str(REPO / "tests/offload_check.py"), str(base), json.dumps(config), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def adamw():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])


def test_offloaded_optimizer_states_get_cpu_adam_or_say_why_not():
    from workflow_scripts.train.parallel.zero import choose_optimizer

    marker = object()
    opt, why = choose_optimizer({"offload_optimizer": {"device": "cpu"}}, lambda: marker, adamw)
    assert opt is marker and why == "DeepSpeedCPUAdam (optimizer states offloaded to cpu)"
    assert choose_optimizer({"offload_optimizer": {"device": "nvme"}}, lambda: marker, adamw)[0] is marker
    for zero in ({"stage": 3}, {"offload_optimizer": {"device": "none"}}, {"offload_optimizer": None}):
        opt, why = choose_optimizer(zero, lambda: marker, adamw)
        assert isinstance(opt, torch.optim.AdamW) and why.startswith("torch AdamW (optimizer states on the accel")

    def no_compiler():
        try:
            raise OSError("g++: command not found")
        except OSError as e:
            raise RuntimeError("DeepSpeedCPUAdam requires the cpu_adam op, which failed to build/load.") from e

    opt, why = choose_optimizer({"offload_optimizer": {"device": "cpu"}}, lambda: marker, adamw, on_gpu=False)
    assert isinstance(opt, torch.optim.AdamW) and why.startswith("torch AdamW (a CPU run")
    opt, why = choose_optimizer({"offload_optimizer": {"device": "cpu"}}, no_compiler, adamw)
    assert isinstance(opt, torch.optim.AdamW)
    assert (
        why
        == "torch AdamW on the host: DeepSpeed's cpu_adam op did not build or load (OSError: g++: command not found)"
    )


@pytest.mark.parametrize(
    ("installed", "capability", "dtype", "expected", "reason"),
    [
        ("2.8.3", (8, 0), torch.bfloat16, "flash_attention_2", "flash-attn 2.8.3 on compute capability 8.0"),
        ("2.8.3", (9, 0), torch.float16, "flash_attention_2", "compute capability 9.0"),
        ("2.8.3", (7, 5), torch.float16, "sdpa", "needs compute capability 8.0 or more, this GPU has 7.5"),  # T4
        ("2.8.3", (7, 0), torch.float16, "sdpa", "this GPU has 7.0"),  # V100
        ("2.8.3", (8, 6), torch.float32, "sdpa", "fp16/bf16 only, training.precision is float32"),
        (None, (9, 0), torch.bfloat16, "sdpa", "flash-attn not installed"),
        ("2.8.3", None, torch.bfloat16, "sdpa", "no GPU"),
    ],
)
def test_flash_attention_only_where_the_gpu_and_dtype_support_it(installed, capability, dtype, expected, reason):
    from workflow_scripts.model.model_loading import choose_attention

    impl, why = choose_attention(installed, capability, dtype)
    assert impl == expected and reason in why


def test_env_check_says_the_attention_and_why(monkeypatch):
    from workflow_scripts.ops import environment

    monkeypatch.setattr("workflow_scripts.model.model_loading.flash_attn_version", lambda: "2.8.3")
    t4 = {"gpus": [{"name": "Tesla T4", "memory_gb": 14.7, "capability": "7.5"}]}
    assert environment.attention_backend(t4, "fp16") == {
        "attention": "sdpa",
        "attention_reason": "flash-attn 2.8.3 needs compute capability 8.0 or more, this GPU has 7.5",
    }
    a100 = {"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 79.3, "capability": "8.0"}]}
    assert environment.attention_backend(a100, "bf16")["attention"] == "flash_attention_2"
    assert environment.attention_backend({"gpus": []}, "bf16")["attention"] == "sdpa"


MALLOC_PROBE = """
import sys
import torch
from workflow_scripts.core.host_memory import map_large_allocations
def rss():
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
if sys.argv[1] == "map":
    map_large_allocations()
big = torch.ones(8 * 2**20 // 4); del big  # glibc raises its mmap threshold past this size
kept, pins = [], []
for _ in range(50):  # 100 MiB of 2 MiB blocks, each followed by a small block that stays
    kept.append(torch.ones(2**19))
    pins.append(torch.ones(2**14))
before = rss()
del kept
print(round(before - rss()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_over_a_mebibyte_go_back_to_the_kernel():
    """What train.py sets first (host_memory.map_large_allocations): without it glibc keeps freed 2 MiB
    blocks in its heap (ZeRO-3's initialize transients: 1.36x DeepSpeed's floor after it at 2 ranks)."""
    returned = {}
    env = tool_env() | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "workflow_scripts")}
    # the two processes side by side (each its own heap; their torch imports are the cost)
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", MALLOC_PROBE, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for mode in ("default", "map")
    }
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        returned[mode] = int(out.split()[-1])
    assert returned["map"] >= 95 and returned["default"] < 20, returned
