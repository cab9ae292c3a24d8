"""consolidate_node: turn a node's final training checkpoint into a Hugging Face model folder.

Each strategy's checkpoint is read through its own export reader (parallel/: DDP's
``state.pt`` memory-mapped, FSDP2's torch.distributed.checkpoint folder, DeepSpeed's
``zero_to_fp32`` lazily). The weights are written in consolidate.dtype: ``base`` (the
default) is the base model's own dtype (``stored_dtype``: bf16 for most hub models, fp32
for the demo and from-scratch presets), or fp32/bf16/fp16. The training-side model is
rebuilt without weights (on the meta device) and its parameters are the checkpoint's
(fp32) tensors rounded once to that dtype, read a few megabytes at a time (in fp32 they
*are* the checkpoint's tensors, no copy); its logits on fixed inputs are the reference.
The weights are then streamed from that model to safetensors one tensor at a time
(``model-0000i-of-0000n.safetensors`` and an index when there is more than one),
handing the pages of memory-mapped files back to the kernel as it goes, so the peak
stays near one copy of the weights in the written dtype, not the three or four that
loading a whole state dict into a model and saving it takes. With LoRA the base is
loaded, the adapter merged into it layer by layer in fp32 and each merged weight rounded
to the written dtype; the adapter itself is saved in peft format (``adapter/``), fp32 as
trained, beside the merged model.

The stage checks its own result, one model in memory at a time: the saved folder,
reloaded with ``from_pretrained`` in the written dtype, gives the training-side model's
logits; every LoRA B matrix is present and non-zero; a short generation runs. A truncated
or corrupt checkpoint fails with one line naming it. Peak RSS per phase goes to
consolidation.json.

The check compares at the precision written. Both models hold their weights in the
written dtype and run in fp32 on the CPU (``fp32_compute`` upcasts each module's weights
for its own forward only), so the reference is the training-side model with its weights
rounded to the written dtype, and the reloaded folder should give bit-identical logits:
the tolerance (1e-5) stays the fp32 one. Comparing with the unrounded fp32 model instead
would need a tolerance as large as bf16 rounding moves the logits (7e-3 on the demo
model's logits, which are of order 1), large enough to hide a wrong tensor. In fp32
nothing is upcast and the path is the one fp32 consolidation always took.

The folder carries the template training used (data.chat_template, data.format_template, or the
base tokenizer's own) as the tokenizer's chat template, and a generation config that stops at the
end-of-turn tokens (``eos_token_id``), pads with the EOS when there is no pad token, and holds
data.template_kwargs as ``chat_template_kwargs``: ``apply_chat_template`` and ``pipeline`` on it
render and stop as training did.

Each folder written (the model, and the LoRA adapter) gets a model card, README.md (model_card.py): the base it
was trained from, how it was trained, the lines that load it. The adapter's adapter_config.json names its base
by the hub id and commit when it came from the hub, else by its absolute path, so that it loads from anywhere.

With eval.checkpoints all or every_n each scored checkpoint is consolidated the same way (``--checkpoint``: that
step's folder instead of the last), and with consolidate.select ``best:<metric>`` the exported model is the
scored checkpoint best on that metric (``--select-from``: their results; checkpoint_select.best_step), recorded
in consolidation.json as ``selected`` (its step, of how many steps, the metric, its value, the candidates).

Before anything is read, the checkpoint's files are checked against the sizes and sha256 its
COMPLETE marker lists (manifest.py): a damaged one stops the stage with one line naming the file.
"""

import argparse
import contextlib
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from workflow_scripts.core.host_memory import PeakRSS, map_large_allocations, page_out
from workflow_scripts.core.layout import matching
from workflow_scripts.core.pipeline_io import UserError, cli, umask_modes, write_json
from workflow_scripts.core.settings import ConsolidateConfig
from workflow_scripts.evals.checkpoint_select import best_step, selection_text
from workflow_scripts.export.model_card import adapter_base, base_of, write_cards
from workflow_scripts.model.weights import (
    DTYPES,
    MAX_SHARD_SIZE,
    SAFETENSORS_CODES,
    dtype_name,
    header_dtypes,
    parse_size,
    stored_dtype,
    stream,
    write_sharded,
)
from workflow_scripts.train.manifest import MARKER
from workflow_scripts.train.manifest import verify as verify_checkpoint
from workflow_scripts.train.parallel import strategy_for


@contextlib.contextmanager
def fp32_compute(model):
    """Run ``model`` in fp32 whatever dtype it holds its weights in: each module's own parameters and
    buffers that are bf16 or fp16 are replaced by fp32 copies for the time of its forward, and put back
    after. The logits are those of the model cast to fp32 (bit for bit), while at most one module's
    weights are held twice. A model held in fp32 gets no hooks at all."""
    stacks: dict[int, list] = {}

    def low(t) -> bool:
        return t is not None and t.is_floating_point() and t.dtype != torch.float32

    def upcast(module, args):
        held = []
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if low(t):
                    held.append((store, name, t))
                    up = t.detach().float()
                    store[name] = torch.nn.Parameter(up, requires_grad=False) if store is module._parameters else up
        stacks.setdefault(id(module), []).append(held)

    def restore(module, args, output):
        for store, name, t in stacks[id(module)].pop():
            store[name] = t

    handles = []
    for module in model.modules():
        if any(low(t) for t in [*module._parameters.values(), *module._buffers.values()]):
            handles += [module.register_forward_pre_hook(upcast), module.register_forward_hook(restore)]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------- checkpoint readers


class ModelSource:
    """A model in memory, read like a checkpoint (the merged LoRA model, the training-side model)."""

    def __init__(self, model):
        self.tensors = model.state_dict()
        self.names = set(self.tensors)

    def read(self, names) -> dict:
        return {n: self.tensors[n] for n in names}

    def release(self, tensors: dict) -> None:
        page_out(tensors.values())  # tensors memory-mapped from a file (DDP's, the base model's)


def open_source(state: dict, folder: Path, shapes: dict[str, torch.Size]):
    """The reader of the strategy that wrote the checkpoint (parallel/: Strategy.export_source)."""
    return strategy_for(state["strategy"]).export_source(folder, shapes, exclude_frozen=state["peft"] == "lora")


# ---------------------------------------------------------------- models


def rebuild(state: dict, dtype: torch.dtype = torch.float32):
    """The LoRA model as training built it: the base weights, wrapped by peft (the adapter in fp32).

    The base is held in ``dtype``: training's fp32 copy of a bf16 base holds the same values."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(state["base_model"], dtype=dtype)
    cfg = state["config"]
    return get_peft_model(
        model,
        LoraConfig(
            r=cfg["lora_r"],
            lora_alpha=cfg["lora_alpha"],
            lora_dropout=cfg["lora_dropout"],
            target_modules=list(cfg["lora_target_modules"]),
            task_type="CAUSAL_LM",
        ),
    )


@torch.no_grad()
def merge_lora(model, dtype: torch.dtype):
    """The merged model, its weights in ``dtype``: each LoRA layer's base weight is merged in fp32 (the
    base weight upcast, plus B @ A x scale) and rounded once, one layer at a time; then the other
    parameters are cast to ``dtype`` (buffers such as the rotary tables stay as they are, as
    from_pretrained keeps them). In fp32 this is peft's merge_and_unload, nothing else."""
    import warnings

    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            weight.data = weight.data.float()
            module.merge()
            weight.data = weight.data.to(dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="All adapters are already merged")
        merged = model.merge_and_unload()  # every layer merged above: unwraps them
    cast_parameters(merged, dtype)
    return merged


@torch.no_grad()
def cast_parameters(model, dtype: torch.dtype) -> None:
    """Floating parameters to ``dtype`` one at a time, in place (a no-op for those already in it)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def empty_model(config, dtype: torch.dtype = torch.float32):
    """The architecture without weights: parameters on the meta device, buffers (rotary tables) real and
    made as ``from_pretrained(dtype=dtype)`` makes them (the reloaded folder's)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def hf_tensors(config) -> tuple[dict[str, torch.Size], set[str]]:
    """Shapes of the tensors a Hugging Face folder of ``config`` holds (tied weights once), and all state names."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes, seen, everything = {}, set(), set()
    for name, t in skeleton.state_dict(keep_vars=True).items():
        everything.add(name)
        if id(t) not in seen:
            seen.add(id(t))
            shapes[name] = t.shape
    return shapes, everything


def check_names(source, needed, allowed, where: str) -> None:
    """Every tensor the model needs is in the checkpoint, and the checkpoint has nothing the model lacks."""
    missing = sorted(set(needed) - source.names)
    if missing:
        raise UserError(f"{where}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    unexpected = sorted(source.names - set(allowed))
    if unexpected:
        raise UserError(f"{where}: checkpoint has tensors the model does not, e.g. {unexpected[0]}")


@torch.no_grad()
def assign(model, tensors, dtype: torch.dtype = torch.float32) -> None:
    """Make the checkpoint's tensors, in ``dtype``, the model's parameters (in fp32 the tensors themselves,
    no copy; else each rounded once), then re-tie shared weights."""
    for name, t in tensors:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        t = t.to(dtype)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[attr] = t
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise UserError(f"checkpoint left {len(left)} parameter(s) without weights, e.g. {left[0]}")


@torch.no_grad()
def copy_in(model, tensors) -> None:
    """Copy tensors into ``model``'s existing parameters (the LoRA adapter into the peft model)."""
    target = model.state_dict()
    for name, t in tensors:
        target[name].copy_(t)


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
    """Logits computed in fp32, whatever dtype the model holds its weights in (fp32_compute)."""
    model.eval()
    with fp32_compute(model):
        return model(input_ids=ids).logits.float()


def save_metadata(base: str, output: Path, template: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
    """config (its dtype the weights'), generation config and tokenizer of the base model, beside the
    weights, with the training's template (``template``: chat_template, format_template, template_kwargs;
    see tokenization_metadata)."""
    config = AutoConfig.from_pretrained(base)
    config.dtype = dtype_name(dtype)
    config.save_pretrained(output)
    try:
        generation = GenerationConfig.from_pretrained(base)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenization_metadata(tokenizer, generation, base, **(template or {}))
    generation.save_pretrained(output)
    tokenizer.save_pretrained(output)


def tokenization_metadata(
    tokenizer,
    generation,
    base: str,
    chat_template: str | None = None,
    format_template: str | None = None,
    template_kwargs: dict | None = None,
) -> None:
    """The tokenizer gets the chat template training used; the generation config stops at its
    end-of-turn tokens (and the base's own EOS ids), pads with the EOS when there is no pad token,
    and carries the template arguments as ``chat_template_kwargs``."""
    from workflow_scripts.data.chat_render import generation_settings, use_template

    use_template(tokenizer, base, chat_template, format_template, required=False)
    settings = generation_settings(tokenizer, template_kwargs)
    own = generation.eos_token_id
    own = [] if own is None else own if isinstance(own, list) else [own]
    stops = list(dict.fromkeys(settings["eos_token_id"] + own))
    if stops:
        generation.eos_token_id = stops if len(stops) > 1 else stops[0]
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [None])[0]
    if settings["chat_template_kwargs"]:
        generation.chat_template_kwargs = settings["chat_template_kwargs"]
    generation._from_model_config = False  # set here, not the model config's: loaded as written, extra keys kept


def consolidate(
    state: dict,
    output: Path,
    max_shard_size: str = MAX_SHARD_SIZE,
    peaks: PeakRSS | None = None,
    template: dict | None = None,
    dtype: str = "base",
):
    """Write the HF folder in ``dtype`` (consolidate.dtype); return (report, fixed input ids, the
    training-side model's logits on them, its weights rounded to the written dtype)."""
    peaks = peaks or PeakRSS()
    folder = Path(state["checkpoint"])
    if not (folder / MARKER).is_file():
        raise UserError(f"{folder}: checkpoint is missing or incomplete (no {MARKER} marker)")
    if problem := verify_checkpoint(folder):  # every file's size and sha256, as written
        raise UserError(
            f"{folder}: damaged checkpoint, not consolidated: {problem} (delete this node's train_state.json"
            " and rerun: training resumes from its newest good checkpoint)"
        )
    max_bytes = parse_size(max_shard_size)
    report = {"checkpoint": str(folder), "strategy": state["strategy"], "peft": state["peft"], "step": state["step"]}
    base_dtype = stored_dtype(state["base_model"])
    target = base_dtype if dtype == "base" else DTYPES[dtype]
    report["dtype"] = dtype_name(target)
    output.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(state["base_model"])
    shapes, allowed = hf_tensors(config)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    with peaks.phase("training_side_model"):
        if state["peft"] == "lora":
            # the checkpoint holds the adapter only; the merged model is the base plus B @ A
            # the base in its own dtype holds what training's fp32 copy of it held; else in fp32
            model = rebuild(state, base_dtype if base_dtype == target else torch.float32)
            trainable = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
            source = open_source(state, folder, trainable)
            check_names(source, trainable, model.state_dict(), str(folder))
            copy_in(model, stream(source, trainable))
            report["lora_b_tensors"] = check_lora(model)
            model.save_pretrained(output / "adapter")
            adapter_base(output / "adapter", base_of(state["base_model"]))  # its base named to load from anywhere
            umask_modes(output / "adapter")  # safetensors writes adapter_model.safetensors 0600
            model = merge_lora(model, target)
        else:
            # the checkpoint's tensors become the parameters of a weightless model of the base's architecture
            source = open_source(state, folder, shapes)
            check_names(source, shapes, allowed, str(folder))
            model = empty_model(config, target)
            assign(model, stream(source, shapes), target)
        expected = logits_on(model, ids)
    with peaks.phase("write"):
        report["weight_files"] = write_sharded(ModelSource(model), shapes, output, max_bytes, target)
        save_metadata(state["base_model"], output, template, target)
    return report, ids, expected


def verify(output: Path, ids: torch.Tensor, expected: torch.Tensor, tolerance: float) -> dict:
    """Reload what was written, in the dtype its config names (every safetensors header must say the
    same): the same logits as the training-side model (both computed in fp32 from the written precision,
    see the module's docstring), and a short generation runs."""
    dtype = AutoConfig.from_pretrained(output).dtype or torch.float32
    codes = sorted(header_dtypes(output))
    if codes != [SAFETENSORS_CODES[dtype]]:
        raise UserError(f"{output}: safetensors hold {', '.join(codes)}; config.json says {dtype_name(dtype)}")
    reloaded = AutoModelForCausalLM.from_pretrained(output, dtype=dtype)
    diff = (logits_on(reloaded, ids) - expected).abs().max().item()
    if not diff <= tolerance:  # a NaN fails too
        raise UserError(f"{output}: reloaded model's logits differ by {diff:.2e} (> {tolerance})")
    pad = reloaded.generation_config.pad_token_id
    with torch.no_grad(), fp32_compute(reloaded):
        sample = reloaded.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=pad)
    return {"max_logit_diff": diff, "generation_ok": sample.shape[1] > 4}


def scored_checkpoints(state: dict, output: Path) -> list[Path]:
    """The results of the model's scored checkpoints of its current run key (eval.checkpoints all/every_n), found by
    the layout beside the model folder (results/<run>/models/<model> -> results/<run>/eval/checkpoints/...)."""
    key = Path(state["checkpoint"]).parent.name
    found = matching(output.parent.parent, "CHECKPOINT_EVAL", node=output.name, key=key, step="*")
    return [p for p in found if p.stem.split("-")[-1].isdigit()]  # not step-<N>.lm_eval.json


def select_checkpoint(state: dict, results: list[Path], metric: str) -> tuple[dict, dict]:
    """The state pointed at the scored checkpoint best on ``metric`` (results: eval/checkpoints/<model>/<key>/
    step-<N>.json, each beside the folder step-<N> of the checkpoint root), and the record of the choice."""
    scores = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in results}
    step, value = best_step(scores, metric)
    root = Path(state["checkpoint"]).parent
    selected = {"step": step, "last_step": state["step"], "candidates": len(scores), "metric": metric,
                "value": value, "checkpoint": str(root / f"step-{step}")}  # fmt: skip
    return state | {"checkpoint": selected["checkpoint"], "step": step}, selected


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", required=True, type=Path, help="train_state.json of the node")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, help="safetensors shard size, e.g. 2GB or 500MB")
    p.add_argument("--config", default="{}", help="its config keys as JSON (settings.ConsolidateConfig)")
    p.add_argument("--checkpoint", type=Path, help="this checkpoint folder (a step-<N>) instead of the last")
    p.add_argument("--select-from", nargs="*", default=[], type=Path, help="consolidate.select best: the results")
    a = p.parse_args(argv)
    cfg = ConsolidateConfig.from_json(a.config)
    map_large_allocations()
    state = json.loads(a.state.read_text())
    selected = None
    if a.checkpoint is not None:
        state = state | {"checkpoint": str(a.checkpoint), "step": int(a.checkpoint.name.split("-")[-1])}
    elif cfg.select != "last":
        scored = a.select_from or scored_checkpoints(state, a.output)
        if not scored:
            raise UserError(f"consolidate.select {cfg.select}: {a.output.name} has no scored checkpoint")
        state, selected = select_checkpoint(state, scored, cfg.select.partition(":")[2])
    peaks = PeakRSS()
    template = {key: getattr(cfg, key) for key in ("chat_template", "format_template", "template_kwargs")}
    report, ids, expected = consolidate(state, a.output, a.max_shard_size, peaks, template, cfg.dtype)
    with peaks.phase("reload_check"):  # one model in memory at a time: the training side is gone
        report |= verify(a.output, ids, expected, a.tolerance)
    report["peak_rss_mb"] = peaks.phases
    if selected is not None:
        report["selected"] = selected
    write_cards(a.output, state, a.state.parent, report)  # README.md: the model card (model_card.py)
    write_json(a.output / "consolidation.json", report)
    print(
        f"{a.output}: consolidated from {report['checkpoint']} in {report['dtype']}"
        f" (max logit diff {report['max_logit_diff']:.1e})"
        + (f"; {selection_text(a.output.name, selected)}" if selected else "")
    )


if __name__ == "__main__":
    main()
