"""The planner at the seeds' sizes: plan_training's GPU and host plan of every config/examples file (each
model from its config.json only), against an independent byte count by hand (tests/model_shapes.by_hand).

    .venv/bin/python bench/plan_examples.py                     # the formula's activations (--probe-timeout 0)
    .venv/bin/python bench/plan_examples.py --probe-timeout 900 # the fake-tensor probe of the training step

Host memory is checked against the TRAIN_MEM_MB of the example's header (profiles/slurm's 200000 without one).
Prints a markdown table (docs/benchmarks/planner.md, "Planner at the seeds' sizes").
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def plan_example(name: str, timeout: float, **training) -> tuple[dict, dict, float]:
    """(the planner's plan, the count by hand, seconds) of config/examples/<name>, with ``training`` keys changed."""
    from model_shapes import by_hand, config_folder
    from test_examples import header_command, load, with_defaults

    from workflow_scripts.core.settings import PlanConfig
    from workflow_scripts.plan.preflight import Planner

    config = with_defaults(load(name))
    config["training"] |= training
    mem_mb = int(header_command(name)[0].get("TRAIN_MEM_MB", 200000))
    with tempfile.TemporaryDirectory() as tmp:
        model = config_folder(config["model"]["name_or_path"], config, Path(tmp))
        t = PlanConfig.from_json(PlanConfig.to_json(config))
        start = time.perf_counter()
        planner = Planner(model, t, timeout, mem_mb)
        plan = planner.plan(t)
        seconds = time.perf_counter() - start
    return plan, by_hand(config, plan["parameters"]), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe-timeout", type=float, default=0)
    p.add_argument("examples", nargs="*")
    a = p.parse_args()
    names = a.examples or sorted(p.name for p in (REPO / "config" / "examples").glob("*.yaml"))
    from workflow_scripts.plan.preflight import live_gb

    print("| example | params (B) | GPU GiB planned / usable | tensors planned | by hand | plan / hand | "
          "host GiB per node: at load, "
          "in training / job | offloaded: planned / by hand | fits | plan s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for name in names:
        plan, hand, seconds = plan_example(name, a.probe_timeout)
        host = plan["host"]
        print(
            f"| {name} | {plan['parameters'] / 1e9:.2f} | {plan['total_gb']:.1f} / {plan['gpu_memory_gb']} | "
            f"{live_gb(plan):.1f} | {hand['tensors_gb']:.1f} | {live_gb(plan) / hand['tensors_gb']:.2f} | "
            f"{host['at_load_gb']:.0f}, "
            f"{host['in_training_gb']:.0f} / {host['memory_gb']:.0f} | "
            f"{host['in_training_gb'] - 1.5 * host['ranks_per_node']:.0f} / {hand['host_gb']:.0f} | "
            f"{'yes' if plan['fits'] else 'NO'} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
