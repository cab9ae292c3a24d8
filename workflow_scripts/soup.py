"""make_soup: average the node models' weights (a "model soup", Wortsman et al. 2022).

- uniform: the mean of every node's weights;
- greedy: nodes sorted by held-out loss, best first; each is added only if the soup's
  held-out loss improves. The held-out set is the shared eval set, so the greedy soup's
  eval numbers are optimistic by the selection; the uniform soup's are not.
Both are saved as Hugging Face folders and evaluated like any other model. The weights are
averaged in fp32 and saved in the node models' dtype (consolidate.dtype); the greedy soup's
held-out losses are those of the weights as they will be saved, computed in fp32.
"""

import argparse
import json
from pathlib import Path

import pandas as pd
import torch
from consolidate import stored_dtype
from evaluation import heldout_loss
from pipeline_io import UserError, cli, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_state(path: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def average(states: list[dict]) -> dict:
    """Element-wise mean in fp32; every state must have the same keys and shapes."""
    keys = states[0].keys()
    for s in states[1:]:
        if s.keys() != keys or any(s[k].shape != states[0][k].shape for k in keys):
            raise UserError("model soup: the node models differ in architecture")
    return {k: torch.stack([s[k].float() for s in states]).mean(0) for k in keys}


def models_dtype(models: list[Path]) -> torch.dtype:
    """The dtype the node models are stored in (fp32 if they disagree)."""
    dtypes = {stored_dtype(str(m)) for m in models}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def as_saved(state: dict, template: Path, dtype: torch.dtype):
    """The model ``template`` with the fp32 weights ``state`` rounded to ``dtype``, as save writes them."""
    model = AutoModelForCausalLM.from_pretrained(template, dtype=dtype)
    model.load_state_dict(state)
    return model


def save(state: dict, template: Path, tokenizer, out: Path, members: list[str], dtype=torch.float32) -> None:
    as_saved(state, template, dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_json(out / "soup.json", {"members": members})


def held_out_loss(state: dict, template: Path, frame: pd.DataFrame, tokenizer, dtype=torch.float32) -> float:
    """evaluate_model's eval_loss of the soup as it will be saved, computed in fp32."""
    return heldout_loss(as_saved(state, template, dtype).float().eval(), tokenizer, frame)


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
    states = {m.name: load_state(m) for m in a.models}
    tokenizer = AutoTokenizer.from_pretrained(a.models[0])
    template, dtype = a.models[0], models_dtype(a.models)

    save(average(list(states.values())), template, tokenizer, a.uniform, names, dtype)

    frame = pd.read_parquet(a.eval)
    order = sorted(names, key=lambda n: losses[n])
    members, best = [order[0]], losses[order[0]]
    trail = [{"added": order[0], "loss": best}]
    for name in order[1:]:
        soup = average([states[m] for m in [*members, name]])
        loss = held_out_loss(soup, template, frame, tokenizer, dtype)
        trail.append({"tried": name, "loss": loss, "kept": loss < best})
        if loss < best:
            members, best = [*members, name], loss
    save(average([states[m] for m in members]), template, tokenizer, a.greedy, members, dtype)
    write_json(a.greedy / "soup.json", {"members": members, "trail": trail})
    print(f"uniform soup of {names}; greedy soup of {members} (held-out loss {best:.4f})")


if __name__ == "__main__":
    main()
