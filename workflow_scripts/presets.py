"""The from-scratch model presets: names and shapes, importable without torch (the Snakefile reads the
names at parse time); demo_model builds them, preflight plans them."""

from pipeline_io import UserError

# From-scratch presets (seed 001's table), Qwen3 layout: GQA, RoPE, SwiGLU, RMSNorm.
# "demo" is the smallest: a few million parameters that train on a CPU in minutes.
PRESETS = {
    "demo": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=24, num_attention_heads=16,
               num_key_value_heads=4, head_dim=128),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128),
    "30b": dict(hidden_size=6656, intermediate_size=17920, num_hidden_layers=60, num_attention_heads=52,
                num_key_value_heads=4, head_dim=128),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128),
}  # fmt: skip
PRESET_NAMES = tuple(PRESETS)


def preset_config(size: str, vocab_size: int, max_seq_len: int, **tokens):
    """The Qwen3Config of a preset (built by demo_model, planned by preflight before it exists)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=max(max_seq_len, 512),
        tie_word_embeddings=size == "demo",
        **tokens,
        **PRESETS[size],
    )


def preset_name(name_or_path: str) -> str | None:
    """ "demo" or "preset:<size>" name a from-scratch model; anything else is a path or hub id."""
    if name_or_path == "demo":
        return "demo"
    if name_or_path.startswith("preset:"):
        size = name_or_path.split(":", 1)[1].lower()
        if size not in PRESET_NAMES:
            raise UserError(f"model.name_or_path: unknown preset {size!r} (one of {', '.join(PRESET_NAMES)})")
        return size
    return None
