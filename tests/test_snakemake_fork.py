"""The tests' forked `snakemake` commands (snakemake_fork.py) answer as the console script's own process does."""

import subprocess

import pytest
from conftest import BIN, FORKED_SNAKEMAKE, snakemake_cmd, tiny_config, tool_env
from snakemake_fork import ForkedSnakemake


def both(cmd: list[str], env: dict, cwd) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    forked = FORKED_SNAKEMAKE.run(cmd, env, cwd, timeout=300)
    alone = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    return forked, alone


def test_a_fork_prints_and_exits_as_the_command_does(tmp_path):
    env = tool_env()
    forked, alone = both([str(BIN / "snakemake"), "--version"], env, tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)
    # a config the schema refuses: exit 1 and the same one-line error, in the working directory asked for
    bad = tiny_config("f") | {"nodes": 0}
    forked, alone = both(snakemake_cmd(tmp_path / "w", bad, "-n"), env, tmp_path)
    assert forked.returncode == alone.returncode == 1
    error = [line for line in alone.stderr.splitlines() if "nodes" in line]
    assert error and error == [line for line in forked.stderr.splitlines() if "nodes" in line]


def test_the_child_has_the_requests_environment_and_directory(tmp_path, monkeypatch):
    forker = FORKED_SNAKEMAKE
    env = tool_env() | {"FORK_TEST_VALUE": "x y"}
    (tmp_path / "Snakefile").write_text(
        'import os\nprint("value", os.environ["FORK_TEST_VALUE"], "cwd", os.getcwd(), "path", os.environ["PATH"])\n'
        "rule a:\n    shell: 'true'\n"
    )
    proc = forker.run([str(BIN / "snakemake"), "-n", "--cores", "1"], env, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"value x y cwd {tmp_path} path {env['PATH']}" in proc.stdout
    assert forker.forkable(tool_env()) and not forker.forkable(tool_env() | {"PYTHONPATH": "/elsewhere"})
    # a client without a server yet starts one for any environment; FORK_SNAKEMAKE=0 turns the forks off
    assert ForkedSnakemake(BIN / "python").forkable(tool_env() | {"PYTHONPATH": "/elsewhere"})
    monkeypatch.setenv("FORK_SNAKEMAKE", "0")
    assert not forker.forkable(tool_env())


def test_a_command_past_its_timeout_is_killed():
    forker = FORKED_SNAKEMAKE
    with pytest.raises(subprocess.TimeoutExpired):
        forker.run([str(BIN / "snakemake"), "--help"], tool_env(), "/", timeout=0.01)
    assert forker.run([str(BIN / "snakemake"), "--version"], tool_env(), "/", timeout=300).returncode == 0
