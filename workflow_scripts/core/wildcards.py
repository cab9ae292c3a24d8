"""Wildcard constraints as short regular expressions: the same names matched, a fraction of the cost.

The rules hold {node}, {shard} and {model} to the run's own names (rules/common.smk's wildcard_constraints).
Written as an alternation of every name ("node0|node1|...|node255"), Snakemake compiles that into each output
pattern of each rule and tries it on every file it looks up: at 256 nodes, 1.0 s of a 12 s cProfile of the 1,044-job
dry run (0.46 s with these), about 0.1-0.3 s of the real run (docs/benchmarks/parse-time.md). ``one_of`` matches
exactly the same names: a run of numbered names (node0 ... node255) becomes the prefix and a range of numbers, every
other name stays itself.
"""

import re

NUMBERED = re.compile(r"(.*?)(0|[1-9][0-9]*)")  # a name's prefix and its number, written without leading zeros


def _same_length(lo: str, hi: str) -> list[str]:
    """Patterns matching every number from ``lo`` to ``hi`` (as strings of one length, lo <= hi)."""
    if lo == hi:
        return [lo]
    if len(lo) == 1:
        return [f"[{lo}-{hi}]"]
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    tail = len(lo) - 1
    low_full, high_full = lo[1:] == "0" * tail, hi[1:] == "9" * tail
    first = int(lo[0]) + (not low_full)  # the leading digits whose every tail is in the range
    last = int(hi[0]) - (not high_full)
    out = [] if low_full else [lo[0] + rest for rest in _same_length(lo[1:], "9" * tail)]
    if first <= last:
        digits = str(first) if first == last else f"[{first}-{last}]"
        out.append(digits + "[0-9]" * tail)
    if not high_full:
        out += [hi[0] + rest for rest in _same_length("0" * tail, hi[1:])]
    return out


def number_range(lo: int, hi: int) -> str:
    """A pattern matching the decimal numbers lo..hi (no leading zeros), nothing else."""
    parts = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(hi, 10**digits - 1)
        if a <= b:
            parts += _same_length(str(a), str(b))
    return parts[0] if len(parts) == 1 else f"(?:{'|'.join(parts)})"


def one_of(names) -> str:
    """A regular expression matching exactly ``names`` (and, with a group, nothing else), shorter than their
    alternation where names are numbered in runs: ["base", "node0", ..., "node255"] ->
    ``base|node(?:[0-9]|[1-9][0-9]|1[0-9][0-9]|2[0-4][0-9]|25[0-5])``. An empty list matches nothing."""
    names = list(dict.fromkeys(names))
    numbered: dict[str, list[int]] = {}
    for name in names:
        found = NUMBERED.fullmatch(name)
        if found:
            numbered.setdefault(found[1], []).append(int(found[2]))
    out, done = [], set()
    for name in names:
        found = NUMBERED.fullmatch(name)
        if not found:
            out.append(re.escape(name))
            continue
        prefix = found[1]
        if prefix in done:
            continue
        done.add(prefix)
        numbers = sorted(numbered[prefix])
        start = 0
        for i in range(1, len(numbers) + 1):  # each run of consecutive numbers: the prefix and its range
            if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
                lo, hi = numbers[start], numbers[i - 1]
                out.append(re.escape(prefix) + (str(lo) if lo == hi else number_range(lo, hi)))
                start = i
    return "|".join(out) or "(?!)"
