"""split_dataset: read raw instruction data, validate it, and split it into per-node shards.

Every input row ends in exactly one place: a node's shard, the shared eval set, or
``rejects.parquet`` with a reason. Assignment is by a hash of the row's content and
a seed, so it is deterministic and appending rows never moves an existing one.
"""

import argparse
import hashlib
import json
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pipeline_io import UserError, atomic_path, cli, file_sha256, write_json

FIELDS = ("prompt", "question", "response")
REQUIRED = ("question", "response")
REJECT_COLUMNS = ["source_file", "source_row", "reason", "detail", *FIELDS]


EXTENSIONS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


def detect_format(path: Path, fmt: str = "auto") -> str:
    if not path.exists():
        raise UserError(f"data.path: file not found: {path}")
    if fmt == "auto":
        fmt = EXTENSIONS.get(path.suffix.lower())
        if fmt is None:
            raise UserError(f"data.path: cannot tell the format of {path} from its extension; set data.format")
    if fmt not in EXTENSIONS.values():
        raise UserError(f"data.format: unknown format {fmt!r} (csv, tsv, jsonl, json, parquet)")
    return fmt


def _unreadable(path: Path, fmt: str, error: Exception) -> UserError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return UserError(f"{path}: cannot read as {fmt}: {first}")


def read_table(path: str | Path, fmt: str = "auto", nrows: int | None = None) -> pd.DataFrame:
    """Read a CSV, TSV, JSONL, JSON or Parquet file into a DataFrame (CSV cells as text)."""
    path = Path(path)
    fmt = detect_format(path, fmt)
    try:
        if fmt in ("csv", "tsv"):
            # every cell as text: "007" stays "007", an empty cell stays ""
            sep = "\t" if fmt == "tsv" else ","
            return pd.read_csv(path, sep=sep, dtype=str, keep_default_na=False, nrows=nrows)
        if fmt == "jsonl":
            return pd.read_json(path, lines=True, dtype=False, nrows=nrows)
        if fmt == "json":
            return pd.read_json(path, dtype=False)
        table = pq.read_table(path)
        return table.slice(0, nrows).to_pandas() if nrows is not None else table.to_pandas()
    except (pa.ArrowInvalid, ValueError, UnicodeDecodeError, pd.errors.ParserError) as e:
        raise _unreadable(path, fmt, e) from None


def check_columns(path: str | Path, fmt: str, columns: dict) -> None:
    """Fail early, from the file's first rows, when a mapped column is absent."""
    head = read_table(path, fmt, nrows=5)
    map_columns(head, columns, str(path))


def map_columns(df: pd.DataFrame, columns: dict, source: str) -> pd.DataFrame:
    """Rename the user's columns onto prompt/question/response; keep a few extras."""
    out = pd.DataFrame({"source_row": range(len(df))})
    for field in FIELDS:
        name = columns.get(field)
        if name is None:
            if field in REQUIRED:
                raise UserError(f"data.columns.{field} is not set")
            out[field] = ""
            continue
        if name not in df.columns:
            raise UserError(
                f"{source}: column {name!r} (data.columns.{field}) not found; the file has {list(df.columns)}"
            )
        out[field] = df[name].to_numpy()
    if "category" in df.columns:
        out["category"] = df["category"].astype(str).to_numpy()
    return out


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def content_hash(prompt: str, question: str, response: str) -> str:
    """Hash of the normalized content; equal for rows that differ only in whitespace."""
    key = "\x1f".join(normalize(t) for t in (prompt, question, response))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def assign(chash: str, seed: int, eval_fraction: float, nodes: int):
    """Return "eval" or a node index for a row with content hash ``chash``."""
    h = hashlib.sha256(f"{seed}:{chash}".encode()).digest()
    if int.from_bytes(h[:8], "big") / 2**64 < eval_fraction:
        return "eval"
    return int.from_bytes(h[8:16], "big") % nodes


def _as_text(value):
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    return value if isinstance(value, str) else str(value)


def split_rows(df: pd.DataFrame, nodes: int, eval_fraction: float, seed: int, source: str = ""):
    """Validate and split mapped rows. Returns (list of node frames, eval frame, rejects frame)."""
    kept, rejects, seen = [], [], set()
    for row in df.to_dict("records"):
        text = {f: _as_text(row[f]) for f in FIELDS}
        reject = None
        missing = [f for f in REQUIRED if text[f] is None]
        if missing:
            reject = ("missing_field", f"{missing[0]} is null")
        elif not text["response"].strip():
            reject = ("empty_response", "response is blank")
        elif not text["question"].strip():
            reject = ("missing_field", "question is blank")
        else:
            chash = content_hash(text["prompt"] or "", text["question"], text["response"])
            if chash in seen:
                reject = ("duplicate", f"same content as an earlier row ({chash[:12]})")
        if reject:
            rejects.append(
                {"source_file": source, "source_row": row["source_row"], "reason": reject[0], "detail": reject[1]}
                | {f: text[f] for f in FIELDS}
            )
            continue
        seen.add(chash)
        record = {f: text[f] or "" for f in FIELDS} | {"source_row": row["source_row"], "content_hash": chash}
        if "category" in row:
            record["category"] = row["category"]
        record["_dest"] = assign(chash, seed, eval_fraction, nodes)
        kept.append(record)
    frame = pd.DataFrame(
        kept,
        columns=[*FIELDS, "source_row", "content_hash", "_dest"] + (["category"] if "category" in df.columns else []),
    )
    shards = [frame[frame["_dest"] == i].drop(columns="_dest").reset_index(drop=True) for i in range(nodes)]
    evalset = frame[frame["_dest"] == "eval"].drop(columns="_dest").reset_index(drop=True)
    return shards, evalset, pd.DataFrame(rejects, columns=REJECT_COLUMNS)


def write_parquet(frame: pd.DataFrame, path) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--format", default="auto")
    p.add_argument("--columns", required=True, help="JSON mapping field -> column name")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--eval-fraction", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-reject-fraction", type=float, default=1.0)
    p.add_argument("--splits", nargs="+", required=True, help="one output path per node")
    p.add_argument("--eval", required=True)
    p.add_argument("--rejects", required=True)
    p.add_argument("--manifest", required=True)
    a = p.parse_args(argv)
    if len(a.splits) != a.nodes:
        raise UserError(f"nodes is {a.nodes} but {len(a.splits)} split paths were given")

    raw = read_table(a.data, a.format)
    mapped = map_columns(raw, json.loads(a.columns), str(a.data))
    shards, evalset, rejects = split_rows(mapped, a.nodes, a.eval_fraction, a.seed, str(a.data))
    n_in, n_rej = len(mapped), len(rejects)
    if n_in == 0 or n_rej == n_in:
        raise UserError(f"{a.data}: no usable rows left ({n_in} read, {n_rej} rejected)")
    if n_rej / n_in > a.max_reject_fraction:
        by_reason = rejects["reason"].value_counts().to_dict()
        raise UserError(
            f"{a.data}: {n_rej} of {n_in} rows rejected ({by_reason}), above data.max_reject_fraction"
            f"={a.max_reject_fraction}"
        )
    assert n_in == sum(map(len, shards)) + len(evalset) + n_rej, "row accounting broken"

    for frame, path in zip(shards, a.splits, strict=True):
        write_parquet(frame, path)
    write_parquet(evalset, a.eval)
    write_parquet(rejects, a.rejects)
    write_json(
        a.manifest,
        {
            "source": {"path": str(a.data), "sha256": file_sha256(a.data), "rows": n_in},
            "nodes": [
                {"node": i, "rows": len(f), "path": str(pth), "sha256": file_sha256(pth)}
                for i, (f, pth) in enumerate(zip(shards, a.splits, strict=True))
            ],
            "eval": {"rows": len(evalset), "path": str(a.eval), "sha256": file_sha256(a.eval)},
            "rejects": {
                "rows": n_rej,
                "by_reason": rejects["reason"].value_counts().to_dict(),
                "path": str(a.rejects),
            },
            "seed": a.seed,
            "eval_fraction": a.eval_fraction,
        },
    )
    print(f"{n_in} rows: {[len(s) for s in shards]} per node, {len(evalset)} eval, {n_rej} rejected")


if __name__ == "__main__":
    main()
