"""The load plans' pure parts: which dtype each strategy keeps, checkpoint key mapping, LoRA init."""

import pytest
import torch

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import training_config
from workflow_scripts.model.model_loading import lora_init
from workflow_scripts.model.weights import CheckpointFiles, checkpoint_name
from workflow_scripts.train.parallel import strategy_for


@pytest.mark.parametrize(
    ("training", "dtype", "how"),
    [
        ({"strategy": "ddp", "precision": "bf16"}, torch.float32, None),  # fp32 master weights
        ({"strategy": "ddp", "precision": "fp16", "peft": "lora"}, torch.float16, None),  # frozen base
        ({"strategy": "fsdp", "precision": "bf16"}, torch.float32, "meta"),
        ({"strategy": "fsdp", "precision": "bf16", "peft": "lora"}, torch.bfloat16, "meta"),
        ({"strategy": "deepspeed", "zero_stage": 2, "precision": "bf16"}, torch.bfloat16, None),
        ({"strategy": "deepspeed", "zero_stage": 3, "precision": "fp32"}, torch.float32, "zero3"),
    ],
)
def test_each_strategy_loads_in_the_dtype_it_trains(training, dtype, how):
    cfg = training_config(training)
    strategy = strategy_for(cfg.strategy)
    assert strategy.load_dtype(cfg) == dtype
    assert strategy.sharded_load(cfg) == how


def test_peft_names_map_to_checkpoint_keys():
    keys = {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight"}
    peft_name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert checkpoint_name(peft_name, keys, "model") == "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("lm_head.weight", keys, "model") == "lm_head.weight"
    unprefixed = "layers.0.self_attn.q_proj.weight"
    assert checkpoint_name(unprefixed, keys, "model") == "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("model.norm.weight", keys, "model") is None


def test_lora_init_is_peft_default_and_seeded_by_name():
    a = lora_init("x.lora_A.default.weight", (8, 64), seed=1)
    assert a.dtype == torch.float32 and a.abs().max() <= 1 / 64**0.5 and a.std() > 0
    assert torch.equal(a, lora_init("x.lora_A.default.weight", (8, 64), seed=1))
    assert not torch.equal(a, lora_init("y.lora_A.default.weight", (8, 64), seed=1))
    assert not torch.equal(a, lora_init("x.lora_A.default.weight", (8, 64), seed=2))
    assert torch.count_nonzero(lora_init("x.lora_B.default.weight", (64, 8), seed=1)) == 0


def test_a_checkpoint_without_safetensors_is_one_line(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="no model.safetensors"):
        CheckpointFiles(tmp_path)


def test_positioned_reads_give_the_saved_tensors(tmp_path):
    """Rows, column cuts and flat ranges read from a safetensors file equal the tensors saved."""
    from safetensors.torch import save_file

    tensors = {
        "w": torch.randn(7, 5).to(torch.bfloat16),
        "b": torch.arange(6, dtype=torch.float32),
        "s": torch.tensor(3.0),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    files = CheckpointFiles(tmp_path)
    assert files.names() == {"w", "b", "s"} and files.shape("w") == (7, 5)
    assert torch.equal(files.read("w", (slice(2, 6), slice(0, 5))), tensors["w"][2:6])
    assert torch.equal(files.read("w", (slice(0, 7), slice(1, 3))), tensors["w"][:, 1:3])
    assert torch.equal(files.read_flat("w", 11, 9), tensors["w"].flatten()[11:20])
    assert torch.equal(files.read("b", (slice(4, 6),)), tensors["b"][4:6]) and files.read("s", ()).item() == 3.0
    files.close()
