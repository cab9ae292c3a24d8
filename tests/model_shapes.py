"""The examples' base models as their hub config.json files give them (no weights), and an independent byte
count of a training config's memory per GPU, written by hand: the cross-check of the planner (test_examples,
bench/plan_examples.py)."""

from pathlib import Path

GB = 2**30
PARAMETERS_B = {"Qwen/Qwen3-32B": 32.8, "Qwen/Qwen3-8B": 8.2, "Qwen/Qwen3-0.6B": 0.6, "meta-llama/Meta-Llama-3-8B": 8.0,
                "meta-llama/Meta-Llama-3-70B": 70.6}  # fmt: skip


def model_shape(name: str, config: dict):
    """The architecture of an example's base model (from its hub config.json), without downloading it."""
    from transformers import LlamaConfig, Qwen3Config

    from workflow_scripts.model.demo_model import preset_config
    from workflow_scripts.model.presets import preset_name

    qwen3 = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    llama3 = dict(num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)
    shapes = {
        "Qwen/Qwen3-32B": lambda: Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                              num_attention_heads=64, **qwen3),
        "Qwen/Qwen3-8B": lambda: Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                             num_attention_heads=32, **qwen3),
        "Qwen/Qwen3-0.6B": lambda: Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                               num_attention_heads=16, **(qwen3 | {"tie_word_embeddings": True})),
        "meta-llama/Meta-Llama-3-8B": lambda: LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                                          num_hidden_layers=32, num_attention_heads=32, **llama3),
        "meta-llama/Meta-Llama-3-70B": lambda: LlamaConfig(hidden_size=8192, intermediate_size=28672,
                                                           num_hidden_layers=80, num_attention_heads=64, **llama3),
    }  # fmt: skip
    preset = preset_name(name)
    if preset:
        return preset_config(preset, config["model"]["demo_vocab_size"], config["data"]["max_seq_len"])
    return shapes[name]()


def config_folder(name: str, config: dict, folder: Path) -> str:
    """A folder holding only the model's config.json (bf16, as the hub's), for the planner; a preset as is."""
    from workflow_scripts.model.presets import preset_name

    if preset_name(name):
        return name
    shape = model_shape(name, config)
    shape.dtype = "bfloat16"
    shape.save_pretrained(folder)
    return str(folder)


def by_hand(config: dict, n: int) -> dict:
    """GPU GB per GPU and host GB per node of an example, counted by hand: bytes per parameter × parameters /
    shards, plus the activations (the layer inputs with checkpointing and one layer's 52 h bytes a token, else
    every layer's; 12 bytes a logit, for one slice of the chunked loss): the live tensors, which the plan's
    total adds GPU-only terms to (allocator headroom, CUDA context, NCCL). Not the planner's code."""
    t, seq = config["training"], config["data"]["max_seq_len"]
    shape = model_shape(config["model"]["name_or_path"], config)
    h, layers, vocab = shape.hidden_size, shape.num_hidden_layers, shape.vocab_size
    world = t["procs_per_node"] * (config["nodes"] if t["mode"] == "joint" else 1)
    nodes = world // t["procs_per_node"]
    tokens = t["micro_batch_size"] * seq
    # training.chunked_loss (the default; these models' architectures have it): the logits of 2^25 // vocab tokens
    logit_tokens = tokens if t.get("chunked_loss") is False else min(tokens, 2**25 // vocab)
    act = (layers * 2 * h + 52 * h if t["gradient_checkpointing"] else layers * 52 * h) * tokens
    act += 12 * vocab * logit_tokens
    host = 0.0
    if t["peft"] == "lora":  # the frozen base in fp16/bf16, the adapters' 16 bytes are small
        r, mods = t["lora"]["r"], len(t["lora"]["target_modules"])
        gpu = 2 * n + 16 * layers * mods * r * 2 * h
    elif t["strategy"] == "fsdp":  # fp32 parameter, gradient and Adam's moments, sharded
        gpu = 16 * n / world
    elif t["strategy"] == "ddp":
        gpu = 16 * n
    elif t["zero_stage"] == 3:
        on_host = t["offload_ratio"] if t["offload"] != "none" else 0
        gpu = n / world * ((0 if t["offload"] == "all" else 2) + (2 if t["offload"] == "none" else 0)
                           + (12 if t["offload"] == "none" else 16 * (1 - on_host)))  # fmt: skip
        host = n / nodes * ((2 if t["offload"] == "all" else 0) + (2 + 16 * on_host if t["offload"] != "none" else 0))
        head = getattr(shape, "head_dim", None) or h // shape.num_attention_heads
        attention = 2 * h * head * (shape.num_attention_heads + shape.num_key_value_heads)
        layer = attention + 3 * h * shape.intermediate_size
        gpu += 2 * (2 * layer + 2 * vocab * h)  # two layers gathered in bf16, the embedding and its gradient whole
    else:  # ZeRO-1/2: bf16 weights on every rank, gradients whole (1) or partitioned (2), fp32 states partitioned
        grads = 2 * n if t["zero_stage"] == 1 else 2 * n / world
        states = 16 * n / world
        gpu = 2 * n + (grads + states if t["offload"] == "none" else 0)
        if t["offload"] != "none":  # fp32 master, bf16 copy, fp32 gradient, Adam; accumulation: a bf16 gradient
            per_param = 18 + 2 * (t["grad_accum"] > 1)
            largest = 1 << (2 * vocab * h - 1).bit_length()  # each rank's pinned bf16 buffer of the embedding
            host = per_param * n / nodes + t["procs_per_node"] * largest
    return {"tensors_gb": (gpu + act) / GB, "host_gb": host / GB}
