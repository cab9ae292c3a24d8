"""train_node's launcher: torchrun, whose ranks, on a machine without GPUs, are forked from this process once it has
imported what every rank imports.

A rank of the trainer spends most of a short run starting: torch, transformers' model classes (which import
torch.distributed.tensor, sympy, torch._dynamo and scipy), pandas, TensorBoard, the strategy's library: ~8-10 s of
CPU a rank on a 2-core development machine, against ~4 s for the demo's 12 steps and two checkpoints. Here they are
imported once, then torchrun's own `--run-path --start-method fork` runs the script in forked ranks (runpy, as
torchrun does), which find every module imported. Everything else is torchrun's: its arguments, rendezvous,
environment variables, signal handling and exit codes.

Where GPUs are present (NVIDIA's or AMD's device files) it is torchrun unchanged, each rank a new Python: a rank forked
from a process in which an import has initialized the GPU driver (DeepSpeed's accelerator detection asks CUDA) cannot
use the GPU, and a GPU job's start is seconds of hours.

    python workflow_scripts/train/ranks.py --standalone --nproc_per_node 2 --max-restarts 0 train.py --config ...

TRAIN_FORK_RANKS=0 starts every rank as a new Python on any machine.
"""

import importlib
import json
import os
import signal
import sys
from pathlib import Path

GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")


def forks_ranks() -> bool:
    """Whether the ranks are forked from this process: no GPU's device file here, and TRAIN_FORK_RANKS not 0."""
    if os.environ.get("TRAIN_FORK_RANKS", "1") == "0":
        return False
    return not any(Path(p).exists() for p in GPU_DEVICE_FILES)


def modules_for(script_args: list[str]) -> list[str]:
    """What the trainer's ranks import on their way to the first step, for the run that ``script_args`` (train.py's
    arguments) describe: the model's class by the base model's config.json, the strategy's library, PEFT for LoRA."""
    from workflow_scripts.train import train

    names = ["workflow_scripts.train.train", *train.RANK_IMPORTS]
    try:
        a = train.parse_args(script_args)
        cfg = json.loads(a.config)
    except (SystemExit, ValueError):  # the ranks say what is wrong with the arguments
        return names
    from workflow_scripts.train.parallel import STRATEGIES

    strategy = STRATEGIES.get(cfg.get("strategy", "ddp"))
    names += strategy.rank_imports if strategy else []
    names += ["peft"] if cfg.get("peft") == "lora" else []
    model_type = read_model_type(Path(a.base_model))
    if model_type:
        names.append(f"transformers.models.{model_type.replace('-', '_')}.modeling_{model_type.replace('-', '_')}")
    return names


def read_model_type(base: Path) -> str | None:
    try:
        return json.loads((base / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def preload(names: list[str]) -> None:
    """Import ``names`` (``module:function``: call the module's function, which imports); one that fails is left to
    the rank that needs it, whose own import says why."""
    for name in names:
        module, _, function = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
        except Exception:  # noqa: BLE001 - the rank's own import reports it
            pass


def fresh_signal_handlers() -> None:
    """In a forked rank: the signal handlers a new Python starts with, not those torchrun's agent set before it forked
    (SIGTERM, SIGINT, SIGHUP and SIGQUIT raising its SignalException); the trainer sets its own (preemption.py)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun

    argv = list(sys.argv[1:] if argv is None else argv)
    if forks_ranks():
        args = torchrun.parse_args(argv)
        preload(modules_for(args.training_script_args))
        # the ranks write through this process's streams: unbuffered, as torchrun's `python -u` ranks
        sys.stdout.reconfigure(write_through=True)
        os.register_at_fork(after_in_child=fresh_signal_handlers)
        argv = ["--run-path", "--start-method", "fork", *argv]
    torchrun.main(argv)


if __name__ == "__main__":
    main()
