"""build_demo_model: a from-scratch Qwen3-architecture model (random init) with its own tokenizer.

The tokenizer is a byte-level BPE trained on the demo data's text, with ChatML
special tokens and a chat template, so nothing is downloaded. The result is an
ordinary Hugging Face folder that ``from_pretrained`` loads like any hub model.
"""

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from workflow_scripts.core.pipeline_io import cli, umask_modes
from workflow_scripts.core.settings import DemoModelConfig
from workflow_scripts.data.mappings import resolve_mapping, to_examples
from workflow_scripts.data.readers import iter_records
from workflow_scripts.model.presets import PRESETS, preset_config, preset_name

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen uses; `{% generation %}` marks what the assistant says. Tool calls (config/README.md, "Tool
# calls") in a compact layout, since the tokenizer is trained on the demo's text only and spells JSON a character
# a token: the function specs (``tools=``) as one signature a line, ``name(argument, ...): description``, in a
# ``<tools>`` block that ends the system turn (a turn of its own without one); each call as a JSON line ``{"name",
# "arguments"}`` after the assistant's text; a tool result as a ``tool`` turn. A conversation without tools renders
# as it did before.
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}{%- endif %}"
    "{{ '<tools>' }}{%- for tool in tools %}{%- set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ '\n' + f['name'] + '(' + ((f['parameters'] or {})['properties'] or {}) | list | join(', ') + ')' }}"
    "{%- if f['description'] %}{{ ': ' + f['description'] }}{%- endif %}{%- endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}{%- endif %}"
    "{% for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}{%- continue %}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] %}{%- if message['content'] or not loop.first %}{{ '\n' }}{%- endif %}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}{%- endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_model(tokenizer, max_seq_len: int, seed: int, size: str = "demo") -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return Qwen3ForCausalLM(preset_config(size, len(tokenizer), max_seq_len, **ids))


def texts_from(spec: str, fmt: str = "auto", mapping: str = "auto", columns: dict | None = None):
    """Every turn's text of every readable example, and the chat roles, for tokenizer training."""
    mapping, names = resolve_mapping(spec, fmt, mapping, columns or {})
    n = 0
    for records in iter_records(spec, fmt):
        for rec in records:
            if rec.error:
                continue
            for messages, _ in to_examples(rec.fields, mapping, names):
                if messages:
                    n += 1
                    yield from (t["content"] for t in messages)
    # the chat template's role names, so that they become tokens of their own
    yield from ["system\nuser\nassistant\n"] * max(1, n // 10)


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="settings.DemoModelConfig as JSON (rules/common.smk)")
    p.add_argument("--preset", default="demo", help="demo or a size: " + ", ".join(PRESETS))
    p.add_argument("--output", required=True, type=Path)
    a = p.parse_args(argv)
    cfg = DemoModelConfig.from_json(a.config)
    texts = texts_from(cfg.path, cfg.format, cfg.mapping, cfg.columns)
    tokenizer = train_tokenizer(texts, cfg.demo_vocab_size)
    model = build_model(tokenizer, cfg.max_seq_len, cfg.seed, preset_name(a.preset) or a.preset)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(a.output)
    tokenizer.save_pretrained(a.output)
    umask_modes(a.output)  # model.safetensors: safetensors writes it 0600
    n = sum(t.numel() for t in model.parameters())
    (a.output / "demo_model.json").write_text(json.dumps({"parameters": n, "vocab_size": len(tokenizer)}) + "\n")
    print(f"demo model: {n / 1e6:.2f}M parameters, vocab {len(tokenizer)}, saved to {a.output}")


if __name__ == "__main__":
    main()
