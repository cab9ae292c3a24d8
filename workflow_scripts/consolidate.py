"""consolidate_node: turn a node's final training checkpoint into a Hugging Face model folder.

DDP ``state.pt``, FSDP2 torch.distributed.checkpoint folders and DeepSpeed ZeRO
checkpoints are each read through their own APIs into one fp32 state dict, loaded
into the model rebuilt from the base, and saved with the tokenizer. With LoRA the
adapter is saved in peft format (``adapter/``) and the merged model beside it.
The stage checks its own result: the saved folder reloads and gives the same
logits as the in-memory model, every LoRA B matrix is present and non-zero, and a
short generation runs.
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from pipeline_io import UserError, cli, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger("consolidate")


def read_ddp(folder: Path) -> dict:
    path = folder / "state.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["model"]
    except (FileNotFoundError, RuntimeError, EOFError, KeyError) as e:
        raise UserError(f"{path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:120]})") from None


def read_fsdp(folder: Path, template: dict) -> dict:
    """Load the ``model`` entries of a DCP checkpoint into plain tensors shaped like ``template``."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.empty_like(v) for k, v in template.items()}}
    try:
        dcp.load(state, checkpoint_id=str(folder / "dcp"), no_dist=True)
    except Exception as e:  # DCP wraps reader errors in its own exception types
        raise UserError(f"{folder / 'dcp'}: unreadable checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
    return state["model"]


def read_deepspeed(folder: Path, exclude_frozen: bool) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        return get_fp32_state_dict_from_zero_checkpoint(
            str(folder.parent), tag=folder.name, exclude_frozen_parameters=exclude_frozen
        )
    except Exception as e:  # the converter raises bare exceptions on missing or short files
        raise UserError(f"{folder}: unreadable DeepSpeed checkpoint ({type(e).__name__}: {str(e)[:160]})") from None


def rebuild(state: dict):
    """The model as training built it (base weights, plus the LoRA wrapper when used)."""
    model = AutoModelForCausalLM.from_pretrained(state["base_model"], dtype=torch.float32)
    cfg = state["config"]
    if state["peft"] == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=cfg["lora_r"],
                lora_alpha=cfg["lora_alpha"],
                lora_dropout=cfg["lora_dropout"],
                target_modules=list(cfg["lora_target_modules"]),
                task_type="CAUSAL_LM",
            ),
        )
    return model


def load_weights(model, weights: dict, only_trainable: bool, source: str) -> None:
    """Load ``weights``; every parameter that training changed must be in them."""
    needed = {n for n, p in model.named_parameters() if p.requires_grad or not only_trainable}
    # tied weights appear under one name only
    needed -= {n for n in needed if n.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    missing = sorted(needed - set(weights))
    if missing:
        raise UserError(f"{source}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    unexpected = [k for k in weights if k not in model.state_dict()]
    if unexpected:
        raise UserError(f"{source}: checkpoint has tensors the model does not, e.g. {unexpected[0]}")
    model.load_state_dict(weights, strict=False)


def check_lora(model) -> int:
    """Every lora_B is present and non-zero (an all-zero B means the adapter never trained)."""
    bs = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    if not bs:
        raise UserError("LoRA adapter has no lora_B tensors")
    zero = [n for n, p in bs.items() if not torch.count_nonzero(p)]
    if zero:
        raise UserError(f"LoRA adapter: {len(zero)} of {len(bs)} lora_B tensors are all zero, e.g. {zero[0]}")
    return len(bs)


@torch.no_grad()
def logits_on(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids).logits.float()


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", required=True, type=Path, help="train_state.json of the node")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--tolerance", type=float, default=1e-5)
    a = p.parse_args(argv)
    state = json.loads(a.state.read_text())
    folder = Path(state["checkpoint"])
    if not (folder / "COMPLETE").is_file():
        raise UserError(f"{folder}: checkpoint is missing or incomplete (no COMPLETE marker)")
    lora = state["peft"] == "lora"

    model = rebuild(state)
    template = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad or not lora}
    if state["strategy"] == "ddp":
        weights = read_ddp(folder)
    elif state["strategy"] == "fsdp":
        weights = read_fsdp(folder, template)
    else:
        weights = read_deepspeed(folder, exclude_frozen=lora)
    load_weights(model, weights, only_trainable=lora, source=str(folder))

    a.output.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": str(folder), "strategy": state["strategy"], "peft": state["peft"], "step": state["step"]}
    if lora:
        report["lora_b_tensors"] = check_lora(model)
        model.save_pretrained(a.output / "adapter")
        model = model.merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(state["base_model"])
    model.save_pretrained(a.output, max_shard_size="2GB")
    tokenizer.save_pretrained(a.output)

    # self-check: reload what was written and compare logits on fixed inputs
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = logits_on(model, ids)
    reloaded = AutoModelForCausalLM.from_pretrained(a.output, dtype=torch.float32)
    diff = (logits_on(reloaded, ids) - expected).abs().max().item()
    if diff > a.tolerance:
        raise UserError(f"{a.output}: reloaded model's logits differ by {diff:.2e} (> {a.tolerance})")
    sample = reloaded.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    report |= {"max_logit_diff": diff, "generation_ok": sample.shape[1] > 4}
    write_json(a.output / "consolidation.json", report)
    print(f"{a.output}: consolidated from {folder} (max logit diff {diff:.1e})")


if __name__ == "__main__":
    main()
