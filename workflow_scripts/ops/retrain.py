"""make retrain: train one node's model again from step 0, then what depends on it, then the report.

A training job that reruns on a finished config trains nothing (checkpoint.Checkpointer.resume): a re-made
plan, a new environment check or a moved checkout is no reason to spend GPU-hours again. To train again from
step 0 (a run you doubt, a node whose hardware failed), this moves the node's checkpoints aside,
results/<run>/checkpoints/<node> -> <node>.before-retrain-<UTC time> (same file system: no copy; delete it once
the new model is good), then runs

    snakemake <args> --configfile <config> -R results/<run>/train/<node>/train_state.json
    snakemake --report results/<run>/report.html --configfile <config>

so the node's training, consolidation and evaluation, the summary and the report pages run again, and nothing
of the other nodes. <args>: the profile (`--profile profiles/slurm`) or `--cores all`. A trainer still
running on those checkpoints stops it first, with one line, moving nothing.
"""

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from workflow_scripts.core.layout import RESULTS, VARIANT_FILES
from workflow_scripts.core.pipeline_io import UserError, cli
from workflow_scripts.train.trainer_lock import running_holder

NODE = re.compile(r"node\d+|joint")


def run_of(config: Path) -> str:
    """The `run:` of a config file, one line naming the file where there is none."""
    try:
        loaded = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{config}: cannot be read ({e})") from e
    if not isinstance(loaded, dict) or not loaded.get("run"):
        raise UserError(f"{config} has no run:")
    return str(loaded["run"])


def node_paths(run: str, node: str, variant: str | None = None) -> tuple[Path, str, str]:
    """The node's checkpoint folder, its train_state.json (the target that reruns it) and the run's report."""
    if not NODE.fullmatch(node):
        raise UserError(f"NODE={node}: not a trained model's name (node0, node1, ... or joint)")
    results = RESULTS.format(run=run)
    where = f"{results}/{variant}" if variant else results
    checkpoints = Path(f"{where}/{VARIANT_FILES['CHECKPOINTS'].format(node=node)}")
    return checkpoints, f"{where}/{VARIANT_FILES['TRAIN_STATE'].format(node=node)}", f"{results}/report.html"


def set_aside(checkpoints: Path, now: float) -> Path | None:
    """Move ``checkpoints`` to a sibling named for the time; None where there is nothing to move."""
    if not checkpoints.exists():
        return None
    holder = running_holder(checkpoints)
    if holder:
        raise UserError(f"{checkpoints}: a trainer is still running there ({holder}); stop it or let it finish first")
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    aside = checkpoints.with_name(f"{checkpoints.name}.before-retrain-{stamp}")
    checkpoints.rename(aside)
    return aside


def commands(snakemake: str, config: Path, target: str, report: str, args: list[str]) -> list[list[str]]:
    """The two Snakemake invocations: the node's chain forced, then the report."""
    config_args = ["--configfile", str(config)]
    return [[snakemake, *args, *config_args, "-R", target], [snakemake, "--report", report, *config_args]]


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("config/config.yaml"), help="the run's config file")
    p.add_argument("--node", required=True, help="node0, node1, ... (joint in training.mode joint)")
    p.add_argument("--variant", help="a grid variant's name (results/<run>/<variant>/)")
    p.add_argument("--snakemake", default=str(Path(sys.executable).with_name("snakemake")))
    p.add_argument("args", nargs="*", help="Snakemake's: --profile profiles/slurm, or --cores all")
    a = p.parse_args(argv)
    checkpoints, target, report = node_paths(run_of(a.config), a.node, a.variant)
    aside = set_aside(checkpoints, time.time())
    print(f"retrain: {checkpoints} moved to {aside} (delete it once the new model is good)" if aside
          else f"retrain: no checkpoints at {checkpoints}: training starts from step 0")  # fmt: skip
    for cmd in commands(a.snakemake, a.config, target, report, a.args):
        print("retrain:", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode:
            kept = f"; the old checkpoints are in {aside}" if aside else ""
            raise UserError(f"retrain: {' '.join(cmd)} failed (its output above){kept}")


if __name__ == "__main__":
    main()
