"""Run under torchrun by tests/test_sharded_load.py: the logits of the model as the trainer loads it
(sharded for FSDP and ZeRO-3) against the same model loaded whole, in fp32, on fixed inputs.

    torchrun --nproc_per_node 2 tests/sharded_load_check.py <base folder> <training config JSON> <out.json>
"""

import json
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from workflow_scripts.core.settings import training_config  # noqa: E402
from workflow_scripts.model.model_loading import add_lora, is_adapter  # noqa: E402
from workflow_scripts.train.parallel import build_strategy, load_model  # noqa: E402


def reference(base: str, cfg, inputs) -> tuple[torch.Tensor, dict]:
    """The unsharded fp32 model (and adapters), loaded the plain way."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    if cfg.peft == "lora":
        model = add_lora(model, cfg, materialize=True)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    return logits, adapters


def full_adapters(strategy) -> dict:
    """The adapters of the trained model, gathered whole on every rank."""
    from torch.distributed.tensor import DTensor

    out = {}
    model = strategy.model.module if hasattr(strategy.model, "module") else strategy.model
    for n, p in model.named_parameters():
        if not is_adapter(n):
            continue
        if isinstance(p, DTensor):
            t = p.full_tensor()
        elif hasattr(p, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                t = p.detach().clone()
        else:
            t = p.detach()
        out[n] = t.float().clone()
    return out


def main() -> None:
    base, config, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    cfg = training_config(config)
    device = torch.device("cpu")
    inputs = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    # first: once a ZeRO-3 config is alive, from_pretrained partitions (a collective)
    expected, expected_adapters = reference(base, cfg, inputs)
    torch.manual_seed(1234)
    model, _ = load_model(base, cfg, device)
    strategy = build_strategy(cfg, model, device, total_steps=1)
    strategy.model.eval()
    with torch.no_grad():
        logits = strategy.model(input_ids=inputs).logits.float()
    adapters = full_adapters(strategy)
    if dist.get_rank() == 0:
        record = {
            "max_abs_diff": float((logits - expected).abs().max()),
            "adapters": len(adapters),
            "adapter_max_abs_diff": max(
                [float((adapters[n] - expected_adapters[n]).abs().max()) for n in expected_adapters] or [0.0]
            ),
            "same_adapter_names": sorted(adapters) == sorted(expected_adapters),
        }
        out.write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    if multiprocessing.parent_process() is None:  # a rank ranks.py forked returns to torchrun's code
        os._exit(0)  # DeepSpeed's CPU backend can abort in interpreter teardown


if __name__ == "__main__":
    main()
