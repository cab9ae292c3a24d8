"""evaluate_model: held-out loss, perplexity and exact match of greedy answers for one model.

The eval set is the tokenized cache that training's caches come from, so the model
sees exactly the token ids training produced: the loss uses ``labels`` as they are,
and generation starts from the first ``prompt_length`` ids of each example. Generation stops at
any end-of-turn token (the EOS and the template's, e.g. ``<|im_end|>`` for a Qwen3 base whose EOS
is ``<|endoftext|>``) and pads with the pad token, else the EOS: a tokenizer without a pad token
(Llama 2, 3) works. Exact match compares like with like: the answers are decoded without special
tokens, and the text of every special token is taken out of both answers and references.
"""

import argparse
import math
from pathlib import Path

import evaluate
import pandas as pd
import torch
import torch.nn.functional as F
from chat_format import remove_special_text, special_texts
from pipeline_io import cli, write_json
from settings import option
from tokenization import generation_settings
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE = -100


def padding_id(tokenizer) -> int:
    """The id padding uses: the pad token, else the EOS, else 0; never None (Llama has no pad token)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def stop_ids(model, tokenizer) -> list[int]:
    """Where generation stops: the tokenizer's end-of-turn tokens and the model's own EOS ids."""
    own = model.generation_config.eos_token_id
    own = [] if own is None else own if isinstance(own, list) else [own]
    return list(dict.fromkeys(generation_settings(tokenizer)["eos_token_id"] + own))


def comparable(texts: list[str], tokens) -> list[str]:
    """Texts with every special token's text taken out (a reference that kept a literal <|endoftext|>
    compares equal to an answer decoded without special tokens)."""
    return [remove_special_text(t, tokens) for t in texts]


def batches(frame: pd.DataFrame, size: int):
    for start in range(0, len(frame), size):
        yield frame.iloc[start : start + size]


@torch.no_grad()
def eval_loss(model, frame: pd.DataFrame, pad_id: int, batch_size: int) -> tuple[float, int]:
    """Token-weighted mean cross-entropy over all label tokens of the eval set."""
    total, count = 0.0, 0
    for batch in batches(frame, batch_size):
        width = int(batch["length"].max())
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, y) in enumerate(zip(batch["input_ids"], batch["labels"], strict=True)):
            ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float().cpu()
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum"
        )
        total += loss.item()
        count += int((labels[:, 1:] != IGNORE).sum())
    return total / max(count, 1), count


@torch.no_grad()
def generate(model, tokenizer, frame: pd.DataFrame, batch_size: int, max_new_tokens: int) -> list[str]:
    """Greedy answers, prompts left-padded so every row's answer starts at the same column."""
    answers = []
    for batch in batches(frame, batch_size):
        prompts = [list(x[:n]) for x, n in zip(batch["input_ids"], batch["prompt_length"], strict=True)]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), padding_id(tokenizer), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, pr in enumerate(prompts):
            ids[i, width - len(pr) :], mask[i, width - len(pr) :] = torch.tensor(pr), 1
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=padding_id(tokenizer),
            eos_token_id=stop_ids(model, tokenizer),
        )
        answers += tokenizer.batch_decode(out[:, width:].cpu(), skip_special_tokens=True)
    return [a.strip() for a in answers]


def score(predictions: list[str], references: list[str], metrics_dir: Path) -> dict:
    """Every evaluate module kept in the repo: exact match, ROUGE-L, BLEU and chrF."""
    out = {}
    for name in ("exact_match", "rouge_l", "bleu_chrf"):
        out |= evaluate.load(str(metrics_dir / name)).compute(predictions=predictions, references=references)
    return out


def exact_match_by_category(predictions: list[str], references: list[str], categories: list, metrics_dir: Path) -> dict:
    """Exact match within each category, by the same evaluate module (same normalization) as the overall one."""
    metric = evaluate.load(str(metrics_dir / "exact_match"))
    rows = pd.DataFrame({"p": predictions, "r": references, "c": categories})
    return {
        str(c): metric.compute(predictions=g["p"].tolist(), references=g["r"].tolist())["exact_match"]
        for c, g in rows.groupby("c", sort=True)
    }


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder or hub id")
    p.add_argument("--name", required=True, help="name in the summary (base, node0, ...)")
    p.add_argument("--eval", required=True, type=Path, help="tokenized eval set")
    p.add_argument("--metrics", required=True, type=Path, help="folder of the repo's evaluate modules")
    p.add_argument("--batch-size", type=int, **option("eval.batch_size"))
    p.add_argument("--max-new-tokens", type=int, **option("eval.max_new_tokens"))
    p.add_argument("--max-samples", type=int, help="0 = the whole eval set", **option("eval.max_samples"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True, type=Path)
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    frame = pd.read_parquet(a.eval)
    if a.max_samples:
        frame = frame.iloc[: a.max_samples]
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # fp32 whatever the folder holds: a bf16 model (consolidate.dtype) is upcast exactly, computed in fp32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(device).eval()

    loss, tokens = eval_loss(model, frame, padding_id(tokenizer), a.batch_size)
    specials = special_texts(tokenizer)
    predictions = comparable(generate(model, tokenizer, frame, a.batch_size, a.max_new_tokens), specials)
    references = comparable(frame["response"].tolist(), specials)
    result = {
        "model": a.name,
        "path": a.model,
        "examples": len(frame),
        "label_tokens": tokens,
        "eval_loss": loss,
        "perplexity": math.exp(min(loss, 50)),
    } | score(predictions, references, a.metrics)
    if frame["category"].astype(bool).any():
        result["exact_match_by_category"] = exact_match_by_category(
            predictions, references, frame["category"].tolist(), a.metrics
        )
    result["samples"] = [
        {"prompt": tokenizer.decode(ids[:n], skip_special_tokens=True)[-300:], "reference": r, "prediction": p}
        for ids, n, r, p in zip(
            frame["input_ids"][:20], frame["prompt_length"][:20], references[:20], predictions[:20], strict=True
        )
    ]
    write_json(a.output, result)
    print(
        f"{a.name}: eval_loss {loss:.4f} perplexity {result['perplexity']:.2f} exact_match {result['exact_match']:.3f}"
    )


if __name__ == "__main__":
    main()
