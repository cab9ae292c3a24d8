"""GSM8K end to end: lm-eval's own gsm8k task on a local folder of split files (gsm8k/train.jsonl,
gsm8k/test.jsonl, in lm-eval's gsm8k format), eval.limit 20, and the training data checked for 13-gram
overlaps with gsm8k's test documents (planted ones, known in advance).

The same real run is the checkout-with-a-space run (its test below): the checkout, its data, the task folder, the
work dir and the model folder all under 'a b/', the model folder named m$(touch x)."""

import csv
import json
import re
import shutil
import subprocess

import pandas as pd
import pytest
import yaml
from conftest import BIN, DEMO_CSV, REPO, job_logs, run_snakemake, tiny_config, tool_env

NAMES = "Ava Ben Cora Dev Elif Finn Gia Hugo Ines Jon Kira Liam Mona Nils Oda Pia Quin Rosa Sami Tess Uma Vik Wren Xia"
NAMES += " Yuri"
FRIENDS = "Abe Bea Cal Dot Eli Fay Gus Hal Ida Jay Kai Lou Max Ned Oli Pam Ray Sue Ted Una Val Wes Xan Yas Zed"
TRAIN_NAMES = "Orlando Penelope Quentin Rosalind Sebastian Theodora Ulysses Valentina"
TEST_DOCS, LIMIT = 25, 20


def problem(i: int, name: str, friend: str) -> dict:
    """A GSM8K-shaped problem (question; answer with its working and "#### n"). A name is never more than 12
    words from the next one, so each 13-gram names its document's people: no 13-gram is in two documents."""
    boxes, per_box, given = i + 4, i + 5, i + 1
    question = (f"{name} has {boxes} boxes of apples and each box holds {per_box} apples {name} gives {given} "
                f"boxes to a neighbour named {friend}. How many apples does {name} keep in total?")  # fmt: skip
    kept = (boxes - given) * per_box
    answer = f"{name} keeps {boxes - given} boxes of {per_box}, {kept} apples.\n#### {kept}"
    return {"question": question, "answer": answer}


def gsm8k_fixture(root):
    """gsm8k/{train,test}.jsonl; the training data (demo rows, question/response, and planted rows) and a
    held-out file of other demo rows. Returns (task folder, training CSV, held-out CSV, test docs, the test
    documents the training rows are known to overlap by a 13-gram)."""
    folder = root / "gsm8k"
    folder.mkdir(parents=True)
    test = [problem(i, n, f) for i, (n, f) in enumerate(zip(NAMES.split(), FRIENDS.split(), strict=True))]
    train = [problem(30 + i, n, "Morgan") for i, n in enumerate(TRAIN_NAMES.split())]
    for split, docs in (("train", train), ("test", test)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    words = lambda i: test[i]["question"].split()  # noqa: E731
    planted = [
        ("Please solve this: " + " ".join(words(3)[2:15]), "I will."),  # 13 words of test doc 3's question
        # the end of doc 8's question and its target, as lm-eval renders the document ("... Answer: <answer>")
        ("What is left?", " ".join(words(8)[-8:]) + " Answer: " + test[8]["answer"]),
        ("Please solve this: " + " ".join(words(12)[2:14]), "I will."),  # 12 words of doc 12: no 13-gram
        ("Practice: " + train[0]["question"], train[0]["answer"]),  # a few-shot example: not a scored document
        ("Please solve this: " + " ".join(words(22)[:16]), "Later."),  # doc 22: past eval.limit, still checked
    ]
    with DEMO_CSV.open() as f:
        demo = [(r["question"], r["response"]) for r in csv.DictReader(f)]
    files = {"train.csv": demo[:300] + planted, "heldout.csv": demo[1000:1024]}
    for name, rows in files.items():
        with (root / name).open("w", newline="") as f:
            csv.writer(f).writerows([("question", "response"), *rows])
    return folder, root / "train.csv", root / "heldout.csv", test, [3, 8, 22]


@pytest.fixture(scope="module")
def space_run(tmp_path_factory, demo_assets):
    """One real run (not a dry run) for this file's two tests: a copy of this checkout under 'a b/' (its scripts;
    the data, gsm8k's folder and the held-out file beside them, in resources/gsm8k-test/), a work dir under it and
    a model folder named m$(touch x): one node trains 2 steps; base and node0 are evaluated on gsm8k and the
    training data checked for overlaps (every job that takes the model folder: the split, tokenization, the plan,
    training, evaluation, decontamination). Returns (tmp, checkout, work dir, model, the command, gsm8k's)."""
    tmp = tmp_path_factory.mktemp("space")
    checkout = tmp / "a b" / "checkout"
    junk = (".git", ".venv", "results", "logs", ".snakemake", "__pycache__", ".pytest_cache", ".ruff_cache")
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(*junk))
    folder, train_csv, heldout_csv, test, contaminated = gsm8k_fixture(checkout / "resources" / "gsm8k-test")
    model = tmp / "a b" / "m$(touch x)"
    shutil.copytree(demo_assets["base"], model)
    config = tiny_config("g", procs_per_node=1, max_steps=2, log_every=1, checkpoint_every=2)
    config |= {"nodes": 1, "model": {"name_or_path": str(model)}}
    config["data"] = {"path": str(train_csv), "eval_path": str(heldout_csv), "max_seq_len": 128}
    config["eval"] |= {"tasks": ["gsm8k"], "task_data": [str(folder)], "limit": LIMIT, "soup": False, "max_samples": 8}
    work = tmp / "a b" / "work"
    work.mkdir()
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = [str(BIN / "snakemake"), "-s", str(checkout / "Snakefile"), "-d", str(work),
           "--configfile", str(work / "config.yaml"), "--cores", "2"]  # fmt: skip
    # every model's evaluation and the decontamination
    proc = run_snakemake([*cmd, "results/g/eval/summary.csv"], cwd=tmp / "a b", timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:] + job_logs(work)
    return tmp, checkout, work, model, cmd, (folder, test, contaminated)


@pytest.mark.e2e
def test_gsm8k_on_local_split_files_with_a_limit_and_decontamination(space_run):
    """Every model (base, node0) has gsm8k's strict and flexible exact match over its first 20 of 25
    test questions; each prompt's 5 few-shot examples are train.jsonl's (the job's log shows lm-eval's first
    prompt), never a test question; data/decontamination.json finds exactly the planted 13-gram overlaps
    with the test documents (all 25, the limit notwithstanding) and not the 12-word one nor the copied
    few-shot example."""
    _, _, work, _, _, (folder, test, contaminated) = space_run
    root = work / "results" / "g"

    for model in ("base", "node0"):
        result = json.loads((root / "eval" / f"{model}.json").read_text())
        assert result["tasks_documents"] == {"gsm8k": {"scored": LIMIT, "of": TEST_DOCS}}, model
        scores = result["tasks"]["gsm8k"]
        assert {"exact_match/strict-match", "exact_match/flexible-extract"} <= set(scores), model
        assert all(0 <= scores[k] <= 1 for k in ("exact_match/strict-match", "exact_match/flexible-extract"))
        own = json.loads((root / "eval" / "lm_eval" / f"{model}.json").read_text())
        data_files = own["configs"]["gsm8k"]["dataset_kwargs"]["data_files"]
        assert data_files == {"train": str(folder / "train.jsonl"), "test": str(folder / "test.jsonl")}
        assert own["configs"]["gsm8k"]["fewshot_split"] == "train" and own["n-shot"]["gsm8k"] == 5
        # lm-eval's first gsm8k prompt, in the job's log: 5 train questions, then test document 0's alone
        log = (work / "logs" / "g" / "evaluate_model" / f"{model}.log").read_text()
        prompt = re.search(r"Task: \S*gsm8k\S*; document 0; context prompt .*?\n(.*?)\n\(end of prompt", log, re.S)
        assert prompt, log[-3000:]
        questions = re.findall(r"Question: (.*)", prompt.group(1))
        assert len(questions) == 6 and questions[-1] == test[0]["question"]
        assert all(q.split()[0] in TRAIN_NAMES.split() for q in questions[:5]), questions
    tasks = pd.read_csv(root / "eval" / "tasks.csv")
    gsm8k = tasks[tasks["task"] == "gsm8k"]
    assert set(gsm8k["model"]) == {"base", "node0"} and set(gsm8k["documents"]) == {LIMIT}
    leaderboard = (root / "eval" / "leaderboard.txt").read_text()
    assert re.search(
        rf"^  gsm8k\.exact_match/\S+ +\S.* \d\.\d{{3}}.*\[first {LIMIT} of {TEST_DOCS} documents", leaderboard, re.M
    )
    assert f"gsm8k {len(contaminated)} of {TEST_DOCS} docs" in leaderboard

    report = json.loads((root / "data" / "decontamination.json").read_text())
    gsm = report["sets"]["gsm8k"]
    assert report["ngram"] == 13 and report["policy"] == "report"
    assert gsm["docs"] == TEST_DOCS and gsm["docs_contaminated"] == len(contaminated)
    assert [e["doc"] for e in gsm["examples"]] == contaminated
    assert report["training_rows_contaminated"] == len(contaminated)
    assert report["sets"]["heldout"]["docs_contaminated"] == 0
    shown = {r["source_row"] for r in report["rows"]}
    assert shown == {300, 301, 304}  # the planted rows after the 300 demo rows (0-based data rows)


@pytest.mark.e2e
def test_checkout_with_a_space_and_a_model_named_like_a_command_run(space_run):
    """The run above: a checkout under 'a b/', its data, work dir and a model folder named m$(touch x) trained and
    evaluated the base model, and created no x; a second attempt of the training keeps the first one's log."""
    tmp, _, work, model, cmd, _ = space_run
    state = json.loads((work / "results/g/train/node0/train_state.json").read_text())
    assert state["base_model"] == str(model) and state["step"] == 2
    assert json.loads((work / "results/g/eval/base.json").read_text())["eval_loss"] > 0
    log = work / "logs/g/train_node/node0.log"
    assert "step 2/2" in log.read_text()
    assert not list(tmp.rglob("x")) and not (REPO / "x").exists()

    # a second attempt (here forced) keeps the first one's log: each under node0.log.attempts/, with a header
    proc = subprocess.run([*cmd, "--forcerun", "train_node", "results/g/train/node0/train_state.json"],
                          capture_output=True, text=True, env=tool_env(), cwd=tmp / "a b", timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:] + job_logs(work)
    first, second = (log.parent / "node0.log.attempts" / f"{n}.log" for n in (1, 2))
    assert first.read_text().startswith("=== attempt 1: ") and "step 2/2" in first.read_text()
    assert second.read_text() == log.read_text() and log.read_text().startswith("=== attempt 2: ")
    # the forced rerun of a finished config trains nothing: its outputs again from the last checkpoint
    assert "host " in log.read_text().splitlines()[0] and "nothing to train" in log.read_text()
