"""What the planner (preflight.py) and its fake-tensor probe (memory_probe.py) share: the model's config
from its name, and what a GPU rank holds beyond its live tensors. Both import it from here, downward: the
probe runs as the planner's subprocess and neither imports the other."""

from workflow_scripts.core.settings import PlanConfig

# What a GPU rank holds beyond its live tensors (GiB), added to a plan's live tensors by the planner.
CUDA_CONTEXT_GB = 0.5  # CUDA context and cuBLAS/cuDNN workspaces (about 0.3-0.6 GiB on A100/H100)
NCCL_GB = 0.5  # NCCL's communicator buffers per process group (NCCL_BUFFSIZE 4 MiB × channels × peers)
GPU_CONSTANTS_GB = {"cuda_context": CUDA_CONTEXT_GB, "nccl_buffers": NCCL_GB}


def load_config(model: str, t: PlanConfig):
    """The model's config: a from-scratch preset's shape (before the possibly huge model is built), or config.json."""
    from transformers import AutoConfig

    from workflow_scripts.model.presets import preset_config, preset_name

    preset = preset_name(model)
    if preset:
        return preset_config(preset, t.demo_vocab_size, t.max_seq_len)
    return AutoConfig.from_pretrained(model)
