"""Generate the embedded demo dataset: small instruction tasks with exact answers.

The tasks are chosen so that a model of a few million parameters learns them on a
CPU in minutes: look-ups with several phrasings (capitals, successors), copy-like
transformations (upper-casing, letter reversal) and small sums. The file uses the
``prompt, question, response`` columns of seed 000, plus a ``category`` column.

``--held-out`` writes instead the data of the second, LoRA stage (config/demo_lora.yaml), as OpenAI chat rows
(JSONL, a ``messages`` list each): two families that resources/demo/instructions.csv never has, on 256 triples of
a-h each. Repeating three letters back in order (``Repeat the letters: c a f`` -> ``c a f``): stage 1's models have
seen the letters (in the reverse family) but never this instruction. And tool calls (config/README.md, "Tool
calls"): a ``repeat_letters`` function in the row's ``tools``, asked to repeat three letters with it (``Use the
tool to repeat "c a f".``), the answer a call ``{"name": "repeat_letters", "arguments": {"letters": "c a f"}}`` that
copies the letters from the question; a quarter of these conversations go on with the tool's result and the final
answer (``c a f``). A conversation's last assistant turn is what is evaluated, so those ending with the call get
the held-out ``tool_call`` score, the others exact match.

    python -m workflow_scripts.data.make_demo_data resources/demo/instructions.csv
    python -m workflow_scripts.data.make_demo_data --held-out resources/demo/lora_task.jsonl

``--multiple-choice`` writes the demo's lm-eval task data (eval.tasks: demo_mc, resources/demo/tasks/): each
question the demo config holds out (data.eval_fraction 0.1, data.seed 0), its answer and three distractors,
answers of other questions of its family, as lm-eval's log-likelihood multiple choice scores them.

    python -m workflow_scripts.data.make_demo_data --multiple-choice resources/demo/tasks/demo_mc.jsonl

``--preferences`` writes the third, DPO stage's pairs (config/demo_dpo.yaml): PREFERENCE_ROWS of the rows, each
question (its system and user turns) with its answer twice, chosen ending with a full stop and rejected with an
exclamation mark (a style stage 1 never saw: its answers end with neither).

    python -m workflow_scripts.data.make_demo_data --preferences resources/demo/preferences.jsonl
"""

import argparse
import csv
import json
import random
from pathlib import Path

from workflow_scripts.data.chat_render import messages_for

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Austria": "Vienna",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Denmark": "Copenhagen",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Ireland": "Dublin",
    "Greece": "Athens",
    "Hungary": "Budapest",
    "Czechia": "Prague",
    "Romania": "Bucharest",
    "Bulgaria": "Sofia",
    "Croatia": "Zagreb",
    "Serbia": "Belgrade",
    "Ukraine": "Kyiv",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Nigeria": "Abuja",
    "Ghana": "Accra",
    "Morocco": "Rabat",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Cuba": "Havana",
    "Mexico": "Mexico City",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "Argentina": "Buenos Aires",
    "Colombia": "Bogota",
    "Turkey": "Ankara",
}
CAPITAL_QUESTIONS = [
    "What is the capital of {c}?",
    "Name the capital city of {c}.",
    "Which city is the capital of {c}?",
    "Capital of {c}?",
    "Tell me the capital of {c}.",
    "{c} has which capital?",
]
WORDS = (
    "apple bread chair dance eagle flame grape house islet juice kite lemon "
    "mango night ocean piano queen river stone tiger uncle violin water yacht "
    "zebra amber brick cloud dream earth frost globe heart ivory jelly knife "
    "light metal noble olive pearl quiet robin sugar table union vivid wheat "
    "young zesty acorn blaze crane daisy ember fairy ghost honey input joker "
    "koala lunar maple nylon orbit plaza quilt radar salad tulip ultra vapor "
    "whale xenon yeast zonal"
).split()
LETTERS = "abcdefgh"

SYSTEM = {
    "capital": "Answer with the city name only.",
    "successor": "Answer with the number only.",
    "predecessor": "Answer with the number only.",
    "upper": "Answer with the word only.",
    "reverse": "Answer with the letters only.",
    "sum": "Answer with the number only.",
}
# The LoRA stage's families: none of these phrasings, nor the categories, is in generate()'s rows.
HELD_OUT_CATEGORY = "repeat"
REPEAT_QUESTIONS = ["Repeat the letters: {s}", "Say the letters again: {s}", "Copy these letters: {s}"]
TOOL_CATEGORY = "tool_call"
REPEAT_ROWS = 256  # of the 512 triples: the tool rows' share of the stage's step budget
# The letters in quotes, which the call's JSON string puts them in too: the same tokens in the question and in the
# call ("c", " a", " f"), which a model copies at the distance of the call's JSON far sooner than from ": c a f".
TOOL_QUESTIONS = ['Use the tool to repeat "{s}".', 'Call repeat_letters on "{s}".', 'Have the tool say "{s}".']
TOOL_ROWS = 256  # triples asked with the tool, of the 512
ANSWERED = 0.25  # the tool conversations that go on to the tool's result and the final answer
TOOL_NAME = "repeat_letters"
# the one function of the tool rows, an OpenAI spec (no description: the demo tokenizer spells it a letter a token)
LETTERS_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "parameters": {"type": "object", "properties": {"letters": {"type": "string"}}, "required": ["letters"]},
    },
}


def generate(seed: int = 0) -> list[dict]:
    """Return unique rows, each ``{prompt, question, response, category}``."""
    rng = random.Random(seed)
    rows = []
    for country, city in CAPITALS.items():
        for q in CAPITAL_QUESTIONS:
            rows.append(("capital", q.format(c=country), city))
    for n in range(200):
        for q in ("What number comes after {n}?", "What is {n} plus one?", "Successor of {n}?"):
            rows.append(("successor", q.format(n=n), str(n + 1)))
        if n > 0:
            for q in ("What number comes before {n}?", "What is {n} minus one?"):
                rows.append(("predecessor", q.format(n=n), str(n - 1)))
    for w in WORDS:
        for q in ("Write {w} in capital letters.", "Uppercase: {w}", "Shout the word {w}."):
            rows.append(("upper", q.format(w=w), w.upper()))
    triples = [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS]
    for t in rng.sample(triples, 300):
        rows.append(("reverse", "Reverse the letters: " + " ".join(t), " ".join(reversed(t))))
    for a in range(15):
        for b in range(15):
            rows.append(("sum", f"What is {a} + {b}?", str(a + b)))
    rng.shuffle(rows)
    seen, out = set(), []
    for category, question, response in rows:
        if question in seen:
            continue
        seen.add(question)
        out.append({"prompt": SYSTEM[category], "question": question, "response": response, "category": category})
    return out


def generate_repeat(seed: int = 0) -> list[dict]:
    """The repeat family: REPEAT_ROWS triples of LETTERS, each asked in one of REPEAT_QUESTIONS' phrasings, as
    ``{prompt, question, response, category}`` rows."""
    rng = random.Random(seed)
    rows = []
    for t in (a + b + c for a in LETTERS for b in LETTERS for c in LETTERS):
        letters = " ".join(t)
        question = rng.choice(REPEAT_QUESTIONS).format(s=letters)
        rows.append({"prompt": SYSTEM["reverse"], "question": question, "response": letters})
    rng.shuffle(rows)
    return [row | {"category": HELD_OUT_CATEGORY} for row in rows[:REPEAT_ROWS]]


def tool_conversation(letters: str, question: str, number: int, answered: bool) -> dict:
    """One OpenAI chat row: the question, the assistant's ``repeat_letters`` call (its arguments a JSON string, as
    OpenAI writes them) and, when ``answered``, the tool's result and the final answer."""
    call_id = f"call_{number}"
    arguments = json.dumps({"letters": letters})
    call = {"id": call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    if answered:
        messages += [
            {"role": "tool", "tool_call_id": call_id, "name": TOOL_NAME, "content": letters},
            {"role": "assistant", "content": letters},
        ]
    return {"messages": messages, "tools": [LETTERS_TOOL], "category": TOOL_CATEGORY}


def generate_tool_calls(seed: int = 0) -> list[dict]:
    """The tool family: TOOL_ROWS triples of LETTERS, each asked in one of TOOL_QUESTIONS' phrasings, a share
    ANSWERED of the conversations answered (tool_conversation)."""
    rng = random.Random(seed + 1)
    triples = rng.sample([a + b + c for a in LETTERS for b in LETTERS for c in LETTERS], TOOL_ROWS)
    rows = []
    for k, t in enumerate(triples):
        letters = " ".join(t)
        question = rng.choice(TOOL_QUESTIONS).format(s=letters)
        rows.append(tool_conversation(letters, question, k, rng.random() < ANSWERED))
    return rows


def generate_held_out(seed: int = 0) -> list[dict]:
    """The LoRA stage's rows as OpenAI chat rows (``{messages, category}``, the tool rows with their ``tools``):
    the repeat family (generate_repeat) and the tool family (generate_tool_calls), shuffled together."""
    rows = [
        {"messages": messages_for(r["prompt"], r["question"], r["response"]), "category": r["category"]}
        for r in generate_repeat(seed)
    ]
    rows += generate_tool_calls(seed)
    random.Random(seed).shuffle(rows)
    return rows


def multiple_choice(rows: list[dict], seed: int = 0, eval_fraction: float = 0.1) -> list[dict]:
    """The held-out rows of ``rows`` (as split_dataset picks them) as 4-way multiple-choice questions."""
    from workflow_scripts.data.identity import is_eval, prompt_hash
    from workflow_scripts.data.mappings import column_names, to_examples

    names = column_names("columns", {"prompt": "prompt", "question": "question", "response": "response"})
    rng, out = random.Random(seed), []
    for row in rows:
        messages = to_examples(row, "columns", names)[0][0]
        if not is_eval(prompt_hash(messages), seed, eval_fraction):
            continue
        others = sorted({r["response"] for r in rows if r["category"] == row["category"]} - {row["response"]})
        choices = [row["response"], *rng.sample(others, 3)]
        rng.shuffle(choices)
        out.append({"question": row["question"], "choices": choices, "answer": choices.index(row["response"]),
                    "category": row["category"]})  # fmt: skip
    return out


PREFERENCE_ROWS = 512
# The DPO stage's rule, a style that stage 1 never trained: its answers end with no mark at all, so its node0 finds
# either ending about as likely (0.56 of held-out pairs chosen-likelier, by category 0.36 to 1), and learning it is
# a preference, not a new skill (the answers themselves are stage 1's, right in both sides).
CHOSEN_END, REJECTED_END = ".", "!"


def preferences(rows: list[dict], seed: int = 0) -> list[dict]:
    """The DPO stage's pairs: the first PREFERENCE_ROWS rows, each as a conversational prompt and its answer twice,
    ending with CHOSEN_END (chosen) and with REJECTED_END (rejected). A rule of the answer's form rather than its
    truth (another answer of its family as the rejected one): the tiny model learns it in a few dozen steps and it
    holds on held-out pairs, where telling a right number from a wrong one stalled at 0.77."""
    return [
        {"prompt": [{"role": "system", "content": row["prompt"]}, {"role": "user", "content": row["question"]}],
         "chosen": row["response"] + CHOSEN_END, "rejected": row["response"] + REJECTED_END,
         "category": row["category"]}
        for row in rows[:PREFERENCE_ROWS]
    ]  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="the LoRA stage's conversations (JSONL) instead")
    parser.add_argument("--multiple-choice", action="store_true", help="the demo_mc task's JSONL instead")
    parser.add_argument("--preferences", action="store_true", help="the DPO stage's pairs (JSONL) instead")
    args = parser.parse_args(argv)
    if args.multiple_choice or args.preferences:
        make = preferences if args.preferences else multiple_choice
        questions = make(generate(args.seed), args.seed)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
        print(f"wrote {len(questions)} {'pairs' if args.preferences else 'questions'} to {args.output}")
        return
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.held_out:
        rows = generate_held_out(args.seed)
        args.output.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        print(f"wrote {len(rows)} conversations to {args.output}")
        return
    rows = generate(args.seed)
    with args.output.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "question", "response", "category"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
