"""torch_varlen (model/varlen_attention.py): the packed attention through PyTorch's variable-length flash kernel.

The kernel is CUDA-only, so here a reference stands in for it: each sequence's own causal attention in fp32,
called exactly as the kernel is (flattened tokens, cumulative lengths, the keywords of either torch version).
What is checked is everything around the kernel: the layout, where sequences start, GQA, the scale, the dtype.
bench/bench_attention.py compares the real kernel with SDPA's masked attention on a GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from workflow_scripts.model import varlen_attention
from workflow_scripts.model.model_loading import attention_implementation, choose_attention


def reference(gqa_keyword: bool, window_keyword: bool):
    """A stand-in for varlen_attn with the signature of torch 2.13 (window_size, enable_gqa) or of an older one."""
    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **kw):
        calls.append(kw)
        assert q.dtype in (torch.bfloat16, torch.float16) and q.dim() == 3 and torch.equal(cu_q, cu_k)
        assert cu_q.dtype == torch.int32 and max_q >= int((cu_q[1:] - cu_q[:-1]).max())
        if not gqa_keyword:
            assert k.shape[1] == q.shape[1]  # an older torch: the wrapper repeats the key/value heads
        out = torch.empty_like(q)
        for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            qs, ks, vs = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
            ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], dim=0) for t in (ks, vs))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
        return out

    params = {"scale"} | ({"enable_gqa"} if gqa_keyword else set())
    params |= {"window_size"} if window_keyword else {"is_causal"}
    return varlen_attn, params, calls


def test_sequences_start_where_positions_restart_and_at_every_row():
    one_row = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert varlen_attention.cumulative_lengths(one_row, 1, 9, "cpu").tolist() == [0, 3, 5, 9]
    two_rows = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 0]])  # the second row's pad tail starts at 0
    assert varlen_attention.cumulative_lengths(two_rows, 2, 5, "cpu").tolist() == [0, 2, 5, 9, 10]
    # padded examples (no position ids of their own: transformers' arange shared by the rows): a row each
    shared = torch.arange(4).unsqueeze(0)
    assert varlen_attention.cumulative_lengths(shared, 3, 4, "cpu").tolist() == [0, 4, 8, 12]
    assert varlen_attention.cumulative_lengths(None, 2, 4, "cpu").tolist() == [0, 4, 8]


def tiny_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    config_class, model_class = classes[kind]
    torch.manual_seed(0)
    shape = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    config = config_class(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, **shape)
    model = model_class(config).to(torch.bfloat16).eval()
    model.config.use_cache = False
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen3")


@pytest.mark.parametrize(
    ("kind", "gqa_keyword", "window_keyword"), [("qwen3", True, True), ("qwen3", False, False), ("llama", True, True)]
)
def test_packed_logits_equal_sdpa_with_the_block_diagonal_mask(monkeypatch, kind, gqa_keyword, window_keyword):
    tiny = tiny_model(kind)
    fn, params, calls = reference(gqa_keyword, window_keyword)
    monkeypatch.setattr(varlen_attention, "kernel", lambda: (fn, params))
    varlen_attention.register()
    lengths = [[5, 7, 4], [9, 3, 4]]
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([sum((list(range(n)) for n in row), []) for row in lengths])

    def logits(impl, pos=positions):
        tiny.set_attn_implementation(impl)
        with torch.no_grad():
            return tiny(input_ids=ids, position_ids=pos).logits.float()

    sdpa, varlen = logits("sdpa"), logits(varlen_attention.NAME)
    tolerance = 0.05
    assert torch.allclose(varlen, sdpa, atol=tolerance, rtol=0), (varlen - sdpa).abs().max()
    # the check can fail: attending across the packed conversations changes the logits by far more
    across = logits("sdpa", torch.arange(16).expand(2, 16))
    assert (across - sdpa).abs().max() > 4 * tolerance
    assert calls and all(("window_size" in kw) == window_keyword for kw in calls)
    if window_keyword:
        assert calls[0]["window_size"] == (-1, 0) and calls[0]["enable_gqa"] is True
    else:
        assert calls[0]["is_causal"] is True


def test_runs_under_autocast_and_refuses_fp32(tiny, monkeypatch):
    fn, params, _ = reference(True, True)
    monkeypatch.setattr(varlen_attention, "kernel", lambda: (fn, params))
    q = torch.randn(1, 4, 6, 16)
    k = v = torch.randn(1, 2, 6, 16)
    with pytest.raises(ValueError, match="bf16/fp16 only"):
        varlen_attention.forward(tiny, q, k, v, None, scaling=0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention.forward(tiny, q, k, v, None, scaling=0.25)
    assert out.shape == (1, 6, 4, 16) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="softcap"):
        varlen_attention.forward(tiny, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, softcap=30.0)


@pytest.mark.parametrize(
    ("installed", "capability", "dtype", "expected"),
    [
        (None, (9, 0), torch.bfloat16, "torch_varlen"),  # an H100 without flash-attn
        (None, (8, 0), torch.float16, "torch_varlen"),
        ("2.8.3", (9, 0), torch.bfloat16, "flash_attention_2"),  # flash-attn first where installed
        (None, (7, 5), torch.float16, "sdpa"),  # T4: no flash kernel
        (None, (9, 0), torch.float32, "sdpa"),
        (None, None, torch.bfloat16, "sdpa"),
    ],
)
def test_the_varlen_kernel_where_flash_attn_is_missing(installed, capability, dtype, expected):
    assert choose_attention(installed, capability, dtype, varlen=True)[0] == expected


def test_train_attention_overrides_the_choice(monkeypatch):
    from workflow_scripts.core.pipeline_io import UserError

    monkeypatch.setenv("TRAIN_ATTENTION", "eager")
    assert attention_implementation(torch.device("cpu"), torch.float32) == "eager"
    monkeypatch.setenv("TRAIN_ATTENTION", "flash")
    with pytest.raises(UserError, match="TRAIN_ATTENTION=flash: not one of sdpa, torch_varlen"):
        attention_implementation(torch.device("cpu"), torch.float32)
    monkeypatch.delenv("TRAIN_ATTENTION")
    assert attention_implementation(torch.device("cpu"), torch.float32) == "sdpa"


def test_the_environment_check_reports_train_attention(monkeypatch):
    from workflow_scripts.ops import environment

    a100 = {"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 79.3, "capability": "8.0"}]}
    monkeypatch.setenv("TRAIN_ATTENTION", "sdpa")
    assert environment.attention_backend(a100, "bf16") == {"attention": "sdpa", "attention_reason": "TRAIN_ATTENTION"}
