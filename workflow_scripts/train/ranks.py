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

import argparse
import importlib
import json
import os
import signal
import socket
import sys
from pathlib import Path

from workflow_scripts.core.fingerprint import model_location
from workflow_scripts.core.pipeline_io import UserError

GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")
# What every rank of train.py imports on its way to the first step, whatever the run: the trainer's own modules (and
# with them torch and pyarrow), the model classes' machinery, pandas (pyarrow's first conversion), TensorBoard, the
# checkpoints' readers (a name that is no module fails tests/train/test_ranks.py).
RANK_IMPORTS = (
    "workflow_scripts.train.parallel", "workflow_scripts.train.batching", "workflow_scripts.train.checkpoint",
    "workflow_scripts.train.metrics_logger", "workflow_scripts.train.trackers", "workflow_scripts.train.step",
    "torch.distributed.checkpoint", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
    "pandas", "psutil", "safetensors.torch", "torch.utils.tensorboard",
)  # fmt: skip


def forks_ranks() -> bool:
    """Whether the ranks are forked from this process: no GPU's device file here, and TRAIN_FORK_RANKS not 0."""
    if os.environ.get("TRAIN_FORK_RANKS", "1") == "0":
        return False
    return not any(Path(p).exists() for p in GPU_DEVICE_FILES)


def modules_for(script: str, script_args: list[str]) -> list[str]:
    """What the ranks of ``script`` import on their way to work: for train.py, RANK_IMPORTS and, for the run that
    ``script_args`` describe, the model's class (by the base model's config.json), the strategy's library and PEFT for
    LoRA; for another script, nothing more than torchrun's own torch."""
    if Path(script).name != "train.py":
        return []
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", default="{}")
    p.add_argument("--base-model", default="")
    a, _ = p.parse_known_args(script_args)
    names = list(RANK_IMPORTS)
    try:
        cfg = json.loads(a.config)
        base = model_location(a.base_model)
    except (ValueError, OSError, UserError):  # the ranks say what is wrong with the arguments
        return names
    if not isinstance(cfg, dict):
        return names
    from workflow_scripts.train.parallel import STRATEGIES

    strategy = STRATEGIES.get(cfg.get("strategy", "ddp"))
    names += strategy.rank_imports if strategy else []
    names += ["peft"] if cfg.get("peft") == "lora" else []
    model_type = read_model_type(Path(base))
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


def fresh_thread_pool() -> None:
    """In a forked child: torch's intra-op thread pool rebuilt by this, its only thread. A fork leaves the pool marked
    corrupt, to be replaced by whichever thread next asks for it; where the parent had set a thread count, every new
    thread asks (transformers 5 loads a checkpoint's tensors from a thread pool), and one that asks while another
    replaces it stops the rank with "Invalid thread pool!" (pytorch/pytorch#54752's fork handling, seen in CI)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


def fresh_child() -> None:
    """What a forked rank starts with: a new Python's signal handlers and its own thread pool."""
    fresh_signal_handlers()
    fresh_thread_pool()


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun

    argv = list(sys.argv[1:] if argv is None else argv)
    args = torchrun.parse_args(argv)
    if args.nnodes not in ("1", "1:1") and not args.standalone:  # a joint job's node: say it came (launch.py)
        print(
            f"node {args.node_rank} ({os.environ.get('SLURMD_NODENAME') or socket.gethostname()}, pid {os.getpid()}):"
            f" {args.nproc_per_node} rank(s), joining the rendezvous at {args.master_addr}:{args.master_port}",
            file=sys.stderr,
            flush=True,
        )
    if forks_ranks():
        preload(modules_for(args.training_script, args.training_script_args))
        # the ranks write through this process's streams: unbuffered, as torchrun's `python -u` ranks
        sys.stdout.reconfigure(write_through=True)
        os.register_at_fork(after_in_child=fresh_child)
        argv = ["--run-path", "--start-method", "fork", *argv]
    torchrun.main(argv)


if __name__ == "__main__":
    main()
