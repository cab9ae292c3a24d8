"""dry_run_summary: what a submission would ask the cluster for, from Snakemake's own dry run.

Runs `snakemake -n` with the given arguments (the profile's resources are evaluated by Snakemake itself and
printed with each job: `resources: ..., slurm_partition=gpu, runtime=1440, gpu=4, ...`), prints its output, then
one line per partition and rule: the jobs, GPUs per job, the first try's time limit and the GPU-hours requested
(GPUs x time limit, over the jobs), and the totals. The rules declared `localrules` (the Snakefile and
rules/*.smk) and the report's pages (report_pages.py) run where Snakemake runs and are counted apart. Retries
(a longer limit each) are not counted.

    python -m workflow_scripts.ops.dry_run_summary --profile profiles/slurm --configfile my.yaml
    snakemake -n --profile profiles/slurm --configfile my.yaml | python -m workflow_scripts.ops.dry_run_summary --read -
"""

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RULE_LINE = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):\s*$")
RESOURCES_LINE = re.compile(r"^\s+resources: (.*)$")
NO_RUN = {"all"}  # the target rule: nothing to run


@dataclass
class DryJob:
    rule: str
    resources: dict[str, str] = field(default_factory=dict)


def parse_resources(text: str) -> dict[str, str]:
    """`tmpdir=/tmp, mem_mb=8000, slurm_partition=gpu, slurm_extra=--signal=URG@600` → a dict (a value may hold
    '=' or ', ' itself: a new key starts only at ', <name>=')."""
    out = {}
    for item in re.split(r", (?=\w+=)", text.strip()):
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def parse_dry_run(text: str) -> list[DryJob]:
    """Each job of a dry run's output (`rule <name>:` and its indented lines) with its resources."""
    jobs: list[DryJob] = []
    for line in text.splitlines():
        header = RULE_LINE.match(line)
        if header:
            jobs.append(DryJob(header.group(1)))
            continue
        resources = RESOURCES_LINE.match(line)
        if resources and jobs and not jobs[-1].resources:
            jobs[-1].resources = parse_resources(resources.group(1))
    return jobs


def minutes(value: str | None) -> float | None:
    """A runtime resource in minutes: Snakemake's number of minutes, or a text such as `2h`, `90m`, `1d 2h`."""
    if value is None or value in {"", "<TBD>", "None"}:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    units = {"s": 1 / 60, "m": 1, "min": 1, "h": 60, "d": 1440}
    parts = re.findall(r"([\d.]+)\s*(min|[smhd])", value)
    return sum(float(n) * units[u] for n, u in parts) if parts else None


def gpus(resources: dict[str, str]) -> int:
    """GPUs of one job: `gpu` (sbatch --gpus, the job's) or `gpus`, else `gres=gpu[:type]:<n>` per node x `nodes`."""
    for key in ("gpu", "gpus"):
        if resources.get(key, "").isdigit():
            return int(resources[key])
    match = re.search(r"gpu(?::[\w.-]+)?:(\d+)", resources.get("gres", ""))
    if match:
        nodes = int(resources["nodes"]) if resources.get("nodes", "").isdigit() else 1
        return int(match.group(1)) * nodes
    return 0


def local_rules(workflow_dir: Path = REPO) -> set[str]:
    """The rules a `localrules:` directive names in the Snakefile and rules/*.smk, and the report's pages' rules
    (rules/report_pages.smk makes one per row of report_pages.py, each `localrule: True`)."""
    from workflow_scripts.core.pages import PAGES

    names = {f"render_{page.name}_page" for page in PAGES}
    for path in [workflow_dir / "Snakefile", *sorted((workflow_dir / "rules").glob("*.smk"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for block in re.finditer(r"^localrules:((?:\s*\n?[ \t]+\w+,?)+)", text, re.M):
            names |= set(re.findall(r"\w+", block.group(1)))
    return names


@dataclass
class Row:
    partition: str
    rule: str
    jobs: int = 0
    gpus_per_job: set = field(default_factory=set)
    limits: set = field(default_factory=set)  # minutes
    gpu_hours: float = 0.0
    unknown_limit: bool = False


def summarize(jobs: list[DryJob], local: set[str]) -> tuple[list[Row], list[str]]:
    """The submitted jobs per (partition, rule), sorted by GPU-hours then partition and rule; the local rules' names."""
    rows: dict[tuple[str, str], Row] = {}
    local_jobs: dict[str, int] = defaultdict(int)
    for job in jobs:
        if job.rule in NO_RUN:
            continue
        if job.rule in local:
            local_jobs[job.rule] += 1
            continue
        partition = job.resources.get("slurm_partition", "") or "(cluster default)"
        row = rows.setdefault((partition, job.rule), Row(partition, job.rule))
        row.jobs += 1
        n, limit = gpus(job.resources), minutes(job.resources.get("runtime"))
        row.gpus_per_job.add(n)
        if limit is None:
            row.unknown_limit = row.unknown_limit or n > 0
        else:
            row.limits.add(limit)
            row.gpu_hours += n * limit / 60
    ordered = sorted(rows.values(), key=lambda r: (-r.gpu_hours, r.partition, r.rule))
    pages = sorted(rule for rule in local_jobs if re.fullmatch(r"render_\w+_page", rule))  # the report's pages
    others = [(rule, n) for rule, n in sorted(local_jobs.items()) if rule not in pages]
    named = [f"{rule} x{n}" if n > 1 else rule for rule, n in others]
    if pages:
        named.append(f"{sum(local_jobs[rule] for rule in pages)} report page(s) (render_*_page)")
    return ordered, named


def span(values: set, fmt) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return fmt(low) if low == high else f"{fmt(low)}-{fmt(high)}"


def limit_text(value: float) -> str:
    hours, rest = divmod(round(value), 60)
    return f"{hours} h" + (f" {rest} min" if rest else "") if hours else f"{rest} min"


def render(rows: list[Row], local: list[str]) -> str:
    """The summary's lines: a table of the submitted jobs, the local ones, the totals per partition."""
    header = ["partition", "rule", "jobs", "GPUs/job", "time limit", "GPU-hours"]
    table = [
        [r.partition, r.rule, str(r.jobs), span(r.gpus_per_job, str), span(r.limits, limit_text),
         f"{r.gpu_hours:.1f}" + ("+?" if r.unknown_limit else "")]
        for r in rows
    ]  # fmt: skip
    lines = ["", "Requested per partition (GPU-hours: GPUs x the first try's time limit; retries not counted):"]
    if table:
        widths = [max(len(x[i]) for x in [header, *table]) for i in range(len(header))]
        right = {2, 3, 5}
        for cells in [header, *table]:
            pairs = enumerate(zip(cells, widths, strict=True))
            aligned = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in pairs]
            lines.append("  " + "  ".join(aligned).rstrip())
    else:
        lines.append("  no job to submit")
    per_partition: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        per_partition[r.partition][0] += r.jobs
        per_partition[r.partition][1] += r.gpu_hours
    totals = ", ".join(f"{p} {int(n)} job(s), {h:.1f} GPU-h" for p, (n, h) in sorted(per_partition.items()))
    if local:
        lines.append(f"  local (on the host running Snakemake, not submitted): {', '.join(local)}")
    submitted = sum(r.jobs for r in rows)
    gpu_hours = sum(r.gpu_hours for r in rows)
    lines.append(f"total: {submitted} job(s) submitted ({totals or 'none'}); {gpu_hours:.1f} GPU-hours requested")
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--read", metavar="FILE", help="summarize a dry run's saved output ('-': stdin), run none")
    p.add_argument("--quiet", action="store_true", help="print the summary only, not the dry run's own output")
    return p.parse_known_args(argv)


def main(argv=None) -> int:
    a, snakemake_args = parse_args(argv)
    if a.read:
        text = sys.stdin.read() if a.read == "-" else Path(a.read).read_text()
        code = 0
    else:
        snakemake = Path(sys.executable).parent / "snakemake"
        cmd = [str(snakemake) if snakemake.exists() else "snakemake", "-n", *snakemake_args]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        text, code = proc.stdout, proc.returncode
        if not a.quiet or code:
            print(text, end="")
        if code:
            return code
    rows, local = summarize(parse_dry_run(text), local_rules())
    print(render(rows, local))
    return code


if __name__ == "__main__":
    sys.exit(main())
