"""The README's quickstart, command by command, as a newcomer runs it: in a fresh clone of this checkout (the
venv linked in), against the throwaway SLURM cluster (profiles/slurm + the slurm-test overlay) and a local
stand-in for the Hugging Face Hub (tests/hub_server.py, HF_ENDPOINT). It reaches a report, and its retrain
command retrains one node and refreshes the summary and the report, touching nothing of the other node.

What a test must change in a command is named where it is changed: the config the user edits (a tiny run of
the served model), the SLURM variables (the cluster's partition), the overlay profile, `--watch` (no terminal)."""

import os
import re
import shlex
import subprocess

import pytest
import yaml
from conftest import BIN, DEMO_CSV, PROFILES, REPO, job_logs, run_snakemake, slurm_env, submissions, tiny_config
from hub_server import HubServer, tiny_chat_model

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

REPO_ID = "acme/tiny-chat"
RUN = "quick"
OVERLAY = f"profiles/slurm --profile {REPO / 'profiles' / 'slurm-test'}"


def quickstart() -> list[str]:
    """The commands of the README's Quickstart block, comments and continuation lines dropped."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [c for c in commands if c and not c.startswith("#")]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = HubServer()
    server.repo(REPO_ID).commit(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), DEMO_CSV))
    yield server
    server.stop()


def test_the_readme_quickstart_reaches_a_report_and_retrains_one_node(slurm_cluster, hub, tmp_path):
    commands = quickstart()
    assert len(commands) <= 10, commands
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    (clone / ".venv").symlink_to(BIN.parent)
    env = slurm_env(slurm_cluster) | {
        "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }  # fmt: skip
    outputs = {}

    def run(command: str) -> str:
        proc = subprocess.run(command, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{command}\n{out[-4000:]}\n{job_logs(clone)}"
        outputs[command] = out
        return out

    for command in commands:
        words = shlex.split(command)
        if command.startswith("source .venv/bin/activate"):  # the shell's PATH, as activate sets it
            env |= {"VIRTUAL_ENV": str(clone / ".venv"), "PATH": f"{clone / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"}
            continue
        if command.startswith("export "):  # the cluster's partition for both; no account here
            assert {w.split("=")[0] for w in words[1:]} == {"SLURM_PARTITION", "SLURM_CPU_PARTITION", "SLURM_ACCOUNT"}
            env |= {"SLURM_CPU_PARTITION": env["SLURM_PARTITION"], "SLURM_ACCOUNT": ""}
            continue
        if words[0] == "cp" and words[-1] == "my.yaml":
            run(command)
            assert yaml.safe_load((clone / "my.yaml").read_text())["model"]["name_or_path"]
            # what the comment says to edit: run, data, model (here the served model, and a run this small)
            config = tiny_config(RUN, procs_per_node=1, max_steps=4, log_every=2, checkpoint_every=4)
            config |= {"model": {"name_or_path": REPO_ID}, "eval": config["eval"] | {"max_samples": 16}}
            (clone / "my.yaml").write_text(yaml.safe_dump(config))
            continue
        command = command.replace("<run>", RUN).replace("ARGS=--watch", "ARGS=--plain")
        command = command.replace("--profile profiles/slurm", f"--profile {OVERLAY}")
        if command.startswith(("make dry-run", "make retrain")):
            command += f" PROFILE={shlex.quote(OVERLAY)}" if "PROFILE=" not in command else ""
            command = command.replace("PROFILE=profiles/slurm", f"PROFILE={shlex.quote(OVERLAY)}")
        run(command)

    root = clone / "results" / RUN
    by_start = {c.split()[0] + " " + c.split()[1]: out for c, out in outputs.items()}
    # the model came from the hub once, in fetch_model, at the commit main resolved to
    fetched = sorted(p.rsplit("/", 1)[1] for p in hub.downloads())
    assert "model.safetensors" in fetched and len(fetched) == len(set(fetched)), fetched
    record = yaml.safe_load((root / "base_model.json").read_text())
    assert record["repo"] == REPO_ID and record["sha"] == hub.repo(REPO_ID).resolve("main")
    # the dry run's summary: jobs per partition and the GPU-hours asked for
    assert "GPU-hours" in by_start["make dry-run"] and "train_node" in by_start["make dry-run"]
    # the submission: every job through sbatch, the report built from it
    submitted = [
        rule for _, rule in submissions(next(o for c, o in outputs.items() if c.startswith("snakemake --profile")))
    ]
    assert submitted.count("train_node") == 2 and "fetch_model" not in submitted, submitted
    assert (root / "report.html").stat().st_size > 0 and (root / "eval" / "summary.csv").exists()
    assert "node0" in by_start["make status"] and "node1" in by_start["make status"]

    # the retrain: node1 from step 0, then its chain, the summary, the pages and the report; nothing of node0
    retrain = by_start["make retrain"]
    rules = [rule for _, rule in submissions(retrain)]
    assert rules.count("train_node") == 1 and rules.count("evaluate_model") == 1, rules
    assert {"summarize", "consolidate_node"} <= set(rules), rules
    assert "rule_train_node_wildcards_node0" not in retrain and "model=node0" not in retrain, retrain[-3000:]
    state = yaml.safe_load((root / "train" / "node1" / "train_state.json").read_text())
    assert state["plan"]["start_step"] == 0
    aside = [p.name for p in (root / "checkpoints").iterdir() if p.name.startswith("node1.before-retrain-")]
    assert len(aside) == 1, aside
    report, summary, node0 = root / "report.html", root / "eval" / "summary.csv", root / "train" / "node0"
    assert report.stat().st_mtime > (root / "train" / "node1" / "train_state.json").stat().st_mtime
    assert summary.stat().st_mtime > (node0 / "train_state.json").stat().st_mtime
    # and then nothing is stale
    dry = run_snakemake([str(BIN / "snakemake"), "-n", "--configfile", "my.yaml", *PROFILES], env, clone, 600)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, (dry.stdout + dry.stderr)[-3000:]
