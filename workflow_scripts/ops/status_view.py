"""status's rendering: the table of training jobs fitted to the terminal's width, the stages, a finished run's summary.

status.py gathers each training job's NodeStatus; this module only formats them. The table leaves out a column
that is "-" on every row, and where it is still wider than the terminal, moves the states' notes below it, shows
a SLURM job by its id alone, then leaves out the least needed columns (named under the table); node, state,
step, ETA and model always stay.
"""

from dataclasses import dataclass, field
from pathlib import Path

from workflow_scripts.core.layout import file, matching
from workflow_scripts.core.pipeline_io import duration


@dataclass
class RunProgress:
    """The whole run beyond its training jobs (status.run_progress): the jobs running now, the stage after training
    that runs, the next one by the files, and the ETA of the whole run with its parts (None: unknown)."""

    running: list[str] = field(default_factory=list)  # "evaluate node0 (slurm 123)", ...
    alive: bool = False  # a Snakemake holds the work dir's lock
    stage: str | None = None  # consolidating, evaluating or summarizing, while one of its jobs runs
    next_stage: str | None = None  # the first stage after training with jobs left
    eta_s: float | None = None
    eta_parts: list[str] = field(default_factory=list)  # "training 3m10s", "evaluation 1m02s"
    eta_unknown: list[str] = field(default_factory=list)  # the parts without an estimate


NEXT = {"consolidating": "consolidation", "evaluating": "evaluation", "summarizing": "the summary"}


def stages(results: Path) -> dict:
    """The stage-level picture from files alone: data split and tokenized, models consolidated and evaluated."""
    return {
        "split": file(results, "MANIFEST").exists(),
        "tokenized": sorted(p.stem for p in matching(results, "TOKEN_STATS", shard="*")),
        "evaluated": sorted(p.stem for p in matching(results, "EVAL_RESULT", model="*")),
        "summary": file(results, "SUMMARY").exists(),
        "grid": file(results, "GRID_TABLE").exists(),  # a grid's comparison (summaries are per variant)
        "report": file(results, "REPORT").exists(),
    }


def leaderboard_head(results: Path) -> list[str]:
    """The best-model lines of eval/leaderboard.txt (its first block after the verdict, up to a blank line)."""
    try:
        text = file(results, "LEADERBOARD_TEXT").read_text()
    except OSError:
        return []
    blocks = text.split("\n\n")
    if blocks[0].startswith("Verdict:") and len(blocks) > 1:  # the verdict's sentences: the report's first page
        blocks = blocks[1:]
    return blocks[0].strip().splitlines()


# Every node's state in one vocabulary, in the order a node goes through them (status.assign_phases): waiting for
# its job or the next stage's, its training job running, its consolidation or evaluation job running, evaluated,
# or its training job ended without finishing. The scheduler's or the stall rule's word follows in parentheses.
PHASES = ("queued", "training", "consolidating", "evaluating", "done", "failed")
TRAINING_PHASE = {"waiting": "queued", "pending": "queued", "starting": "training", "running": "training",
                  "stalled": "training"}  # fmt: skip


def phase(s, running: set[str]) -> str:
    """A NodeStatus's phase (PHASES) from its training state, the jobs running now (status.running_jobs' names:
    "consolidate node0", "evaluate lr-1e-05/node1") and its files: "done" only once trained, consolidated and
    evaluated; a trained node whose next job is not running is queued."""
    if s.state != "done":
        return TRAINING_PHASE.get(s.state, "failed")  # failed, timeout, cancelled, stopped, ...
    if f"consolidate {name(s)}" in running:
        return "consolidating"
    if f"evaluate {name(s)}" in running:
        return "evaluating"
    return "done" if s.model and s.eval_loss is not None else "queued"


def state_word(s) -> str:
    """The state cell's word: the phase, and the training state where it says more (pending, starting,
    stalled, timeout, ...)."""
    word = s.phase or phase(s, set())
    detail = s.state if s.state not in ("running", "done", "waiting", word) else ""
    if word == "queued" and s.state == "done":
        detail = "consolidation next" if not s.model else "evaluation next"
    return f"{word} ({detail})" if detail else word


def number(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def epochs(value: float | None) -> str:
    """Epochs trained: whole ones as such (a finished run's 20), else two decimals."""
    if value is None:
        return "-"
    return f"{round(value)}" if abs(value - round(value)) < 1e-6 else f"{value:.2f}"


# loss: the mean of the recent logged losses; held-out: the latest held-out loss logged during training
# (training.eval_every); tok/s: the median of the recent intervals; checkpoint: the newest complete one's step
# and age; resumed: the step (signal, job) this job took over from; eval: the model's held-out eval loss once
# evaluated (the state says where it is before that)
COLUMNS = ["node", "job", "state", "step", "epoch", "loss", "held-out", "tok/s", "MFU", "ETA", "checkpoint",
           "resumed", "eval"]  # fmt: skip
KEPT = {"node", "state", "step", "ETA", "eval"}  # never left out
LEAVE_OUT = ["resumed", "MFU", "job", "checkpoint", "epoch", "tok/s", "loss", "held-out"]  # first left out first
RIGHT = {"step", "epoch", "loss", "held-out", "tok/s", "MFU", "ETA"}


def row(s, now: float, notes: bool = True) -> list[str]:
    """A NodeStatus's cells (status.py), in COLUMNS' order; ``notes``: the state's notes in its cell."""
    ckpt = f"{s.checkpoint['step']}, {duration(now - s.checkpoint['time'])} ago" if s.checkpoint else "-"
    resumed = "-"
    if s.resumed_after:
        r = s.resumed_after
        resumed = f"{r.get('step')}" + (f" {r['signal']}" if r.get("signal") else "")
        resumed += f" job {r['slurm_job_id']}" if r.get("slurm_job_id") else ""
    model = "-" if s.eval_loss is None else f"{s.eval_loss:.3f}"
    state = state_word(s) + (f": {'; '.join(s.notes)}" if s.notes and notes else "")
    return [
        name(s),
        s.job or "-",
        state,
        f"{number(s.step, 'd')}/{number(s.total, 'd')}",
        epochs(s.epoch),
        number(s.loss, ".4f"),
        number(s.held_out, ".4f"),
        number(s.tokens_per_s, ".0f"),
        "-" if s.mfu is None else f"{s.mfu:.1%}",
        "done" if s.state == "done" else duration(s.eta_s),
        ckpt,
        resumed,
        model,
    ]


def name(s) -> str:
    return f"{s.variant}/{s.node}" if s.variant else s.node


def table_width(columns: list[str], rows: list[list[str]], sep: int) -> int:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    return sum(widths) + sep * (len(columns) - 1)


def fit(nodes: list, now: float, width: int | None, sep: int = 2) -> tuple[list[str], list[list[str]], list[str]]:
    """The table's columns and rows for ``width`` characters (None: any width), and the lines to print below it
    (the notes moved out of the state cells, the columns left out)."""
    columns, rows = list(COLUMNS), [row(s, now) for s in nodes]

    def drop(column: str) -> None:
        i = columns.index(column)
        del columns[i]
        for r in rows:
            del r[i]

    for column in [c for c in COLUMNS if c not in KEPT]:
        if all(r[columns.index(column)] == "-" for r in rows):
            drop(column)
    below: list[str] = []
    if width is None or table_width(columns, rows, sep) <= width:
        return columns, rows, below
    state = columns.index("state")
    for r, s in zip(rows, nodes, strict=True):
        if s.notes:
            r[state] = state_word(s)
            below.append(f"{name(s)}: {'; '.join(s.notes)}")
        if "job" in columns:  # the SLURM job's id without its state, which the state column says
            r[columns.index("job")] = r[columns.index("job")].split()[0]
    left_out = []
    for column in LEAVE_OUT:
        if table_width(columns, rows, sep) <= width:
            break
        if column in columns:
            drop(column)
            left_out.append(column)
    if left_out:
        below.append(f"(left out at {width} columns: {', '.join(left_out)})")
    return columns, rows, below


def summary_lines(nodes: list, results: Path) -> list[str]:
    """A finished run: each job done at step N, its final loss and training time; the best model."""
    lines = []
    for s in nodes:
        evaluated = f", eval loss {s.eval_loss:.3f}" if s.eval_loss is not None else ""
        lines.append(
            f"{name(s)}: done at step {number(s.step, 'd')}, final loss {number(s.last_loss, '.4f')}, "
            f"trained {duration(s.train_seconds)}{evaluated}"
        )
    lines += leaderboard_head(results)
    for variant in dict.fromkeys(s.variant for s in nodes if s.variant):  # a grid: each variant's best model
        head = leaderboard_head(results / variant)
        first = head[1:2] if head[:1] and head[0].startswith("Best model per metric") else head[:1]  # eval loss's
        lines += [f"{variant}: {line.strip()}" for line in first]
    return lines


def stage_line(picture: dict) -> str:
    return (
        f"stages: split {'yes' if picture['split'] else 'no'}; tokenized {', '.join(picture['tokenized']) or '-'};"
        f" evaluated {', '.join(picture['evaluated']) or '-'};"
        + (" grid.csv yes;" if picture["grid"] else f" summary {'yes' if picture['summary'] else 'no'};")
        + f" report {'yes' if picture['report'] else 'no'}"
    )


def headline(nodes: list, results: Path, progress: RunProgress | None = None) -> str:
    """`N training job(s)` while one trains; then `training finished; evaluating` (the stage whose job runs now,
    also where an older summary is still there: a retrained node's) or `...; evaluation next, no job running`;
    `finished` once the models are compared (summary, a grid's table) and no later job runs."""
    if not nodes or any(s.state != "done" for s in nodes):
        return f"{len(nodes)} training job(s)"
    if progress is not None and progress.stage:
        return f"training finished; {progress.stage}"
    compared = any(file(results, name).exists() for name in ("SUMMARY", "GRID_TABLE"))  # GRID_TABLE: a grid's
    if compared:
        return "finished"
    if progress is None:
        return "training finished"
    if progress.next_stage:
        return f"training finished; {NEXT[progress.next_stage]} next, no job running"
    return "training finished"


def progress_lines(progress: RunProgress | None, finished: bool) -> list[str]:
    """`running now: ...` (or the jobs a stopped Snakemake left unfinished) and the whole run's ETA."""
    if progress is None or finished:
        return []
    lines = []
    if progress.running and progress.alive:
        lines.append(f"running now: {', '.join(progress.running)}")
    elif progress.running:
        jobs = ", ".join(progress.running)
        lines.append(f"left unfinished by a Snakemake that is not running (a rerun redoes them): {jobs}")
    parts = ", ".join(progress.eta_parts)
    if progress.eta_s is not None:
        lines.append(f"whole run: ETA {duration(progress.eta_s)} ({parts}; each later stage as long as its longest"
                     " finished job, its jobs side by side)")  # fmt: skip
    elif progress.eta_unknown:
        known = f"{parts}; " if parts else ""
        lines.append(f"whole run: ETA unknown ({known}not yet measured: {', '.join(progress.eta_unknown)})")
    return lines


def render_plain(run: str, nodes: list, results: Path, now: float, width: int | None = None,
                 progress: RunProgress | None = None) -> str:  # fmt: skip
    """The status as plain text: a header, an aligned table (fitted to ``width``), the stages, what runs now and
    the whole run's ETA, and a finished run's summary."""
    finished = bool(nodes) and all(s.state == "done" for s in nodes)
    lines = [f"run {run}: {headline(nodes, results, progress)} ({results})"]
    if nodes:
        columns, rows, below = fit(nodes, now, width)
        table = [columns, *rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
        lines += below
    else:
        lines.append("no training folder yet")
    lines.append(stage_line(stages(results)))
    lines += progress_lines(progress, headline(nodes, results, progress) == "finished")
    if finished:
        lines += summary_lines(nodes, results)
    return "\n".join(lines)


STATE_STYLE = {"done": "green", "training": "cyan", "consolidating": "cyan", "evaluating": "cyan", "queued": "yellow",
               "failed": "red"}  # fmt: skip


def render_rich(console, run: str, nodes: list, results: Path, now: float, progress: RunProgress | None = None) -> None:
    """The status as a rich table, fitted to the console's width (rich wraps the lines below it)."""
    from rich import box
    from rich.table import Table

    finished = bool(nodes) and all(s.state == "done" for s in nodes)
    table = Table(
        title=f"run {run}: {headline(nodes, results, progress)}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        show_edge=False,
    )
    # a column's right padding, the box's blank divider and the next one's left padding
    columns, rows, below = fit(nodes, now, console.width, sep=3)
    for c in columns:
        table.add_column(c, justify="right" if c in RIGHT else "left", no_wrap=True, min_width=len(c))
    state = columns.index("state")
    for s, cells in zip(nodes, rows, strict=True):
        style = "bold red" if s.state == "stalled" else STATE_STYLE.get(s.phase or s.state, "")
        cells[state] = f"[{style}]{cells[state]}[/]" if style else cells[state]
        table.add_row(*cells)
    console.print(table if nodes else f"run {run}: no training folder yet")
    after = progress_lines(progress, headline(nodes, results, progress) == "finished")
    for line in [*(below if nodes else []), stage_line(stages(results)), *after]:
        console.print(line, highlight=False)
    if finished:
        for line in summary_lines(nodes, results):
            console.print(line, highlight=False)
