"""Generate the embedded demo dataset: small instruction tasks with exact answers.

The tasks are chosen so that a model of a few million parameters learns them on a
CPU in minutes: look-ups with several phrasings (capitals, successors), copy-like
transformations (upper-casing, letter reversal) and small sums. The file uses the
``prompt, question, response`` columns of seed 000, plus a ``category`` column.

``--held-out`` writes instead the task family of the second, LoRA stage (config/demo_lora.yaml):
repeating three letters back in order (``Repeat the letters: c a f`` -> ``c a f``), a family that
resources/demo/instructions.csv never has. Stage 1's models have seen the letters (in the reverse
family) but never this instruction, so the LoRA stage has something to learn on top of them.

    python -m workflow_scripts.data.make_demo_data resources/demo/instructions.csv
    python -m workflow_scripts.data.make_demo_data --held-out resources/demo/lora_task.csv

``--multiple-choice`` writes the demo's lm-eval task data (eval.tasks: demo_mc, resources/demo/tasks/): each
question the demo config holds out (data.eval_fraction 0.1, data.seed 0), its answer and three distractors,
answers of other questions of its family, as lm-eval's log-likelihood multiple choice scores them.

    python -m workflow_scripts.data.make_demo_data --multiple-choice resources/demo/tasks/demo_mc.jsonl

``--preferences`` writes the third, DPO stage's pairs (config/demo_dpo.yaml): PREFERENCE_ROWS of the rows, each
question (its system and user turns) with its answer chosen and another answer of its family rejected.

    python -m workflow_scripts.data.make_demo_data --preferences resources/demo/preferences.jsonl
"""

import argparse
import csv
import json
import random
from pathlib import Path

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
# The LoRA stage's family: none of these phrasings, nor the category, is in generate()'s rows.
HELD_OUT_CATEGORY = "repeat"
REPEAT_QUESTIONS = ["Repeat the letters: {s}", "Say the letters again: {s}", "Copy these letters: {s}"]


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


def generate_held_out(seed: int = 0) -> list[dict]:
    """The LoRA stage's rows: every triple of LETTERS once, asked in one of REPEAT_QUESTIONS' phrasings."""
    rng = random.Random(seed)
    rows = []
    for t in (a + b + c for a in LETTERS for b in LETTERS for c in LETTERS):
        letters = " ".join(t)
        question = rng.choice(REPEAT_QUESTIONS).format(s=letters)
        rows.append({"prompt": SYSTEM["reverse"], "question": question, "response": letters})
    rng.shuffle(rows)
    return [row | {"category": HELD_OUT_CATEGORY} for row in rows]


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


PREFERENCE_ROWS = 1024


def preferences(rows: list[dict], seed: int = 0) -> list[dict]:
    """The DPO stage's pairs: the first PREFERENCE_ROWS rows, each as a conversational prompt, its answer (chosen)
    and a plausible mistake (rejected): another answer of its family."""
    rng, family = random.Random(seed), {}
    for row in rows:
        family.setdefault(row["category"], set()).add(row["response"])
    return [
        {"prompt": [{"role": "system", "content": row["prompt"]}, {"role": "user", "content": row["question"]}],
         "chosen": row["response"], "rejected": rng.choice(sorted(family[row["category"]] - {row["response"]})),
         "category": row["category"]}
        for row in rows[:PREFERENCE_ROWS]
    ]  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="the LoRA stage's task family instead")
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
    rows = generate_held_out(args.seed) if args.held_out else generate(args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "question", "response", "category"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
