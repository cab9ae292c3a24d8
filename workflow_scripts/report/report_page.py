"""render_page: a table, JSON or text output as a self-contained HTML page, for the report to show in place.

Snakemake's report shows an HTML item in the page, and offers a CSV, JSON or text item as a download only;
rules/report_pages.smk has each such output rendered here into a page beside it, and the report shows that
page (the CSV/JSON/TXT stay as they are, for tools). A page holds no script and loads nothing: inline CSS,
every value escaped, long text wrapped. A CSV's cells are shown as written (no number reformatted); a
``<model>_correct`` column of samples.csv shows ✓ or ✗.
"""

import argparse
import base64
import csv
import html
import json
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError, atomic_path, cli
from workflow_scripts.report.page_layout import (
    clipped,
    like_objects,
    merge_intervals,
    page_order,
    scalar_text,
    sections,
    sideways,
)

STYLE = """
body { font-family: system-ui, sans-serif; font-size: 14px; margin: 1em; color: #222; }
h1 { font-size: 18px; }
table { border-collapse: collapse; margin: 0.3em 0; max-width: 100%; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: left; vertical-align: top;
         white-space: pre-wrap; overflow-wrap: break-word; max-width: 30em; }
th { background: #f0f0f0; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
details summary { cursor: pointer; } details { overflow-wrap: anywhere; } img { max-width: 100%; }
.yes { color: #137333; font-weight: bold; } .no { color: #b3261e; font-weight: bold; }
"""
WRAPPED = "white-space: pre-wrap; overflow-wrap: break-word; font-size: 13px"  # inline: the first page takes the body
MARKS = {"True": ("✓", "yes"), "False": ("✗", "no"), "true": ("✓", "yes"), "false": ("✗", "no")}


def page(title: str, body: str, lead: str = "") -> str:
    """A whole HTML document: ``body`` (HTML) under ``title`` (text), styled inline; ``lead`` (HTML) above the
    title (the leaderboard's verdict: the report's first page opens with it)."""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n"
        f'<body>{lead}<h1 style="font-size: 18px">{html.escape(title)}</h1>\n{body}\n</body></html>\n'
    )


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def is_numeric(value: str) -> bool:
    """A number as page_layout writes it: 1,059, 0.376 or 1.46 [1.22, 1.70]."""
    return bool(value) and is_number(value.replace(",", "").split(" [")[0])


def cell(value: str, column: str) -> str:
    """A table cell: ✓/✗ in a ``_correct`` column, numbers right-aligned, a long text clipped with the whole of it
    in a details element, everything escaped."""
    if column.endswith("_correct") and value in MARKS:
        mark, css = MARKS[value]
        return f'<td class="{css}" title="{value}">{mark}</td>'
    css = ' class="num"' if is_numeric(value) else ""
    mark = ""
    if value[:2] in ("✓ ", "✗ "):  # page_layout.merge_intervals' verdict before a model's answer
        mark = f'<span class="{"yes" if value[0] == "✓" else "no"}">{value[0]}</span> '
        value = value[2:]
    long = clipped(value)
    if long:
        shown, whole = long
        text = f"<details><summary>{mark}{html.escape(shown)}</summary>{html.escape(whole)}</details>"
        return f"<td{css}>{text}</td>"
    return f"<td{css}>{mark}{html.escape(value)}</td>"


def table_html(header: list[str], rows: list[list[str]]) -> str:
    """A table; where the first column has no heading (a table on its side), its cells are the rows' headings."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    lead = not header[0]
    body = "".join(
        "<tr>"
        + (f"<th>{html.escape(row[0])}</th>" if lead else "")
        + "".join(cell(v, h) for h, v in zip(header[lead:], row[lead:], strict=False))
        + "</tr>\n"
        for row in rows
    )
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table>"


def csv_body(text: str, source: str = "the CSV") -> str:
    """A CSV's rows as a table, cells as written (multi-line cells kept, wrapped)."""
    rows = list(csv.reader(text.splitlines(keepends=True)))
    if not rows:
        return "<p>(empty table)</p>"
    header, rows = rows[0], rows[1:]
    for i, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise UserError(f"{source}: row {i} has {len(row)} cells, its header {len(header)}")
    count = len(rows)
    header, rows = merge_intervals(header, rows)
    turned = sideways(header, rows)
    if turned:
        header, rows = turned
        return table_html(header, rows) + f"\n<p>{count} models, a column each (the CSV has a row each)</p>"
    return table_html(header, rows) + f"\n<p>{count} rows</p>"


def td(text: str) -> str:
    """A JSON page's cell: a number right-aligned."""
    return f'<td class="num">{text}</td>' if is_numeric(text) else f"<td>{text}</td>"


def json_html(value, key: str = "", parent: str = "") -> str:
    """JSON as nested tables: an object as key | value rows, an object of like objects (page_layout.like_objects)
    and a list of objects as one table (a column per key), a list of scalars as one comma-separated line; numbers
    formatted, a null package "not installed" (page_layout.scalar_text)."""
    if isinstance(value, dict):
        if not value:
            return "<i>none</i>"
        keys = like_objects(value)
        if keys and len(keys) > len(value):  # on its side: a row per key, a column per object (the shards)
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in ["", *value])
            body = "".join(f"<tr><th>{html.escape(str(k))}</th>" + "".join(td(json_html(v.get(k), k)) for v in
                           value.values()) + "</tr>\n" for k in keys)  # fmt: skip
            return f"<table>\n<thead><tr>{head}</tr></thead>\n{body}</table>"
        if keys:
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in ["", *keys])
            body = "".join(f"<tr><th>{html.escape(str(name))}</th>" + "".join(td(json_html(v.get(k), k)) for k in keys)
                           + "</tr>\n" for name, v in value.items())  # fmt: skip
            return f"<table>\n<thead><tr>{head}</tr></thead>\n{body}</table>"
        rows = "".join(f"<tr><th>{html.escape(str(k))}</th>{td(json_html(v, str(k), key))}</tr>\n"
                       for k, v in value.items())  # fmt: skip
        return f"<table>\n{rows}</table>"
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            keys = list(dict.fromkeys(k for v in value for k in v))
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
            body = "".join("<tr>" + "".join(td(json_html(v.get(k), k)) for k in keys) + "</tr>\n" for v in value)
            return f"<table>\n<thead><tr>{head}</tr></thead>\n{body}</table>"
        if all(not isinstance(v, dict | list) for v in value):
            return html.escape(", ".join(scalar_text(v) for v in value)) or "<i>none</i>"
        return "<ol>" + "".join(f"<li>{json_html(v)}</li>" for v in value) + "</ol>"
    return html.escape(scalar_text(value, key, parent))


def json_page(data) -> str:
    """A JSON file's page: its top-level scalars in one table, then each nested value under its own heading."""
    if not isinstance(data, dict):
        return json_html(data)
    flat, nested = sections(data)
    parts = [json_html(flat)] if flat else []
    parts += [
        f'<h2 style="font-size: 16px">{html.escape(str(k))}</h2>\n{json_html(v, str(k))}' for k, v in nested.items()
    ]
    return "\n".join(parts)


def image_html(path: Path) -> str:
    """A PNG embedded as a data URI, as wide as the page at most. Its base64 in lines of 76 characters (a URL's
    line breaks are dropped when it is read): docutils, which renders the report's first page, refuses a line
    over 10,000 characters."""
    data = base64.encodebytes(path.read_bytes()).decode().strip()
    return f'<p><img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}" style="max-width: 100%"></p>'


def verdict_html(text: str) -> tuple[str, str]:
    """The leaderboard text's verdict (its first block, "Verdict:" then a "- " bullet per sentence, wrapped) as
    a list of sentences in prose, and the rest of the text; ("", text) without one."""
    if not text.startswith("Verdict:"):
        return "", text
    block, _, rest = text.partition("\n\n")
    sentences: list[str] = []
    for line in block.splitlines()[1:]:
        if line.startswith("- ") or not sentences:
            sentences.append(line[2:] if line.startswith("- ") else line.strip())
        else:
            sentences[-1] += " " + line.strip()
    # inline styles: the report's first page shows this page's body without its head
    items = "".join(f'<li style="margin: 0.2em 0">{html.escape(s)}</li>' for s in sentences)
    head = '<p style="font-weight: bold; margin-bottom: 0.2em">Verdict</p>'
    return f'{head}\n<ul style="padding-left: 1.2em; max-width: 60em; margin-top: 0">{items}</ul>\n', rest


def render(path: Path, title: str, images: list[Path] = ()) -> str:
    """The page of ``path`` by its suffix: .csv a table, .json nested tables, anything else wrapped text; then
    ``images`` (PNGs) embedded. The report's first page (report/workflow.rst) shows the body of the
    leaderboard's page: its text and key plots."""
    text = path.read_text()
    if images:
        verdict, text = verdict_html(text)
        body = f'<pre style="{WRAPPED}">{html.escape(text)}</pre>\n'
        return page(title, body + "\n".join(map(image_html, images)), verdict)
    if path.suffix == ".csv":
        return page(title, csv_body(text, str(path)))
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not JSON ({e})") from None
        return page(title, json_page(page_order(data)))
    return page(title, f'<pre style="{WRAPPED}">{html.escape(text)}</pre>')


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, type=Path, help="a .csv, .json or text file")
    p.add_argument("--output", required=True, type=Path, help="the .html page")
    p.add_argument("--title", required=True)
    p.add_argument("--images", nargs="*", default=[], type=Path, help="PNGs shown under a text file's text")
    a = p.parse_args(argv)
    with atomic_path(a.output) as tmp:
        tmp.write_text(render(a.input, a.title, a.images))
    print(f"{a.input} -> {a.output}")


if __name__ == "__main__":
    main()
