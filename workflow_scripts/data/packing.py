"""Packing plans: which tokenized examples share a training row (training.packing).

tokenize_shard writes one plan per shard (``write_packing``, PACKING_SCHEMA); the trainer reads it
(batching.load_bins). The plan is best-fit decreasing over the examples' lengths, and its stats
compare it with padding each micro-batch to its longest example.
"""

import bisect
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from workflow_scripts.core.contracts import PACKING_SCHEMA
from workflow_scripts.core.pipeline_io import atomic_path

PAD_BATCH = 8  # micro-batch size of the pad-to-longest comparison


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each sequence, longest first, into the fullest bin it still fits.

    Bins are kept in buckets by space left, and the distinct space values (at most
    ``capacity``) in a sorted list, so each placement costs O(log capacity).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # space left -> bins with exactly that space
    spaces: list[int] = []  # sorted keys of the non-empty buckets
    for i in order:
        n = min(lengths[i], capacity)
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):
            space = spaces[at]
            b = buckets[space].pop()
            if not buckets[space]:
                del buckets[space]
                spaces.pop(at)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = space - n
        if left > 0:
            if left not in buckets:
                buckets[left] = []
                bisect.insort(spaces, left)
            buckets[left].append(b)
    return bins


def packing_stats(lengths: list[int], bins: list[list[int]], capacity: int, seed: int = 0) -> dict:
    real = sum(lengths)
    shuffled = lengths[:]
    random.Random(seed).shuffle(shuffled)
    padded = sum(
        max(shuffled[i : i + PAD_BATCH]) * len(shuffled[i : i + PAD_BATCH]) for i in range(0, len(shuffled), PAD_BATCH)
    )
    return {
        "bins": len(bins),
        "packing_efficiency": real / (len(bins) * capacity) if bins else 0.0,
        "pad_to_longest_efficiency": real / padded if padded else 0.0,
        "pad_batch": PAD_BATCH,
    }


def write_packing(lengths: list[int], capacity: int, path: Path) -> dict:
    """Pack ``lengths`` into bins of ``capacity`` tokens, write the plan to ``path``; its stats."""
    bins = pack_best_fit_decreasing(lengths, capacity)
    table = pa.table({"bin": pa.array(range(len(bins)), pa.int32()), "examples": pa.array(bins, pa.list_(pa.int32()))},
                     schema=PACKING_SCHEMA)  # fmt: skip
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return packing_stats(lengths, bins, capacity)
