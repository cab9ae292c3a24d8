"""``deepspeed``: DeepSpeed ZeRO 1-3 (training.zero_stage) with optional CPU offload.

- Load plan: ZeRO-1/2 keep a full replica on every rank by design, read once in the compute dtype
  (the optimizer keeps the fp32 master partitions). ZeRO-3 creates the model under
  ``deepspeed.zero.Init`` (which transformers enables while an ``HfDeepSpeedConfig`` is alive), so
  parameters are partitioned as they are created, and each rank copies its own partition from the
  safetensors files.
- Training: the engine scales, clips and steps at the accumulation boundary; its ZeRO buffers are
  sized to the model (``zero_buffer_sizes``), and that ZeRO section keys the checkpoints.
- Checkpoints: DeepSpeed's own; consolidation reads them with DeepSpeed's ``zero_to_fp32`` parsers,
  lazily (``DeepSpeedSource``).
- Memory terms: DeepSpeed's own estimators (see preflight's docstring).
"""

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.core.host_memory import page_out, trim
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import PlanConfig
from workflow_scripts.model.model_loading import source_key
from workflow_scripts.model.weights import READ_BYTES
from workflow_scripts.train.checkpoint import agree, commit, step_of, verify_shared
from workflow_scripts.train.parallel.base import SHARDED_LOAD, Footprint, Strategy, change_keys, compute_dtype
from workflow_scripts.train.parallel.zero_memory import hidden_size, layer_parameters, zero_buffer_sizes  # noqa: F401 (hidden_size: tests)
from workflow_scripts.train.parallel.zero_runtime import import_deepspeed, prepare_deepspeed

log = logging.getLogger("train")

DS_BUFFER = 1.5  # DeepSpeed's additional_buffer_factor (its memory estimators)
_KEEP_ALIVE = []  # HfDeepSpeedConfig: transformers holds it by weak reference until deepspeed.initialize


def deepspeed_config(cfg, world_size: int, model_config) -> dict:
    """DeepSpeed JSON from our config, on top of a user-supplied one when given; ZeRO's buffer sizes
    from the model's shape (zero_buffer_sizes) where that JSON does not set them."""
    base = json.loads(Path(cfg.deepspeed_config).read_text()) if cfg.deepspeed_config else {}
    zero = {"stage": cfg.zero_stage, **base.get("zero_optimization", {})}
    for key, size in zero_buffer_sizes(zero["stage"], model_config).items():
        if zero.get(key, "auto") == "auto":  # unset, or transformers' "auto"
            zero[key] = size
    if cfg.offload in ("optimizer", "all"):
        zero.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": cfg.offload_pin_memory})
    if cfg.offload == "all" and cfg.zero_stage == 3:
        zero.setdefault("offload_param", {"device": "cpu", "pin_memory": True})
    if cfg.offload_ratio < 1:  # ZeRO-3's partial optimizer offload: the first sub-groups stay on the GPU
        if error := offload_ratio_error(zero["stage"], cfg.offload, cfg.offload_ratio):
            raise UserError(error)
        zero["offload_optimizer"] = {**zero["offload_optimizer"], "ratio": cfg.offload_ratio}
    return base | {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world_size,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        # dynamic loss scaling (loss_scale 0), as torch's GradScaler: start at 2^16, halve on overflow
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def offload_ratio_error(stage: int, offload: str, ratio: float) -> str | None:
    """DeepSpeed 0.19 takes offload_optimizer.ratio < 1 with ZeRO-3 only (its config asserts it), and only
    where the optimizer is offloaded."""
    if ratio < 1 and (stage != 3 or offload == "none"):
        return f"training.offload_ratio {ratio} needs training.zero_stage 3 and training.offload optimizer or all"
    return None


class DeepSpeedStrategy(Strategy):
    # DeepSpeed, and the module its optimizer check imports, which compiles Muon with torch.compile at import
    # (torch._inductor: 1.3 s a process once torch and transformers are imported, timed on the 2-core machine)
    rank_imports = (
        "workflow_scripts.train.parallel.zero_runtime:import_deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer",
    )  # fmt: skip

    @classmethod
    def unmet(cls, report: dict) -> list[str]:
        if report["packages"].get("deepspeed") is None:
            return ["training.strategy is deepspeed but deepspeed is not installed"]
        return []

    # ------------------------------------------------------------ load plan

    @classmethod
    def load_dtype(cls, cfg) -> torch.dtype:
        return compute_dtype(cfg)  # the optimizer keeps the fp32 master partitions

    @classmethod
    def sharded_load(cls, cfg) -> str | None:
        return "zero3" if cfg.zero_stage == 3 else None

    @classmethod
    def filled_on_creation(cls, cfg) -> bool:
        return cfg.zero_stage == 3

    @classmethod
    def create(cls, config, cfg, attn: str, files):
        if cfg.zero_stage != 3:
            return super().create(config, cfg, attn, files)
        model = zero3_model(config, cfg, attn)
        fill_partitions(model, files)
        return model

    @classmethod
    def place(cls, model, files, cfg, device: torch.device) -> None:
        if cfg.zero_stage != 3:  # ZeRO-3's partitions were filled as the model was created
            super().place(model, files, cfg, device)

    # ------------------------------------------------------------ training

    def __init__(self, cfg, model, device, total_steps):
        deepspeed = import_deepspeed()
        super().__init__(cfg, device, total_steps)
        prepare_deepspeed()
        config = deepspeed_config(cfg, dist.get_world_size(), model.config)
        optimizer, why = choose_optimizer(
            config["zero_optimization"],
            lambda: self.cpu_adam(model.parameters()),
            lambda: self.make_optimizer(model.parameters()),
            on_gpu=device.type == "cuda",
        )
        (log.warning if "did not" in why else log.info)("optimizer: %s", why)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=self.make_scheduler, config=config
        )
        trim()  # initialize's freed transients below the mmap threshold (flattening, the fp32 casts)

    def cpu_adam(self, params):
        """DeepSpeed's vectorized AdamW for states on the host (5-7x torch's there, DeepSpeed says); its
        cpu_adam op is prebuilt or compiled on first use (a minute or more; cached in ~/.cache/torch_extensions)."""
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            self.param_groups(params), lr=self.cfg.lr, betas=tuple(self.cfg.adam_betas), adamw_mode=True
        )

    def forward_backward(self, batch, last_micro: bool):
        # the engine scales by gradient_accumulation_steps and steps at the boundary
        loss = self.compute_loss(batch)
        self.model.backward(loss)
        self.model.step()
        return loss

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.model.module

    def step(self) -> float:
        """The engine clipped and stepped at the last micro-batch's boundary; its norm."""
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def loss_scale_stats(self) -> dict:
        if self.cfg.precision != "fp16":
            return {}
        return {"loss_scale": float(self.optimizer.cur_scale), "skipped_steps": int(self.model.skipped_steps)}

    def save(self, folder: Path, writes) -> None:
        # DeepSpeed's default checkpoint engine writes every state file with torch.save of a path: here
        # through ``writes``, hashed as written. What it writes otherwise (zero_to_fp32.py, another engine
        # set in the DeepSpeed JSON) is read back at commit.
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        engine = self.model.checkpoint_engine
        if type(engine) is TorchCheckpointEngine:
            serialization = {"_use_new_zipfile_serialization": engine.zipfile_serialization}
            engine.save = lambda state_dict, path: writes.torch_save(state_dict, path, **serialization)
        try:
            self.model.save_checkpoint(
                str(folder.parent), tag=folder.name, exclude_frozen_parameters=self.cfg.peft != "none"
            )
        finally:
            engine.__dict__.pop("save", None)  # the class's own again

    def load(self, folder: Path, saved_world: int) -> dict:
        """The checkpoint as saved, or at another world size its universal copy (``universal_copy``):
        the engine reads the ZeRO config's ``checkpoint.load_universal`` only in ``load_checkpoint``
        (deepspeed 0.19), so it is set on the engine's config for that one load."""
        universal = universal_copy(folder) if saved_world != dist.get_world_size() else None
        where, tag = (folder, UNIVERSAL) if universal else (folder.parent, folder.name)
        self.model._config.load_universal_checkpoint = universal is not None
        try:
            path, _ = self.model.load_checkpoint(str(where), tag=tag, load_module_strict=self.cfg.peft == "none")
        finally:
            self.model._config.load_universal_checkpoint = False
        if path is None:
            raise RuntimeError(f"{folder}: DeepSpeed could not load this checkpoint")
        if universal:
            own_steps(self.optimizer)
        return {"universal": str(universal)} if universal else {}

    def key_extra(self, base_model: str) -> str | None:
        """Also the ZeRO section this runs with: its sub-groups lay out the optimizer state, and their
        sizes are filled from the model, so a checkpoint of other sizes is not resumed."""
        from transformers import AutoConfig

        zero = deepspeed_config(self.cfg, 1, AutoConfig.from_pretrained(base_model))["zero_optimization"]
        return json.dumps([super().key_extra(base_model), zero], sort_keys=True)

    @classmethod
    def export_source(cls, folder: Path, shapes, exclude_frozen: bool):
        return DeepSpeedSource(folder, exclude_frozen)

    # ------------------------------------------------------------ memory terms

    @classmethod
    def shards(cls, t: PlanConfig) -> tuple[bool, bool, bool]:
        stage = t.zero_stage
        return stage == 3, stage >= 2, True

    @classmethod
    def replica_bytes(cls, f: Footprint) -> float:
        return f.frozen * f.c + f.trainable * f.c  # the fp32 master copy is made later, partitioned

    @classmethod
    def host_load_bytes(cls, t: PlanConfig, f: Footprint, largest_file: int) -> float:
        """ZeRO-3: transformers reads one safetensors file at a time, plus the node's partitions when
        ``offload: all`` keeps them on the host; ZeRO-1/2: a replica per rank."""
        if t.zero_stage == 3:
            return largest_file + (f.params * f.c / f.nodes if t.offload == "all" else 0)
        return super().host_load_bytes(t, f, largest_file)

    @classmethod
    def offloaded_bytes(cls, t: PlanConfig, f: Footprint) -> float:
        """DeepSpeed's own estimate_zero3_model_states_mem_needs (zero_init=True) and
        estimate_zero2_model_states_mem_needs, over the trainable parameters: the plan's cross-check
        (plan/memory.json's host.deepspeed_estimator_gb); the plan itself counts ``model_states``."""
        offload = t.offload
        if t.zero_stage == 3:
            if offload == "none":
                return f.largest_layer * 4 * f.procs * DS_BUFFER
            params = offload == "all"  # offload_param: the parameters' partitions live on the host too
            return (f.trainable * (16 + f.c * params) + f.frozen * f.c * params) / f.nodes * DS_BUFFER
        return f.trainable * 16 / f.nodes * DS_BUFFER if offload != "none" else 0.0

    @classmethod
    def unsupported(cls, t: PlanConfig) -> str | None:
        return offload_ratio_error(t.zero_stage, t.offload, t.offload_ratio)

    @classmethod
    def model_states(cls, t: PlanConfig, layout, world: int) -> dict | None:
        """ZeRO's model states from DeepSpeed's source (parallel/zero_memory.py)."""
        from workflow_scripts.train.parallel.zero_memory import model_states

        return model_states(t, layout(), world, getattr(t, "optimizer_device", "cpu"))

    @classmethod
    def probe_config(cls, t: PlanConfig) -> PlanConfig:
        """DeepSpeed has no fake-tensor path: the probe runs the same micro-batch, sequence, checkpointing
        and LoRA under FSDP2, for the activations (and logits) alone (a PlanConfig: never the planner's NVMe
        optimizer_device, settings.PlannedConfig)."""
        probed = PlanConfig(**{f.name: getattr(t, f.name) for f in dataclasses.fields(PlanConfig)})
        return dataclasses.replace(
            probed, strategy="fsdp", zero_stage=3, offload="none", fsdp_no_sync=False, offload_ratio=1.0
        )

    @classmethod
    def sharded_alternative(cls, t: PlanConfig) -> dict | None:
        return SHARDED_LOAD if t.zero_stage < 3 else None

    @classmethod
    def proposals(cls, t: PlanConfig, attempt) -> list[dict]:
        """ZeRO-3's partial optimizer offload (with the parameters too where ``t`` is ZeRO-3 offloading
        them, and without), each at the smallest offload_ratio that fits; unpinned where none does; then
        ZeRO-3 with the optimizer on NVMe."""
        from workflow_scripts.train.parallel.zero_memory import ratio_for

        def partial(keys: dict) -> dict:
            result, change, split = ratio_for(t, attempt, keys)
            label = f"{change_keys(change)} (ZeRO-3 partial offload: {split} optimizer sub-groups per rank on the host)"
            return result | {"proposal": label, "change": change}

        offloads = ["all", "optimizer"] if t.strategy == "deepspeed" and t.offload == "all" else ["optimizer"]
        out = [partial({"offload": offload}) for offload in offloads]
        if not any(p["fits"] for p in out):  # unpinned: no power-of-two rounding of the optimizer's host blocks
            out += [partial({"offload": offload, "offload_pin_memory": False}) for offload in offloads]
        change = {"strategy": "deepspeed", "zero_stage": 3, "offload": "all", "optimizer_device": "nvme"}
        label = (
            "ZeRO-3 with the optimizer states on NVMe (training.strategy: deepspeed, training.zero_stage: 3, "
            'training.offload: all, and training.deepspeed_config with "offload_optimizer": {"device": "nvme", '
            '"nvme_path": <local disk>})'
        )
        return out + [attempt(label, change)]


def choose_optimizer(zero: dict, cpu_adam, torch_adamw, on_gpu: bool = True) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer for this ZeRO section and why: DeepSpeedCPUAdam (``cpu_adam()``) when a GPU run's
    optimizer states are offloaded (offload_optimizer on cpu or nvme: DeepSpeed steps them on the host), else
    torch's AdamW (``torch_adamw()``); torch's AdamW too, said as a warning, where the cpu_adam op cannot be
    built or loaded (no compiler, an unsupported CPU). A CPU run (DS_ACCELERATOR=cpu) keeps torch's AdamW: its
    states are host memory already, and the op's first build takes minutes there; except with a partial
    offload (offload_optimizer.ratio < 1), which DeepSpeed runs with DeepSpeedCPUAdam only."""
    offload = zero.get("offload_optimizer") or {}
    device = offload.get("device", "none")
    if device not in ("cpu", "nvme"):
        return torch_adamw(), "torch AdamW (optimizer states on the accelerator)"
    if offload.get("ratio", 1.0) < 1:  # stage3's partial offload asserts DeepSpeedCPUAdam, on a CPU run too
        return cpu_adam(), f"DeepSpeedCPUAdam ({offload['ratio']:.0%} of the optimizer offloaded to {device})"
    if not on_gpu:
        return torch_adamw(), f"torch AdamW (a CPU run: offload_optimizer {device} steps on the host either way)"
    try:
        return cpu_adam(), f"DeepSpeedCPUAdam (optimizer states offloaded to {device})"
    except Exception as e:  # DeepSpeed raises RuntimeError over the build's own errors
        cause = e.__cause__ or e
        why = f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1][:200] if str(cause).strip() else ''}"
        return torch_adamw(), f"torch AdamW on the host: DeepSpeed's cpu_adam op did not build or load ({why})"


# ---------------------------------------------------------------- another world size

UNIVERSAL = "universal"  # a checkpoint's universal copy: <checkpoint>/universal, with its own marker
CONVERSION_WAIT = timedelta(hours=12)  # the other ranks wait this long for rank 0's conversion


def universal_copy(folder: Path) -> Path:
    """``folder``'s DeepSpeed universal checkpoint (ds_to_universal: every parameter's fp32 weights and
    Adam states whole, loadable at any world size), made once by rank 0 into ``folder/universal`` and
    committed with its own COMPLETE marker (every file's size and sha256). A copy already there is checked
    as a checkpoint is, each rank a share; one missing, cut short or damaged is made again from ``folder``
    (verified before this). A conversion that fails raises on every rank, with its reason."""
    target, rank = folder / UNIVERSAL, dist.get_rank()
    problem = verify_shared(target, rank)
    if problem is None:
        return target
    # a conversion outlasts the collective timeout on a large model: the ranks wait for it in a group of their own
    wait = dist.new_group(backend="gloo", timeout=CONVERSION_WAIT)
    failed = None
    if rank == 0:
        if target.exists():
            log.warning("%s: %s; making it again", target, problem)
        try:
            convert_to_universal(folder, target)
        except Exception as e:
            failed = f"its universal copy could not be made ({type(e).__name__}: {str(e).strip()[-300:]})"
    failed = agree(failed, group=wait)
    dist.destroy_process_group(wait)
    if failed:
        raise RuntimeError(failed)
    return target


def own_steps(optimizer) -> None:
    """DeepSpeed 0.19's ZeRO-3 universal load gives every sub-group's fp32 partition one and the same
    ``step`` tensor, which torch's AdamW advances in place once per sub-group each step: the bias
    correction then runs ahead (measured: the loss 2.6e-4 off an uninterrupted run 4 steps after the
    resume, 2.4e-7 with this). Each partition gets its own copy."""
    for state in getattr(optimizer, "optimizer", optimizer).state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def convert_to_universal(folder: Path, target: Path) -> None:
    """DeepSpeed's ds_to_universal in a process of its own (its workers are processes: none is forked from
    a rank), then the marker. ``latest_universal``, which it writes beside the copy, is no file of ours."""
    if target.exists():
        shutil.rmtree(target)
    workers = str(max(1, min(4, len(os.sched_getaffinity(0)) // 2)))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(folder),
           "--output_folder", str(target), "--inject_missing_state", "--num_extract_workers", workers,
           "--num_merge_workers", workers]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (folder / "latest_universal").unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ds_to_universal exited {proc.returncode}: {proc.stdout.strip()[-300:]}")
    files, read_back = commit(target, step_of(folder), {})
    log.info("%s: universal copy made in %.1f s, %d files, %.1f MB (hashed as read back)",
             target, time.monotonic() - start, len(files), read_back / 1e6)  # fmt: skip


# ---------------------------------------------------------------- ZeRO-3 load plan


def zero3_model(config, cfg, attn: str):
    """The model created under zero.Init: each parameter is partitioned over the ranks as its module
    is created, in the load dtype, and not initialized (the checkpoint fills every partition).

    The model class is instantiated directly, in the contexts transformers' from_pretrained uses for
    ZeRO-3: from_config would also gather every module once to initialize its weights (a transient
    that measured 0.4x the fp32 model bytes per rank on a 0.6B model)."""
    deepspeed = import_deepspeed()
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:  # keeps torch.arange in its own dtype under the bf16 default (rotary positions); seen missing in 5.17
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:
        import transformers

        raise UserError(
            f"training.strategy deepspeed with zero_stage 3 needs transformers' prevent_arange_dtype_change, which "
            f"transformers {transformers.__version__} lacks: install the locked transformers==5.23.0"
        ) from None

    prepare_deepspeed()
    deepspeed.init_distributed()  # zero.Init partitions over DeepSpeed's view of the process group
    ds_config = deepspeed_config(cfg, dist.get_world_size(), config)
    _KEEP_ALIVE.append(HfDeepSpeedConfig(ds_config))  # transformers' is_deepspeed_zero3_enabled()
    config = AutoConfig.for_model(**config.to_dict() | {"attn_implementation": attn})
    default = torch.get_default_dtype()
    torch.set_default_dtype(compute_dtype(cfg))
    try:
        zero_init = deepspeed.zero.Init(config_dict_or_path=ds_config)
        with no_init_weights(), prevent_arange_dtype_change(), no_init_broadcast(), zero_init:
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    finally:
        torch.set_default_dtype(default)
    model.tie_weights()  # as from_config does after construction: tied embeddings are one parameter
    return model


@contextlib.contextmanager
def no_init_broadcast():
    """zero.Init broadcasts every new parameter from rank 0 before partitioning it, so that random
    inits agree; ours are filled from the checkpoint afterwards, and the broadcast only costs each
    other rank a full-size receive buffer of every tensor (the embedding: 0.15x this 0.6B model's
    fp32 bytes). DeepSpeed 0.19's Init._zero_init_param, without the broadcast."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param

    def partition_only(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        Init._zero_init_param = original


def fill_partitions(model, files) -> None:
    """ZeRO-3: each rank copies its own partition (a range of the flattened tensor) from the files."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = source_key(files, name, param.ds_shape, model)
            part = param.ds_tensor
            start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
            count = max(0, min(part.ds_numel, param.ds_numel - start))
            for at in range(start, start + count, READ_BYTES // part.element_size()):
                end = min(at + READ_BYTES // part.element_size(), start + count)
                part.data[at - start : end - start].copy_(files.read_flat(key, at, end - at))


# ---------------------------------------------------------------- export reader


class DeepSpeedSource:
    """DeepSpeed's own checkpoint parsers (``deepspeed.utils.zero_to_fp32``); every parameter is read
    lazily from the ranks' memory-mapped fp32 partitions. ZeRO-3 through DeepSpeed's lazy mode
    (``GatheredTensor``); ZeRO 1/2 through ``Zero2Param``, because DeepSpeed's lazy mode for them
    first concatenates each group's partitions into one vector, a second copy of the weights."""

    def __init__(self, folder: Path, exclude_frozen: bool):
        import_deepspeed()
        from deepspeed.utils import zero_to_fp32 as z

        self.folder, where = folder, str(folder)
        try:
            # no_grad: the saved partitions require grad, and an autograd graph from a gathered
            # tensor back to them would keep every memory-mapped partition file resident
            with torch.no_grad(), contextlib.redirect_stdout(sys.stderr), mapped_loads():  # they print progress
                models = z.parse_model_states(z.get_model_state_files(where))
                stage, _, flat_groups, paddings = z.parse_optim_states(z.get_optim_files(where), where)
                if stage <= 2:
                    self.tensors = zero2_state_dict(flat_groups, models, paddings, exclude_frozen)
                else:  # DeepSpeed's public lazy mode parses the (memory-mapped) files again: a second or two
                    self.tensors = z.get_fp32_state_dict_from_zero_checkpoint(
                        str(folder.parent), tag=folder.name, exclude_frozen_parameters=exclude_frozen, lazy_mode=True
                    )
        except UserError:
            raise
        except Exception as e:  # the parsers raise bare exceptions on missing or short files
            raise UserError(f"{folder}: unreadable DeepSpeed checkpoint ({type(e).__name__}: {str(e)[:160]})") from None
        self.names = set(self.tensors)
        trim()

    @torch.no_grad()
    def read(self, names) -> dict:
        try:
            return {n: self.tensors[n].contiguous() for n in names}
        except Exception as e:
            raise UserError(f"{self.folder}: unreadable DeepSpeed checkpoint ({type(e).__name__}: {e})") from None

    def release(self, tensors: dict) -> None:
        page_out(chunk for n in tensors for chunk in partition_slices(self.tensors[n]))


@contextlib.contextmanager
def mapped_loads():
    """``torch.load`` memory-maps what it reads. DeepSpeed's ``parse_model_states`` loads each
    model-states file whole to find the buffers and shapes; for ZeRO 1/2 that file holds every weight
    again, in fp32: read whole it was a transient copy of the fp32 weights, twice the bf16 model."""
    load = torch.load
    torch.load = functools.partial(load, mmap=True)
    try:
        yield
    finally:
        torch.load = load


class Zero2Param:
    """A ZeRO 1/2 parameter: ``shape.numel()`` elements from ``start`` of its group's fp32 vector,
    which is the ranks' partitions back to back (memory-mapped; read when ``contiguous()`` is called)."""

    def __init__(self, partitions: list[torch.Tensor], start: int, shape: torch.Size):
        self.partitions, self.start, self.shape = partitions, start, torch.Size(shape)

    def slices(self):
        lo, hi, base = self.start, self.start + self.shape.numel(), 0
        for part in self.partitions:
            a, b = max(lo, base), min(hi, base + part.numel())
            if a < b:
                yield part[a - base : b - base]
            base += part.numel()

    def contiguous(self) -> torch.Tensor:
        return torch.cat(list(self.slices())).view(self.shape)


def zero2_state_dict(flat_groups, models, paddings, exclude_frozen: bool) -> dict:
    """ZeRO 1/2's state dict with the layout of DeepSpeed's ``_zero2_merge_trainable_params``, without
    concatenating the partitions: each group holds its parameters in order, each followed by its
    alignment padding, and the group's total is aligned to 2 x world size."""
    first = models[0]
    state = dict(first.buffers)
    if not exclude_frozen:
        state |= {name: first.frozen_param_fragments[name] for name in first.frozen_param_shapes or {}}
    align = 2 * len(flat_groups)
    for g, shapes in enumerate(first.param_shapes):
        parts = [rank[g] for rank in flat_groups]
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            state[name] = Zero2Param(parts, offset, shape)
            offset += math.prod(shape) + (paddings[g][i] if paddings is not None else 0)
        available = sum(p.numel() for p in parts)
        if -(-offset // align) != -(-available // align):
            raise UserError(f"parameter group {g} needs {offset} elements, the partitions hold {available}")
    for target, source in first.shared_params:
        if source in state:
            state[target] = state[source]
    return state


def partition_slices(t):
    """The slices of memory-mapped partitions a lazy DeepSpeed tensor reads (none for a real tensor)."""
    if isinstance(t, Zero2Param):
        yield from t.slices()
        return
    groups, bounds = getattr(t, "flat_groups", None), getattr(t, "flat_groups_offset", None)
    if groups is None:
        return
    start, end = t.offset, t.offset + t.partitioned_numel  # DeepSpeed's GatheredTensor (ZeRO-3)
    for rank in groups:
        for g, flat in enumerate(rank):
            lo, hi = max(start, int(bounds[g])), min(end, int(bounds[g + 1]))
            if lo < hi:
                yield flat[lo - int(bounds[g]) : hi - int(bounds[g])]
