"""The from-scratch model presets: names and shapes, importable without torch (the Snakefile reads the
names at parse time); demo_model builds them, preflight plans them."""

from workflow_scripts.core.pipeline_io import UserError

# From-scratch presets (seed 001's table), Qwen3 layout: GQA, RoPE, SwiGLU, RMSNorm.
# "demo" is the smallest: a few million parameters that train on a CPU in minutes.
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
SHAPES = {
    "demo": (256, 768, 4, 4, 2, 64),
    "350m": (1024, 2816, 24, 16, 4, 64),
    "1b": (2048, 5120, 24, 16, 4, 128),
    "3b": (3072, 8192, 28, 24, 8, 128),
    "7b": (4096, 11008, 32, 32, 8, 128),
    "13b": (5120, 13824, 40, 40, 8, 128),
    "30b": (6656, 17920, 60, 52, 4, 128),
    "70b": (8192, 28672, 80, 64, 8, 128),
}
PRESETS = {name: dict(zip(SHAPE_KEYS, shape, strict=True)) for name, shape in SHAPES.items()}
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
