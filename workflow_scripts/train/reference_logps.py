"""reference_logps: the reference model's summed log-probability of every tokenized row's answer, computed once.

training.objective dpo with ``training.dpo.reference: cached`` reads the reference model's log-probabilities of
each pair's answers from this stage's file instead of running a second model in every step (a full fine-tuning
has no adapters to switch off). The reference is the base model in fp32, whatever training.precision, so the
file depends on the base model's content and the tokenized shard alone: it is cached by those (the model's
fingerprint, the shard's sha256), and a new beta, loss or learning rate reuses it.

One Parquet row per row of the tokenized shard, in its order (a pair's chosen row, then its rejected one):
``logps`` (float64, the sum over the row's answer tokens, train/preference.answer_logps) and ``tokens`` (how
many); the file's metadata names the shard's sha256, which the trainer checks against the shard it trains on.

    python -m workflow_scripts.train.reference_logps --tokens data/tokenized/node0.parquet \\
        --base-model base_model --output data/reference_logps/node0.parquet
"""

import argparse
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import torch

from workflow_scripts.core.fingerprint import local_model_folder, model_fingerprint, model_location
from workflow_scripts.core.pipeline_io import UserError, atomic_path, cli, file_sha256
from workflow_scripts.train.reference_file import read_logps, row_logps, write_logps

log = logging.getLogger("reference_logps")
FORMAT = "reference_logps/1"  # what the file holds and how it is computed: part of the cache key


def cache_key(model_fp: str, data_sha: str) -> str:
    return hashlib.sha256(json.dumps([FORMAT, model_fp, data_sha]).encode()).hexdigest()[:24]


def load_reference(base: str, device):
    """The base model in fp32, for inference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local_model_folder(base), dtype=torch.float32).to(device)
    return model.eval()


def compute_file(tokens: Path, base: str, output: Path, cache_dir: Path | None, batch_size: int = 8) -> dict:
    """``output`` for the shard ``tokens`` and the model ``base``: a copy of the cache's entry (its key: the
    model's fingerprint and the shard's sha256), or computed, then cached. Returns what it did."""
    data_sha = file_sha256(tokens)
    output.parent.mkdir(parents=True, exist_ok=True)
    digests = (cache_dir or output.parent) / "model_digests.json"
    if cache_dir:
        cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(model_fingerprint(base, digests), data_sha)
    rows = pq.ParquetFile(tokens).metadata.num_rows
    entry = cache_dir / key / "logps.parquet" if cache_dir else None
    if entry is not None and entry.exists():
        try:
            read_logps(entry, tokens, data_sha, rows)
            with atomic_path(output) as tmp:
                shutil.copyfile(entry, tmp)
            return {"rows": rows, "key": key, "cache": "hit"}
        except UserError as e:
            log.warning("cache entry %s is damaged (%s): computed again", entry, e)
    table = pq.read_table(tokens, columns=["input_ids", "labels"])
    pairs = list(zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist(), strict=True))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_reference(base, device)
    logps, counts = row_logps(model, pairs, model.config.pad_token_id or 0, batch_size, device)
    with atomic_path(output) as tmp:
        write_logps(tmp, logps, counts, data_sha)
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(entry) as tmp:
            shutil.copyfile(output, tmp)
    return {"rows": rows, "key": key, "cache": "miss" if entry is not None else "off"}


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", required=True, type=Path, help="a tokenized shard (Parquet)")
    p.add_argument("--base-model", required=True)
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--cache-dir", type=Path, help="the content-addressed cache (none: computed every time)")
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args(argv)
    stats = compute_file(a.tokens, model_location(a.base_model), a.output, a.cache_dir, a.batch_size)
    print(f"{a.tokens}: {stats['rows']} rows, reference log-probabilities {a.output}, cache {stats['cache']}")


if __name__ == "__main__":
    main()
