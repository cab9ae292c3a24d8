"""summarize: one table of every evaluated model and the training curves of every node."""

import argparse
import json
from pathlib import Path

import matplotlib
import pandas as pd
from pipeline_io import atomic_path, cli

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = ["model", "eval_loss", "perplexity", "exact_match", "rouge_l", "bleu", "chrf"]
SCORES = ["exact_match", "rouge_l", "bleu", "chrf"]  # all on 0-1, higher is better


def summary_table(results: list[dict]) -> pd.DataFrame:
    """One row per model, base first, with the change against base."""
    frame = pd.DataFrame(results)
    frame = frame[[c for c in COLUMNS if c in frame.columns]]
    frame = frame.sort_values("model", key=lambda s: s.map(lambda m: -1 if m == "base" else int(m.startswith("soup"))),
                              kind="stable")  # fmt: skip
    base = frame[frame["model"] == "base"]
    if len(base):
        frame["eval_loss_vs_base"] = frame["eval_loss"] / base["eval_loss"].iloc[0]
        frame["exact_match_delta"] = frame["exact_match"] - base["exact_match"].iloc[0]
    return frame.reset_index(drop=True)


def leaderboard_text(table: pd.DataFrame) -> str:
    """What the end of a run says: the best model (lowest held-out eval loss), its eval loss and exact match
    against the untrained base model's, then every model's numbers. `make run` prints it; the report shows it."""
    rows = table.dropna(subset=["eval_loss"])
    best = rows.loc[rows["eval_loss"].idxmin()]
    lines = [
        f"Best model: {best['model']} (lowest eval loss of the {len(rows)} models evaluated on the same held-out set)"
    ]
    base = rows[rows["model"] == "base"]
    if len(base):
        b = base.iloc[0]
        lines += [
            f"  eval loss    {best['eval_loss']:.3f} vs base {b['eval_loss']:.3f}:"
            f" {best['eval_loss'] / b['eval_loss']:.2f}x base ({best['eval_loss'] - b['eval_loss']:+.3f})",
            f"  exact match  {best['exact_match']:.3f} vs base {b['exact_match']:.3f}:"
            f" {best['exact_match'] - b['exact_match']:+.3f}",
        ]
        if best["model"] == "base":
            lines.append("  no trained model has a lower eval loss than the untrained base model")
    else:
        lines.append(f"  eval loss {best['eval_loss']:.3f}, exact match {best['exact_match']:.3f} (no base model)")
    columns = [c for c in ("model", "eval_loss", *SCORES) if c in table]
    lines += [
        "",
        "eval_loss: lower is better; exact_match, rouge_l, bleu, chrf: 0-1, higher is better",
        table[columns].to_string(index=False, float_format="{:.3f}".format),
    ]
    return "\n".join(lines) + "\n"


def examples_trained(plan: dict) -> dict:
    """From a training job's plan.json: the examples its shard(s) hold after tokenization, and how many
    the planned steps draw (all for whole epochs; with max_steps short of an epoch, or the last partial
    global batch of an epoch, fewer; exact without packing, pro rata of the packed bins with it)."""
    units = plan.get("packed_bins") or plan["examples"]
    drawn = min(units, plan["total_steps"] * plan["global_batch"])
    trained = plan["examples"] if drawn >= units else round(plan["examples"] * drawn / units)
    return {"examples_tokenized": plan["examples"], "examples_trained": trained}


def with_examples_trained(table: pd.DataFrame, metrics: list[Path]) -> pd.DataFrame:
    """The summary with examples_tokenized and examples_trained for each trained model (train/<node>/plan.json,
    beside its metrics); empty for the base model and the soups."""
    counts = {p.parent.name: examples_trained(json.loads((p.parent / "plan.json").read_text()))
              for p in metrics if (p.parent / "plan.json").exists()}  # fmt: skip
    if not counts:
        return table
    for column in ("examples_tokenized", "examples_trained"):
        table[column] = table["model"].map(lambda m, c=column: counts.get(m, {}).get(c)).astype("Int64")
    return table


def read_metrics(path: Path) -> pd.DataFrame:
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def plot_curves(curves: dict[str, pd.DataFrame], path: Path) -> None:
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    for name, frame in curves.items():
        ax_loss.plot(frame["step"], frame["loss"], label=name)
        ax_lr.plot(frame["step"], frame["lr"], label=name)
    ax_loss.set(xlabel="step", ylabel="training loss", title="Loss per node", yscale="log")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="Learning rate")
    for ax in (ax_loss, ax_lr):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def median_throughput(curves: dict[str, pd.DataFrame]) -> dict[str, float]:
    """Median tokens/s of each node over its logged intervals (the first one includes start-up)."""
    return {
        name: float(frame["tokens_per_s"].median())
        for name, frame in curves.items()
        if "tokens_per_s" in frame and frame["tokens_per_s"].notna().any()
    }


def plot_throughput(curves: dict[str, pd.DataFrame], path: Path) -> dict[str, float]:
    """Training throughput (tokens/s of all of a node's ranks together) per logged interval, every node overlaid."""
    medians = median_throughput(curves)
    fig, ax = plt.subplots(figsize=(11, 4))
    for name, median in medians.items():
        frame = curves[name]
        ax.plot(frame["step"], frame["tokens_per_s"], marker="o", ms=3, label=f"{name} (median {median:,.0f})")
    ax.set(xlabel="step", ylabel="tokens/s per node", title="Training throughput per node", ylim=(0, None))
    ax.grid(alpha=0.3)
    if medians:
        ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return medians


def plot_leaderboard(table: pd.DataFrame, path: Path) -> str:
    """Eval loss per model, the best one highlighted and named in the title. Returns its name."""
    best = table.loc[table["eval_loss"].idxmin()]
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(table) + 1.6))
    colors = ["tab:green" if m == best["model"] else "tab:gray" for m in table["model"]]
    ax.barh(table["model"], table["eval_loss"], color=colors)
    for y, (loss, em) in enumerate(zip(table["eval_loss"], table["exact_match"], strict=True)):
        ax.text(loss, y, f"  loss {loss:.3f}   exact match {em:.3f}", va="center")
    ax.invert_yaxis()
    ax.set_xlim(0, table["eval_loss"].max() * 1.45)
    vs_base = f", {best['eval_loss_vs_base']:.2f}x the base model's loss" if "eval_loss_vs_base" in best else ""
    ax.set_title(f"Best model: {best['model']} (eval loss {best['eval_loss']:.3f}{vs_base})", fontweight="bold")
    ax.set_xlabel("held-out loss (lower is better)")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return str(best["model"])


def plot_categories(results: list[dict], path: Path) -> None:
    """Exact match per category, one bar per model."""
    table = pd.DataFrame({r["model"]: r.get("exact_match_by_category", {}) for r in results})
    fig, ax = plt.subplots(figsize=(11, 4))
    if len(table):
        table.plot.bar(ax=ax, rot=0)
    ax.set(title="Exact match per category", ylabel="exact match", ylim=(0, 1))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def consolidation_table(folders: list[Path]) -> pd.DataFrame:
    """One row per consolidated model: what was read, how the self-check went, peak memory per phase."""
    rows = []
    for folder in folders:
        report = json.loads((folder / "consolidation.json").read_text())
        index = folder / "model.safetensors.index.json"
        size = (
            json.loads(index.read_text())["metadata"]["total_size"]
            if index.exists()
            else sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        )
        row = {
            "model": folder.name,
            "strategy": report["strategy"],
            "peft": report["peft"],
            "step": report["step"],
            "weight_files": len(report["weight_files"]),
            "dtype": report.get("dtype", "float32"),  # written before consolidate.dtype: fp32
            "weights_mb": size / 2**20,
            "max_logit_diff": report["max_logit_diff"],
            "generation_ok": report["generation_ok"],
        }
        peaks = report.get("peak_rss_mb", {})  # in the order the phases run
        row |= {f"peak_rss_mb_{p}": peaks[p] for p in ("training_side_model", "write", "reload_check") if p in peaks}
        rows.append(row)
    return pd.DataFrame(rows)


def samples_table(results: list[dict]) -> pd.DataFrame:
    """Prompt, reference and every model's answer, side by side."""
    base = results[0]["samples"]
    rows = [{"prompt": s.get("prompt", ""), "reference": s["reference"]} for s in base]
    for r in results:
        for row, sample in zip(rows, r["samples"], strict=False):
            row[r["model"]] = sample["prediction"]
    return pd.DataFrame(rows)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", nargs="+", required=True, type=Path, help="eval/<model>.json files")
    p.add_argument("--metrics", nargs="+", required=True, type=Path, help="train/node<i>/metrics.jsonl files")
    p.add_argument("--summary", required=True, type=Path)
    p.add_argument("--curves", required=True, type=Path)
    p.add_argument("--throughput", required=True, type=Path)
    p.add_argument("--categories", required=True, type=Path)
    p.add_argument("--leaderboard", required=True, type=Path)
    p.add_argument("--leaderboard-text", required=True, type=Path)
    p.add_argument("--samples", required=True, type=Path)
    p.add_argument("--models", nargs="+", required=True, type=Path, help="models/<node> folders")
    p.add_argument("--consolidation", required=True, type=Path)
    a = p.parse_args(argv)
    results = [json.loads(p.read_text()) for p in a.results]
    table = with_examples_trained(summary_table(results), a.metrics)
    with atomic_path(a.summary) as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    curves = {p.parent.name: read_metrics(p) for p in a.metrics}
    plot_curves(curves, a.curves)
    for node, tps in plot_throughput(curves, a.throughput).items():
        print(f"{node}: median {tps:,.0f} tokens/s")
    plot_categories(results, a.categories)
    plot_leaderboard(table, a.leaderboard)
    board = leaderboard_text(table)
    with atomic_path(a.leaderboard_text) as tmp:
        tmp.write_text(board)
    with atomic_path(a.samples) as tmp:
        samples_table(results).to_csv(tmp, index=False)
    with atomic_path(a.consolidation) as tmp:
        consolidation_table(a.models).to_csv(tmp, index=False, float_format="%.6g")
    print(table.to_string(index=False))
    print(board, end="")


if __name__ == "__main__":
    main()
