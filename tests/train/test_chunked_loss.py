"""The chunked loss (chunked_loss.py) against the model's own: the same loss and gradients, fewer logits alive."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from workflow_scripts.train.chunked_loss import causal_lm_loss, install, slice_tokens, supported

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip


def models(config_cls, tie: bool):
    torch.manual_seed(0)
    own = AutoModelForCausalLM.from_config(config_cls(**SHAPE, tie_word_embeddings=tie), dtype=torch.float32)
    chunked = copy.deepcopy(own)
    assert install(chunked)
    return own, chunked


def packed_batch():
    """Two packed sequences in a row of 24 tokens, prompts masked, and a second row with none trained."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SHAPE["vocab_size"], (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[0, 12:15] = -100
    labels[1, :] = -100
    labels[1, 20:] = ids[1, 20:]
    positions = torch.cat([torch.arange(12), torch.arange(12)]).expand(2, 24)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


@pytest.mark.parametrize("config_cls,tie", [(Qwen3Config, True), (LlamaConfig, False)])
def test_chunked_loss_equals_the_models_own_loss_and_gradients(config_cls, tie, monkeypatch):
    from workflow_scripts.train import chunked_loss

    monkeypatch.setattr(chunked_loss, "SLICE_LOGITS", 7 * SHAPE["vocab_size"])  # 7-token slices: 48 = 6 × 7 + 6
    own, chunked = models(config_cls, tie)
    batch = packed_batch()
    a, b = own(**batch).loss, chunked(**batch).loss
    assert b.item() == pytest.approx(a.item(), rel=1e-6)
    a.backward()
    b.backward()
    for (name, p), q in zip(own.named_parameters(), chunked.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    # without labels (generation, evaluation): the model's own forward, logits included
    assert torch.equal(chunked(input_ids=batch["input_ids"]).logits, own(input_ids=batch["input_ids"]).logits)


def test_no_trained_token_gives_nan_as_the_models_own_loss():
    own, chunked = models(Qwen3Config, True)
    ids = torch.randint(3, 300, (1, 8))
    labels = torch.full_like(ids, -100)
    assert torch.isnan(own(input_ids=ids, labels=labels).loss)
    assert torch.isnan(chunked(input_ids=ids, labels=labels).loss)


def test_only_architectures_whose_loss_it_reproduces():
    assert supported(Qwen3Config(**SHAPE)) is None and supported(LlamaConfig(**SHAPE)) is None
    from transformers import Gemma2Config

    assert "gemma2" in supported(Gemma2Config())
    config = LlamaConfig(**SHAPE)
    config.logit_scale = 0.5
    assert supported(config) == "logit_scale is set"


def test_no_tensor_holds_more_than_one_slice_of_logits():
    assert slice_tokens(151936) == 220 and slice_tokens(128256) == 261 and slice_tokens(2**30) == 1
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel())
            return out

    head = torch.nn.Linear(64, 4096, bias=False)
    hidden = torch.randn(1, 2048, 64, requires_grad=True)
    labels = torch.randint(0, 4096, (1, 2048))
    with Largest():
        causal_lm_loss(head, hidden, labels, 256).backward()
    assert Largest.largest == 256 * 4096  # one slice's logits (the whole: 2048 × 4096)
