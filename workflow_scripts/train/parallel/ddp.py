"""``ddp``: DistributedDataParallel. Every rank holds a full replica, read once directly in the dtype
training keeps (fp32 master weights for a full fine-tuning, the compute dtype for a LoRA's frozen
base; autocast computes in the compute dtype). Rank 0 writes ``state.pt``: the trainable tensors, the
optimizer, the schedule; consolidation reads it memory-mapped. Nothing is sharded or offloaded."""

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.core.host_memory import page_out
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import PlanConfig
from workflow_scripts.train.parallel.base import SHARDED_LOAD, Strategy, compute_dtype, loss_scaler, skipped


def trainable_state_dict(model) -> dict:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


class DDPStrategy(Strategy):
    offloads = False

    def __init__(self, cfg, model, device, total_steps):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(cfg, device, total_steps)
        self.inner = model.to(device)
        self.model = DistributedDataParallel(self.inner, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = self.make_optimizer(self.inner.parameters())
        self.scheduler = self.make_scheduler(self.optimizer)
        self.autocast = torch.autocast(device.type, dtype=compute_dtype(cfg), enabled=cfg.precision != "fp32")
        self.scaler = loss_scaler(cfg, device, sharded=False)

    def forward_backward(self, batch, last_micro: bool):
        sync = contextlib.nullcontext() if last_micro else self.model.no_sync()
        with sync:
            with self.autocast:
                loss = self.compute_loss(batch)
            self.backward(loss)
        return loss

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.inner

    def eval_loss(self, batch) -> torch.Tensor:
        # the replica itself: every rank holds all of it, and DDP's wrapper has nothing to synchronize
        with self.autocast:
            return self.inner(**batch).loss

    def save(self, folder: Path, writes) -> None:
        if dist.get_rank() == 0:
            state = {
                "model": trainable_state_dict(self.inner),
                "optimizer": self.optimizer.state_dict(),
                **self.extra_state(),
            }
            writes.torch_save(state, folder / "state.pt")

    def load(self, folder: Path, saved_world: int) -> dict:
        # rank 0's full state: the same at any world size
        state = torch.load(folder / "state.pt", map_location=self.device, weights_only=True)
        # only trainable tensors are saved; tied weights appear once in named_parameters
        needed = {n for n, p in self.inner.named_parameters() if p.requires_grad}
        _, unexpected = self.inner.load_state_dict(state["model"], strict=False)
        lacking = sorted(needed - set(state["model"]))
        if unexpected or lacking:
            raise RuntimeError(f"{folder / 'state.pt'}: does not match the model ({unexpected[:2]} {lacking[:2]})")
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_extra_state(state)
        return {}

    @classmethod
    def export_source(cls, folder: Path, shapes, exclude_frozen: bool):
        return DDPSource(folder)

    @classmethod
    def sharded_alternative(cls, t: PlanConfig) -> dict | None:
        return SHARDED_LOAD

    # ------------------------------------------------------------ the fake-tensor probe

    fake_probe = True

    @classmethod
    def probe_shims(cls) -> dict:
        """DDP's start: a cross-rank check of the parameters' shapes and rank 0's broadcast of the weights,
        skipped."""
        from torch.nn.parallel import distributed as ddp_module

        return super().probe_shims() | {
            (ddp_module, "_verify_param_shape_across_processes"): skipped,
            (ddp_module, "_sync_module_states"): skipped,
        }

    def probe_prepare(self) -> None:
        """The fake process group's all-reduce completes without a value, which DDP's reducer rejects: the
        bucket all-reduced in place instead, and the reducer's first buckets kept."""
        self.model.register_comm_hook(None, in_place_all_reduce)
        self.model.reducer = FixedBuckets(self.model.reducer)

    def probe_tracker(self, tracked):
        """MemTracker on the replica (DDP's wrapper holds no tensors of its own)."""
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = tracked(MemTracker)()
        tracker.track_external(self.inner, self.optimizer)
        return tracker


def in_place_all_reduce(state, bucket):
    """DDP's gradient bucket all-reduced in place, as gloo and NCCL do: the fake process group's
    all-reduce completes without a value, which DDP's reducer rejects."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class FixedBuckets:
    """DDP's reducer, keeping its first buckets: rebuilding them in the order of the first backward
    broadcasts bucket indices (values a fake tensor has not). The rebuilt buckets hold the same gradients,
    and they are made before the forward's activations, so the peak does not see the difference."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


class DDPSource:
    """Rank 0's ``state.pt``, memory-mapped: tensors are read from the file only when used."""

    def __init__(self, folder: Path):
        self.path = folder / "state.pt"
        try:
            self.tensors = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)["model"]
        except (FileNotFoundError, RuntimeError, EOFError, KeyError, ValueError) as e:
            raise UserError(f"{self.path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
        self.names = set(self.tensors)

    def read(self, names) -> dict:
        return {n: self.tensors[n] for n in names}

    def release(self, tensors: dict) -> None:
        page_out(tensors.values())
