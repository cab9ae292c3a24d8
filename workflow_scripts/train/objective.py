"""The training objective (training.objective): what a strategy's micro-batch loss is.

``sft``: the model's own loss on the batch (the causal LM's cross-entropy on the answers' tokens), as training
always was. ``dpo``: preference pairs, each micro-batch ``micro_batch_size`` pairs whose chosen and rejected
sequences run in one forward, concatenated along the batch ([chosen..., rejected...]: batching.Batches with
``pairs``); the loss is train/preference.py's ``training.dpo.loss``. The reference model's log-probabilities
are, by ``training.dpo.reference``: ``adapters_off``, the same model with its LoRA adapters disabled, under
no_grad, in the same step; ``cached``, the batch's ``ref_logps`` (the reference_logps stage's, in the batch's
order). The reference-free losses (simpo, orpo) read neither.

Each strategy's forward_backward asks its objective for the loss (parallel/base.Strategy.compute_loss), so the
DPO step is train_step itself: the planner's fake-tensor probe runs the same function. An objective keeps the
metrics of its micro-batches for the metrics logger (``metrics``: TRL's names, train/preference.py).
"""

import torch

from workflow_scripts.core.contracts import IGNORE
from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.core.settings import reads_cached_reference
from workflow_scripts.train.preference import DPOSettings, answer_logps, needs_reference, preference_loss, split_pairs

REFERENCE_KEY = "ref_logps"  # a cached reference's log-probabilities in the batch: (2 x pairs,), chosen first


class SFT:
    """The model's own loss (its forward with labels)."""

    pairs = False  # a data unit is one example

    def __init__(self, cfg):
        self.cfg = cfg

    def loss(self, model, unwrapped, batch: dict) -> torch.Tensor:
        return model(**batch).loss

    def metrics(self) -> dict:
        """The last micro-batch's metrics (tensors), taken once: none for SFT."""
        return {}


def dpo_settings(cfg) -> DPOSettings:
    """training.dpo as the loss reads it."""
    return DPOSettings(**{k: v for k, v in cfg.dpo.items() if k in DPOSettings.__dataclass_fields__})


class DPO:
    """Preference pairs: a loss of train/preference.py over the pairs' answer log-probabilities."""

    pairs = True  # a data unit is a pair: two consecutive rows of the tokenized data, chosen then rejected

    def __init__(self, cfg):
        self.cfg, self.settings = cfg, dpo_settings(cfg)
        self.reference = cfg.dpo["reference"] if needs_reference(self.settings.loss) else None
        if self.reference == "adapters_off" and cfg.peft != "lora":
            raise UserError(
                f"training.dpo.reference adapters_off needs training.peft lora (it is {cfg.peft}): use"
                " reference: cached, or a reference-free loss (simpo, orpo)"
            )
        if cfg.packing:
            raise UserError("training.objective dpo trains on pairs, not packed bins: set training.packing false")
        self.last = {}

    def loss(self, model, unwrapped, batch: dict) -> torch.Tensor:
        batch = dict(batch)
        cached = batch.pop(REFERENCE_KEY, None)
        labels = batch.pop("labels")
        reference = None
        if self.reference == "adapters_off":
            reference = self.reference_logps(unwrapped, batch, labels)
        elif self.reference == "cached":
            if cached is None:
                raise UserError("training.dpo.reference is cached but the batch has no reference log-probabilities")
            reference = split_pairs(cached, answer_tokens(labels))
        policy = split_pairs(*answer_logps(model(**batch).logits, labels))
        loss, self.last = preference_loss(self.settings, policy, reference)
        return loss

    @staticmethod
    def reference_logps(unwrapped, batch: dict, labels: torch.Tensor):
        """The pairs' log-probabilities under the base model: LoRA's adapters disabled, no graph kept."""
        with torch.no_grad(), unwrapped.disable_adapter():
            return split_pairs(*answer_logps(unwrapped(**batch).logits, labels))

    def metrics(self) -> dict:
        last, self.last = self.last, {}
        return last


def answer_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's trained tokens (answer_logps' count, without the logits)."""
    return (labels[:, 1:] != IGNORE).sum(-1)


OBJECTIVES = {"sft": SFT, "dpo": DPO}


def objective_for(cfg):
    """cfg's objective (training.objective)."""
    return OBJECTIVES[getattr(cfg, "objective", "sft")](cfg)


def cached_reference(cfg) -> bool:
    """Whether cfg's objective reads the reference_logps stage's files (training.dpo.reference cached, with a loss
    that has a reference)."""
    return reads_cached_reference(getattr(cfg, "objective", "sft"), getattr(cfg, "dpo", {}))


def pairs(cfg) -> bool:
    """Whether cfg's objective trains on pairs (a data unit is two rows)."""
    return OBJECTIVES[getattr(cfg, "objective", "sft")].pairs
