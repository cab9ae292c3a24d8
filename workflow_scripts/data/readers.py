"""Readers: any common data file in, records out, a batch at a time.

A reader streams the rows of one file format (CSV, TSV, JSONL, JSON array, Parquet) from one file, every data file
of a folder, or a glob. READERS holds them by data.format's name; the schema's data.format enum equals its keys
and ``auto`` (tests/test_split.py holds them equal). To add a file format, write its batches function (lists of
a row's dict, or a reject tuple (reason, detail, what was read)) and add a ``Reader`` entry to READERS with its
extensions, then the name to config/schema.yaml's data.format enum. data_mappings.py turns a record into a
conversation; split.py runs both.
"""

import codecs
import glob
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ijson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from workflow_scripts.core.contracts import batches, parquet_file
from workflow_scripts.core.pipeline_io import UserError


@dataclass
class Record:
    """One input row: where it came from, and its fields or why it could not be read."""

    source_file: str
    source_row: int
    fields: dict | None  # the record; for an unreadable one, what could be recovered of it
    error: tuple[str, str] | None = None  # (reason, detail)
    line: int | None = None  # the file's 1-based line the record starts on (source_line: JSONL exact, CSV/TSV by rows)


def resolve_paths(spec: str) -> list[Path]:
    """One file, every data file in a folder, or a glob; sorted, so the order is stable."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in EXTENSIONS and p.is_file())
        if not files:
            raise UserError(f"data.path: folder {spec} has no {'/'.join(EXTENSIONS)} files")
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
        if fmt not in READERS:
            raise UserError(f"data.format: unknown format {fmt!r} ({', '.join(READERS)})")
        return fmt
    found = EXTENSIONS.get(path.suffix.lower())
    if found is None:
        raise UserError(f"data.path: cannot tell the format of {path} from its extension; set data.format")
    return found


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
        file = parquet_file(path)
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


def _csv_columns(path: Path, delimiter: str) -> list[str]:
    try:
        reader = pacsv.open_csv(path, parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True))
    except pa.ArrowInvalid as e:
        raise UserError(f"{path}: cannot read as CSV: {printable(str(e).splitlines()[0])}") from None
    return reader.schema.names


def _parquet_columns(path: Path, delimiter: str | None) -> list[str]:
    try:
        return parquet_file(path).schema_arrow.names
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path}: cannot read as Parquet: {str(e).splitlines()[0]}") from None


@dataclass(frozen=True)
class Reader:
    """A file format. ``batches(path, batch_rows, delimiter)`` yields lists of rows (a dict, or a reject tuple
    (reason, detail, fields)); ``lines`` says how a row's line is known: "row" (a CSV: the header is line 1),
    "item" (batches yield (line, row) pairs: JSONL) or None. ``text``: the file must be UTF-8 text (check_text);
    ``header``: lines before the first row; ``count``: how its rows are bounded cheaply ("lines", "metadata":
    Parquet's, None: unknown); ``columns(path, delimiter)`` reads the header alone (None: the first rows' keys);
    ``delimiter``: the default a delimited format splits on (None: not delimited)."""

    extensions: tuple[str, ...]
    batches: Callable[[Path, int, str | None], Iterator[list]]
    lines: str | None = None
    text: bool = True
    header: int = 0
    count: str | None = "lines"
    columns: Callable[[Path, str | None], list[str]] | None = None
    delimiter: str | None = None


def delimited(extension: str, delimiter: str) -> Reader:
    """CSV-like text: arrow's reader, every cell a string, ``delimiter`` unless data.delimiter says another."""
    return Reader(
        (extension,), lambda path, rows, sep: _csv_batches(path, sep or delimiter, batch_bytes=4 << 20), lines="row",
        header=1, columns=lambda path, sep: _csv_columns(path, sep or delimiter), delimiter=delimiter,
    )  # fmt: skip


# data.format's names (the schema's enum less auto), each with its reader; a new format is one entry here
READERS = {
    "csv": delimited(".csv", ","),
    "tsv": delimited(".tsv", "\t"),
    "jsonl": Reader((".jsonl",), lambda path, rows, _: _jsonl_batches(path, rows), lines="item"),
    "json": Reader((".json",), lambda path, rows, _: _json_batches(path, rows), count=None),
    "parquet": Reader(
        (".parquet",),
        lambda path, rows, _: _parquet_batches(path, rows),
        text=False,
        count="metadata",
        columns=_parquet_columns,
    ),  # fmt: skip
}
FORMATS = tuple(READERS)
EXTENSIONS = {ext: name for name, reader in READERS.items() for ext in reader.extensions}


def rows_at_most(spec: str, fmt: str, limit: int, chunk: int = 1 << 20) -> int | None:
    """An upper bound of the rows in ``spec``'s files, cheap enough for parse time: Parquet's from its metadata,
    JSONL's and CSV's by counting lines (less a CSV's header; blank lines and quoted line breaks only add), read
    in blocks until the count passes ``limit`` (then a number above it); None where unknown (a JSON array)."""
    total = 0
    for path in resolve_paths(spec):
        reader = READERS[detect_format(path, fmt)]
        if reader.count is None:
            return None
        if reader.count == "metadata":
            try:
                total += parquet_file(path).metadata.num_rows
            except (pa.ArrowInvalid, OSError):
                return None  # the reader says why
        else:
            lines, last = -reader.header, b"\n"
            with open(path, "rb") as f:
                while total + lines <= limit and (block := f.read(chunk)):
                    lines += block.count(b"\n")
                    last = block[-1:]
            total += max(lines + (last != b"\n"), 0)
        if total > limit:
            break
    return total


def estimate_rows(spec: str, fmt: str = "auto") -> tuple[int | None, bool]:
    """The rows iter_records will yield from ``spec``, for a progress line: (total, exact). Parquet's come from its
    metadata (exact); JSONL's and CSV's are a line count (an estimate: blank lines, a header, quoted newlines);
    a JSON array's are unknown (None)."""
    total, exact = 0, True
    for path in resolve_paths(spec):
        reader = READERS[detect_format(path, fmt)]
        if reader.count is None:
            return None, False
        if reader.count == "metadata":
            try:
                total += parquet_file(path).metadata.num_rows
            except (pa.ArrowInvalid, OSError):
                return None, False  # the reader says why
        else:
            total += max(count_lines(path) - reader.header, 0)
            exact = False
    return total, exact


def iter_records(spec: str, fmt: str = "auto", delimiter: str | None = None, batch_rows: int = 8192):
    """Yield lists of Records, a batch at a time, from every file ``spec`` names. A record's ``line`` is the
    file's 1-based line number: exact for JSONL (blank lines counted); for CSV/TSV the row's number with the
    header as line 1 (its line where no cell above it holds a line break); None for JSON and Parquet."""
    for path in resolve_paths(spec):
        kind = detect_format(path, fmt)
        reader = READERS[kind]
        if reader.text:
            check_text(path, kind)
        row = 0
        for rows in reader.batches(path, batch_rows, delimiter):
            out = []
            for item in rows:
                line = row + 2 if reader.lines == "row" else None
                if reader.lines == "item":
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
    reader = READERS[kind]
    if reader.text:
        check_text(path, kind)
    if reader.columns is not None:
        return path, reader.columns(path, delimiter)
    for batch in iter_records(str(path), kind, batch_rows=50):
        names = []
        for rec in batch:
            if not rec.error:
                names += [k for k in rec.fields if k not in names]
        return path, names
    return path, []


def delimiter_hint(path: Path, fmt: str, present: list[str]) -> str:
    """For a CSV whose header names hold a ';', a tab or a '|': it was split on the wrong delimiter."""
    if READERS[detect_format(path, fmt)].delimiter is None:
        return ""
    for sep, value in ((";", '";"'), ("\t", "tab"), ("|", '"|"')):
        if any(sep in name for name in present):
            return f" (its header holds {'a tab' if sep == chr(9) else repr(sep)}: set data.delimiter: {value})"
    return ""


def delimiter_arg(value: str | None) -> str | None:
    """'\\t' and 'tab' from config or the command line mean a tab."""
    if value in (None, ""):
        return None
    return {"tab": "\t", "\\t": "\t"}.get(value, value)
