"""compare_grid: the table that compares an experiment grid's variants (eval/grid.csv) and its plot; the variants
themselves (names, expansion, their training sections) are core/variants.py's.
"""

import argparse
import json
import math
from pathlib import Path

from workflow_scripts.core.pipeline_io import UserError, atomic_path, cli
from workflow_scripts.core.settings import GridConfig
from workflow_scripts.core.variants import PREFIX, expand_grid, value_text
from workflow_scripts.evals.metrics import LOSSES, NOT_METRICS, SCORES, direction, lower_is_better, task_scores

FIRST = (*LOSSES, SCORES[0])  # the table's first metric columns (losses, exact match); the rest as they come


def metrics_of(result: dict) -> dict:
    """A result JSON's numeric metrics: its top-level numbers (eval_loss, perplexity, exact_match, ...; not
    their stderr) and, when it has one, its `tasks` as `<task>.<metric>`, read as summarize reads them
    (lm-eval's "acc,none" is acc; "exact_match,strict-match" is exact_match/strict-match)."""
    out = {
        k: float(v)
        for k, v in result.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k not in NOT_METRICS and "_stderr" not in k
    }
    for task, scores in task_scores(result).items():
        out |= {f"{task}.{metric}": value for metric, (value, _) in scores.items()}
    return out


def grid_rows(variants: dict[str, dict], results: dict[tuple[str, str], dict], base: dict) -> list[dict]:
    """The rows of eval/grid.csv: base first, then each (variant, model) in grid order, with the variant's
    grid values as columns (key without `training.`), every metric, `<metric>_delta` (minus base) and
    `<metric>_ratio` (over base), and `best_for`: the metrics for which the row is the best of the
    trained variants (lowest for losses and perplexities, highest otherwise; ties all marked, and none where
    every variant scores the same)."""
    keys = [k.removeprefix(PREFIX) for k in next(iter(variants.values()), {})]
    base_metrics = metrics_of(base)
    rows = [{"variant": "base", "model": "base", **dict.fromkeys(keys), **base_metrics}]
    for (variant, model), result in results.items():
        grid_values = variants[variant].items()
        values = {k.removeprefix(PREFIX): value_text(v) if isinstance(v, list) else v for k, v in grid_values}
        rows.append({"variant": variant, "model": model, **values, **metrics_of(result)})
    found = [m for row in rows for m in row if m not in {"variant", "model", *keys}]
    metrics = list(dict.fromkeys([*(m for m in FIRST if m in found), *found]))
    for row in rows:
        for m in metrics:
            value, ref = row.get(m), base_metrics.get(m)
            row[f"{m}_delta"] = value - ref if value is not None and ref is not None else None
            row[f"{m}_ratio"] = value / ref if value is not None and ref else None
    best = {}
    for m in metrics:
        scored = [row[m] for row in rows[1:] if row.get(m) is not None and not math.isnan(row[m])]
        if scored and min(scored) != max(scored):  # where every variant scores the same, none is best
            best[m] = min(scored) if lower_is_better(m) else max(scored)
    for row in rows:
        marks = [m for m, b in best.items() if row["variant"] != "base" and row.get(m) == b]
        row["best_for"] = ";".join(marks)
    changes = [f"{m}_{change}" for m in metrics for change in ("delta", "ratio")]
    order = ["variant", "model", *keys, *metrics, *changes, "best_for"]
    return [{column: row.get(column) for column in order} for row in rows]


def grid_table(rows: list[dict], variants: dict[str, dict]):
    """eval/grid.csv as a DataFrame; the grid's columns keep their values' types beside the base row's blanks."""
    import pandas as pd

    table = pd.DataFrame(rows)
    for key in next(iter(variants.values()), {}):
        column = key.removeprefix(PREFIX)
        table[column] = pd.Series([row.get(column) for row in rows], dtype=object)
    return table


def plot_grid(table, path: Path, metrics=("eval_loss", "exact_match")) -> None:
    """One panel per metric: a bar per variant x model, the base model's value as a dashed line."""
    from workflow_scripts.core.plotting import (  # matplotlib: not imported when the Snakefile imports this
        model_color,
        plt,
        save_png,
    )

    metrics = [m for m in metrics if m in table]
    trained = table[table["variant"] != "base"]
    labels = [f"{v}\n{m}" for v, m in zip(trained["variant"], trained["model"], strict=True)]
    panels = max(len(metrics), 1)
    fig, axes = plt.subplots(1, panels, figsize=(panels * max(4.0, 0.8 * len(labels)), 4.5), squeeze=False)
    axes = list(axes[0])
    for ax, metric in zip(axes, metrics, strict=False):
        ax.bar(range(len(labels)), trained[metric], color=[model_color(m) for m in trained["model"]])
        base = table.loc[table["variant"] == "base", metric]
        if len(base) and base.notna().all():
            ax.axhline(float(base.iloc[0]), color=model_color("base"), linestyle="--", label="base")
            ax.legend()
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{metric} ({direction(metric)})")
    save_png(fig, path)


def result_key(path: Path, variants: dict) -> tuple[str, str]:
    """(variant, model) of results/<run>/<variant>/eval/<model>.json."""
    variant = path.parent.parent.name
    if variant not in variants:
        raise UserError(f"{path}: not in a variant's folder ({', '.join(variants)})")
    return variant, path.stem


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True, help="settings.GridConfig as JSON: the config's grid")
    p.add_argument("--base", required=True, type=Path, help="the base model's eval/base.json")
    p.add_argument("--results", nargs="+", required=True, type=Path, help="each <variant>/eval/<model>.json")
    p.add_argument("--table", required=True, type=Path)
    p.add_argument("--plot", required=True, type=Path)
    a = p.parse_args(argv)
    variants = expand_grid(GridConfig.from_json(a.config).grid)
    results = {result_key(r, variants): json.loads(r.read_text()) for r in a.results}
    table = grid_table(grid_rows(variants, results, json.loads(a.base.read_text())), variants)
    with atomic_path(a.table) as tmp:
        table.to_csv(tmp, index=False)
    plot_grid(table, a.plot)
    print(table.to_string(index=False, max_cols=12))


if __name__ == "__main__":
    main()
