"""DeepSpeed imported and readied as training uses it, without two costs a process pays for what training never runs.

- ``import_deepspeed``: DeepSpeed's package imports its autotuner, which imports mlflow whenever it is installed
  (the trackers' extra): 1.6 s of CPU in each process that imports DeepSpeed, for an autotuner no job runs. The
  ranks and consolidation import it here, mlflow hidden from that one import; a tracker imports mlflow afterwards as
  before. (ds_to_universal's own process, which DeepSpeed's module starts, still pays it.)
- ``prepare_deepspeed``: before the first collective (see its docstring).
"""

import sys
import warnings

SHM_COMM_OP = "deepspeed_shm_comm"  # deepspeed.ops.op_builder.cpu.ShareMemCommBuilder.NAME


def import_deepspeed():
    """The ``deepspeed`` module, imported (if it is not yet) with mlflow hidden from its autotuner."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # import mlflow raises ImportError: the autotuner's has_mlflow = False
    try:
        import deepspeed
    finally:
        if hidden:
            del sys.modules["mlflow"]
    return deepspeed


def prepare_deepspeed() -> None:
    """Before DeepSpeed's first collective. DeepSpeed 0.19 calls torch.distributed's deprecated
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, and the warning repeats on every call (something in
    each step resets Python's once-per-location registry): with layer-sized buckets, hundreds of lines a step.

    And on the CPU accelerator its communication backend compiles (a machine's first run: about 75 s of CPU) and
    loads its shared-memory op, which only ``inference_all_reduce`` (tensor-parallel inference) uses, never
    training: marked incompatible before the backend is made, it is neither built nor loaded; training's
    collectives are gloo's either way. GPU accelerators have no such op."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    import_deepspeed()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
