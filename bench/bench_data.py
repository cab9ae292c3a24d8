"""Data-stage benchmark: our split + tokenize against Hugging Face `datasets` .map on the same work.

    .venv/bin/python bench/bench_data.py --rows 200000            # the table in docs/benchmarks/data.md
    .venv/bin/python bench/bench_data.py --rows 2000000 --only-ours  # bounded memory on ~1 GB of CSV
    .venv/bin/python bench/bench_data.py --rows 1000000 --decontaminate  # data.decontaminate's cost

Generates a long-tailed synthetic dataset (log-normal answer lengths, seed 000's
``prompt, question, response`` CSV), trains an 8k byte-level BPE tokenizer on a
sample, then times, each in its own process (one core: OMP/tokenizers threads = 1):
  ours      split.py (read, validate, dedup, hash-assign; no tokenizer, as the rule runs it under
            balance: rows) and tokenization.py (read → special text → template → tokenize → mask →
            fit → pack → write): the only stage that loads the tokenizer
  baseline  datasets.Dataset.from_parquet(shard).map(batched=True) applying the chat
            template, tokenizing the prompt and the full text, masking, then to_parquet
Also runs ../shared/data through ours. Prints a table, the ratios (tokenize alone, and split +
tokenize together, against the baseline), and peak RSS per process.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
SCRIPTS = REPO / "workflow_scripts"
sys.path.insert(0, str(REPO))

WORDS = "the of and to in is you that it he was for on are as with his they at be this have from or one had by".split()
WORDS += "word but not what all were we when your can said there use an each which she do how their if will".split()
WORDS += "up other about out many then them these so some her would make like him into time has look two more".split()

BASELINE = r"""
import json, sys, time
import datasets
from transformers import AutoTokenizer
shard, tok_dir, out, max_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(tok_dir)
t0 = time.perf_counter()
ds = datasets.Dataset.from_parquet(shard, cache_dir=out + ".cache")

def fn(batch):
    ids, labels, lengths = [], [], []
    for m in batch["messages"]:
        msgs = json.loads(m)
        prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(msgs, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        f = tok(full, add_special_tokens=False)["input_ids"][:max_len]
        ids.append(f)
        labels.append([-100] * min(len(p), len(f)) + f[len(p):])
        lengths.append(len(f))
    return {"input_ids": ids, "labels": labels, "length": lengths}

ds = ds.map(fn, batched=True, batch_size=1000, remove_columns=ds.column_names)
ds.to_parquet(out)
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": int(sum(ds["length"]))}))
"""


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """Seed-000-style CSV; answers have a long-tailed (log-normal) length, some multi-line."""
    import csv

    rng = random.Random(seed)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "question", "response"])
        for i in range(rows):
            q = " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))
            n = min(3000, int(rng.lognormvariate(4.0, 1.0)))
            body = " ".join(rng.choices(WORDS, k=n))
            if rng.random() < 0.1:
                body = body.replace(" the ", "\nthe ", 3)
            w.writerow(["You are a helpful assistant.", f"{i}: {q}?", body])


def bench_decontaminate(work: Path, rows: int, env: dict) -> None:
    """data.decontaminate on ``rows`` generated training rows (50 of them planted with 20 words of a document)
    against a GSM8K-sized evaluation set (1,319 documents of 40-120 words): the split, then decontaminate, each
    its own one-core process; the ratio is decontaminate's time over the split's, the extra a user pays."""
    import csv

    rng = random.Random(1)
    docs = [" ".join(rng.choices(WORDS, k=rng.randint(40, 120))) for _ in range(1319)]
    data, held = work / f"decon_train_{rows}.csv", work / "decon_eval.csv"
    if not data.exists():
        generate(data, rows)
        with data.open("a", newline="") as f:
            w = csv.writer(f)
            for i in range(50):
                words = docs[i * 7].split()
                w.writerow(["", f"planted {i}: " + " ".join(words[5:25]), "an answer"])
    with held.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "question", "response"])
        w.writerows(["", f"doc {i}: {d}", f"the answer is {i}"] for i, d in enumerate(docs))
    py = sys.executable
    config = json.dumps({"path": str(data), "eval_path": str(held), "nodes": 1, "max_reject_fraction": 0.9})
    split = [py, str(SCRIPTS / "data/split.py"), "--config", config, "--splits", str(work / "d0.parquet"),
             "--eval", str(work / "deval.parquet"), "--rejects", str(work / "drej.parquet"),
             "--manifest", str(work / "dman.json")]  # fmt: skip
    split_s, split_rss, _ = rss_of(split, env)
    decon = [py, str(SCRIPTS / "evals/decontaminate.py"), "--config", json.dumps({"decontaminate": "report"}),
             "--shards", str(work / "d0.parquet"), "--eval", str(work / "deval.parquet"),
             "--output", str(work / "decon.json")]  # fmt: skip
    decon_s, decon_rss, _ = rss_of(decon, env)
    report = json.loads((work / "decon.json").read_text())
    print(f"\ndecontamination: {report['training_rows']:,} training rows against 1,319 documents, 13-grams\n")
    print(f"| {'step':<46} | {'seconds':>8} | {'rows/s':>9} | {'peak RSS MB':>11} |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 11}|{'-' * 13}|")
    n = report["training_rows"]
    for name, secs, rss in (("split (baseline: the pass a user runs anyway)", split_s, split_rss),
                            ("decontaminate (report)", decon_s, decon_rss)):  # fmt: skip
        print(f"| {name:<46} | {secs:8.1f} | {n / secs:9,.0f} | {rss:11,.0f} |")
    found = report["sets"]["heldout"]["docs_contaminated"]
    print(f"\ndecontaminate / split: {decon_s / split_s:.2f}x; planted 50, found {report['training_rows_contaminated']}"
          f" rows touching {found} documents")  # fmt: skip


def rss_of(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """Run through /usr/bin/time-like wrapper: a fresh Python parent so RUSAGE_CHILDREN is per command."""
    wrapper = [
        sys.executable, "-c",
        "import resource,subprocess,sys,time,json;t=time.perf_counter();"
        "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
        "print(json.dumps({'rc':p.returncode,'wall':time.perf_counter()-t,"
        "'rss':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024,'out':p.stdout,'err':p.stderr[-3000:]}))",
        *cmd,
    ]  # fmt: skip
    res = json.loads(subprocess.run(wrapper, capture_output=True, text=True, env=env).stdout)
    if res["rc"] != 0:
        raise SystemExit(f"failed: {' '.join(cmd[:4])}\n{res['err']}")
    return res["wall"], res["rss"], res["out"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--only-ours", action="store_true", help="skip the datasets baseline")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--decontaminate", action="store_true", help="only data.decontaminate's table (1M rows: --rows)")
    a = p.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"

    if a.decontaminate:
        return bench_decontaminate(work, a.rows, env)
    data = work / f"data_{a.rows}.csv"
    if not data.exists():
        generate(data, a.rows)
    size_mb = data.stat().st_size / 2**20
    tok_dir = work / "tokenizer"
    if not tok_dir.exists():
        from workflow_scripts.model.demo_model import train_tokenizer

        sample = (line for i, line in enumerate(data.open()) if i < 20_000)
        train_tokenizer(sample, 8192).save_pretrained(tok_dir)

    py = sys.executable
    split_config = json.dumps({"path": str(data), "nodes": 1, "eval_fraction": 0.001})
    tok_config = json.dumps({"max_seq_len": a.max_seq_len, "overlength": "truncate", "cache_dir": ""})
    split_cmd = [
        py, str(SCRIPTS / "data/split.py"), "--config", split_config,
        "--splits", str(work / "node0.parquet"), "--eval", str(work / "eval.parquet"),
        "--rejects", str(work / "rejects.parquet"), "--manifest", str(work / "manifest.json"),
    ]  # fmt: skip
    split_s, split_rss, _ = rss_of(split_cmd, env)
    tok_cmd = [
        py, str(SCRIPTS / "data/tokenization.py"), "--config", tok_config, "--shard", str(work / "node0.parquet"),
        "--tokenizer", str(tok_dir), "--output", str(work / "tok.parquet"),
        "--packing", str(work / "pack.parquet"), "--stats", str(work / "tok.json"),
    ]  # fmt: skip
    tok_s, tok_rss, _ = rss_of(tok_cmd, env)
    stats = json.loads((work / "tok.json").read_text())
    tokens = stats["tokens"]

    rows = [
        ("ours: split (read, validate, dedup, assign)", split_s, tokens / split_s, split_rss),
        ("ours: tokenize (template, tokenize, mask, fit, pack, write)", tok_s, tokens / tok_s, tok_rss),
        ("ours: split + tokenize", split_s + tok_s, tokens / (split_s + tok_s), max(split_rss, tok_rss)),
    ]
    ratio = combined = None
    if not a.only_ours:
        script = work / "baseline.py"
        script.write_text(BASELINE)
        cmd = [
            py,
            str(script),
            str(work / "node0.parquet"),
            str(tok_dir),
            str(work / "base.parquet"),
            str(a.max_seq_len),
        ]
        base_s, base_rss, out = rss_of(cmd, env)
        base_tokens = json.loads(out.strip().splitlines()[-1])["tokens"]
        rows.append(("baseline: datasets .map(batched=True) + to_parquet", base_s, base_tokens / base_s, base_rss))
        ratio = (tokens / tok_s) / (base_tokens / base_s)
        combined = (tokens / (split_s + tok_s)) / (base_tokens / base_s)

    shared = REPO.parent / "shared" / "data"
    if shared.exists():
        s_config = json.dumps({"path": str(shared / "*.jsonl"), "mapping": "nested", "nodes": 2})
        s_split = [
            py, str(SCRIPTS / "data/split.py"), "--config", s_config,
            "--splits", str(work / "s0.parquet"), str(work / "s1.parquet"), "--eval", str(work / "seval.parquet"),
            "--rejects", str(work / "srej.parquet"), "--manifest", str(work / "smanifest.json"),
        ]  # fmt: skip
        rss_of(s_split, env)
        s_tok = [
            py, str(SCRIPTS / "data/tokenization.py"), "--config", tok_config, "--shard", str(work / "s0.parquet"),
            "--tokenizer", str(tok_dir), "--output", str(work / "stok.parquet"),
            "--packing", str(work / "spack.parquet"), "--stats", str(work / "stok.json"),
        ]  # fmt: skip
        st_s, st_rss, _ = rss_of(s_tok, env)
        st = json.loads((work / "stok.json").read_text())
        rows.append((f"ours on ../shared/data node0 ({st['examples']} examples)", st_s, st["tokens"] / st_s, st_rss))

    print(f"\n{a.rows} rows, {size_mb:.0f} MB CSV, {tokens} tokens after templating, 1 core each\n")
    print(f"| {'step':<62} | {'seconds':>8} | {'tokens/s/core':>13} | {'peak RSS MB':>11} |")
    print(f"|{'-' * 64}|{'-' * 10}|{'-' * 15}|{'-' * 13}|")
    for name, secs, tps, rss in rows:
        print(f"| {name:<62} | {secs:8.1f} | {tps:13,.0f} | {rss:11,.0f} |")
    print(
        f"\npacking at {a.max_seq_len}: {stats['packing_efficiency']:.4f} real tokens / slots "
        f"({stats['bins']} bins); pad-to-longest (micro-batch {stats['pad_batch']}): "
        f"{stats['pad_to_longest_efficiency']:.4f}"
    )
    if ratio is not None:
        print(f"tokenize throughput ratio ours / datasets baseline: {ratio:.2f}x")
        print(f"split + tokenize together / datasets baseline (both stages' wall time): {combined:.2f}x")
    print(f"work dir: {work}")


if __name__ == "__main__":
    main()
