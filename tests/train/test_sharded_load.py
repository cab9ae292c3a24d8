"""Sharded loading is the same model: the trainer's FSDP (meta device, per-rank slices of the
checkpoint) and DeepSpeed ZeRO-3 (zero.Init) loads give the unsharded model's logits, and the same
LoRA adapters, under torchrun with 2 ranks (tests/sharded_load_check.py)."""

import json
import subprocess

import pytest
import torch
from conftest import REPO, check_ranks_command, trainer_env

pytestmark = pytest.mark.torchrun

LORA = {"peft": "lora", "lora": {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Qwen3 saved three ways: fp32, bf16, and fp32 with tied embeddings."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    root = tmp_path_factory.mktemp("sharded-load")
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape, tie_word_embeddings=False), dtype=torch.float32)
    model.save_pretrained(root / "fp32")
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    tied = AutoModelForCausalLM.from_config(Qwen3Config(**shape, tie_word_embeddings=True), dtype=torch.float32)
    tied.save_pretrained(root / "tied", max_shard_size="40KB")  # several files and an index
    return root


def check(base, training: dict, tmp_path) -> dict:
    out = tmp_path / "check.json"
    config = {"precision": "fp32", "zero_stage": 3} | training
    script = REPO / "tests" / "sharded_load_check.py"
    cmd = [*check_ranks_command(config), str(script), str(base), json.dumps(config), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


# The trainer reads the checkpoint files itself: one run on a bf16 file (fp32 master shards from it), three
# on tied embeddings saved as several files with an index
CASES = [
    ("ddp", "none", "tied"),  # one replica per rank: the same meta build, tied weights re-tied
    ("fsdp", "none", "tied"),
    ("fsdp", "lora", "bf16"),
    ("deepspeed", "none", "tied"),
    ("deepspeed", "lora", "fp32"),
]


@pytest.mark.parametrize(("strategy", "peft", "base"), CASES)
def test_sharded_load_gives_the_unsharded_logits(checkpoints, strategy, peft, base, tmp_path):
    result = check(checkpoints / base, {"strategy": strategy} | (LORA if peft == "lora" else {}), tmp_path)
    assert result["max_abs_diff"] <= 1e-5, result
    assert result["adapters"] == (3 * 3 * 2 if peft == "lora" else 0)  # 3 layers x 3 modules x (A, B)
    assert result["same_adapter_names"] and result["adapter_max_abs_diff"] == 0.0, result
