"""make_soup: average the node models' weights (a "model soup", Wortsman et al. 2022).

- uniform: the mean of every node's weights;
- greedy: nodes sorted by held-out loss, best first; each is added only if the soup's
  held-out loss improves. The held-out set is the shared eval set, so the greedy soup's
  eval numbers are optimistic by the selection; the uniform soup's are not.
Both are saved as Hugging Face folders and evaluated like any other model. The weights are
averaged in fp32 and saved in the node models' dtype (consolidate.dtype); the greedy soup's
held-out losses are those of the weights as they will be saved, computed in fp32.
A soup is streamed tensor by tensor from the node models' safetensors (positioned reads, as
training loads its base) to safetensors: the nodes' weights are never all in memory; the one
whole model held is the greedy soup's fp32 candidate, which its held-out loss needs.
Each soup gets a model card (README.md: model_card.write_soup_card), its base the one the node models' cards name.
"""

import argparse
import json
import math
from contextlib import closing, suppress
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from workflow_scripts.core.pipeline_io import UserError, cli, write_json
from workflow_scripts.evals.heldout import heldout_loss
from workflow_scripts.export.model_card import write_soup_card
from workflow_scripts.model.weights import (
    MAX_SHARD_SIZE,
    CheckpointFiles,
    dtype_name,
    parse_size,
    stored_dtype,
    stream,
    write_sharded,
)


class MeanSource:
    """The element-wise fp32 mean of the same tensor in every node model, read like a checkpoint
    (weights.stream, a batch of tensors at a time)."""

    def __init__(self, files: list[CheckpointFiles]):
        self.files = files
        self.shapes = {n: torch.Size(files[0].shape(n)) for n in files[0].tensors}  # the first node's order
        for f in files[1:]:
            if {n: torch.Size(f.shape(n)) for n in f.tensors} != self.shapes:
                self.close()
                raise UserError(f"model soup: {f.folder} differs in architecture from {files[0].folder}")

    def read(self, names) -> dict:
        """Summed in fp32 in the nodes' order, then divided: bit for bit torch.stack(...).mean(0), without the
        stack (a tensor in fp32 and one node's copy in its own dtype at a time, whatever the number of nodes)."""

        def tensor(f, name):
            return f.read_flat(name, 0, math.prod(f.shape(name))).view(f.shape(name))

        out = {}
        for n in names:
            total = tensor(self.files[0], n).float()
            for f in self.files[1:]:
                total.add_(tensor(f, n))
            out[n] = total.div_(len(self.files))
        return out

    def release(self, tensors: dict) -> None:
        tensors.clear()

    def close(self) -> None:
        for f in self.files:
            f.close()


def soup_of(models: list[Path], members: list[str]) -> MeanSource:
    """The mean of the node models named in ``members``, summed in that order."""
    folders = {m.name: m for m in models}
    return MeanSource([CheckpointFiles(folders[m]) for m in members])


def models_dtype(models: list[Path]) -> torch.dtype:
    """The dtype the node models are stored in (fp32 if they disagree)."""
    dtypes = {stored_dtype(str(m)) for m in models}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def save(
    source: MeanSource, template: Path, out: Path, record: dict, dtype: torch.dtype, models: list[Path] = ()
) -> None:
    """The soup as a Hugging Face folder: ``dtype`` safetensors, the first node's config, generation
    config and tokenizer, ``record`` (its members, the greedy trail) as soup.json, and a model card (README.md,
    its base the one the node ``models``' cards name)."""
    out.mkdir(parents=True, exist_ok=True)
    with closing(source):
        write_sharded(source, source.shapes, out, parse_size(MAX_SHARD_SIZE), dtype)
    config = AutoConfig.from_pretrained(template)
    config.dtype = dtype_name(dtype)
    config.save_pretrained(out)
    with suppress(OSError):  # a node model without a generation config: the soup has none either
        GenerationConfig.from_pretrained(template).save_pretrained(out)
    AutoTokenizer.from_pretrained(template).save_pretrained(out)
    write_json(out / "soup.json", record)
    write_soup_card(out, list(models), record["members"])


@torch.no_grad()
def held_out_loss(model, source: MeanSource, tokenizer, frame: pd.DataFrame, dtype: torch.dtype) -> float:
    """evaluate_model's eval_loss of the soup as it will be saved (rounded to ``dtype``), computed in fp32
    in ``model``, whose weights it overwrites."""
    target = model.state_dict()
    with closing(source):
        for name, tensor in stream(source, source.shapes):
            if name not in target:
                raise UserError(f"model soup: {name} of the node models is no parameter of {type(model).__name__}")
            target[name].copy_(tensor.to(dtype))
    return heldout_loss(model.eval(), tokenizer, frame)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", required=True, type=Path, help="models/node<i> folders")
    p.add_argument("--results", nargs="+", required=True, type=Path, help="eval/node<i>.json, same order")
    p.add_argument("--eval", required=True, type=Path, help="tokenized eval set")
    p.add_argument("--uniform", required=True, type=Path)
    p.add_argument("--greedy", required=True, type=Path)
    a = p.parse_args(argv)
    names = [m.name for m in a.models]
    losses = {json.loads(r.read_text())["model"]: json.loads(r.read_text())["eval_loss"] for r in a.results}
    tokenizer = AutoTokenizer.from_pretrained(a.models[0])
    template, dtype = a.models[0], models_dtype(a.models)

    save(soup_of(a.models, names), template, a.uniform, {"members": names}, dtype, a.models)

    frame = pd.read_parquet(a.eval)
    order = sorted(names, key=lambda n: losses[n])
    members, best = [order[0]], losses[order[0]]
    trail = [{"added": order[0], "loss": best}]
    model = AutoModelForCausalLM.from_pretrained(template, dtype=torch.float32) if len(order) > 1 else None
    for name in order[1:]:
        loss = held_out_loss(model, soup_of(a.models, [*members, name]), tokenizer, frame, dtype)
        trail.append({"tried": name, "loss": loss, "kept": loss < best})
        if loss < best:
            members, best = [*members, name], loss
    del model
    save(soup_of(a.models, members), template, a.greedy, {"members": members, "trail": trail}, dtype, a.models)
    print(f"uniform soup of {names}; greedy soup of {members} (held-out loss {best:.4f})")


if __name__ == "__main__":
    main()
