"""Preference pairs in (training.objective dpo): a record with a chosen and a rejected answer to one prompt.

data.mapping ``preference`` (mappings.MAPPINGS; auto finds it by ``chosen`` and ``rejected`` columns) reads:

- text columns: ``prompt`` (the user turn), ``chosen`` and ``rejected`` (the answers), all strings;
- chat pairs (UltraFeedback-binarized): ``chosen`` and ``rejected`` each a whole conversation (a list of
  ``{role, content}`` turns) sharing every turn but the last, the answer;
- a conversational prompt (TRL's): ``prompt`` a list of turns, ``chosen`` and ``rejected`` one assistant turn
  each (a list of one turn, a turn, or a string);
- ShareGPT (LLaMA-Factory): ``conversations`` (``{from, value}`` turns ending with the human's) and
  ``chosen`` / ``rejected`` each one ``{from: gpt, value}`` turn (or a string).

Lists may come as JSON text (CSV). Every turn is read and checked as the chat mapping reads it (``parse``:
mappings._chat), so the same roles, parts and orders are accepted or rejected with the same reasons; a pair
adds its own: ``identical_pair`` (both answers the same text, whitespace aside), ``empty_answer`` (either
blank) and ``prompt_mismatch`` (chat pairs whose turns before the answers differ).

A pair travels through the split as one conversation: the prompt's turns, then the chosen answer whose turn
carries the rejected answer's text under ``rejected`` (so its content hash and its eval/node assignment are the
prompt's and the chosen answer's, as an SFT row's). Tokenization renders each side (``pair_sides``) through the
chat template after the same prompt and writes them as two consecutive rows, chosen then rejected
(train/batching.py reads them back as a pair).
"""

import json
from collections.abc import Callable

from workflow_scripts.data.identity import normalize

REJECTED = "rejected"  # the key of the chosen answer's turn that holds the rejected answer's text
PAIR_REASONS = ("identical_pair", "empty_answer", "prompt_mismatch")


def has_pairs(shard) -> bool:
    """Whether a split shard holds preference pairs (its first row is one; a shard is all pairs or none)."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(shard)
    if file.metadata.num_rows == 0:
        return False
    first = file.read_row_group(0, columns=["messages"]).column("messages")[0].as_py()
    return is_pair(json.loads(first))


def is_pair(messages: list[dict]) -> bool:
    return REJECTED in messages[-1]


def pair_sides(messages: list[dict]) -> list[list[dict]]:
    """A split row's conversations to render: a pair's chosen and rejected conversations (the same prompt
    turns), or the conversation itself."""
    if not is_pair(messages):
        return [messages]
    *prompt, last = messages
    answer = {k: v for k, v in last.items() if k != REJECTED}
    return [[*prompt, answer], [*prompt, answer | {"content": last[REJECTED]}]]


def _json(value):
    """A list or object given as JSON text (a CSV cell), else the value."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _answer_turn(value):
    """An answer as a raw turn: a string becomes the assistant's turn; a list of one turn, that turn."""
    value = _json(value)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    return value


def _prompt_turns(fields: dict, names: dict, get) -> list | None:
    """The prompt's raw turns: ShareGPT's conversations, a conversational prompt, or a text prompt."""
    conversations = fields.get(names.get("conversations") or "conversations")
    if conversations is not None:
        return _json(conversations)
    prompt = _json(fields.get(names["prompt"])) if names.get("prompt") else None
    if isinstance(prompt, list):
        return prompt
    text = get("prompt")
    return None if text is None else [{"role": "user", "content": text}]


def preference_examples(fields: dict, names: dict, get, parse: Callable) -> list:
    """A record as ``[(pair, None)]`` or ``[(None, (reason, detail))]``; ``parse(turns, column)``: the chat
    mapping's reading of a conversation (turns and their order checked)."""
    chosen, rejected = (_json(fields.get(names[k])) for k in ("chosen", "rejected"))
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None or (isinstance(value, float) and value != value):
            return [(None, ("missing_field", f"{names[key]} is missing or null"))]
    if isinstance(chosen, list) and isinstance(rejected, list) and (len(chosen) > 1 or len(rejected) > 1):
        sides = [parse(chosen, names["chosen"]), parse(rejected, names["rejected"])]  # chat pairs, whole
    else:
        prompt = _prompt_turns(fields, names, get)
        if not prompt:
            return [(None, ("missing_field", f"{names.get('prompt') or 'prompt'} is missing or null"))]
        if not isinstance(prompt, list):
            return [(None, ("missing_field", "the prompt is not a list of turns"))]
        sides = [parse([*prompt, _answer_turn(v)], names[k]) for k, v in (("chosen", chosen), ("rejected", rejected))]
    for _, problem in sides:
        if problem:
            return [(None, problem)]
    (chosen_turns, _), (rejected_turns, _) = sides
    return [pair_of(chosen_turns, rejected_turns)]


def pair_of(chosen: list[dict], rejected: list[dict]) -> tuple:
    """(the pair as one conversation, None), or (None, (reason, detail))."""
    if [(t["role"], normalize(t["content"])) for t in chosen[:-1]] != [
        (t["role"], normalize(t["content"])) for t in rejected[:-1]
    ]:
        return None, ("prompt_mismatch", "the chosen and rejected conversations differ before their answers")
    good, bad = chosen[-1]["content"], rejected[-1]["content"]
    if not good.strip() or not bad.strip():
        return None, ("empty_answer", f"the {'chosen' if not good.strip() else 'rejected'} answer is blank")
    if normalize(good) == normalize(bad):
        return None, ("identical_pair", "the chosen and rejected answers are the same text")
    return [*chosen[:-1], chosen[-1] | {REJECTED: bad}], None
