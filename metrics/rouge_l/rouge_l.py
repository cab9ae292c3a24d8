"""ROUGE-L F-measure (rouge_score), kept in the repo because hub metrics cannot be downloaded."""

import datasets
import evaluate
from rouge_score import rouge_scorer

_DESCRIPTION = "Mean ROUGE-L F1 between predictions and references (longest common subsequence of tokens)."
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): reference answers.
Returns:
    rouge_l (float): mean F1 in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class RougeL(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, 2004. ROUGE: A Package for Automatic Evaluation of Summaries.",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        if not predictions:
            return {"rouge_l": 0.0}
        scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
        scores = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references, strict=True)]
        return {"rouge_l": sum(scores) / len(scores)}
