"""Figures: matplotlib without a display (compute nodes have none), and every plot saved the same way."""

from pathlib import Path

import matplotlib
from pipeline_io import atomic_path

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plt", "save_png"]


def save_png(fig, path: Path, dpi: int = 100) -> None:
    """Lay ``fig`` out, write it to ``path`` as a PNG at ``dpi`` and close it. Written atomically: a job killed
    while saving leaves no half image that Snakemake would take for the finished output."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)
