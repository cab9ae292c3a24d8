"""``fsdp``: FSDP2, ``fully_shard`` per decoder layer and on the root. The model is built on the meta
device (no memory), sharded, given storage with ``to_empty`` and each rank copies only its own slices
out of the safetensors files. Checkpoints are torch.distributed.checkpoint folders (``dcp/``) plus the
schedule (``scheduler.pt``); consolidation reads them without a process group. Weights, gradients
and optimizer states are sharded over the world; CPU offload (CPUOffloadPolicy) keeps each rank's
shard of all three on the host."""

from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import PlanConfig
from workflow_scripts.model.model_loading import materialize
from workflow_scripts.train.parallel.base import Footprint, Strategy, compute_dtype, loss_scaler, on_real_tensors


def offloaded(cfg, device: torch.device) -> bool:
    """FSDP2 CPU offload (training.offload optimizer or all: FSDP2 offloads parameters, gradients and
    optimizer states together). Taken on a CPU run too, where the shards already live on the host, so
    that CPU tests run the offload path (CPUOffloadPolicy, gradient clipping of CPU DTensors over the
    process group's CPU backend: ``FSDPStrategy.process_group_backend``)."""
    return cfg.offload != "none"


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks, found by the class names transformers marks as unsplittable."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"no decoder layers found in {type(base).__name__} (looked for {sorted(names)})")
    return layers


def fsdp_kwargs(cfg, device) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    return {
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype(cfg), reduce_dtype=torch.float32),
        # pinned host memory needs an accelerator; a CPU run offloads to pageable memory
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if offloaded(cfg, device)
        else OffloadPolicy(),
    }


def shard_fsdp(model, cfg, device) -> None:
    """FSDP2: ``fully_shard`` each decoder block, then the root. A model on the meta device stays
    there (``place`` fills it); a materialized one moves to the device one block at a time."""
    from torch.distributed.fsdp import fully_shard

    kwargs = fsdp_kwargs(cfg, device)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


class FSDPStrategy(Strategy):
    # Measured on an H200 (docs/benchmarks/gpu.md, "GPU checklist"): max_memory_reserved 27.5% above
    # max_memory_allocated at grad_accum 1, 12.3% at 2, 10.4% with LoRA: FSDP2 frees and re-allocates every
    # unit's gathered parameters and reduce-scatter buffers on its own streams, which the allocator keeps apart.
    allocator_headroom = 0.30

    def __init__(self, cfg, model, device, total_steps):
        from torch.distributed.fsdp import FSDPModule

        super().__init__(cfg, device, total_steps)
        if not isinstance(model, FSDPModule):  # load_model shards while loading; tests pass whole models
            shard_fsdp(model, cfg, device)
        self.model = model
        self.optimizer = self.make_optimizer(model.parameters())
        self.scheduler = self.make_scheduler(self.optimizer)
        self.scaler = loss_scaler(cfg, device, sharded=True)

    @classmethod
    def process_group_backend(cls, cfg, device_type: str) -> str:
        """NCCL on GPUs, plus gloo for CPU tensors when FSDP2 offloads to the host: its sharded gradients are
        CPU DTensors there, and clipping them all-reduces their norms on the CPU."""
        if device_type == "cuda" and cfg.offload != "none":
            return "cpu:gloo,cuda:nccl"
        return super().process_group_backend(cfg, device_type)

    @classmethod
    def unmet(cls, report: dict) -> list[str]:
        if not report.get("fsdp2_available"):
            return ["training.strategy is fsdp but torch.distributed.fsdp.fully_shard is missing (torch >= 2.6)"]
        return []

    @classmethod
    def sharded_load(cls, cfg) -> str | None:
        return "meta"

    @classmethod
    def place(cls, model, files, cfg, device: torch.device) -> None:
        shard_fsdp(model, cfg, device)
        materialize(model, files, cfg.seed, torch.device("cpu") if offloaded(cfg, device) else device, tie=False)

    def forward_backward(self, batch, last_micro: bool):
        # By default every micro-batch reduce-scatters its gradients, so a rank only ever holds its
        # shard; training.fsdp_no_sync holds the unsharded fp32 gradients until the last micro-batch.
        if self.cfg.fsdp_no_sync:
            self.model.set_requires_gradient_sync(last_micro)
        loss = self.compute_loss(batch)
        self.backward(loss)
        return loss

    def _options(self, loading: bool = False):
        """LoRA's checkpoints leave the frozen base out. Loading one, set_state_dict's strict check would
        ask for the frozen weights too (``Missing key(s)``): not strict, as dcp.load has already read
        every trainable tensor the model asked for (it raises on one the checkpoint lacks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self.cfg.peft != "none"
        return StateDictOptions(ignore_frozen_params=lora, strict=not (lora and loading))

    def save(self, folder: Path, writes) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=hashing_writer(folder / "dcp", writes))
        if dist.get_rank() == 0:
            writes.torch_save(self.extra_state(), folder / "scheduler.pt")

    def load(self, folder: Path, saved_world: int) -> dict:
        # DCP reads each rank's shards of the model and optimizer states as this world lays them out,
        # from whichever saved shards hold them: a checkpoint of another world size is resharded on load
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self._options(loading=True),
        )
        self.load_extra_state(torch.load(folder / "scheduler.pt", weights_only=True))
        return {}

    @classmethod
    def export_source(cls, folder: Path, shapes, exclude_frozen: bool):
        return FSDPSource(folder, shapes)

    # ------------------------------------------------------------ memory terms

    @classmethod
    def shards(cls, t: PlanConfig) -> tuple[bool, bool, bool]:
        return True, True, True

    @classmethod
    def host_load_bytes(cls, t: PlanConfig, f: Footprint, largest_file: int) -> float:
        """The largest checkpoint file (its pages are shared by the node's ranks) plus every rank's shard."""
        shard = (f.trainable * 4 + f.frozen * f.c) / f.world
        return largest_file + f.procs * shard

    @classmethod
    def offloaded_bytes(cls, t: PlanConfig, f: Footprint) -> float:
        """CPUOffloadPolicy: each rank's shard of parameters, gradients and Adam's states, 4 + 4 + 8."""
        if t.offload != "none":
            return (f.trainable * 16 + f.frozen * f.c) / f.nodes
        return 0.0

    @classmethod
    def unsharded_gradient_bytes(cls, t: PlanConfig, trainable: int) -> int:
        """training.fsdp_no_sync with grad_accum > 1: every rank holds the unsharded fp32 gradient until the
        last micro-batch."""
        return trainable * 4 if t.fsdp_no_sync and t.grad_accum > 1 else 0

    @classmethod
    def probed_components(cls, t: PlanConfig, probed: dict) -> tuple[dict, str]:
        """CPUOffloadPolicy: the sharded parameters, gradients and optimizer states live on the host."""
        parts = dict(probed["components_bytes"])
        if t.offload == "none":
            return parts, ""
        cats = probed["tracker_categories_bytes"]
        parts["params"] -= cats.get("Sharded Param", 0)
        parts["grads"] -= cats.get("Sharded Grad", 0)
        parts["optimizer"] = 0
        return parts, "; FSDP2 offload: sharded parameters, gradients and optimizer states on the host"

    # ------------------------------------------------------------ the fake-tensor probe

    fake_probe = True

    @classmethod
    def probe_shims(cls) -> dict:
        """Run on real tensors: fully_shard's default device mesh (its rank map's ``tolist``) and a DTensor
        shard's offset (model_loading.local_index), metadata computed with data-dependent tensor ops."""
        from torch.distributed.fsdp._fully_shard import _fully_shard
        from torch.distributed.tensor import _utils

        return super().probe_shims() | {
            (_fully_shard, "_init_default_mesh"): on_real_tensors,
            (_utils, "compute_local_shape_and_global_offset"): on_real_tensors,
        }

    def probe_tracker(self, tracked):
        """FSDPMemTracker: it tells sharded from unsharded parameters and gradients."""
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return tracked(FSDPMemTracker)(self.model, self.optimizer)


def hashing_writer(path: Path, writes):
    """DCP's FileSystemWriter with its files opened through ``writes`` (hashed as they are written)."""
    import contextlib

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with writes.open(path, fileno=True) as stream:  # DCP fsyncs it; torch.save gets a wrapper
                yield stream

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            writes.renamed(path, new_path)

    writer = FileSystemWriter(str(path))
    writer.fs = HashingFileSystem()
    return writer


class FSDPSource:
    """A torch.distributed.checkpoint folder, read a batch of keys at a time without a process group."""

    def __init__(self, folder: Path, shapes: dict[str, torch.Size]):
        from torch.distributed.checkpoint import FileSystemReader

        self.path, self.shapes = folder / "dcp", shapes
        try:
            meta = FileSystemReader(str(self.path)).read_metadata()
        except Exception as e:  # DCP wraps reader errors in its own exception types
            raise UserError(f"{self.path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
        self.names = {k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")}

    def read(self, names) -> dict:
        import torch.distributed.checkpoint as dcp

        state = {"model": {n: torch.empty(self.shapes[n], dtype=torch.float32) for n in names}}
        try:
            dcp.load(state, checkpoint_id=str(self.path), no_dist=True)
        except Exception as e:
            raise UserError(f"{self.path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
        return state["model"]

    def release(self, tensors: dict) -> None:
        pass  # read into fresh tensors
