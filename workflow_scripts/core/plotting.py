"""Figures: matplotlib without a display (compute nodes have none), one colour per model in every plot, and
every plot saved the same way."""

import re
import zlib
from pathlib import Path

import matplotlib

from workflow_scripts.core.pipeline_io import atomic_path

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["model_color", "plt", "save_png"]

BASE_COLOR = "tab:gray"  # the untrained base model (the eval set too, in the data plots: it is no model)
# matplotlib's ten colours without grey: node<i> takes the i-th, joint the first (it is the one trained model)
PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan"]  # fmt: skip
NAMED = {"base": BASE_COLOR, "eval": BASE_COLOR, "joint": PALETTE[0], "soup_uniform": "gold", "soup_greedy": "black"}


def model_color(name: str) -> str:
    """The colour of a model (or a shard: node<i>, eval) in every plot: base grey, node<i> the i-th of PALETTE,
    the soups their own; a grid's ``<variant>/<model>`` and any other name by a hash of the name, the same
    in every plot and every run."""
    if name in NAMED:
        return NAMED[name]
    if match := re.fullmatch(r"node(\d+)", name):
        return PALETTE[int(match.group(1)) % len(PALETTE)]
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def save_png(fig, path: Path, dpi: int = 100) -> None:
    """Lay ``fig`` out, write it to ``path`` as a PNG at ``dpi`` and close it. Written atomically: a job killed
    while saving leaves no half image that Snakemake would take for the finished output."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)
