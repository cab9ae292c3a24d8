"""tokenize_shard: render conversations with the chat template and tokenize them.

Output: one Parquet row per example with ``input_ids``, ``labels`` (-100 on the
prompt, so the loss is on the assistant's answer only), ``length`` and
``prompt_length`` (the number of tokens evaluation feeds the model before it
generates). The same ``encode`` serves training and evaluation, so both see the
same token ids.
"""

import argparse
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pipeline_io import UserError, atomic_path, cli, write_json
from transformers import AutoTokenizer

IGNORE = -100


def messages_for(prompt: str, question: str, response: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": prompt}] if prompt else []
    messages.append({"role": "user", "content": question})
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    return messages


def render(tokenizer, prompts, questions, responses) -> tuple[list[str], list[str]]:
    """Return (prefix texts ending in the generation prompt, completions after them)."""
    prefixes, completions = [], []
    for p, q, r in zip(prompts, questions, responses, strict=True):
        prefix = tokenizer.apply_chat_template(messages_for(p, q), add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages_for(p, q, r), tokenize=False)
        if not full.startswith(prefix):
            raise UserError("chat template: the rendered conversation does not start with its generation prompt")
        prefixes.append(prefix)
        completions.append(full[len(prefix) :])
    return prefixes, completions


def encode(tokenizer, prompts, questions, responses) -> list[dict]:
    """Tokenize a batch of examples; labels cover the answer up to and including EOS."""
    prefixes, completions = render(tokenizer, prompts, questions, responses)
    prefix_ids = tokenizer(prefixes, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    out = []
    for pre, comp in zip(prefix_ids, completion_ids, strict=True):
        end = comp.index(eos) + 1 if eos in comp else len(comp)
        labels = [IGNORE] * len(pre) + comp[:end] + [IGNORE] * (len(comp) - end)
        out.append({"input_ids": pre + comp, "labels": labels, "prompt_length": len(pre)})
    return out


def fit_length(example: dict, max_len: int, policy: str) -> dict | None:
    """Apply the over-length policy: keep, truncate, drop (None) or raise."""
    if len(example["input_ids"]) <= max_len:
        return example
    if policy == "error":
        raise UserError(f"an example has {len(example['input_ids'])} tokens, above data.max_seq_len={max_len}")
    if policy == "drop" or example["prompt_length"] >= max_len:
        return None
    return {k: v[:max_len] if isinstance(v, list) else v for k, v in example.items()}


def tokenize_frame(tokenizer, frame: pd.DataFrame, max_len: int, policy: str, batch_size: int = 512):
    """Tokenize a split frame. Returns (tokenized frame, stats)."""
    rows, dropped, truncated = [], 0, 0
    for start in range(0, len(frame), batch_size):
        batch = frame.iloc[start : start + batch_size]
        encoded = encode(tokenizer, batch["prompt"].tolist(), batch["question"].tolist(), batch["response"].tolist())
        for example, (_, src) in zip(encoded, batch.iterrows(), strict=True):
            fitted = fit_length(example, max_len, policy)
            if fitted is None:
                dropped += 1
                continue
            truncated += fitted is not example
            rows.append(
                fitted
                | {
                    "length": len(fitted["input_ids"]),
                    "response": src["response"],
                    "content_hash": src["content_hash"],
                    "category": src.get("category", ""),
                }
            )
    columns = ["input_ids", "labels", "length", "prompt_length", "response", "content_hash", "category"]
    out = pd.DataFrame(rows, columns=columns)
    tokens = int(out["length"].sum()) if len(out) else 0
    stats = {"examples": len(out), "tokens": tokens, "dropped_too_long": dropped, "truncated": truncated}
    return out, stats


SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("length", pa.int32()),
        ("prompt_length", pa.int32()),
        ("response", pa.string()),
        ("content_hash", pa.string()),
        ("category", pa.string()),
    ]
)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard", required=True, type=Path)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--max-seq-len", type=int, required=True)
    p.add_argument("--overlength", choices=["drop", "truncate", "error"], default="truncate")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--stats", required=True, type=Path)
    a = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    if tokenizer.chat_template is None:
        raise UserError(f"{a.tokenizer}: the tokenizer has no chat template")
    frame = pd.read_parquet(a.shard)
    out, stats = tokenize_frame(tokenizer, frame, a.max_seq_len, a.overlength)
    with atomic_path(a.output) as tmp:
        pq.write_table(pa.Table.from_pandas(out, schema=SCHEMA, preserve_index=False), tmp)
    write_json(a.stats, stats | {"shard": str(a.shard), "max_seq_len": a.max_seq_len})
    print(f"{a.shard}: {stats}")


if __name__ == "__main__":
    main()
