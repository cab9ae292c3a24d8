"""Exact match between generated and reference answers, kept in the repo (hub metrics cannot be downloaded).

Whitespace at the ends is ignored and inner runs of whitespace count as one space;
case matters unless ``ignore_case=True``.
"""

import re

import datasets
import evaluate

_DESCRIPTION = "Fraction of predictions equal to their reference after whitespace normalization."
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): reference answers.
    ignore_case (bool): compare case-insensitively. Defaults to False.
Returns:
    exact_match (float): the fraction in [0, 1].
"""


def _norm(text: str, ignore_case: bool) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text.lower() if ignore_case else text


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, ignore_case=False):
        if not predictions:
            return {"exact_match": 0.0}
        hits = sum(
            _norm(p, ignore_case) == _norm(r, ignore_case) for p, r in zip(predictions, references, strict=False)
        )
        return {"exact_match": hits / len(predictions)}
