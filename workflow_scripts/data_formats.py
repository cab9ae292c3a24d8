"""Readers and mappings: any common instruction format in, one internal form out.

Readers stream record batches (CSV, TSV, JSONL, JSON array, Parquet; one file, a
folder or a glob). Mappings turn a record into a conversation — a list of
``{"role", "content"}`` turns ending with the assistant — or into a reject reason:

- ``columns``: system / user / assistant columns (seed 000's ``prompt, question,
  response``; ``prompt, completion`` with ``prompt: null``...).
- ``alpaca``: ``instruction``, optional ``input``, ``output``.
- ``chat``: a ``messages`` list of ``{role, content}`` turns (multi-turn, optional system). A turn's
  content may be a list of OpenAI-style parts: its text parts are joined with a newline (what vLLM
  and other OpenAI-compatible servers give a template that takes a string, as Qwen3's and Llama 3's
  do); any other part (``image_url``, ``input_audio``...) rejects the row, naming the part's type.
- ``sharegpt``: a ``conversations`` list of ``{from, value}`` turns, ``from`` human/user, gpt/assistant
  or system. Each mapping reads both turn forms, and, when its column is absent, the other's
  (``messages`` <-> ``conversations``): a ShareGPT file read with ``chat`` works.
- ``nested``: one ``instruction`` with a list of ``instances`` ``{input, output}``,
  one example per instance (the self-instruct format of ../shared/data).

A conversation's identity (its hashes) and where it goes (eval or which node) are identity.py's.
"""

import codecs
import glob
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ijson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from chat_format import with_text
from contracts import batches
from pipeline_io import UserError

EXTENSIONS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
FORMATS = ("csv", "tsv", "jsonl", "json", "parquet")
MAPPINGS = ("columns", "alpaca", "chat", "sharegpt", "nested")  # and auto: resolve_mapping
DEFAULT_COLUMNS = {
    "columns": {"prompt": "prompt", "question": "question", "response": "response"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": None},
    "chat": {"messages": "messages"},
    "sharegpt": {"conversations": "conversations"},
    "nested": {"instruction": "instruction", "instances": "instances", "input": "input", "output": "output"},
}
CHAT_COLUMNS = {"messages": "conversations", "conversations": "messages"}  # chat and sharegpt read either
REQUIRED = {
    "columns": ("question", "response"),
    "alpaca": ("instruction", "output"),
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "nested": ("instruction", "instances"),
}


@dataclass
class Record:
    """One input row: where it came from, and its fields or why it could not be read."""

    source_file: str
    source_row: int
    fields: dict | None  # the record; for an unreadable one, what could be recovered of it
    error: tuple[str, str] | None = None  # (reason, detail)
    line: int | None = None  # the file's 1-based line the record starts on (source_line: JSONL exact, CSV/TSV by rows)


# ---------------------------------------------------------------- files


def resolve_paths(spec: str) -> list[Path]:
    """One file, every data file in a folder, or a glob; sorted, so the order is stable."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in EXTENSIONS and p.is_file())
        if not files:
            raise UserError(f"data.path: folder {spec} has no .csv/.tsv/.jsonl/.json/.parquet files")
        return files
    if any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise UserError(f"data.path: no file matches {spec}")
        return files
    if not path.exists():
        raise UserError(f"data.path: file not found: {spec}")
    return [path]


def detect_format(path: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        if fmt not in FORMATS:
            raise UserError(f"data.format: unknown format {fmt!r} ({', '.join(FORMATS)})")
        return fmt
    found = EXTENSIONS.get(path.suffix.lower())
    if found is None:
        raise UserError(f"data.path: cannot tell the format of {path} from its extension; set data.format")
    return found


# ---------------------------------------------------------------- readers

TEXT_PROBE = 1 << 16  # the bytes check_text reads from a file's start
NOT_TEXT = re.compile("[\x00-\x08\x0b\x0e-\x1f\ufffd]")  # C0 controls but tab, LF, FF, CR; undecodable bytes
NOT_TEXT_SHARE = 0.1  # above this share of such characters a file is binary (a stray NUL is a row's problem)


def check_text(path: Path, kind: str) -> None:
    """A CSV/TSV/JSONL/JSON data file is text: when more than a tenth of its first 64 KiB is control characters
    or bytes that are no UTF-8 (a binary file, a spreadsheet saved under a .csv name, UTF-16), one line naming it,
    before any of its bytes reach the terminal. A few such bytes are left to the rows they are in (invalid_utf8,
    data.control_chars)."""
    with open(path, "rb") as f:
        head = f.read(TEXT_PROBE)
    text = head.decode("utf-8", errors="replace")
    if len(head) == TEXT_PROBE:
        text = text[:-4]  # a character the probe cut in two is no fault
    bad = len(NOT_TEXT.findall(text))
    if text and bad / len(text) > NOT_TEXT_SHARE:
        raise UserError(
            f"{path}: not a text file ({bad:,} of its first {len(text):,} characters are control characters or"
            f" not UTF-8): data.format {kind} needs UTF-8 text (a binary file, a spreadsheet or a UTF-16 export"
            " under a text extension?)"
        )


def printable(text: str, limit: int = 200) -> str:
    """``text`` safe for a terminal on one line: control characters and undecodable bytes escaped, cut at
    ``limit`` characters (a reader's message quoting a line of a binary file)."""
    out = "".join(c if c.isprintable() and c != "\ufffd" else ascii(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def _decode(value, column: str, crlf: bool):
    """Bytes from the CSV reader to text (a CRLF as LF in a CRLF file, as ``_utf8_batch``); invalid UTF-8
    becomes an error for this row only."""
    if value is None or isinstance(value, str):
        return value
    try:
        return value.decode("utf-8").replace("\r\n", "\n") if crlf else value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"column {column!r}: invalid UTF-8 at byte {e.start}") from None


def _utf8_batch(batch: pa.RecordBatch, crlf: bool) -> pa.RecordBatch | None:
    """The batch's binary cells as text, when every one is valid UTF-8 (else None: decode row by row). In a
    file with CRLF line ends, a line end inside a quoted cell is one too: it becomes LF, so a CSV saved on
    Windows gives the rows of the same file saved with LF."""
    try:
        text = [c.cast(pa.string()) for c in batch.columns]
    except pa.ArrowInvalid:
        return None
    text = [pc.replace_substring(c, "\r\n", "\n") for c in text] if crlf else text
    return pa.RecordBatch.from_arrays(text, names=batch.schema.names)


def has_crlf(path: Path) -> bool:
    """Whether a text file's first line ends in CRLF: its line ends are Windows'."""
    with open(path, "rb") as f:
        return f.readline(1 << 20).endswith(b"\r\n")


def _csv_batches(path: Path, delimiter: str, batch_bytes: int) -> Iterator[list[dict | tuple]]:
    parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    read = pacsv.ReadOptions(block_size=batch_bytes)
    crlf = has_crlf(path)
    try:
        names = pacsv.open_csv(path, read_options=read, parse_options=parse).schema.names
        # every cell as raw bytes: "007" stays "007", and bad UTF-8 is caught per row
        convert = pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.binary()), strings_can_be_null=False)
        reader = pacsv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)
        for batch in reader:
            if (text := _utf8_batch(batch, crlf)) is not None:  # all valid: decoded in Arrow, not cell by cell
                yield text.to_pylist()
                continue
            rows = []
            for row in batch.to_pylist():
                try:
                    rows.append({k: _decode(v, k, crlf) for k, v in row.items()})
                except ValueError as e:
                    raw = {
                        k: v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v for k, v in row.items()
                    }
                    rows.append(("invalid_utf8", str(e), raw))
            yield rows
    except pa.ArrowInvalid as e:
        raise UserError(f"{path}: cannot read as CSV: {printable(str(e).splitlines()[0])}") from None


def skip_bom(f) -> None:
    """Past a UTF-8 byte order mark at the start of a file opened in binary (Excel and Notepad write one)."""
    if f.read(len(codecs.BOM_UTF8)) != codecs.BOM_UTF8:
        f.seek(0)


# json.loads, but a raw control character inside a string (a NUL byte) is read, for data.control_chars to
# judge like an escaped one (\u0000), not an invalid_json reject
JSON_DECODER = json.JSONDecoder(strict=False)


def _jsonl_batches(path: Path, batch_rows: int) -> Iterator[list[tuple[int, dict | tuple]]]:
    """Batches of (the 1-based line number, the line's object or a reject tuple)."""
    rows = []
    with open(path, "rb") as f:
        skip_bom(f)
        for number, line in enumerate(f, 1):  # a CRLF line end is whitespace to JSON
            if not line.strip():
                continue  # blank lines are not rows
            try:
                obj = JSON_DECODER.decode(line.decode("utf-8"))
                item = obj if isinstance(obj, dict) else ("invalid_json", "line is not a JSON object", {"line": obj})
            except UnicodeDecodeError as e:
                raw = {"line": line.decode("utf-8", "backslashreplace").rstrip("\r\n")}
                item = ("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the line", raw)
            except json.JSONDecodeError as e:
                item = ("invalid_json", f"{e.msg} at column {e.colno}", {"line": line.decode().rstrip("\r\n")})
            except RecursionError:  # [[[[... thousands deep: Python's JSON reader cannot follow it
                raw = {"line": line.decode("utf-8", "backslashreplace").rstrip("\r\n")}
                item = ("invalid_json", f"nested deeper than the JSON reader follows ({sys.getrecursionlimit()})", raw)
            rows.append((number, item))
            if len(rows) >= batch_rows:
                yield rows
                rows = []
    if rows:
        yield rows


def json_array_prefix(path: Path) -> str:
    """Where the records of a JSON file are: a top-level array, or the array under an object's first key."""
    with path.open("rb") as f:
        skip_bom(f)
        events = ijson.parse(f)
        try:
            _, event, _ = next(events)
            if event == "start_array":
                return "item"
            if event == "start_map":
                _, event, key = next(events)
                if event == "map_key" and next(events)[1] == "start_array":
                    return f"{key}.item"  # {"data": [...]}
        except StopIteration:
            pass
        except (ijson.JSONError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: cannot read as JSON: {str(e).splitlines()[0]}") from None
    raise UserError(f"{path}: a JSON file must hold an array of objects (or an object whose first key holds one)")


def _json_batches(path: Path, batch_rows: int) -> Iterator[list[dict | tuple]]:
    # streamed with ijson: a JSON array is never held in memory whole
    prefix = json_array_prefix(path)
    rows: list[dict | tuple] = []
    with path.open("rb") as f:
        skip_bom(f)
        try:
            for item in ijson.items(f, prefix, use_float=True):
                bad = ("invalid_json", "item is not an object", {"item": item})
                rows.append(item if isinstance(item, dict) else bad)
                if len(rows) == batch_rows:
                    yield rows
                    rows = []
        except (ijson.JSONError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: cannot read as JSON: {str(e).splitlines()[0]}") from None
    if rows:
        yield rows


def _parquet_batches(path: Path, batch_rows: int) -> Iterator[list[dict | tuple]]:
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path}: cannot read as Parquet: {str(e).splitlines()[0]}") from None
    for batch in batches(file, batch_rows):
        yield batch.to_pylist()


def count_lines(path: Path, chunk: int = 16 << 20) -> int:
    """Newlines in a file (one more when its last line has none), read in large blocks: GB/s."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(chunk):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def rows_at_most(spec: str, fmt: str, limit: int, chunk: int = 1 << 20) -> int | None:
    """An upper bound of the rows in ``spec``'s files, cheap enough for parse time: Parquet's from its metadata,
    JSONL's and CSV's by counting lines (less a CSV's header; blank lines and quoted line breaks only add), read
    in blocks until the count passes ``limit`` (then a number above it); None where unknown (a JSON array)."""
    total = 0
    for path in resolve_paths(spec):
        kind = detect_format(path, fmt)
        if kind == "json":
            return None
        if kind == "parquet":
            try:
                total += pq.ParquetFile(path).metadata.num_rows
            except (pa.ArrowInvalid, OSError):
                return None  # the reader says why
        else:
            lines, last = -(kind != "jsonl"), b"\n"
            with open(path, "rb") as f:
                while total + lines <= limit and (block := f.read(chunk)):
                    lines += block.count(b"\n")
                    last = block[-1:]
            total += max(lines + (last != b"\n"), 0)
        if total > limit:
            break
    return total


def check_rows_fill_nodes(spec: str, fmt: str, mapping: str, nodes: int, separate_eval: bool) -> None:
    """At parse time, before the DAG of ``nodes`` shards is built: a UserError (one line) when ``spec`` cannot
    have the rows the split needs (split.check_shards at the rule's --min-examples-per-shard 1): one for each
    node's shard and, without data.eval_path, one for the eval set. A line count, not a parse: it refuses only
    what is certain (data.mapping nested makes several examples of a row: not checked)."""
    need = nodes + (not separate_eval)
    if mapping == "nested" or nodes < 1:
        return
    found = rows_at_most(spec, fmt, need)
    if found is not None and found < need:
        eval_part = "" if separate_eval else " and one for the eval set"
        raise UserError(
            f"data.path {spec}: at most {found} row{'s' * (found != 1)} (its line count) for nodes: {nodes}; the split"
            f" needs a row for each node's shard{eval_part}: lower nodes or add rows"
        )


def estimate_rows(spec: str, fmt: str = "auto") -> tuple[int | None, bool]:
    """The rows iter_records will yield from ``spec``, for a progress line: (total, exact). Parquet's come from its
    metadata (exact); JSONL's and CSV's are a line count (an estimate: blank lines, a header, quoted newlines);
    a JSON array's are unknown (None)."""
    total, exact = 0, True
    for path in resolve_paths(spec):
        kind = detect_format(path, fmt)
        if kind == "json":
            return None, False
        if kind == "parquet":
            try:
                total += pq.ParquetFile(path).metadata.num_rows
            except (pa.ArrowInvalid, OSError):
                return None, False  # the reader says why
        else:
            total += max(count_lines(path) - (kind != "jsonl"), 0)
            exact = False
    return total, exact


def iter_records(spec: str, fmt: str = "auto", delimiter: str | None = None, batch_rows: int = 8192):
    """Yield lists of Records, a batch at a time, from every file ``spec`` names. A record's ``line`` is the
    file's 1-based line number: exact for JSONL (blank lines counted); for CSV/TSV the row's number with the
    header as line 1 (its line where no cell above it holds a line break); None for JSON and Parquet."""
    for path in resolve_paths(spec):
        kind = detect_format(path, fmt)
        if kind in ("csv", "tsv", "jsonl", "json"):
            check_text(path, kind)
        if kind in ("csv", "tsv"):
            sep = delimiter or ("\t" if kind == "tsv" else ",")
            batches = _csv_batches(path, sep, batch_bytes=4 << 20)
        elif kind == "jsonl":
            batches = _jsonl_batches(path, batch_rows)
        elif kind == "json":
            batches = _json_batches(path, batch_rows)
        else:
            batches = _parquet_batches(path, batch_rows)
        row = 0
        for rows in batches:
            out = []
            for item in rows:
                line = row + 2 if kind in ("csv", "tsv") else None
                if kind == "jsonl":
                    line, item = item
                if isinstance(item, tuple):
                    out.append(Record(str(path), row, item[2], item[:2], line))
                else:
                    out.append(Record(str(path), row, item, line=line))
                row += 1
            yield out


def peek_columns(spec: str, fmt: str = "auto", delimiter: str | None = None) -> tuple[Path, list[str]]:
    """The first file's column names, read from its start only."""
    path = resolve_paths(spec)[0]
    kind = detect_format(path, fmt)
    if kind != "parquet":
        check_text(path, kind)
    if kind in ("csv", "tsv"):
        sep = delimiter or ("\t" if kind == "tsv" else ",")
        try:
            reader = pacsv.open_csv(path, parse_options=pacsv.ParseOptions(delimiter=sep, newlines_in_values=True))
        except pa.ArrowInvalid as e:
            raise UserError(f"{path}: cannot read as CSV: {printable(str(e).splitlines()[0])}") from None
        return path, reader.schema.names
    if kind == "parquet":
        try:
            return path, pq.ParquetFile(path).schema_arrow.names
        except (pa.ArrowInvalid, OSError) as e:
            raise UserError(f"{path}: cannot read as Parquet: {str(e).splitlines()[0]}") from None
    for batch in iter_records(str(path), kind, batch_rows=50):
        names = []
        for rec in batch:
            if not rec.error:
                names += [k for k in rec.fields if k not in names]
        return path, names
    return path, []


# ---------------------------------------------------------------- mappings


def column_names(mapping: str, columns: dict) -> dict:
    """The mapping's column names: its defaults, overridden by data.columns where it names them."""
    if mapping not in MAPPINGS:
        raise UserError(f"data.mapping: unknown mapping {mapping!r} ({', '.join(MAPPINGS)}, or auto)")
    names = dict(DEFAULT_COLUMNS[mapping])
    names.update({k: v for k, v in columns.items() if k in names})
    return names


# What data.mapping: auto reads a file as, by its columns, the first that fits: (mapping, the columns that
# tell it, its column names where they are not the mapping's defaults)
DETECTED = (
    ("chat", ("messages",), {}),
    ("sharegpt", ("conversations",), {}),
    ("nested", ("instruction", "instances"), {}),
    ("alpaca", ("instruction", "output"), {}),
    ("alpaca", ("instruction", "context", "response"), {"input": "context", "output": "response"}),  # Dolly
    ("columns", ("question", "response"), {}),
    ("columns", ("prompt", "completion"), {"prompt": None, "question": "prompt", "response": "completion"}),
    ("columns", ("question", "answer"), {"prompt": None, "response": "answer"}),
    ("columns", ("instruction", "response"), {"prompt": None, "question": "instruction"}),
)


def detect_mapping(present: list[str]) -> tuple[str, dict] | None:
    """The mapping and column names a file with columns ``present`` fits (DETECTED), or None. A ``system``
    column is the system turn of a columns mapping that has no ``prompt``."""
    for mapping, needs, names in DETECTED:
        if set(needs) <= set(present):
            if mapping == "columns" and names.get("prompt", "prompt") not in present and "system" in present:
                names = names | {"prompt": "system"}
            return mapping, dict(names)
    return None


def resolve_mapping(spec: str, fmt: str, mapping: str, columns: dict, delimiter: str | None = None):
    """(mapping, column names) as ``spec`` is read, its mapped columns checked (``check_columns``).
    ``auto``: the mapping the first file's columns fit, with that format's own names; data.columns set
    away from the columns mapping's defaults under ``auto`` mean the columns mapping (the default before
    ``auto``); no fit is a one-line UserError naming the columns found."""
    if mapping == "auto":
        if any(DEFAULT_COLUMNS["columns"].get(k) != v for k, v in columns.items()):
            mapping = "columns"
        else:
            path, present = peek_columns(spec, fmt, delimiter)
            found = detect_mapping(present)
            if found is None:
                raise UserError(
                    f"{path}: data.mapping auto knows no format with the columns {present}; set data.mapping"
                    f" ({', '.join(MAPPINGS)}) and data.columns" + delimiter_hint(path, fmt, present)
                )
            mapping, columns = found
    check_columns(spec, fmt, mapping, columns, delimiter)
    return mapping, column_names(mapping, columns)


def mapping_hint(present: list[str], mapping: str) -> str:
    """For a column not found: the mapping the file's columns fit, when it is another."""
    found = detect_mapping(present)
    return f" (its columns fit data.mapping: {found[0]})" if found and found[0] != mapping else ""


def check_columns(spec: str, fmt: str, mapping: str, columns: dict, delimiter: str | None = None) -> None:
    """Fail early, from the first file's header, when a mapped column is absent."""
    path, present = peek_columns(spec, fmt, delimiter)
    names = column_names(mapping, columns)
    for field in REQUIRED[mapping] + tuple(k for k in names if k not in REQUIRED[mapping]):
        name = names.get(field)
        if name is None:
            if field in REQUIRED[mapping]:
                raise UserError(f"data.columns.{field} is not set (needed by data.mapping {mapping})")
            continue
        if mapping == "nested" and field in ("input", "output"):
            continue  # keys inside each instance, not columns
        # an optional field under its default name may be absent; a name the user chose may not
        optional_default = field not in REQUIRED[mapping] and name == DEFAULT_COLUMNS[mapping].get(field)
        alternate = mapping in ("chat", "sharegpt") and CHAT_COLUMNS.get(name) in present
        if present and name not in present and not optional_default and not alternate:
            raise UserError(
                f"{path}: column {name!r} (data.columns.{field}) not found; the file has {present}"
                + (delimiter_hint(path, fmt, present) or mapping_hint(present, mapping))
            )


def delimiter_hint(path: Path, fmt: str, present: list[str]) -> str:
    """For a CSV whose header names hold a ';', a tab or a '|': it was split on the wrong delimiter."""
    if detect_format(path, fmt) not in ("csv", "tsv"):
        return ""
    for sep, value in ((";", '";"'), ("\t", "tab"), ("|", '"|"')):
        if any(sep in name for name in present):
            return f" (its header holds {'a tab' if sep == chr(9) else repr(sep)}: set data.delimiter: {value})"
    return ""


def _text(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, float) and value != value:  # NaN from pandas-written files
        return None
    return value if isinstance(value, str) else str(value)


def _join(instruction: str, extra: str | None) -> str:
    return f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction


def _fields(instruction: str, extra: str | None) -> dict:
    """The record's own fields, kept beside the joined content for data.format_template's {instruction}
    and {input} (Alpaca's prompt with an input, or the one without)."""
    return {"instruction": instruction, "input": extra if extra and extra.strip() else ""}


def to_examples(fields: dict, mapping: str, names: dict) -> list[tuple[list[dict], None] | tuple[None, tuple]]:
    """Map one record to ``[(messages, None)]`` or ``[(None, (reason, detail))]`` (several for nested)."""

    def get(field):
        return _text(fields.get(names[field])) if names.get(field) else None

    if mapping == "columns":
        system, user, answer = get("prompt"), get("question"), get("response")
        if user is None or answer is None:
            missing = "question" if user is None else "response"
            return [(None, ("missing_field", f"{names[missing]} is missing or null"))]
        turns = [{"role": "system", "content": system}] if system and system.strip() else []
        return [(turns + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], None)]
    if mapping == "alpaca":
        instruction, extra, answer, system = get("instruction"), get("input"), get("output"), get("system")
        if instruction is None or answer is None:
            missing = "instruction" if instruction is None else "output"
            return [(None, ("missing_field", f"{names[missing]} is missing or null"))]
        turns = [{"role": "system", "content": system}] if system and system.strip() else []
        user = {"role": "user", "content": _join(instruction, extra), "fields": _fields(instruction, extra)}
        return [(turns + [user, {"role": "assistant", "content": answer}], None)]
    if mapping in ("chat", "sharegpt"):
        column = names["messages" if mapping == "chat" else "conversations"]
        if column not in fields and CHAT_COLUMNS.get(column) in fields:
            column = CHAT_COLUMNS[column]  # a ShareGPT file read with chat, or the reverse
        return [_chat(fields.get(column), column)]
    instruction, instances = get("instruction"), fields.get(names["instances"])
    if instruction is None:
        return [(None, ("missing_field", f"{names['instruction']} is missing or null"))]
    if not isinstance(instances, list) or not instances:
        return [(None, ("missing_field", f"{names['instances']} is not a non-empty list"))]
    out = []
    for inst in instances:
        if not isinstance(inst, dict) or _text(inst.get(names["output"])) is None:
            out.append((None, ("missing_field", f"an instance has no {names['output']!r}")))
            continue
        extra = _text(inst.get(names["input"]))
        user = {"role": "user", "content": _join(instruction, extra), "fields": _fields(instruction, extra)}
        out.append(([user, {"role": "assistant", "content": _text(inst[names["output"]])}], None))
    return out


def _chat(messages, column: str):
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            return None, ("invalid_json", f"{column} is a string that is not JSON")
    if not isinstance(messages, list) or not messages:
        return None, ("missing_field", f"{column} is missing or not a list")
    turns = []
    for i, m in enumerate(messages):
        turn, problem = _turn(m, i)
        if problem:
            return None, problem
        turns.append(turn)
    roles = [t["role"] for t in turns]
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * (len(body) // 2)
    if len(body) < 2 or body != expected:
        return None, ("bad_turn_order", f"roles {roles}: expected optional system, then user/assistant pairs")
    return turns, None


# ShareGPT's `from` values, and the role each is trained as; function_call and observation (LLaMA-Factory's
# tool call and result) are turns the chat mapping does not train
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
TOOL_TURNS = ("function_call", "observation", "tool", "function")


def _turn(m, i: int) -> tuple[dict | None, tuple | None]:
    """Turn ``i`` of a conversation as ``{role, content}``: an OpenAI ``{role, content}`` (content a string or a
    list of parts) or a ShareGPT ``{from, value}``; or (None, (reason, detail))."""
    if not isinstance(m, dict):
        return None, ("missing_field", f"turn {i} is not an object")
    if "role" in m or "from" not in m:
        role, content = _text(m.get("role")), m.get("content")
    else:
        source = _text(m.get("from"))
        if source in TOOL_TURNS:
            return None, ("unsupported_content", f"turn {i} is from {source!r}, a tool turn, which is not trained")
        if source not in SHAREGPT_ROLES:
            known = ", ".join(SHAREGPT_ROLES)
            return None, ("unknown_role", f"turn {i} is from {source!r}; a ShareGPT turn is from {known}")
        role, content = SHAREGPT_ROLES[source], m.get("value")
    if isinstance(content, list):
        content, problem = _parts(content, i, role)
        if problem:
            return None, problem
    else:
        content = _text(content)
    if role is None or content is None:
        return None, ("missing_field", f"turn {i} lacks {'role' if role is None else 'content'}")
    return {"role": role, "content": content}, None


def _parts(parts: list, i: int, role) -> tuple[str | None, tuple | None]:
    """An OpenAI content list's text parts, joined with a newline (as vLLM joins them for a template that takes
    a string); any other part is an ``unsupported_content`` reject naming its type."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if kind != "text" else "a text part without text"
            return None, ("unsupported_content", f"{role} turn {i} has {what}: only text parts are trained")
        texts.append(part["text"])
    return "\n".join(texts), None


# ---------------------------------------------------------------- control characters

# C0 controls but tab, LF and CR: a NUL or an escape sequence in a field is a broken export, not text
CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")
CONTROL_POLICIES = ("reject", "strip")


class ControlChars:
    """data.control_chars on a conversation: ``reject`` a row with a control character in a turn (reason
    ``control_chars``) or ``strip`` them. Counts the rows and characters found, for the manifest."""

    def __init__(self, policy: str = "reject"):
        if policy not in CONTROL_POLICIES:
            raise UserError(f"data.control_chars must be one of {CONTROL_POLICIES}, not {policy!r}")
        self.policy, self.rows, self.found = policy, 0, Counter()

    def __call__(self, messages: list[dict]) -> tuple[list[dict] | None, tuple | None]:
        """(the conversation as the policy leaves it, None), or (None, (reason, detail)) to reject it."""
        for turn in messages:  # a loop, not any(): this runs on every row
            if CONTROL_CHARS.search(turn["content"]):
                break
        else:
            return messages, None
        hits = [(i, c) for i, turn in enumerate(messages) for c in CONTROL_CHARS.findall(turn["content"])]
        self.rows += 1
        self.found.update(f"U+{ord(c):04X}" for _, c in hits)
        if self.policy == "reject":
            i, c = hits[0]
            name = f"U+{ord(c):04X}" + (" (NUL)" if c == "\0" else "")
            role = messages[i]["role"]
            detail = f"{role} turn {i} contains the control character {name} (data.control_chars: strip keeps the row)"
            return None, ("control_chars", detail)
        return [with_text(turn, lambda text: CONTROL_CHARS.sub("", text)) for turn in messages], None

    def summary(self) -> dict:
        return {"policy": self.policy, "rows": self.rows, "by_char": dict(sorted(self.found.items()))}


def delimiter_arg(value: str | None) -> str | None:
    """'\\t' and 'tab' from config or the command line mean a tab."""
    if value in (None, ""):
        return None
    return {"tab": "\t", "\\t": "\t"}.get(value, value)
