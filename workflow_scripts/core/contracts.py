"""The Parquet files the data stages hand to each other, defined once.

    split_dataset  → data/splits/<node>.parquet, data/eval.parquet   SPLIT_SCHEMA, one row per example
                   → data/rejects.parquet                            REJECT_SCHEMA
    tokenize_shard → data/tokenized/<shard>.parquet                  TOKENIZED_SCHEMA, read by training
                                                                     (token_store) and evaluation
                   → data/tokenized/<shard>.packing.parquet          PACKING_SCHEMA, read by batching
                   → data/tokenized/<shard>.rejects.parquet          REJECT_SCHEMA

Both stages' rejects have one schema, so "every input row is trained or rejected with its reason" is
one query over the files. A stage fills the columns it knows and leaves the others null: the split
has the input row (``record``) and, once the row is a conversation, its ``messages`` and
``content_hash``; tokenization has the conversation, its hash and, for a length reject, its lengths.

``IGNORE`` is the label of a position the loss skips (the prompt, padding), as tokenization writes
it and training and evaluation read it.
"""

from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:  # pyarrow.parquet (and pyarrow.fs with it) loads on first use: the rules import this at parse time
    import pyarrow.parquet as pq

IGNORE = -100  # label of a position that is not trained (PyTorch's cross_entropy ignore_index)

SPLIT_SCHEMA = pa.schema(
    [
        ("messages", pa.string()),  # JSON list of {role, content}
        ("response", pa.string()),  # the last assistant turn's text
        ("content_hash", pa.string()),  # identity.py's content hash: the row's identity
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("category", pa.string()),
    ]
)
TOKENIZED_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),  # IGNORE where not trained
        ("length", pa.int32()),  # len(input_ids), after the length policy
        ("prompt_length", pa.int32()),  # the ids evaluation feeds the model before the last answer
        ("response", pa.string()),
        ("content_hash", pa.string()),
        ("category", pa.string()),
    ]
)
PACKING_SCHEMA = pa.schema(
    [
        ("bin", pa.int32()),
        ("examples", pa.list_(pa.int32())),  # indices into the tokenized shard's rows
    ]
)
REJECT_SCHEMA = pa.schema(
    [
        ("source_file", pa.string()),
        ("source_row", pa.int64()),  # 0-based, counting rows (a JSONL file's blank lines are none)
        ("line", pa.int64()),  # the input file's 1-based line (the split's rejects; data_readers.iter_records)
        ("reason", pa.string()),  # a reason code (config/README.md lists them)
        ("detail", pa.string()),
        ("content_hash", pa.string()),  # null where the row never became a conversation
        ("tokens", pa.int32()),  # the example's length before the length policy: length rejects only
        ("prompt_tokens", pa.int32()),  # its prompt's length: length rejects only
        ("messages", pa.string()),  # the conversation as JSON, where there is one
        ("record", pa.string()),  # the input row as JSON (the split's rejects), so nothing is lost
    ]
)


def batches(file: "pq.ParquetFile", batch_rows: int, columns: list[str] | None = None):
    """A Parquet file's record batches, one reader per row group: pyarrow 26's reader over a whole file keeps
    what it has decoded until it ends (measured: RSS +500 MB over 200 row groups of 8k conversations; flat
    per row group), so memory would grow with the file."""
    for group in range(file.num_row_groups):
        yield from file.iter_batches(batch_size=batch_rows, row_groups=[group], columns=columns)


def parquet_file(path) -> "pq.ParquetFile":
    """A Parquet file opened for reading, pyarrow.parquet imported here: about 0.1 s with pyarrow.fs, which the
    parse-time checks (rules/common.smk: data's columns and rows) pay only for a Parquet data file."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path)
