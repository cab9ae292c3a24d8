"""data_report: what the data stages did, as JSON and one figure for the report.

Rows per node, eval and rejects; rejects by reason; tokens per node; length
histograms per node; packing efficiency against padding to the longest example.
"""

import argparse
import json
from pathlib import Path

import matplotlib
import pyarrow.parquet as pq
from pipeline_io import atomic_path, cli, write_json

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def collect(manifest: dict, stats: dict[str, dict], lengths: dict[str, list[int]]) -> dict:
    shards = {}
    for name, s in stats.items():
        n = lengths[name]
        shards[name] = {
            "examples": s["examples"],
            "tokens": s["tokens"],
            "max_length": max(n) if n else 0,
            "mean_length": sum(n) / len(n) if n else 0.0,
            "dropped_too_long": s["dropped_too_long"],
            "truncated": s["truncated"],
            "packing_efficiency": s["packing_efficiency"],
            "pad_to_longest_efficiency": s["pad_to_longest_efficiency"],
            "cache": s.get("cache"),
        }
    return {
        "rows_in": manifest["rows_in"],
        "rows_per_node": [n["rows"] for n in manifest["nodes"]],
        "eval_rows": manifest["eval"]["rows"],
        "rejected": manifest["rejects"]["rows"],
        "rejects_by_reason": manifest["rejects"]["by_reason"],
        "special_text": manifest.get("special_text"),  # data.special_text: policy, rows and tokens found
        "shards": shards,
    }


def draw_rejects(ax, report: dict) -> None:
    """Rejected rows per reason as bars; with no rejects, no empty chart but a line saying so."""
    reasons = {r: n for r, n in report["rejects_by_reason"].items() if n}
    ax.set_title(f"Rejected rows by reason ({report['rejected']} of {report['rows_in']})")
    if not reasons:
        ax.axis("off")
        text = f"No rejected rows:\nall {report['rows_in']} input rows kept"
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=12)
        return
    ax.barh(list(reasons), list(reasons.values()), color="tab:red")
    ax.set(xlabel="rows")
    ax.grid(alpha=0.3)


def plot(report: dict, lengths: dict[str, list[int]], path: Path) -> None:
    fig, (ax_len, ax_rej, ax_tok) = plt.subplots(1, 3, figsize=(14, 4))
    for name, n in lengths.items():
        if n:
            ax_len.hist(n, bins=40, histtype="step", label=name)
    ax_len.set(title="Sequence length per shard", xlabel="tokens", ylabel="examples", yscale="log")
    ax_len.legend()
    draw_rejects(ax_rej, report)
    names = list(report["shards"])
    ax_tok.bar(names, [report["shards"][n]["tokens"] for n in names], color="tab:blue")
    ax_tok.set(title="Tokens per shard", ylabel="tokens")
    for ax in (ax_len, ax_tok):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", required=True, type=Path)
    p.add_argument("--tokenized", nargs="+", required=True, type=Path, help="tokenized shards (.parquet)")
    p.add_argument("--json", required=True, type=Path)
    p.add_argument("--plot", required=True, type=Path)
    a = p.parse_args(argv)
    manifest = json.loads(a.manifest.read_text())
    stats = {t.stem: json.loads(t.with_suffix(".json").read_text()) for t in a.tokenized}
    lengths = {t.stem: pq.read_table(t, columns=["length"]).column("length").to_pylist() for t in a.tokenized}
    report = collect(manifest, stats, lengths)
    write_json(a.json, report)
    plot(report, lengths, a.plot)
    print(json.dumps({k: v for k, v in report.items() if k != "shards"}))


if __name__ == "__main__":
    main()
