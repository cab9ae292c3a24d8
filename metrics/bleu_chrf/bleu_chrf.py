"""Corpus BLEU and chrF (sacrebleu), kept in the repo because hub metrics cannot be downloaded."""

import datasets
import evaluate
import sacrebleu

_DESCRIPTION = "Corpus-level BLEU and chrF of predictions against one reference each, on a 0-100 scale."
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): reference answers.
Returns:
    bleu (float): sacrebleu corpus BLEU (0-100).
    chrf (float): sacrebleu corpus chrF (0-100).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class BleuChrf(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Post, 2018. A Call for Clarity in Reporting BLEU Scores.",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        if not predictions:
            return {"bleu": 0.0, "chrf": 0.0}
        refs = [list(references)]
        return {
            "bleu": sacrebleu.corpus_bleu(predictions, refs).score,
            "chrf": sacrebleu.corpus_chrf(predictions, refs).score,
        }
