"""Run under torchrun by tests/test_gpu_paths.py: a strategy with CPU offload as the trainer runs it (its
process group, load, wrap and step), on CPU: the optimizer class that steps; for FSDP2 which offload policy
each FSDP module got and where the shards live; one clipped optimizer step (FSDP2: the gradient norm
all-reduced over CPU DTensors).

    torchrun --nproc_per_node 2 tests/offload_check.py <base folder> <training config JSON> <out.json>
"""

import json
import multiprocessing
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workflow_scripts.core.settings import training_config  # noqa: E402
from workflow_scripts.train.parallel import build_strategy, load_model  # noqa: E402
from workflow_scripts.train.train import init_distributed  # noqa: E402


def main() -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    base, config, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    cfg = training_config(config)
    device = init_distributed(cfg)
    torch.manual_seed(1234)
    model, _ = load_model(base, cfg, device)
    strategy = build_strategy(cfg, model, device, total_steps=1)
    policies = sorted(
        {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in strategy.model.modules()
         if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group}
    )  # fmt: skip
    shards = {p.to_local().device.type for p in strategy.model.parameters() if isinstance(p, DTensor)}
    inputs = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    strategy.model.train()
    loss = strategy.forward_backward({"input_ids": inputs, "labels": inputs}, last_micro=True)
    grads = {p.grad.to_local().device.type for p in strategy.model.parameters() if isinstance(p.grad, DTensor)}
    norm = strategy.step()  # DeepSpeed: its engine stepped at the boundary, this reads the norm
    optimizer = getattr(strategy.optimizer, "optimizer", strategy.optimizer)  # DeepSpeed wraps the client's
    if dist.get_rank() == 0:
        record = {
            "backend": str(dist.get_backend()),
            "policies": policies,
            "shard_devices": sorted(shards),
            "grad_devices": sorted(grads),
            "loss": float(loss),
            "grad_norm": norm,
            "optimizer": type(optimizer).__name__,
        }
        out.write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    if multiprocessing.parent_process() is None:  # a rank ranks.py forked returns to torchrun's code
        os._exit(0)  # DeepSpeed's CPU backend can abort in interpreter teardown


if __name__ == "__main__":
    main()
