"""The trainer's data: tokenized shards and packing plans → a data plan → micro-batches.

A data unit is an example, or a packed bin of examples (training.packing). The data plan
turns units into optimizer steps over all ranks (of every node, in joint mode): the step
is the data position, so a resumed job continues where the checkpoint left off.

The examples are read from each shard's memory-mapped token store (token_store.py) and the
packing plans are held as arrays: a rank's memory holds the rows of its micro-batches, not
the shard, however large the shard.
"""

import bisect
import dataclasses
import functools
import hashlib
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.pipeline_io import UserError, file_sha256
from workflow_scripts.data.token_store import TokenStore, open_store
from workflow_scripts.train.objective import REFERENCE_KEY, cached_reference
from workflow_scripts.train.objective import pairs as trains_on_pairs
from workflow_scripts.train.reference_file import read_logps


class Examples:
    """The examples of the shards, concatenated in order (joint mode trains on every node's shard):
    ``examples[i]`` is example i's (input_ids, labels), int32 views into its shard's mapped store."""

    def __init__(self, stores: list[TokenStore]):
        self.stores = stores
        self.starts = [0, *np.cumsum([s.rows for s in stores]).tolist()]  # the first example of each shard

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        i = range(len(self))[i]  # IndexError out of range, as a list
        shard = bisect.bisect_right(self.starts, i) - 1
        return self.stores[shard].row(i - self.starts[shard])

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stores)

    def release(self) -> None:
        """Drop the rows read so far from this process's memory (token_store.TokenStore.release)."""
        for s in self.stores:
            s.release()


def load_examples(paths: list[Path], store_root: Path, shas: list[str] | None = None) -> Examples:
    """The shards' examples from their token stores under ``store_root`` (built on first use);
    ``shas``: the shards' content hashes when already known."""
    shas = shas or [file_sha256(p) for p in paths]
    return Examples([open_store(p, store_root, sha) for p, sha in zip(paths, shas, strict=True)])


def combined_sha256(shas: list[str]) -> str:
    """One shard's hash, or a hash of the shards' hashes in order."""
    return shas[0] if len(shas) == 1 else hashlib.sha256("\n".join(shas).encode()).hexdigest()


def data_sha256(paths: list[Path]) -> str:
    """One shard's content hash, or a hash of the shards' hashes in order."""
    return combined_sha256([file_sha256(p) for p in paths])


@dataclasses.dataclass(frozen=True)
class Bins:
    """Packed bins as arrays: bin b holds the examples ``examples[offsets[b]:offsets[b + 1]]``."""

    examples: np.ndarray  # int64: every bin's example indices, back to back
    offsets: np.ndarray  # int64: bins + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, b: int) -> np.ndarray:
        b = range(len(self))[b]
        return self.examples[self.offsets[b] : self.offsets[b + 1]]

    def __iter__(self):
        return (self[b] for b in range(len(self)))


def covers_once(indices: np.ndarray, count: int) -> bool:
    """Whether ``indices`` holds each of 0 … count - 1 exactly once."""
    return len(indices) == count and np.array_equal(np.sort(indices), np.arange(count))


def load_bins(plans: list[Path], shards: list[Path]) -> Bins:
    """The packing plans written by tokenize_shard (example indices of each bin), one per shard,
    as indices into the shards' concatenated examples."""
    if len(plans) != len(shards):
        raise UserError(f"{len(plans)} packing plan(s) for {len(shards)} shard(s)")
    examples, offsets, count = [], [np.zeros(1, np.int64)], 0
    for plan, shard in zip(plans, shards, strict=True):
        rows = pq.ParquetFile(shard).metadata.num_rows
        column = pq.ParquetFile(plan).read(columns=["examples"], use_threads=False).column("examples").combine_chunks()
        own = column.flatten().to_numpy().astype(np.int64)
        if not covers_once(own, rows):
            raise UserError(f"{plan}: packing plan does not cover the {rows} examples of {shard.name} exactly once")
        ends = column.offsets.to_numpy().astype(np.int64)
        examples.append(own + count)
        offsets.append(ends[1:] - ends[0] + offsets[-1][-1])
        count += rows
    bins = Bins(np.concatenate(examples), np.concatenate(offsets))
    pa.default_memory_pool().release_unused()  # Arrow's allocator keeps what reading the plans took
    return bins


@dataclasses.dataclass
class DataPlan:
    """How the data units of every shard become optimizer steps over all ranks."""

    examples: int  # units: examples, or bins when packing
    world_size: int
    micro_batch_size: int
    grad_accum: int
    epochs: float
    max_steps: int | None

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.examples // self.global_batch)

    @property
    def total_steps(self) -> int:
        if self.max_steps:
            return self.max_steps
        return max(1, math.ceil(self.epochs * self.steps_per_epoch))


@functools.lru_cache(maxsize=2)
def epoch_order(units: int, seed: int) -> np.ndarray:
    """The seeded permutation of an epoch's units, made once per epoch (not per micro-batch), kept
    as an array (8 bytes a unit, not a Python int each); read-only, as it is shared."""
    order = torch.randperm(units, generator=torch.Generator().manual_seed(seed)).numpy()
    order.setflags(write=False)
    return order


def micro_batch_indices(plan: DataPlan, seed: int, step: int, micro: int, rank: int) -> list[int]:
    """Unit indices for (step, micro-batch, rank): a seeded permutation per epoch."""
    epoch, pos = divmod(step, plan.steps_per_epoch)
    order = epoch_order(plan.examples, seed + epoch)
    start = (pos * plan.grad_accum + micro) * plan.micro_batch_size * plan.world_size
    start += rank * plan.micro_batch_size
    return order[(start + np.arange(plan.micro_batch_size)) % plan.examples].tolist()


def as_batch(**arrays: np.ndarray) -> dict:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def collate(examples, pad_id: int) -> dict:
    """Pad to the longest example in the micro-batch (examples: (input_ids, labels) pairs, arrays or lists)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE, dtype=np.int64)
    mask = np.zeros((len(examples), width), dtype=np.int64)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = ids
        labels[i, : len(lab)] = lab
        mask[i, : len(ids)] = 1
    return as_batch(input_ids=input_ids, labels=labels, attention_mask=mask)


def collate_packed(rows: list[list[tuple]], pad_id: int) -> dict:
    """Padding-free packing: each row holds its sequences back to back.

    Position ids restart at 0 for every sequence and no attention mask is passed, so
    transformers builds block-diagonal causal attention from the position ids (SDPA and
    eager) or calls flash-attention's varlen kernel (one row): no token attends across
    sequences. The first label of every sequence is masked, so the last token of one
    sequence is never trained to predict the next. Rows shorter than the longest are
    filled with pad tokens forming their own masked pseudo-sequence.
    """
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for ids, lab in row:
            n = len(ids)
            input_ids[r, at : at + n] = ids
            labels[r, at + 1 : at + n] = lab[1:]
            positions[r, at : at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(width - at)
    return as_batch(input_ids=input_ids, labels=labels, position_ids=positions)


def pair_rows(indices: list[int]) -> list[int]:
    """The rows of these pairs as one batch holds them: every pair's chosen row (2i), then every rejected (2i + 1)."""
    return [2 * i for i in indices] + [2 * i + 1 for i in indices]


class Batches:
    """Micro-batches of a node's data: padded examples, or packed bins (one row per bin,
    or all bins in one row for flash-attention, whose varlen path takes a single row), or preference
    pairs (``pairs``: unit i is rows 2i, chosen, and 2i + 1, rejected; a batch is [chosen..., rejected...])."""

    def __init__(self, examples: Examples, bins: Bins | None, pad_id: int, one_row: bool, pairs: bool = False,
                 reference: np.ndarray | None = None):  # fmt: skip
        self.examples, self.bins, self.pad_id, self.one_row, self.pairs = examples, bins, pad_id, one_row, pairs
        self.reference = reference  # pairs: the reference model's log-probability of every row (reference_logps)

    def __len__(self) -> int:
        if self.pairs:
            return len(self.examples) // 2
        return len(self.bins) if self.bins is not None else len(self.examples)

    def make(self, indices: list[int]) -> tuple[dict, list[int]]:
        """The batch for these unit indices and the lengths of its sequences (real tokens)."""
        if self.pairs:
            rows = pair_rows(indices)
            items = [self.examples[i] for i in rows]
            batch = collate(items, self.pad_id)
            if self.reference is not None:
                batch[REFERENCE_KEY] = torch.from_numpy(self.reference[rows].astype(np.float32))
        elif self.bins is None:
            items = [self.examples[i] for i in indices]
            batch = collate(items, self.pad_id)
        else:
            rows = [[self.examples[j] for j in self.bins[i]] for i in indices]
            rows = [[seq for row in rows for seq in row]] if self.one_row else rows
            items = [seq for row in rows for seq in row]
            batch = collate_packed(rows, self.pad_id)
        self.examples.release()  # copied into the batch
        return batch, [len(ids) for ids, _ in items]


class TrainingData:
    """A rank's view of the training data: the plan, and the micro-batches of each step."""

    def __init__(
        self, cfg, shards: list[Path], plans: list[Path] | None, world: int, rank: int, store_root: Path,
        reference: list[Path] | None = None,
    ):  # fmt: skip
        """``reference``: with training.dpo.reference cached, each shard's reference_logps file."""
        if cfg.packing and trains_on_pairs(cfg):
            raise UserError("training.objective dpo trains on pairs, not packed bins: set training.packing false")
        if cfg.packing and plans is None:
            raise UserError("training.packing is true but no --packing plan was given")
        self.cfg, self.rank, self.shards, self.pairs = cfg, rank, shards, trains_on_pairs(cfg)
        shas = [file_sha256(p) for p in shards]
        self.examples = load_examples(shards, store_root, shas)
        self.bins = load_bins(plans, shards) if cfg.packing else None
        units = len(self.bins) if cfg.packing else len(self.examples)
        if self.pairs:
            units = self.pair_count()
        self.reference = self.reference_logps(reference, shas) if cached_reference(cfg) else None
        self.plan = DataPlan(units, world, cfg.micro_batch_size, cfg.grad_accum, cfg.epochs, cfg.max_steps)
        if units < cfg.micro_batch_size * world:
            what = "pairs" if self.pairs else "packed bins" if cfg.packing else "examples"
            raise UserError(f"{' '.join(map(str, shards))}: {units} {what}, fewer than one micro-batch on every rank")
        self.sha256 = combined_sha256(shas) + (data_sha256(plans) if cfg.packing else "")
        self.batches = None

    def bind(self, pad_id: int, one_row: bool) -> None:
        """Batches need the model's pad token and attention layout, known once the model is loaded."""
        self.batches = Batches(self.examples, self.bins, pad_id, one_row, self.pairs, self.reference)

    def pair_count(self) -> int:
        """The preference pairs: each shard holds them as consecutive rows (chosen, rejected)."""
        for shard, store in zip(self.shards, self.examples.stores, strict=True):
            if store.rows % 2:
                raise UserError(
                    f"{shard}: {store.rows} rows, an odd count: training.objective dpo reads pairs (chosen and"
                    " rejected rows in turn), as tokenization writes them from preference data"
                )
        return len(self.examples) // 2

    def reference_logps(self, files: list[Path] | None, shas: list[str]) -> np.ndarray:
        """The reference model's log-probability of every row of the shards, from their reference_logps files."""
        if not files or len(files) != len(self.shards):
            raise UserError(
                f"training.dpo.reference is cached: the trainer needs a --reference-logps file for each of its"
                f" {len(self.shards)} shard(s) (the reference_logps stage's), given {len(files or [])}"
            )
        return np.concatenate([
            read_logps(path, shard, sha, store.rows)
            for path, shard, sha, store in zip(files, self.shards, shas, self.examples.stores, strict=True)
        ])  # fmt: skip

    def micro_batches(self, step: int):
        """The step's micro-batches on this rank: (batch, sequence lengths), grad_accum of them."""
        for micro in range(self.cfg.grad_accum):
            yield self.batches.make(micro_batch_indices(self.plan, self.cfg.seed, step, micro, self.rank))

    def describe(self) -> dict:
        return {
            "shards": [p.name for p in self.shards],
            "examples": len(self.examples),
            "packed_bins": len(self.bins) if self.bins is not None else None,
            **({"pairs": self.plan.examples} if self.pairs else {}),
            "tokens": self.examples.tokens,
            "token_stores": [str(s.folder) for s in self.examples.stores],
            "global_batch": self.plan.global_batch,
            "steps_per_epoch": self.plan.steps_per_epoch,
            "total_steps": self.plan.total_steps,
        }
