"""Small helpers shared by the workflow scripts: one-line errors, atomic writes, hashing, progress lines."""

import contextlib
import errno
import fcntl
import functools
import gc
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
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


def new_temp_file(folder: Path, name: str) -> Path:
    """A new empty hidden file ``.<name>.<random>.tmp`` in ``folder``, with the mode any new file gets (0666 less
    the umask: 0644 by default), not mkstemp's 0600: renamed onto an output, it is readable as the others are."""
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name} in {folder}")


def new_file_mode() -> int:
    """The mode the umask gives any new file: 0666 less the umask (0644 by default)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def umask_modes(folder) -> None:
    """Every file under ``folder`` (a library's save_pretrained output) with the mode of any new file: safetensors
    0.8 writes its files 0600 through a temporary file, which a group sharing results/ could not read."""
    mode = new_file_mode()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink() and (path.stat().st_mode & 0o777) != mode:
            path.chmod(mode)


def size_text(n: float) -> str:
    """1.5 GB, 320 MB, 0 B: a size as a person reads it (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def is_disk_full(error: BaseException, free: int | None) -> bool:
    """``error`` is a full disk or quota: its errno or its text says so (pyarrow, C++ streams wrap it), or
    the file system had less than 1 MiB free when it was raised (torch's `basic_ios::clear: iostream error`)."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    return any(text in str(error) for text in DISK_FULL_TEXT) or (free is not None and free < 2**20)


RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")  # torch's prefix on a rank's traceback lines
LOGGED = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (ERROR|CRITICAL|WARNING) (.+)$")  # cli's logging format


SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+)$")  # srun's word on a node's task that ended
# what torchrun raises because another process ended (a rank; srun ending the node's task): never the cause
CONSEQUENCES = ("ChildFailedError", "SignalException: Process")


def stop_reason(text: str) -> str | None:
    """Why a job stopped, as one line, from the end of its log: the last `error: ...` line (cli's UserError),
    else the exception line that ends the last traceback (a rank's too; torchrun's ChildFailedError only wraps a
    rank's, its SignalException is srun ending it), else the first node task srun saw end (a joint job's), else the
    last ERROR line logged (or the trainer's warning that it exits 75 on a stop signal); None when the log says
    nothing (killed from outside)."""
    found: dict[int, str] = {}
    in_traceback = False
    for line in text.splitlines():
        line = RANK_PREFIX.sub("", line.rstrip())
        if line.startswith("error: "):
            found[0] = line.removeprefix("error: ")
        elif line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            in_traceback = False
            if not any(c in line for c in CONSEQUENCES):
                found[1] = line
        elif (m := SRUN_TASK.match(line)) and 2 not in found:
            node, task, how = m.groups()
            found[2] = f"{node}'s task {task} {how[0].lower()}{how[1:]} (srun then ended the other nodes' tasks)"
        elif (m := LOGGED.match(line)) and (m.group(1) != "WARNING" or "exiting 75" in line):
            found[3] = m.group(2)
    return found[min(found)] if found else None


def log_tail(path, tail: int = 1 << 16) -> str | None:
    """The last ``tail`` bytes of the file ``path`` as text (None when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            return f.read().decode(errors="replace")
    except OSError:
        return None


def log_stop_reason(path, tail: int = 1 << 16) -> str | None:
    """stop_reason of the last ``tail`` bytes of the log file ``path`` (None when it cannot be read)."""
    text = log_tail(path, tail)
    return None if text is None else stop_reason(text)


# slurmstepd's lines in a job's SLURM log (its stdout) when SLURM, not the job, ended it (Slurm before 20.02: no "ON")
SLURM_CANCELLED = re.compile(r"\*\*\* (JOB|STEP) (\S+)(?: ON (\S+))? CANCELLED AT (\S+)(?: DUE TO (.+?))? \*\*\*")
SLURM_OOM = re.compile(r"Detected \d+ oom[-_]kill event\S* in (?:step )?(\S+?)\.?(?:\s|$)")
SLURM_CAUSES = {"TIME LIMIT": "its time limit (the rule's resources.runtime, minutes)", "PREEMPTION": "preemption"}


def slurm_stop_reason(text: str) -> str | None:
    """Why SLURM ended a job, as one line, from its SLURM log (slurmstepd's `*** JOB 7 ON node0 CANCELLED AT ...
    DUE TO TIME LIMIT ***`, an oom-kill count); None when SLURM said nothing of it there."""
    cancelled = [m for line in text.splitlines() if (m := SLURM_CANCELLED.search(line))]
    if cancelled:
        kind, job, node, when, cause = cancelled[0].groups()
        why = SLURM_CAUSES.get(cause, cause.lower()) if cause else "scancel or an administrator"
        return f"SLURM cancelled {kind.lower()} {job}{f' on {node}' if node else ''} at {when}: {why}"
    oom = [m for line in text.splitlines() if (m := SLURM_OOM.search(line))]
    if oom:
        return f"SLURM killed {oom[-1].group(1)} for memory: out of its memory (the rule's resources.mem_mb)"
    return None


def slurm_log_folder(rule: str, wildcards: list) -> Path:
    """Where Snakemake's slurm executor writes the SLURM logs (the batch jobs' output) of a rule's job with these
    wildcard values (its get_job_wildcards)."""
    return Path(".snakemake", "slurm_logs", f"rule_{rule}", "_".join(map(str, wildcards)).replace(os.sep, "_"))


def slurm_log_stop_reason(folder, since: float = 0.0, tail: int = 1 << 16) -> str | None:
    """slurm_stop_reason of the newest SLURM log (``*.log``) in ``folder``, Snakemake's slurm executor's folder for
    one rule and wildcards (.snakemake/slurm_logs/rule_<name>/<wildcards>), if written at or after ``since`` (this
    run's start: not an earlier run's); None when there is none."""
    logs = sorted(Path(folder).glob("*.log"), key=lambda p: p.stat().st_mtime) if Path(folder).is_dir() else []
    if not logs or logs[-1].stat().st_mtime < since:
        return None
    text = log_tail(logs[-1], tail)
    return None if text is None else slurm_stop_reason(text)


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success. The file gets the
    mode of any new file (the umask's, see new_temp_file). A full disk or quota while writing ends in a
    UserError naming ``path`` and the free space there (one line, by cli), the partial file removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_file(path.parent, path.name)
    try:
        yield tmp
        os.replace(tmp, path)
    except Exception as e:
        free = free_bytes(path.parent)
        if is_disk_full(e, free):
            left = "unknown" if free is None else size_text(free)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"{path}: disk full while writing it ({left} free in {path.parent}; {why})") from e
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_json(path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def file_sha256(path, chunk: int = 1 << 22) -> str:
    """A file's sha256, read in 4 MiB blocks (checkpoint manifests, token caches, the split's sources)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def locked(path):
    """An exclusive lock held for the ``with`` block on ``<path>.lock`` (created beside ``path``): parallel jobs
    that build the same cache entry, token store or MLflow store wait for the first one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_metrics(path) -> list[dict]:
    """metrics.jsonl's records, one per logged step (status.py's progress, summarize.py's curves). A line cut
    short (a write in progress, a crash) is skipped; a step logged again (a job that resumed from an earlier
    checkpoint) replaces the records from that step on, as the resumed job's history does."""
    records: list[dict] = []
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        while records and records[-1]["step"] >= record["step"]:
            records.pop()
        records.append(record)
    return records


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


CHECKOUT = Path(__file__).resolve().parents[2]  # the folder holding the package workflow_scripts


def module_env(environ=os.environ) -> dict:
    """``environ`` with this checkout first on PYTHONPATH: a script started as `python -m workflow_scripts.<...>`
    from another one imports the same package wherever the parent ran from."""
    paths = [str(CHECKOUT), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(environ) | {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def checkout_on_pythonpath(environ=os.environ) -> None:
    """Put this checkout first on ``environ``'s PYTHONPATH (the Snakefile: every job's python imports the package
    workflow_scripts of the checkout the workflow runs from, wherever it lives; a SLURM job inherits it and its own
    Snakemake sets it again)."""
    environ["PYTHONPATH"] = module_env(environ)["PYTHONPATH"]


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
    is still collected, later. Measured on tokenize_shard, 20k rows: 4.97 -> 4.37 s (docs/benchmarks/data.md)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
