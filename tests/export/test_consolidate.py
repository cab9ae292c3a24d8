"""consolidate_node in the base model's dtype: a bf16 base gives bf16 safetensors (half the bytes of fp32),
consolidate.dtype fp32 keeps fp32, the self-check compares at the precision written and still catches a
wrong weight, and a LoRA adapter stays fp32 while the merged model is bf16.

The checkpoints are written here the way train.py's DDP checkpointer leaves them (rank 0's ``state.pt``
with the model's fp32 tensors, a COMPLETE marker listing its size and sha256, train_state.json): no torchrun,
a few seconds each.
The base is a tiny random Qwen3 (untied embeddings) with a byte-level BPE and a ChatML template.
"""

import dataclasses
import json
import re
import struct
from pathlib import Path

import pytest
import torch
from conftest import bpe_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import training_config
from workflow_scripts.train.manifest import MARKER, Writes, build_manifest, marker_text

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = ["What is the capital of France? Paris.", "Name a large ocean. The Pacific.", "system user assistant"] * 20


def tiny_base(folder, dtype: torch.dtype, seed: int = 0):
    """A tiny random Qwen3 saved in ``dtype`` with its tokenizer; returns the folder."""
    tokenizer = bpe_tokenizer(CORPUS, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML, vocab_size=320,
                              eos_token="<|im_end|>", pad_token="<|endoftext|>")  # fmt: skip
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    Qwen3ForCausalLM(config).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_checkpoint(root, base, tensors: dict, peft: str = "none", **training) -> dict:
    """A DDP checkpoint of ``tensors`` (fp32, as training holds them) and its train_state.json."""
    folder = root / "ckpt" / "step_00000004"
    folder.mkdir(parents=True)
    writes = Writes(folder)
    writes.torch_save({"model": {k: v.detach().float().contiguous() for k, v in tensors.items()}}, folder / "state.pt")
    (folder / MARKER).write_text(marker_text(4, build_manifest(folder, writes.files)[0], 0.0))
    cfg = dataclasses.asdict(training_config({"peft": peft, **training}))
    state = {"checkpoint": str(folder), "step": 4, "strategy": "ddp", "zero_stage": 0, "peft": peft,
             "base_model": str(base), "config": cfg}  # fmt: skip
    (root / "train_state.json").write_text(json.dumps(state))
    return state


def trained(base) -> dict:
    """The base's weights upcast to fp32 and moved as a few training steps would: off the bf16 grid."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def header(path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def weight_files(folder) -> list:
    return sorted(folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("bf16-base") / "base", torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, bf16_base):
    root = tmp_path_factory.mktemp("bf16-ckpt")
    weights = trained(bf16_base)
    return write_checkpoint(root, bf16_base, weights), weights


def run(state, output, dtype="base", **kw):
    """consolidate + verify, as main runs them; returns (report, ids, expected)."""
    from workflow_scripts.export.consolidate import consolidate, verify

    report, ids, expected = consolidate(state, output, dtype=dtype, **kw)
    report |= verify(output, ids, expected, 1e-5)
    return report, ids, expected


def test_stored_dtype_reads_the_config_then_the_safetensors(tmp_path, bf16_base):
    from workflow_scripts.model.weights import stored_dtype

    assert stored_dtype(str(bf16_base)) == torch.bfloat16
    assert json.loads((bf16_base / "config.json").read_text())["dtype"] == "bfloat16"
    folder = tmp_path / "old"
    folder.mkdir()
    for f in bf16_base.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((bf16_base / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")  # as transformers < 4.56 wrote it
    (folder / "config.json").write_text(json.dumps(config))
    assert stored_dtype(str(folder)) == torch.bfloat16
    del config["torch_dtype"]  # no dtype in the config: the safetensors tell
    (folder / "config.json").write_text(json.dumps(config))
    assert stored_dtype(str(folder)) == torch.bfloat16
    config["dtype"] = "float64"  # none of fp32, bf16, fp16: fp32
    (folder / "config.json").write_text(json.dumps(config))
    assert stored_dtype(str(folder)) == torch.float32


def test_demo_and_preset_bases_are_fp32(demo_assets):
    """The from-scratch models are built and saved in fp32, so their consolidated models stay fp32."""
    from workflow_scripts.model.weights import stored_dtype

    assert stored_dtype(str(demo_assets["base"])) == torch.float32


def test_bf16_base_consolidates_to_bf16_and_fp32_on_request(tmp_path, bf16_checkpoint):
    state, weights = bf16_checkpoint
    report, _, _ = run(state, tmp_path / "bf16")
    assert report["dtype"] == "bfloat16" and report["max_logit_diff"] == 0.0 and report["generation_ok"]
    fp32, _, _ = run(state, tmp_path / "fp32", dtype="fp32")
    assert fp32["dtype"] == "float32" and fp32["max_logit_diff"] == 0.0

    for name, code, dtype in (("bf16", "BF16", "bfloat16"), ("fp32", "F32", "float32")):
        folder = tmp_path / name
        assert json.loads((folder / "config.json").read_text())["dtype"] == dtype
        assert AutoConfig.from_pretrained(folder).dtype == getattr(torch, dtype)
        entries = {k: v for f in weight_files(folder) for k, v in header(f).items() if k != "__metadata__"}
        assert {e["dtype"] for e in entries.values()} == {code} and entries.keys() == weights.keys()
    data = {n: sum(f.stat().st_size for f in weight_files(tmp_path / n)) for n in ("bf16", "fp32")}
    params = sum(v.numel() for v in weights.values())
    assert data["fp32"] - 4 * params == pytest.approx(data["bf16"] - 2 * params, abs=64)  # the headers
    assert 0.49 < data["bf16"] / data["fp32"] < 0.51

    from safetensors.torch import load_file

    bf16 = load_file(weight_files(tmp_path / "bf16")[0])
    exact = load_file(weight_files(tmp_path / "fp32")[0])
    for k, v in weights.items():
        assert torch.equal(exact[k], v)  # fp32: the checkpoint's tensors as they are
        assert bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.to(torch.bfloat16))  # rounded once


def test_the_self_check_compares_at_the_written_precision(tmp_path, bf16_checkpoint):
    """The reference is the training-side model with its weights rounded to bf16, in fp32 compute: the
    reloaded folder matches it exactly, while the unrounded fp32 model differs by bf16 rounding."""
    from workflow_scripts.export.consolidate import logits_on

    state, weights = bf16_checkpoint
    _, ids, expected = run(state, tmp_path / "bf16")
    unrounded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    unrounded.load_state_dict(weights)
    rounding = (logits_on(unrounded, ids) - expected).abs().max().item()
    assert rounding > 1e-4  # far above the check's 1e-5: the unrounded model is no reference for bf16
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}
    assert torch.equal(logits_on(reloaded, ids), expected)
    assert torch.equal(logits_on(reloaded, ids), logits_on(reloaded.float(), ids))  # fp32 compute, bit for bit


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_corrupt_bf16_weight_fails_the_check(tmp_path, bf16_checkpoint, where):
    from workflow_scripts.export.consolidate import verify

    state, _ = bf16_checkpoint
    out = tmp_path / "bf16"
    _, ids, expected = run(state, out)
    (file,) = weight_files(out)
    head = header(file)
    raw = bytearray(file.read_bytes())
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    if where == "data":  # one element of one layer's weight, its bf16 bits changed
        offset = start + head["model.layers.1.mlp.down_proj.weight"]["data_offsets"][0] + 2 * 100
        raw[offset + 1] ^= 0x01
        file.write_bytes(bytes(raw))
        with pytest.raises(UserError, match="logits differ"):
            verify(out, ids, expected, 1e-5)
    else:  # the same bytes declared F16: the header and config.json disagree
        file.write_bytes(bytes(raw).replace(b'"dtype":"BF16"', b'"dtype":"F16" ', 1))
        with pytest.raises(UserError, match="safetensors hold BF16, F16; config.json says bfloat16"):
            verify(out, ids, expected, 1e-5)


@pytest.mark.parametrize("damage", ["flipped", "zeroed", "truncated"])
def test_a_damaged_checkpoint_is_not_consolidated(tmp_path, damage):
    """The checkpoint's bytes are checked against its marker before anything is read: zeroed bytes used to
    load, consolidate and pass the self-check (a wrong model with nothing to show it)."""
    from workflow_scripts.export.consolidate import consolidate

    base = tiny_base(tmp_path / "base", torch.float32)
    state = write_checkpoint(tmp_path / "run", base, trained(base))
    path = Path(state["checkpoint"]) / "state.pt"
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    if damage == "flipped":
        raw[middle : middle + 4096] = bytes(b ^ 0xFF for b in raw[middle : middle + 4096])
    elif damage == "zeroed":
        raw[middle : middle + 4096] = bytes(4096)
    else:
        del raw[middle:]
    path.write_bytes(bytes(raw))
    why = r"state\.pt has [0-9,]+ bytes" if damage == "truncated" else r"state\.pt: sha256 differs"
    with pytest.raises(
        UserError, match=f"^{re.escape(state['checkpoint'])}: damaged checkpoint, not consolidated: {why}"
    ):
        consolidate(state, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fp32_base_writes_what_it_always_wrote(tmp_path):
    """An fp32 base: F32 safetensors equal to the checkpoint's tensors, config dtype float32, and
    --dtype bf16 on request."""
    base = tiny_base(tmp_path / "base", torch.float32)
    weights = trained(base)
    state = write_checkpoint(tmp_path / "run", base, weights)
    report, _, _ = run(state, tmp_path / "out")
    assert report["dtype"] == "float32" and report["max_logit_diff"] == 0.0
    (file,) = weight_files(tmp_path / "out")
    assert {e["dtype"] for k, e in header(file).items() if k != "__metadata__"} == {"F32"}
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(file)[k], v) for k, v in weights.items())
    report, _, _ = run(state, tmp_path / "bf16", dtype="bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert report["dtype"] == config["dtype"] == "bfloat16"


def test_lora_on_a_bf16_base_merges_in_fp32_and_keeps_the_adapter_fp32(tmp_path, bf16_base):
    from safetensors.torch import load_file

    from workflow_scripts.export.consolidate import logits_on, rebuild

    lora = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    state = {"base_model": str(bf16_base), "config": dataclasses.asdict(training_config({"peft": "lora", **lora}))}
    model = rebuild(state)  # the training-side model: the base in fp32, the adapter trained (here: random)
    gen = torch.Generator().manual_seed(2)
    adapter = {n: 0.05 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters() if p.requires_grad}
    state = write_checkpoint(tmp_path / "run", bf16_base, adapter, peft="lora", **lora)
    report, ids, expected = run(state, tmp_path / "out")
    assert report["dtype"] == "bfloat16" and report["lora_b_tensors"] == 3 * 2 and report["max_logit_diff"] == 0.0

    saved = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(adapter) and {v.dtype for v in saved.values()} == {torch.float32}
    (file,) = weight_files(tmp_path / "out")
    assert {e["dtype"] for k, e in header(file).items() if k != "__metadata__"} == {"BF16"}
    # every merged weight is the fp32 merge, rounded once
    with torch.no_grad():
        model.load_state_dict(adapter, strict=False)
        reference = model.merge_and_unload()  # peft's merge, all in fp32
    merged = load_file(file)
    assert all(torch.equal(merged[k], v.to(torch.bfloat16)) for k, v in reference.state_dict().items())
    assert not torch.equal(logits_on(reference, ids), expected)  # the reference is the rounded one


def test_cli_takes_consolidate_dtype(tmp_path, bf16_checkpoint, capsys):
    """The script's command line (its main, in this process: a new one would import torch and transformers
    again, seconds here); a UserError would end it with exit code 2 (SystemExit), failing the test."""
    from workflow_scripts.export.consolidate import main

    state, _ = bf16_checkpoint
    path = tmp_path / "train_state.json"
    path.write_text(json.dumps(state))
    main(["--state", str(path), "--output", str(tmp_path / "out"), "--config", json.dumps({"dtype": "fp32"})])
    report = json.loads((tmp_path / "out" / "consolidation.json").read_text())
    assert report["dtype"] == "float32"
    assert set(report["peak_rss_mb"]) == {"training_side_model", "write", "reload_check"}
    assert "in float32" in capsys.readouterr().out


def test_best_select_points_the_export_at_the_best_scored_checkpoint(tmp_path):
    """consolidate.select best:<metric>: the results of the node's current run key are found beside the model
    folder (not their lm-eval JSON, not another key's), and the state points at the best step's folder."""
    from workflow_scripts.export.consolidate import scored_checkpoints, select_checkpoint

    run = tmp_path / "results" / "r"
    state = {"checkpoint": "results/r/checkpoints/node0/abc/step-560", "step": 560, "strategy": "ddp"}
    scores = run / "eval" / "checkpoints" / "node0"
    for key, step, loss in (("abc", 300, 1.2), ("abc", 560, 1.5), ("old", 100, 0.1)):
        (scores / key).mkdir(parents=True, exist_ok=True)
        (scores / key / f"step-{step}.json").write_text(json.dumps({"eval_loss": loss, "exact_match": step / 1000}))
        (scores / key / f"step-{step}.lm_eval.json").write_text("{}")
    found = scored_checkpoints(state, run / "models" / "node0")
    assert [p.name for p in found] == ["step-300.json", "step-560.json"]
    chosen, selected = select_checkpoint(state, found, "eval_loss")
    assert chosen == state | {"checkpoint": "results/r/checkpoints/node0/abc/step-300", "step": 300}
    assert selected == {"step": 300, "last_step": 560, "candidates": 2, "metric": "eval_loss", "value": 1.2,
                        "checkpoint": "results/r/checkpoints/node0/abc/step-300"}  # fmt: skip
    assert select_checkpoint(state, found, "exact_match")[1]["step"] == 560
