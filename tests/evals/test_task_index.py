"""task_index: eval.tasks checked at parse time against lm-eval's task names (read without lm-eval, cached
per installation) and eval.task_data's YAMLs; a folder of split files named after the task's splits."""

import json
from pathlib import Path

import pytest
from conftest import REPO, snakemake, tiny_config

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.evals.task_index import build_index, check_tasks, lm_eval_index

DEMO_MC = REPO / "resources" / "demo" / "tasks" / "demo_mc.yaml"


def lm_eval_tasks() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks"


@pytest.mark.parametrize("folder", ["gsm8k", "mmlu", "scrolls", "afrixnli", "arc"])
def test_index_names_what_lm_evals_own_index_names(folder):
    """Each name lm-eval's TaskIndex finds (tasks, Python tasks, groups, tags from included YAMLs), of the same
    kind and YAML: folders with includes, tags only in an included file, `class` tasks beside a `group`."""
    from lm_eval.tasks._index import TaskIndex

    root = lm_eval_tasks()
    theirs = TaskIndex.build([root / folder])
    ours = build_index(root / folder)
    assert set(ours) == set(theirs) and len(ours) > 3
    for name, entry in theirs.items():
        assert ours[name]["kind"] == entry.kind.name.lower().removeprefix("py_"), name
        if entry.yaml_path is not None:
            assert root / folder / ours[name]["yaml"] == entry.yaml_path, name


def test_the_index_is_built_once_per_lm_eval_installation(tmp_path, monkeypatch):
    from workflow_scripts.evals import task_index

    calls, built = [], {"t": {"kind": "task", "yaml": "t.yaml"}}
    monkeypatch.setattr(task_index, "build_index", lambda root: calls.append(root) or dict(built))
    version, root, index = lm_eval_index(tmp_path)
    assert index == {"t": {"kind": "task", "yaml": "t.yaml"}} and calls == [root]
    (cached,) = tmp_path.glob(f"{version}-*.json")
    assert lm_eval_index(tmp_path)[2] == index and len(calls) == 1  # read from the cache
    cached.write_text("{broken")
    assert lm_eval_index(tmp_path)[2] == index and len(calls) == 2  # a broken cache is rebuilt
    assert json.loads(cached.read_text()) == index


@pytest.fixture
def fake_lm_eval(monkeypatch):
    """lm-eval's index as far as these tests need it: its own gsm8k (the real YAML) and a tag."""
    from workflow_scripts.evals import task_index

    index = {"gsm8k": {"kind": "task", "yaml": "gsm8k/gsm8k.yaml"}, "math_word_problems": {"kind": "tag", "yaml": ""}}
    monkeypatch.setattr(task_index, "lm_eval_index", lambda cache: ("0.4.13", lm_eval_tasks(), index))


def test_unknown_task_is_one_line_naming_it_what_was_found_and_the_rule(fake_lm_eval):
    check_tasks(["gsm8k", "math_word_problems", "demo_mc"], [str(DEMO_MC)])  # lm-eval's, a tag, a YAML's
    with pytest.raises(UserError) as e:
        check_tasks(["demo_mc", "gsm8kk"], [str(DEMO_MC)])
    assert str(e.value) == (
        "eval.tasks: gsm8kk is no task: lm-eval 0.4.13 has none of that name, and eval.task_data's YAMLs define "
        "demo_mc (demo_mc.yaml); a task is named by the `task:` (or `group:`, `tag:`) of its YAML, lm-eval's own "
        "or one in eval.task_data; did you mean gsm8k?"
    )
    with pytest.raises(UserError, match=r"^eval.tasks: demo_mc is no task: .*YAMLs define none;"):
        check_tasks(["demo_mc"], [])


def write_split_files(folder: Path, *splits: str) -> None:
    folder.mkdir(parents=True)
    for split in splits:
        (folder / f"{split}.jsonl").write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + "\n")


def test_split_files_are_named_after_the_splits_the_task_reads(fake_lm_eval, tmp_path):
    """gsm8k reads train (its 5-shot examples) and test (scored): a dev.jsonl, or no train.jsonl, is one line."""
    write_split_files(tmp_path / "ok" / "gsm8k", "train", "test")
    check_tasks(["gsm8k"], [str(tmp_path / "ok" / "gsm8k")])
    write_split_files(tmp_path / "dev" / "gsm8k", "dev", "test", "train")
    with pytest.raises(UserError) as e:
        check_tasks(["gsm8k"], [str(tmp_path / "dev" / "gsm8k")])
    assert str(e.value) == (
        f"eval.task_data: {(tmp_path / 'dev' / 'gsm8k' / 'dev.jsonl').resolve()} is named after no split gsm8k "
        "reads (test, train): each file of gsm8k/ is named after the split it replaces, e.g. gsm8k/test.jsonl"
    )
    write_split_files(tmp_path / "no-train" / "gsm8k", "test")
    with pytest.raises(UserError, match=r"gsm8k's folder has no train file for its 5-shot examples"):
        check_tasks(["gsm8k"], [str(tmp_path / "no-train" / "gsm8k")])


def test_a_yaml_of_task_data_names_its_split_files_too(tmp_path):
    """A task of eval.task_data's own YAML (demo_mc: test split only, no few-shot): its folder of split files
    holds test.jsonl; a train.jsonl it never reads is one line. lm-eval's index is never needed."""
    write_split_files(tmp_path / "demo_mc", "test", "train")
    with pytest.raises(UserError, match=r"train.jsonl is named after no split demo_mc reads \(test\)"):
        check_tasks(["demo_mc"], [str(DEMO_MC), str(tmp_path / "demo_mc")], cache=tmp_path / "no-cache")
    assert not (tmp_path / "no-cache").exists()


def test_snakemake_stops_at_parse_time_on_an_unknown_task(tmp_path):
    """The dry run names the task on one line before any job; the index is cached in the work dir's .snakemake
    (the second run reads it)."""
    config = tiny_config("t")
    config["eval"] |= {"tasks": ["gsm8kk"], "task_data": []}
    for _ in range(2):
        proc = snakemake(tmp_path, config, "-n", check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: eval.tasks: gsm8kk is no task: lm-eval "), errors
        assert "did you mean gsm8k?" in errors[0] and "Job stats" not in proc.stdout
        assert len(list((tmp_path / ".snakemake" / "lm_eval_tasks").glob("*.json"))) == 1


def test_evaluation_loads_lm_evals_own_task_by_its_folder_not_every_yaml(fake_lm_eval, tmp_path):
    """evaluate_model and decontaminate load gsm8k from its YAML's folder (the index says where), not by a
    TaskManager over lm-eval's 14,000 YAMLs; the local split files still replace its data."""
    from workflow_scripts.evals.tasks import extra_tasks

    write_split_files(tmp_path / "gsm8k", "train", "test")
    (task,), manager = extra_tasks(["gsm8k"], [str(tmp_path / "gsm8k")])
    assert "gsm8k" in manager.all_tasks and len(manager.all_tasks) < 50
    assert len(task.eval_docs) == 1 and task.config.dataset_kwargs["data_files"]["test"].endswith("gsm8k/test.jsonl")


def test_without_lm_eval_where_snakemake_runs_its_names_are_left_to_the_jobs(monkeypatch):
    """Snakemake in an environment without lm-eval (--sdm conda: the jobs run in envs/eval.yaml's): a name
    that is no YAML's of eval.task_data is not refused at parse time; the evaluation job checks it."""
    from workflow_scripts.evals import task_index

    monkeypatch.setattr(task_index, "lm_eval_index", lambda cache: None)
    check_tasks(["gsm8k", "demo_mc"], [str(DEMO_MC)])


def test_a_task_yaml_that_does_not_load_is_one_line(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("task: mine\ndataset_path: [unclosed\n")
    with pytest.raises(UserError, match=r"^eval.task_data: .*mine.yaml is no task YAML lm-eval can read \(") as e:
        check_tasks(["mine"], [str(bad)], cache=tmp_path / "cache")
    assert "\n" not in str(e.value)


def test_one_file_for_every_split_of_a_few_shot_task_stops_at_parse_time(fake_lm_eval, tmp_path):
    """gsm8k.jsonl would serve gsm8k's 5-shot examples from the test questions it scores: one line asking for
    the folder, before any job."""
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + "\n")
    with pytest.raises(UserError, match=r"gsm8k.jsonl serves every split of gsm8k, whose 5-shot examples come"):
        check_tasks(["gsm8k"], [str(tmp_path / "gsm8k.jsonl")])
