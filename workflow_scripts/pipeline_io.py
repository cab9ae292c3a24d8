"""Small helpers shared by the workflow scripts: one-line errors, atomic writes, hashing, progress lines."""

import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input or config: printed as one line, no traceback."""


def cli(main):
    """Run ``main`` so that a UserError ends the process with one line and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_json(path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def file_sha256(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def json_object(text: str) -> dict:
    """argparse type of --template-kwargs: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--template-kwargs: not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise UserError(f"--template-kwargs: a JSON object is needed, not {text!r}")
    return value


def duration(seconds: float | None) -> str:
    """45s, 3m12s, 2h05m, 1d03h: an ETA or an elapsed time as a person reads it ("-" for None)."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class Progress:
    """Progress of a long stage as plain lines in its log (``tail -f`` shows them; no carriage returns):
    ``split: 45,000/~120,000 rows (37%), 1,520 rows/s, ETA 49s``, at most every ``every`` seconds, at each
    tenth of a known total (but not twice within ``least`` seconds), and a last line from ``done()``.
    ``total`` may be an estimate (``exact=False``, shown with ~) or None (no percentage, no ETA). Rates are
    averages since the start. ``update`` takes other running counts too (``tokens=...``), shown with their rate."""

    def __init__(self, what: str, total: int | None = None, unit: str = "rows", *, exact: bool = True,
                 every: float = 30.0, least: float = 2.0, emit=None, clock=time.monotonic):  # fmt: skip
        self.what, self.total, self.unit, self.exact = what, total, unit, exact
        self.every, self.least, self.clock = every, least, clock
        self.emit = emit or logging.getLogger("progress").info
        self.start = self.last = clock()
        self.count, self.others = 0, {}
        self.tenth = 0  # the last tenth of the total a line was written for

    def update(self, n: int, **others: int) -> None:
        self.count += n
        for name, k in others.items():
            self.others[name] = self.others.get(name, 0) + k
        now = self.clock()
        tenth = min(10, self.count * 10 // self.total) if self.total else 0
        if now - self.last >= self.every or (tenth > self.tenth and now - self.last >= self.least):
            self.tenth = max(self.tenth, tenth)
            self.last = now
            self.emit(self.line(now))

    def line(self, now: float, final: bool = False) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.count / elapsed
        done = f"{self.count:,}"
        if self.total:
            done += f"/{'' if self.exact else '~'}{self.total:,} {self.unit} ({100 * self.count / self.total:.0f}%)"
        else:
            done += f" {self.unit}"
        parts = [done, f"{rate:,.0f} {self.unit}/s"]
        parts += [f"{k:,} {name} ({k / elapsed:,.0f} {name}/s)" for name, k in self.others.items()]
        if self.total and rate > 0 and self.count < self.total and not final:
            parts.append(f"ETA {duration((self.total - self.count) / rate)}")
        parts.append(f"elapsed {duration(elapsed)}")
        return f"{self.what}: " + ", ".join(parts)

    def done(self) -> None:
        """The last line: everything counted, the average rates, the time it took."""
        now = self.clock()
        self.total = self.total if self.exact else None  # an estimate is no longer of interest
        self.emit(self.line(now, final=True).replace(": ", ": done, ", 1))


def interpreter_first_on_path(environ=os.environ, executable: str = sys.executable) -> None:
    """Put the folder of the running interpreter first on PATH when it holds the training stack (torchrun),
    so the rules' `python` and `torchrun` are those of the environment Snakemake runs from: `.venv/bin/snakemake`
    works without activating .venv. A job's conda env (--sdm conda) is still put before it by Snakemake, and
    Snakemake's jobs (local or SLURM) inherit the PATH. Nothing changes when it is first already."""
    folder = str(Path(executable).parent)
    path = environ.get("PATH", "")
    if (Path(folder) / "torchrun").exists() and path.split(os.pathsep)[0] != folder:
        environ["PATH"] = os.pathsep.join([folder, path]) if path else folder


def fewer_gc_pauses() -> None:
    """For a stage that streams millions of rows: freeze what exists now (the imported modules, torch's and
    transformers' among them, which each full collection would walk again) and collect the young generation
    every 50,000 allocations instead of 700. The rows' short-lived lists of token ids hold no cycles; a cycle
    is still collected, later. Measured on tokenize_shard, 20k rows: 4.97 -> 4.37 s (docs/benchmarks.md)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
