"""Under torchrun (gloo, real tensors): memory_probe.measure's per-rank peak of each case, written by rank 0
as JSON, for tests/test_memory_probe.py to hold the fake-tensor probe against.

    torchrun --standalone --nproc_per_node 2 tests/memory_probe_check.py CONFIG_JSON CASES_JSON OUT
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from workflow_scripts.core.settings import PlanConfig  # noqa: E402
from workflow_scripts.plan.memory_probe import measure  # noqa: E402


def main() -> None:
    shape, cases, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    results = [measure(Qwen3Config(**shape), PlanConfig.build(t)) for t in cases]
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
