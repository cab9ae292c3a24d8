"""Names of the from-scratch model presets, importable without torch (the Snakefile reads them at parse time).

The shapes are in demo_model.PRESETS.
"""

from pipeline_io import UserError

PRESET_NAMES = ("demo", "350m", "1b", "3b", "7b", "13b", "30b", "70b")


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
