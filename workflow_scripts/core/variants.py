"""An experiment grid's variants: `grid:` maps dotted training keys to lists of values; the variants are their
cartesian product, in the order the keys and values are written. A variant's name joins `<key>-<value>` per grid
key with `_`, the key without its `training.` prefix (`lr-1e-05_lora.r-8`); settings.check_grid validates keys and
values. The rules (one job chain per variant), layout (a variant's folder) and report/grid.py (the table) read
them from here.
"""

import copy
import itertools
import json
import re

from workflow_scripts.core.pipeline_io import UserError

PREFIX = "training."


def value_text(value) -> str:
    """A grid value as it appears in a variant's name: floats in Python's short form (1e-05, 0.003)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "+".join(value_text(v) for v in value)
    return str(value)


def variant_name(values: dict) -> str:
    """`lr-1e-05_lora.r-8` for {"training.lr": 1e-5, "training.lora.r": 8}: file-system safe (characters
    other than letters, digits, `.`, `_`, `+` and `-` become `-`)."""
    parts = [f"{key.removeprefix(PREFIX)}-{value_text(value)}" for key, value in values.items()]
    return re.sub(r"[^A-Za-z0-9._+-]", "-", "_".join(parts))


def expand_grid(grid: dict) -> dict[str, dict]:
    """Each variant's name -> its grid values ({dotted key: value}); {} without a grid. Two variants whose
    names would be the same (a value listed twice) are a UserError naming the key."""
    if not grid:
        return {}
    for key, values in grid.items():
        texts = [value_text(v) for v in values]
        if len(set(texts)) < len(texts):
            raise UserError(f"grid: {key} lists {next(t for t in texts if texts.count(t) > 1)} twice")
    variants = {}
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo, strict=True))
        name = variant_name(values)
        if name in variants:  # values that differ only in characters a file name cannot hold
            raise UserError(f"grid: two variants would both be named {name}; make their values differ in letters")
        variants[name] = values
    return variants


def variant_training(training: dict, values: dict) -> dict:
    """The `training` section with a variant's grid values set (a deep copy)."""
    out = copy.deepcopy(training)
    for key, value in values.items():
        *parents, leaf = key.removeprefix(PREFIX).split(".")
        section = out
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = copy.deepcopy(value)
    return out
