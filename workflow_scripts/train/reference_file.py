"""The reference_logps stage's file (train/reference_logps.py writes it, the trainer reads it): one Parquet row per
row of a tokenized shard, ``logps`` (float64: the reference model's summed log-probability of the row's answer
tokens) and ``tokens`` (their count), the shard's sha256 in the file's metadata."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from workflow_scripts.core.pipeline_io import UserError

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
