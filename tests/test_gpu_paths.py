"""The GPU-only paths made to run, or decided, without a GPU: FSDP2's CPU offload (its process group and a
clipped step, under torchrun on CPU), the attention implementation a GPU gets, and DeepSpeed's CPU Adam."""

import json
import subprocess

import pytest
import torch
from conftest import BIN, REPO, trainer_env
from settings import training_config
from train import process_group_backend


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
    out = tmp_path / "check.json"
    config = {"strategy": "fsdp", "offload": "all", "precision": "fp32", "max_grad_norm": 1e-3}
    if peft == "lora":
        config |= {"peft": "lora", "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(REPO / "tests/fsdp_offload_check.py"),
           str(tiny_qwen3), json.dumps(config), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["policies"] == ["CPUOffloadPolicy"], result
    assert result["shard_devices"] == ["cpu"] and result["grad_devices"] == ["cpu"]
    assert result["backend"] == "gloo"
    assert result["grad_norm"] > 1e-3 and result["grad_norm"] == pytest.approx(result["grad_norm"])  # finite
