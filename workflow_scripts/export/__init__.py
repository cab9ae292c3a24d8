"""export: trained checkpoints to Hugging Face folders: consolidate (any strategy's checkpoint, through the
strategy's export reader; LoRA merged or kept as an adapter) and soup (weight averages of the node models)."""
