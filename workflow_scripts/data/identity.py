"""A conversation's identity and where it goes: pure functions the split and the demo data generator share.

Its identity is a hash of its normalized text (``content_hash``: equal for rows that differ only in
whitespace); which rows are held out for evaluation, and which node a row goes to, are pure functions
of that hash and a seed (``is_eval``, ``node_by_hash``), so appending rows never moves an existing one.
"""

import hashlib
import json

JSON_TEXT = json.JSONEncoder(ensure_ascii=False)  # json.dumps(..., ensure_ascii=False), without a new encoder a call
json_string = (
    json.encoder.py_encode_basestring if json.encoder.c_encode_basestring is None else json.encoder.c_encode_basestring
)


def normalize(text: str) -> str:
    """Runs of whitespace as one space, none at the ends (as re.sub(r"\\s+", " ", text).strip(), faster)."""
    return " ".join(text.split())


def turn_texts(messages: list[dict]) -> list[str]:
    """Each turn's [role, normalized content] as JSON (what json.dumps writes for the pair); a turn of a tool
    conversation with its calls, specs, reasoning or result name as a third item (``tool_parts``)."""
    return [
        f"[{json_string(t['role'])}, {json_string(normalize(t['content']))}]"
        if len(t) == 2 or not (extra := tool_parts(t))
        else f"[{json_string(t['role'])}, {json_string(normalize(t['content']))}, {extra}]"
        for t in messages
    ]


TOOL_PARTS = ("tools", "tool_calls", "reasoning_content", "name")  # what a tool conversation's turn adds (ids: not)


def tool_parts(turn: dict) -> str:
    """The tool conversation's parts of a turn as sorted JSON (its calls without their ids), "" when it has none."""
    parts = {k: turn[k] for k in TOOL_PARTS if k in turn}
    if "tool_calls" in parts:
        parts["tool_calls"] = [call["function"] for call in parts["tool_calls"]]
    if "reasoning_content" in parts:
        parts["reasoning_content"] = normalize(parts["reasoning_content"])
    return json.dumps(parts, ensure_ascii=False, sort_keys=True) if parts else ""


def normalized_hash(turns: list[str]) -> str:
    """Hash of a conversation's stable text: the JSON list of its turns' [role, normalized content] pairs."""
    return hashlib.sha256(f"[{', '.join(turns)}]".encode()).hexdigest()


def content_hash(messages: list[dict]) -> str:
    """Hash of the normalized conversation; equal for rows that differ only in whitespace."""
    return normalized_hash(turn_texts(messages))


def prompt_hash(messages: list[dict]) -> str:
    """Hash of all but the final answer: one question never straddles train and eval."""
    return content_hash(messages[:-1])


def conversation_hashes(messages: list[dict]) -> tuple[str, str]:
    """(content_hash, prompt_hash) of a conversation, each turn normalized and written once."""
    turns = turn_texts(messages)
    return normalized_hash(turns), normalized_hash(turns[:-1])


def unit(key: str, seed: int, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{salt}:{key}".encode()).digest()[:8], "big")


def is_eval(phash: str, seed: int, eval_fraction: float) -> bool:
    return unit(phash, seed, "eval") / 2**64 < eval_fraction


def node_by_hash(chash: str, seed: int, nodes: int) -> int:
    return unit(chash, seed, "node") % nodes if nodes > 1 else 0  # one node: no hash to take
