"""Corpus BLEU and chrF (sacrebleu), kept in the repo because hub metrics cannot be downloaded."""

import datasets
import evaluate
import sacrebleu

_DESCRIPTION = (
    "Corpus-level BLEU and chrF of predictions against one reference each, on a 0-1 scale like the repo's"
    " other metrics (sacrebleu's 0-100 scores divided by 100)."
)
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): reference answers.
Returns:
    bleu (float): sacrebleu corpus BLEU / 100 (0-1).
    chrf (float): sacrebleu corpus chrF / 100 (0-1).
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
        bleu = sacrebleu.corpus_bleu(predictions, refs).score
        chrf = sacrebleu.corpus_chrf(predictions, refs).score
        # identical texts give a BLEU of 100.00000000000004 (rounding in the geometric mean)
        return {"bleu": min(bleu / 100, 1.0), "chrf": min(chrf / 100, 1.0)}
