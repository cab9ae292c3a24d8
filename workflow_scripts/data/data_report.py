"""data_report: what the data stages did, as JSON and one figure for the report.

Rows per node, eval and rejects; rejects by reason (the split's and tokenization's);
each shard's rows from the split to the tokenized examples training reads; tokens per
node; length histograms per node (before truncation, against max_seq_len); packing
efficiency against padding to the longest example. Every count comes from the split's
manifest (rows) and tokenization's stats (examples, tokens, lengths): only tokenization
tokenizes.
"""

import argparse
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from workflow_scripts.core.pipeline_io import cli, write_json
from workflow_scripts.core.plotting import model_color, plt, save_png


def collect(manifest: dict, stats: dict[str, dict], lengths: dict[str, list[int]], decon: dict | None = None) -> dict:
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
            "rejected": s.get("rejected", {}),
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
        "special_text": special_text(stats),  # data.special_text: policy, rows and tokens found
        "control_chars": manifest.get("control_chars"),  # data.control_chars: policy, rows and characters found
        "shards": shards,
        "decontamination": decontamination(decon),
    } | funnel(manifest, stats, decon)


def special_text(stats: dict[str, dict]) -> dict | None:
    """data.special_text over every shard tokenization read: the policy, the special tokens looked for,
    the rows holding one and the count of each token found."""
    found = [s["special_text"] for s in stats.values() if s.get("special_text")]
    if not found:
        return None
    by_token = Counter()
    for f in found:
        by_token.update(f["by_token"])
    return found[0] | {"rows": sum(f["rows"] for f in found), "by_token": dict(by_token)}


def decontamination(decon: dict | None) -> dict | None:
    """data/decontamination.json in brief: the policy, the training rows involved, and per evaluation set the
    documents sharing an n-gram with them (the examples stay in that file)."""
    if decon is None:
        return None
    sets = {name: {k: v for k, v in s.items() if k != "examples"} for name, s in decon["sets"].items()}
    keep = ("ngram", "policy", "training_rows", "training_rows_contaminated", "training_rows_by_shard")
    return {k: decon[k] for k in keep} | {"sets": sets}


def funnel(manifest: dict, stats: dict[str, dict], decon: dict | None = None) -> dict:
    """Where the input rows went: per shard, the rows the split gave it, those data.decontaminate: drop left
    out (``contaminated``, in data/contaminated.parquet), the examples tokenization left out (by reason; each
    in data/tokenized/<shard>.rejects.parquet) and the examples training reads. Training draws every
    tokenized example for whole epochs (eval/summary.csv: examples_trained)."""
    dropped = decon["training_rows_by_shard"] if decon and decon["policy"] == "drop" else {}
    shards, by_reason = {}, {}
    split_rows = {f"node{n['node']}": n["rows"] for n in manifest["nodes"]} | {"eval": manifest["eval"]["rows"]}
    for name, s in stats.items():
        rejected = s.get("rejected", {}) | ({"contaminated": dropped[name]} if dropped.get(name) else {})
        shards[name] = {
            "split": split_rows.get(name, s.get("rows")),
            "left_out": sum(rejected.values()),
            "left_out_by_reason": rejected,
            "tokenized": s["examples"],
        }
        for reason, n in rejected.items():
            if reason != "contaminated":
                by_reason[reason] = by_reason.get(reason, 0) + n
    tokenized = sum(s["tokenized"] for s in shards.values())
    return {
        "max_seq_len": next((s["settings"]["max_seq_len"] for s in stats.values() if "settings" in s), None),
        "tokenize_rejected": sum(by_reason.values()),
        "tokenize_rejects_by_reason": by_reason,
        "funnel": {"rows_in": manifest["rows_in"], "split_rejected": manifest["rejects"]["rows"],
                   "shards": shards, "tokenized": tokenized},
    }  # fmt: skip


def draw_rejects(ax, report: dict) -> None:
    """Rejected rows per reason, the split's and tokenization's, as bars; with no rejects, no empty chart
    but a line saying so."""
    reasons = {r: n for r, n in report["rejects_by_reason"].items() if n}
    reasons |= {f"tokenize: {r}": n for r, n in report.get("tokenize_rejects_by_reason", {}).items() if n}
    total = report["rejected"] + report.get("tokenize_rejected", 0)
    ax.set_title(f"Rejected rows by reason ({total} of {report['rows_in']})")
    if not reasons:
        ax.axis("off")
        text = f"No rejected rows:\nall {report['rows_in']} input rows kept"
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=12)
        return
    ax.barh(list(reasons), list(reasons.values()), color="tab:red")
    ax.set(xlabel="rows")
    ax.grid(alpha=0.3)


def draw_lengths(ax, counts: dict[str, dict[int, int]], max_len: int | None, before: bool) -> None:
    """Length histograms per shard (examples by length), with data.max_seq_len as a vertical line: what
    lies right of it is truncated or left out."""
    for name, c in counts.items():
        if c:
            ax.hist(list(c), bins=40, weights=list(c.values()), histtype="step", label=name, color=model_color(name))
    if max_len:
        ax.axvline(max_len, color="black", linestyle="--", label=f"max_seq_len {max_len}")
    title = "Example length per shard" + (" (before truncation)" if before else "")
    ax.set(title=title, xlabel="tokens", ylabel="examples", yscale="log")
    ax.legend()


def draw_funnel(ax, report: dict) -> None:
    """Per shard: the rows the split gave it, and the examples left after tokenization."""
    shards = report["funnel"]["shards"]
    names = list(shards)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [shards[n]["split"] for n in names], 0.4, label="split", color="tab:gray")
    ax.bar([i + 0.2 for i in x], [shards[n]["tokenized"] for n in names], 0.4, label="tokenized", color="tab:green")
    ax.set_xticks(list(x), names)
    ax.set(title=f"Rows per shard ({report['rows_in']} in)", ylabel="rows")
    ax.legend()


def draw_packing(ax, shards: dict[str, dict]) -> None:
    """Per shard: the share of token slots holding real tokens, packed into bins of max_seq_len against each
    micro-batch padded to its longest example (packing.py's packing_efficiency, pad_to_longest_efficiency)."""
    names = [n for n, s in shards.items() if "packing_efficiency" in s]
    x = range(len(names))
    for offset, key, label, hatch in ((-0.2, "packing_efficiency", "packed", None),
                                      (0.2, "pad_to_longest_efficiency", "padded to longest", "//")):  # fmt: skip
        values = [shards[n][key] for n in names]
        ax.bar([i + offset for i in x], values, 0.4, label=label, hatch=hatch,
               color=[model_color(n) for n in names], edgecolor="black")  # fmt: skip
    ax.set_xticks(list(x), names)
    ax.set(title="Token slots holding real tokens", ylabel="share of slots", ylim=(0, 1))
    ax.legend(fontsize="small")


def plot(report: dict, counts: dict[str, dict[int, int]], path: Path, before: bool = False) -> None:
    """overview.png: five panels in the funnel's order (rows through the stages, the rejects, lengths, tokens,
    packing), two a row at 11 inches wide: the report shows an image in a frame of about 1,000 px, where one
    row of five (22 x 4 inches) shrank its text to a few pixels."""
    fig, axes = plt.subplots(3, 2, figsize=(11, 11))
    (ax_fun, ax_rej), (ax_len, ax_tok), (ax_pack, ax_off) = axes
    ax_off.axis("off")
    draw_lengths(ax_len, counts, report.get("max_seq_len"), before)
    draw_rejects(ax_rej, report)
    draw_funnel(ax_fun, report)
    names = list(report["shards"])
    ax_tok.bar(names, [report["shards"][n]["tokens"] for n in names], color=[model_color(n) for n in names])
    ax_tok.set(title="Tokens per shard", ylabel="tokens")
    draw_packing(ax_pack, report["shards"])
    for ax in (ax_len, ax_fun, ax_tok, ax_pack):
        ax.grid(alpha=0.3)
    save_png(fig, path)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", required=True, type=Path)
    p.add_argument(
        "--tokenized", nargs="+", required=True, type=Path, help="tokenized shards (.parquet; their stats beside them)"
    )
    p.add_argument("--decontamination", type=Path, help="data/decontamination.json")
    p.add_argument("--json", required=True, type=Path)
    p.add_argument("--plot", required=True, type=Path)
    a = p.parse_args(argv)
    manifest = json.loads(a.manifest.read_text())
    stats = {t.stem: json.loads(t.with_suffix(".json").read_text()) for t in a.tokenized}
    lengths = {t.stem: pq.read_table(t, columns=["length"]).column("length").to_pylist() for t in a.tokenized}
    decon = json.loads(a.decontamination.read_text()) if a.decontamination else None
    report = collect(manifest, stats, lengths, decon)
    write_json(a.json, report)
    full = lengths_before(stats)
    plot(report, full or {name: Counter(n) for name, n in lengths.items()}, a.plot, before=bool(full))
    print(json.dumps({k: v for k, v in report.items() if k not in ("shards", "funnel")}))
    print(funnel_text(report))


def lengths_before(stats: dict[str, dict]) -> dict[str, dict[int, int]] | None:
    """Each shard's examples by length before the length policy (tokenization's ``length_counts``; a row
    the template rejects has none); None when a shard's stats lack them."""
    if not all("length_counts" in s for s in stats.values()):
        return None
    full = {name: {int(n): c for n, c in s["length_counts"].items()} for name, s in stats.items()}
    return full if any(full.values()) else None


def funnel_text(report: dict) -> str:
    """The funnel as lines, for the log: rows in, then per shard split → left out → tokenized."""
    f = report["funnel"]
    lines = [f"{f['rows_in']} rows in, {f['split_rejected']} rejected by the split {report['rejects_by_reason']}"]
    for name, s in f["shards"].items():
        why = f" {s['left_out_by_reason']}" if s["left_out"] else ""
        lines.append(f"  {name}: {s['split']} rows → {s['left_out']} left out{why} → {s['tokenized']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
