"""The training loss over slices of tokens, so the logits of a whole micro-batch never exist at once.

A causal LM's loss makes vocab × tokens logits (bf16), their fp32 upcast and its fp32 gradient: 12 bytes a
logit, 1.74 MiB a token at Qwen3's 151,936-token vocabulary, 7 GiB for a micro-batch of 4096 tokens on
every GPU, whatever the model's size. Here the decoder runs as before and the head and the cross-entropy
run over slices of at most ``slice_tokens(vocab)`` tokens, each under activation checkpointing: forward
keeps one scalar a slice, backward recomputes one slice's logits at a time. The cost is the head's matmul
once more in backward (2 × vocab × hidden FLOPs a token against 6 × parameters: 0.8% of a Qwen3-32B step,
8.7% at Qwen3-0.6B).

The loss is transformers' ForCausalLMLoss as the model's own forward computes it (labels shifted by one,
-100 ignored, the mean over the micro-batch's trained tokens, logits upcast to fp32), so it applies only to
architectures whose forward is ``lm_head(last_hidden_state)`` followed by that loss (PLAIN_HEAD, and no
logit scaling or soft-capping in the config); any other model keeps its own forward. torch is imported
where it is used: the planner's formula reads ``supported`` and ``slice_tokens`` without it.
"""

import types

from workflow_scripts.core.contracts import IGNORE

# model_type values whose *ForCausalLM.forward is exactly lm_head(hidden) then ForCausalLMLoss (transformers 5)
PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# config attributes that change the logits after the head in some architectures
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
SLICE_LOGITS = 2**25  # logits a slice: 384 MiB at 12 bytes each


def slice_tokens(vocab: int) -> int:
    """Tokens a slice: about SLICE_LOGITS logits (220 tokens at Qwen3's vocabulary, 261 at Llama 3's)."""
    return max(1, SLICE_LOGITS // vocab)


def supported(config) -> str | None:
    """None when the chunked loss reproduces this model's own loss, else why not."""
    kind = getattr(config, "model_type", None)
    if kind not in PLAIN_HEAD:
        return f"model_type {kind} is not one of {sorted(PLAIN_HEAD)}"
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 0, 1, 1.0):
            return f"{name} is set"
    return None


def install(model) -> bool:
    """Replace the causal LM's forward (this instance only) with the chunked one when ``labels`` are given.
    Module names, parameters and hooks are unchanged, so sharding, LoRA and checkpoints see the same model."""
    if supported(model.config) is not None or getattr(model, "_chunked_loss", False):
        return False
    own = model.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        if labels is None or kwargs.get("inputs_embeds") is not None:
            return own(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                       **kwargs)  # fmt: skip
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("num_items_in_batch", None)
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs).last_hidden_state  # fmt: skip
        loss = causal_lm_loss(self.lm_head, hidden, labels, slice_tokens(self.config.vocab_size))
        return CausalLMOutputWithPast(loss=loss)

    model.forward = types.MethodType(forward, model)
    model._chunked_loss = True
    return True


def causal_lm_loss(head, hidden, labels, tokens: int):
    """ForCausalLMLoss(head(hidden), labels) with at most ``tokens`` tokens' logits alive at a time."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], tokens):
        # every slice runs, also one without a trained token: no data-dependent branch (the planner runs
        # this under fake tensors) and the same collectives on every rank (FSDP2, ZeRO-3)
        target = shifted[start : start + tokens]
        total = total + checkpoint(slice_loss, head, hidden[start : start + tokens], target, use_reentrant=False)
    return total / (shifted != IGNORE).sum()


def slice_loss(head, hidden, target):
    import torch.nn.functional as F

    return F.cross_entropy(head(hidden).float(), target, ignore_index=IGNORE, reduction="sum")
