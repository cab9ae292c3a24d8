"""Packed training's attention without flash-attn: PyTorch's own flash kernel, variable-length
(``torch.nn.attention.varlen.varlen_attn``), registered with transformers as ``torch_varlen``.

A packed row holds several conversations back to back, their position ids restarting at 0 at each.
Under SDPA transformers turns those position ids into a block-diagonal causal mask of seq × seq and
SDPA runs a masked kernel over the whole square (the H200's first measurement: MFU 9%). The
variable-length flash kernel instead takes where each conversation starts (cumulative lengths, as
flash-attn's ``flash_attn_varlen_func`` does) and computes only each conversation's own causal
triangle. Same maths as the mask, exactly what flash-attn's varlen path does; needs CUDA, compute
capability 8.0+ and 16-bit inputs (model_loading.choose_attention decides).

Sequences are found from the position ids: a new one starts wherever a position is 0, and at each
row's start (a padded batch without position ids: each row is one sequence; right padding, as
batching.collate pads, leaves every real token's attention exact). transformers builds no mask for
an implementation it does not know, so none is built here.
"""

import functools
import inspect

import torch

NAME = "torch_varlen"


def available() -> bool:
    """Whether this torch has the variable-length attention (2.10+)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def register() -> None:
    """Make ``attn_implementation="torch_varlen"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, forward)


def cumulative_lengths(position_ids: torch.Tensor | None, batch: int, seq: int, device) -> torch.Tensor:
    """int32 offsets of each sequence's start in the flattened batch × seq tokens, and the end (N + 1 values).
    Fake position ids (the memory planner's probe) have no values: a sequence a row, the same tensors' sizes."""
    from torch._subclasses.fake_tensor import is_fake

    row_starts = torch.arange(0, batch * seq, seq, device=device)
    if position_ids is None or tuple(position_ids.shape) != (batch, seq) or is_fake(position_ids):
        starts = row_starts  # one sequence a row (position ids shared by the rows: arange)
    else:
        starts = torch.cat([row_starts, torch.nonzero(position_ids.reshape(-1) == 0).flatten()]).unique()  # sorted
    end = torch.tensor([batch * seq], device=device)
    return torch.cat([starts, end]).to(torch.int32)


_last = None  # (position_ids, batch, seq, offsets): a model forward asks once per layer with the same tensor


def offsets_for(position_ids, batch: int, seq: int, device) -> torch.Tensor:
    global _last
    if _last is None or _last[0] is not position_ids or _last[1:3] != (batch, seq):
        _last = (position_ids, batch, seq, cumulative_lengths(position_ids, batch, seq, device))
    return _last[3]


@functools.cache
def kernel():
    """``varlen_attn`` and the keywords this torch's version takes (window_size for causal, enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None,
            position_ids=None, **kwargs):  # fmt: skip
    """transformers' attention interface: query (B, Hq, S, D), key and value (B, Hkv, S, D) → ((B, S, Hq, D), None)."""
    for unsupported in ("s_aux", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"attention torch_varlen: this model's {unsupported} is not supported; "
                             "set TRAIN_ATTENTION=sdpa")  # fmt: skip
    if dropout and module.training:
        raise ValueError(f"attention torch_varlen has no dropout (the model's is {dropout}); set TRAIN_ATTENTION=sdpa")
    varlen_attn, params = kernel()
    b, hq, s, d = query.shape
    dtype = torch.get_autocast_dtype(query.device.type) if torch.is_autocast_enabled(query.device.type) else query.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention torch_varlen runs in bf16/fp16 only, not {dtype}")
    gqa = "enable_gqa" in params  # else (an older torch) every query head gets its own key and value

    def flat(t, heads: int):
        """(B, H, S, D) → (B·S, heads, D) in ``dtype``, transposed, cast and repeated (GQA) in one copy."""
        t = t.transpose(1, 2)
        if heads != t.shape[2]:
            t = t.unsqueeze(3).expand(b, s, t.shape[2], heads // t.shape[2], d)
        return t.to(dtype=dtype, memory_format=torch.contiguous_format).reshape(b * s, heads, d)

    kv_heads = key.shape[1] if gqa else hq
    q, k, v = flat(query, hq), flat(key, kv_heads), flat(value, kv_heads)
    cu = offsets_for(position_ids, b, s, query.device)
    extra = {"scale": scaling}
    if gqa:
        extra["enable_gqa"] = hq != key.shape[1]
    if "window_size" in params:
        extra["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)  # (left, 0): causal
    elif "is_causal" in params and sliding_window is None:
        extra["is_causal"] = True
    else:
        raise ValueError(f"attention torch_varlen: this torch's varlen_attn takes no causal sliding window "
                         f"({sliding_window}); set TRAIN_ATTENTION=sdpa")  # fmt: skip
    out = varlen_attn(q, k, v, cu, cu, s, s, **extra)  # s: a bound on every length
    return out.view(b, s, hq, d), None
