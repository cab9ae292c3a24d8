"""The reference_logps stage's file (train/reference_logps.py writes it, the trainer reads it): one Parquet row per
row of a tokenized shard, ``logps`` (float64: the reference model's summed log-probability of the row's answer
tokens) and ``tokens`` (their count), the shard's sha256 in the file's metadata; and ``row_logps``, how a model's
are computed (the stage's, and the held-out preference evaluation's)."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.pipeline_io import Progress, UserError
from workflow_scripts.train.preference import answer_logps

SCHEMA = pa.schema([("logps", pa.float64()), ("tokens", pa.int32())])
SHA_KEY = b"data_sha256"  # the file's metadata: the tokenized shard it was computed for


def write_logps(path: Path, logps: np.ndarray, tokens: np.ndarray, data_sha: str) -> None:
    table = pa.table({"logps": logps, "tokens": tokens}, schema=SCHEMA)
    pq.write_table(table.replace_schema_metadata({SHA_KEY: data_sha.encode()}), path)


def read_logps(path: Path, shard: Path, shard_sha: str, rows: int) -> np.ndarray:
    """The file's log-probabilities, checked to be of ``shard`` (its sha256 and row count); one-line UserErrors."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(
            f"{path}: unreadable reference log-probabilities ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    found = (table.schema.metadata or {}).get(SHA_KEY, b"").decode()
    if found != shard_sha or table.num_rows != rows:
        raise UserError(
            f"{path}: reference log-probabilities of another tokenized shard than {shard} ({table.num_rows} rows for"
            f" {rows}): rerun the reference_logps stage"
        )
    return table.column("logps").to_numpy()


@torch.no_grad()
def row_logps(model, rows, pad_id: int, batch_size: int, device) -> tuple[np.ndarray, np.ndarray]:
    """Each row's summed answer log-probability and answer tokens, ``rows[i]`` an (input_ids, labels) pair;
    rows of similar length batched together (less padding), the results in the rows' order."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    logps, tokens = np.zeros(len(rows), np.float64), np.zeros(len(rows), np.int32)
    progress = Progress("reference log-probabilities", len(rows))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = padded([rows[i] for i in chunk], pad_id)
        logits = model(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
        ).logits
        summed, count = answer_logps(logits, batch["labels"].to(device))
        logps[chunk], tokens[chunk] = summed.double().cpu().numpy(), count.cpu().numpy()
        progress.update(len(chunk))
    progress.done()
    return logps, tokens


def padded(rows, pad_id: int) -> dict:
    """(input_ids, labels) rows padded to the longest (batching.collate's layout: pad ids, IGNORE labels, a mask)."""
    width = max(len(ids) for ids, _ in rows)
    batch = {"input_ids": torch.full((len(rows), width), pad_id), "labels": torch.full((len(rows), width), IGNORE),
             "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}  # fmt: skip
    for i, (ids, labels) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        batch["labels"][i, : len(labels)] = torch.as_tensor(np.asarray(labels, dtype=np.int64))
        batch["attention_mask"][i, : len(ids)] = 1
    return batch
