"""preference_eval: a model's held-out preference accuracy on the eval set's pairs (training.objective dpo).

For every held-out pair (the eval split tokenized with both answers: chosen and rejected rows in turn) the model's
summed answer log-probabilities, in fp32 (train/reference_file.row_logps), beside the reference model's (the
reference_logps stage's file of the same shard: the base model, as training's cached reference):

- ``accuracy``: the share of pairs whose implicit reward margin is positive, (chosen - its reference) > (rejected -
  its reference): TRL's ``rewards/accuracies`` on held-out pairs (0 for the base model itself, whose margins are 0);
- ``margin``: ``beta`` (training.dpo.beta) times the mean margin (TRL's ``rewards/margins``);
- ``chosen_likelier``: the share of pairs whose chosen answer the model finds likelier than the rejected one, without
  a reference (the base model's own preference, for comparison).

The file holds them as an extra task, ``preference`` ({task: {metric: value, metric_stderr}}, as lm-eval's tasks
in eval/<model>.json), so summarize puts them in summary.csv (``preference.accuracy``...) and tasks.csv, each
with its change against base.

    python -m workflow_scripts.evals.preference_eval --model results/run/models/node0 --name node0 \\
        --pairs data/tokenized/eval_pairs.parquet --reference data/reference_logps/eval_pairs.parquet --beta 0.1 \\
        --output eval/preference/node0.json
"""

import argparse
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from workflow_scripts.core.fingerprint import local_model_folder, model_location
from workflow_scripts.core.pipeline_io import UserError, cli, file_sha256, write_json
from workflow_scripts.train.reference_file import read_logps, row_logps

TASK = "preference"


def preference_metrics(policy: np.ndarray, reference: np.ndarray, beta: float) -> dict:
    """The task's metrics from every row's summed log-probability under the model and the reference (rows in
    pairs: chosen, rejected); each share with its binomial standard error."""
    if len(policy) % 2 or len(policy) != len(reference) or not len(policy):
        raise UserError(
            f"preference evaluation needs rows in pairs under both models, not {len(policy)} and {len(reference)}"
        )
    margins = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
    pairs = len(margins)
    accuracy, likelier = float(np.mean(margins > 0)), float(np.mean(policy[0::2] > policy[1::2]))
    share_error = lambda p: math.sqrt(p * (1 - p) / pairs)  # noqa: E731
    return {
        "accuracy": accuracy, "accuracy_stderr": share_error(accuracy),
        "margin": beta * float(np.mean(margins)), "margin_stderr": beta * float(np.std(margins)) / math.sqrt(pairs),
        "chosen_likelier": likelier, "chosen_likelier_stderr": share_error(likelier),
    }  # fmt: skip


def evaluate(model_path: str, pairs: Path, reference: Path, beta: float, batch_size: int = 8) -> dict:
    """The task's metrics of the model at ``model_path`` on the tokenized pairs, against the reference's file."""
    from transformers import AutoModelForCausalLM

    rows = pq.ParquetFile(pairs).metadata.num_rows
    ref = read_logps(reference, pairs, file_sha256(pairs), rows)
    table = pq.read_table(pairs, columns=["input_ids", "labels"])
    sequences = list(zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist(), strict=True))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(local_model_folder(model_path), dtype=torch.float32).to(device).eval()
    policy, _ = row_logps(model, sequences, model.config.pad_token_id or 0, batch_size, device)
    return preference_metrics(policy, ref, beta)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder (or a fetch record)")
    p.add_argument("--name", required=True, help="its name in the summary (base, node0, ...)")
    p.add_argument("--pairs", required=True, type=Path, help="the eval split's pairs, tokenized (both answers)")
    p.add_argument("--reference", required=True, type=Path, help="the reference_logps stage's file of --pairs")
    p.add_argument("--beta", required=True, type=float, help="training.dpo.beta (the margin's scale)")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args(argv)
    metrics = evaluate(model_location(a.model), a.pairs, a.reference, a.beta, a.batch_size)
    pairs = pq.ParquetFile(a.pairs).metadata.num_rows // 2
    write_json(
        a.output, {"model": a.name, "tasks": {TASK: metrics}, "tasks_documents": {TASK: {"scored": pairs, "of": pairs}}}
    )
    print(f"{a.name}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not k.endswith("_stderr")))


if __name__ == "__main__":
    main()
