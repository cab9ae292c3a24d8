"""decontaminate: training rows sharing a word n-gram with the held-out set or an eval task's scored documents."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import split_files

from workflow_scripts.evals.decontaminate import EvalIndex, decontaminate, heldout_docs, ngrams, task_sets

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def test_ngrams_are_lowercased_words_without_punctuation():
    assert ngrams("A, b! c", 3) == ngrams("a b c", 3) == {hash(("a", "b", "c"))}
    assert ngrams("a b", 3) == set()  # shorter than n: no n-gram
    assert len(ngrams(" ".join(WORDS), 13)) == len(WORDS) - 12


def gsm8k_folder(tmp_path):
    """GSM8K-shaped local data (question, answer ending "#### n"), one file per split."""
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    test = [  # no words in common between documents: each overlap below is with one document
        {"question": f"Question {i}: " + " ".join(f"{w}{i}" for w in WORDS) + " how many apples are left?",
         "answer": f"So {i}.\n#### {i}"}
        for i in range(3)
    ]  # fmt: skip
    train = [{"question": "Tom has 3 apples and eats one. How many are left?", "answer": "3 - 1 = 2\n#### 2"}] * 2
    for split, rows in (("test", test), ("train", train)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, test


def test_gsm8k_test_docs_overlaps_are_found_as_lm_eval_renders_them(tmp_path):
    """lm-eval's own gsm8k task on local split files: each scored document is rendered as lm-eval prompts it
    ("Question: ...\\nAnswer:") with its target; training rows sharing a 13-gram are found, one sharing 12
    words is not. With drop, rows in = rows kept + contaminated rejects, row for row."""
    folder, test = gsm8k_folder(tmp_path)
    import lm_eval.tasks

    own = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"  # lm-eval's own task: no 10 s index of all
    (name, docs), *_ = task_sets(["gsm8k"], [str(own), str(folder)])
    docs = list(docs)
    assert name == "gsm8k" and len(docs) == 3
    assert docs[0].startswith("Question: Question 0: alpha0") and docs[0].endswith("Answer: So 0.\n#### 0")
    q1, q2 = test[1]["question"].split(), test[2]["question"].split()
    rows = [
        ("Repeat: " + " ".join(q1[2:15]), "ok"),  # 13 words of test doc 1 (after its "Question 1:")
        ("Repeat: " + " ".join(q1[2:14]), "ok"),  # 12 words: no 13-gram in common
        ("Something else entirely", "fine"),
        # the end of doc 2's question and its target, as lm-eval renders them ("Answer: So 2. #### 2")
        ("What is left?", " ".join(q2[-9:]) + " Answer: So 2. #### 2"),
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": a, "response": b}) + "\n" for a, b in rows))
    out = split_files(tmp_path / "split", data, nodes=2, eval_fraction=1e-9)
    index = EvalIndex(13)
    index.add("heldout", heldout_docs(out["eval"]))
    index.add("gsm8k", docs)
    clean = [tmp_path / f"clean{i}.parquet" for i in range(2)]
    report = decontaminate(out["splits"], index, "drop", clean, tmp_path / "contaminated.parquet")
    assert report["training_rows"] == 4 and report["training_rows_contaminated"] == 2
    gsm = report["sets"]["gsm8k"]
    assert gsm["docs"] == 3 and gsm["docs_contaminated"] == 2 and [e["doc"] for e in gsm["examples"]] == [1, 2]
    rejects = pq.read_table(tmp_path / "contaminated.parquet").to_pylist()
    assert sorted(r["source_row"] for r in rejects) == [0, 3] and {r["reason"] for r in rejects} == {"contaminated"}
    kept = sum(pq.read_metadata(p).num_rows for p in clean)
    assert kept + len(rejects) == sum(pq.read_metadata(p).num_rows for p in out["splits"]) == 4


def test_multiple_choice_documents_carry_the_right_choice(tmp_path):
    from conftest import REPO

    demo_mc = REPO / "resources" / "demo" / "tasks" / "demo_mc.yaml"
    (name, docs), *_ = task_sets(["demo_mc"], [str(demo_mc)])
    first = json.loads((demo_mc.parent / "demo_mc.jsonl").read_text().splitlines()[0])
    assert next(iter(docs)) == f"{first['question']} {first['choices'][first['answer']]}"


@pytest.mark.parametrize("policy", ["report", "drop"])
def test_cli_writes_the_report_and_with_drop_the_clean_shards(tmp_path, policy):
    from workflow_scripts.evals.decontaminate import main

    data = tmp_path / "d.jsonl"
    rows = [(" ".join(WORDS[i : i + 14]), "x") for i in range(3)] + [("unrelated words here", "y")] * 1
    data.write_text("".join(json.dumps({"question": a, "response": b}) + "\n" for a, b in rows))
    out = split_files(tmp_path / "s", data, nodes=1, eval_fraction=0.4)
    args = ["--config", json.dumps({"decontaminate": policy}), "--shards", str(out["splits"][0]),
            "--eval", str(out["eval"]), "--output", str(tmp_path / "decon.json")]  # fmt: skip
    if policy == "drop":
        args += ["--clean", str(tmp_path / "clean.parquet"), "--rejects", str(tmp_path / "rej.parquet")]
    main(args)
    report = json.loads((tmp_path / "decon.json").read_text())
    assert report["policy"] == policy and report["ngram"] == 13 and set(report["sets"]) == {"heldout"}
    assert report["training_rows"] == pq.read_metadata(out["splits"][0]).num_rows
    if policy == "drop":
        kept, dropped = (pq.read_metadata(tmp_path / p).num_rows for p in ("clean.parquet", "rej.parquet"))
        assert kept + dropped == report["training_rows"] and dropped == report["training_rows_contaminated"]
