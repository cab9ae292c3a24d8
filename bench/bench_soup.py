"""make_soup's memory: the streamed soup against the whole-state-dict soup it replaced (2026-11-25).

    .venv/bin/python bench/bench_soup.py --workdir /tmp/bench_soup              # 3 nodes of the Qwen3-0.6B shape
    .venv/bin/python bench/bench_soup.py --workdir /tmp/bench_soup --nodes 2

bench_eval.py's randomly initialised Qwen3-0.6B-shaped model (596M parameters, bf16 safetensors, a word-level
tokenizer) and synthetic held-out set (8 examples); --nodes node models made from it by adding different
noise to every tensor, saved in bf16 as consolidation writes them. Each soup runs in its own process under
/usr/bin/time (peak RSS = its maximum resident set, wall time), on the same node models and held-out set:
  streamed  workflow_scripts/export/soup.py: the uniform soup streamed from the nodes' safetensors to safetensors,
            the greedy soup's candidates streamed into one fp32 model for their held-out loss
  before    the soup.py of 6faf679 (LEGACY below, its algorithm verbatim): every node's fp32 state dict in
            memory, their mean, the template model in the saving dtype, its fp32 copy for the loss
Both write the same files (the bench checks the uniform and greedy weights are equal, and the same trail).
The ratio is peak RSS over the fp32 bytes of one model (4 x parameters), and streamed / before.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

LEGACY = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import pandas as pd, torch
from workflow_scripts.evals.heldout import heldout_loss
from workflow_scripts.model.weights import stored_dtype
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_state(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def average(states):
    return {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[0]}


def as_saved(state, template, dtype):
    model = AutoModelForCausalLM.from_pretrained(template, dtype=dtype)
    model.load_state_dict(state)
    return model


def save(state, template, tokenizer, out, members, dtype):
    as_saved(state, template, dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "soup.json").write_text(json.dumps({"members": members}))


models = [Path(m) for m in sys.argv[2].split(",")]
losses, frame, uniform, greedy = json.loads(sys.argv[3]), sys.argv[4], Path(sys.argv[5]), Path(sys.argv[6])
names = [m.name for m in models]
states = {m.name: load_state(m) for m in models}
tokenizer = AutoTokenizer.from_pretrained(models[0])
template, dtype = models[0], stored_dtype(str(models[0]))
save(average(list(states.values())), template, tokenizer, uniform, names, dtype)
frame = pd.read_parquet(frame)
order = sorted(names, key=lambda n: losses[n])
members, best = [order[0]], losses[order[0]]
trail = [{"added": order[0], "loss": best}]
for name in order[1:]:
    soup = average([states[m] for m in [*members, name]])
    loss = heldout_loss(as_saved(soup, template, dtype).float().eval(), tokenizer, frame)
    trail.append({"tried": name, "loss": loss, "kept": loss < best})
    if loss < best:
        members, best = [*members, name], loss
save(average([states[m] for m in members]), template, tokenizer, greedy, members, dtype)
(greedy / "soup.json").write_text(json.dumps({"members": members, "trail": trail}))
"""


def node_models(work: Path, nodes: int) -> tuple[list[Path], int]:
    """--nodes copies of the base, each with its own noise on every tensor (bf16, one safetensors file)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    base = work / "model"
    state = load_file(base / "model.safetensors")
    parameters = sum(t.numel() for t in state.values())
    paths = []
    for i in range(nodes):
        path = work / f"node{i}"
        if not (path / "model.safetensors").exists():
            shutil.copytree(base, path, dirs_exist_ok=True)
            g = torch.Generator().manual_seed(i + 1)
            noisy = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}
            save_file(noisy, path / "model.safetensors", metadata={"format": "pt"})
            del noisy
        paths.append(path)
    return paths, parameters


def timed(cmd: list[str], env: dict) -> dict:
    """Peak RSS (MB) and wall time of a command, by /usr/bin/time."""
    proc = subprocess.run(["/usr/bin/time", "-f", "PEAK %M %e", *cmd], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("PEAK ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{cmd[1]}: failed\n{proc.stderr[-4000:]}")
    _, kb, seconds = lines[-1].split()
    return {"peak_mb": int(kb) / 1024, "seconds": float(seconds)}


def same_soups(work: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    for soup in ("uniform", "greedy"):
        a, b = (load_file(work / f"{v}-{soup}" / "model.safetensors") for v in ("before", "streamed"))
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return False
    trails = [json.loads((work / f"{v}-greedy" / "soup.json").read_text()) for v in ("before", "streamed")]
    return trails[0] == trails[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    from bench_eval import build

    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench_soup_"))
    work.mkdir(parents=True, exist_ok=True)
    build(work, "qwen3-0.6b", examples=8, prompt=64)
    models, parameters = node_models(work, a.nodes)
    losses = {m.name: 1.0 + i for i, m in enumerate(models)}  # node0 first: the greedy soup tries the others
    results = []
    for m in models:
        (work / f"{m.name}.json").write_text(json.dumps({"model": m.name, "eval_loss": losses[m.name]}))
        results.append(str(work / f"{m.name}.json"))
    (work / "legacy_soup.py").write_text(LEGACY)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    eval_ = str(work / "eval.parquet")
    rows = {}
    streamed = [sys.executable, "-m", "workflow_scripts.export.soup", "--models", *map(str, models),
                "--results", *results, "--eval", eval_, "--uniform", str(work / "streamed-uniform"),
                "--greedy", str(work / "streamed-greedy")]  # fmt: skip
    before = [sys.executable, str(work / "legacy_soup.py"), str(REPO),
              ",".join(map(str, models)), json.dumps(losses), eval_, str(work / "before-uniform"),
              str(work / "before-greedy")]  # fmt: skip
    start = time.perf_counter()
    for name, cmd in (("streamed", streamed), ("before", before)):
        rows[name] = timed(cmd, env)
        print(name, rows[name], flush=True)
    fp32_mb = 4 * parameters / 2**20
    print(f"\nQwen3-0.6B shape ({parameters / 1e6:.1f}M parameters, bf16 node models, fp32 {fp32_mb:,.0f} MB), "
          f"{a.nodes} nodes, {time.perf_counter() - start:.0f} s; the same soups: {same_soups(work)}\n")  # fmt: skip
    print("| make_soup | peak RSS MB | x fp32 model | wall s |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['peak_mb']:,.0f} | {r['peak_mb'] / fp32_mb:.2f} | {r['seconds']:.1f} |")
    print(f"\nratio streamed / before: peak RSS {rows['streamed']['peak_mb'] / rows['before']['peak_mb']:.2f}x, "
          f"wall {rows['streamed']['seconds'] / rows['before']['seconds']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
