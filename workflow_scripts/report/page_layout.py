"""How report_page.py lays a table or a JSON file out so that it reads in the report's frame (about 1,000 px).

The CSVs and JSONs stay as written for tools; only their pages change. A CSV page shows numbers to three
significant figures, a score and its interval in one cell (``v [lo, hi]`` from the ``<metric>_lo``/``_hi``
columns; ``_stderr`` left to the CSV), a model's ✓/✗ in its answer's cell, long text clipped with the whole of it
one click away (a ``details`` element), and a per-model table with more columns than rows turned on its side (a
row per column, a column per model: summary.csv has 30 columns and three models). A JSON page puts the data
report in funnel order (rows read, rejected, split per shard, tokenized) and the environment check's problems
first, a package that is absent as "not installed", and an object of like objects (the shards) as one table.
"""

import math
import re

CLIP = 80  # a cell's characters shown before the rest goes into a details element
INTERVAL_ENDS = ("_lo", "_hi")
HIDDEN_SUFFIXES = ("_stderr",)  # in the CSV, not on the page: the interval says it
INT = re.compile(r"-?\d+")


def number_text(text: str) -> str:
    """A CSV cell's number to three significant figures (0.376, 1.46, 1,059), an integer with thousands
    separators; anything else as written."""
    if not text or INT.fullmatch(text):
        return f"{int(text):,}" if text and abs(int(text)) >= 10_000 else text
    try:
        x = float(text)
    except ValueError:
        return text
    return sig3(x)


def sig3(x: float) -> str:
    if math.isnan(x):
        return ""
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) < 1e-3:
        return f"{x:.2e}"
    return f"{x:#.3g}".rstrip(".")


def merge_intervals(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Numbers at three significant figures; each ``<c>`` with ``<c>_lo`` and ``<c>_hi`` in one cell
    ``v [lo, hi]``, those two columns and ``<c>_stderr`` dropped; ``<model>_correct`` in ``<model>``'s cell as a
    leading ✓ or ✗ (a column of marks for each model made the samples page twice as wide)."""
    index = {h: i for i, h in enumerate(header)}
    merged = {h for h in header if all(h + end in index for end in INTERVAL_ENDS)}
    marks = {h for h in header if h + "_correct" in index}
    drop = {h + e for h in merged for e in (*INTERVAL_ENDS, *HIDDEN_SUFFIXES)} | {h + "_correct" for h in marks}
    keep = [h for h in header if h not in drop]
    out = []
    for row in rows:
        cells = []
        for h in keep:
            value = row[index[h]]
            if h in merged and value:
                lo, hi = (number_text(row[index[h + e]]) for e in INTERVAL_ENDS)
                value = number_text(value) + (f" [{lo}, {hi}]" if lo and hi else "")
            elif h in marks:
                mark = {"True": "✓ ", "False": "✗ ", "true": "✓ ", "false": "✗ "}.get(row[index[h + "_correct"]], "")
                value = mark + value
            else:
                value = number_text(value)
            cells.append(value)
        out.append(cells)
    return keep, out


ID_COLUMNS = ("variant", "model")  # a per-model table's leading columns naming its row (the grid's: both)


def sideways(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]] | None:
    """A per-model table (its first columns ``model``, or ``variant`` and ``model``) with more columns than
    rows, turned: a row per column, a column per model (``variant/model``). None for any other table."""
    ids = 0
    while ids < len(header) and header[ids] in ID_COLUMNS:
        ids += 1
    if not ids or len(header) - ids <= max(len(rows), 8):
        return None
    labels = ["/".join(x for x in row[:ids] if x) for row in rows]
    turned = [[h, *(row[i] for row in rows)] for i, h in enumerate(header) if i >= ids]
    return ["", *labels], turned


def clipped(text: str) -> tuple[str, str] | None:
    """(shown, whole) for a cell longer than CLIP characters, None for a short one."""
    if len(text) <= CLIP:
        return None
    return text[: CLIP - 1] + "…", text


# ---------------------------------------------------------------- JSON pages

DATA_ORDER = ["rows_in", "rejected", "rejects_by_reason", "split_rejected", "rows_per_node", "eval_rows",
              "tokenize_rejected", "tokenize_rejects_by_reason", "max_seq_len", "funnel", "shards", "decontamination",
              "control_chars", "special_text"]  # fmt: skip
ENV_ORDER = ["ok", "problems", "attention", "attention_reason", "gpu", "fsdp2_available", "packages", "benchmark",
             "python", "platform"]  # fmt: skip
FUNNEL_COLUMNS = ["split", "left_out", "left_out_by_reason", "tokenized"]


def ordered(value: dict, order: list[str]) -> dict:
    """``value`` with ``order``'s keys first, in that order, then the rest as written."""
    return {k: value[k] for k in order if k in value} | {k: v for k, v in value.items() if k not in order}


def funnel_first(data: dict) -> dict:
    """The data report in the order its rows went: read, rejected, split into shards (split, left out,
    tokenized per shard), tokenized, then each shard's tokenization and the decontamination."""
    data = ordered(data, DATA_ORDER)
    funnel = data.get("funnel")
    if isinstance(funnel, dict):
        funnel = ordered(funnel, ["rows_in", "split_rejected", "shards", "tokenized"])
        shards = funnel.get("shards")
        if isinstance(shards, dict):
            funnel["shards"] = {name: ordered(s, FUNNEL_COLUMNS) if isinstance(s, dict) else s
                                for name, s in shards.items()}  # fmt: skip
        data["funnel"] = funnel
    return data


def page_order(data):
    """A JSON page's order: the data report's funnel (it has ``funnel``), the environment check's verdict and
    problems first (it has ``packages``); any other file as written."""
    if not isinstance(data, dict):
        return data
    if "funnel" in data:
        return funnel_first(data)
    if "packages" in data:
        return ordered(data, ENV_ORDER)
    return data


def sections(data: dict) -> tuple[dict, dict]:
    """A JSON page's top level split: (scalars and empty values, one table first; nested values, a section
    each under its own heading), so that no table sits in another's narrow cell."""
    flat = {k: v for k, v in data.items() if not isinstance(v, dict | list) or not v or is_scalars(v)}
    return flat, {k: v for k, v in data.items() if k not in flat}


def is_scalars(value) -> bool:
    return isinstance(value, list) and all(not isinstance(v, dict | list) for v in value)


def like_objects(value: dict) -> list[str] | None:
    """The columns of an object whose values are all objects of scalars with keys in common (the shards, the
    decontamination's sets): shown as one table, a row per key. None for any other object."""
    if len(value) < 2 or not all(isinstance(v, dict) and v for v in value.values()):
        return None
    keys = list(dict.fromkeys(k for v in value.values() for k in v))
    if any(isinstance(x, list) for v in value.values() for x in v.values()):
        return None
    if len(keys) > 12 or any(len(v) < len(keys) / 2 for v in value.values()):
        return None
    return keys


def scalar_text(value, key: str = "", parent: str = "") -> str:
    """A JSON scalar for a page: numbers formatted (three significant figures, thousands separators), a null
    package "not installed", another null "none", booleans yes/no."""
    if value is None:
        return "not installed" if parent == "packages" else "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return sig3(value)
    return str(value)
