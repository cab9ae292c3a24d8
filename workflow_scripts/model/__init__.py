"""model: the base model: fetched from the hub at a pinned revision (fetch_model), built for the demo
(demo_model), presets of known shapes, loading (model_loading: attention implementation, PEFT) and the
safetensors weights on disk (weights)."""
