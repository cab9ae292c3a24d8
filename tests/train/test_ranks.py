"""ranks.py: torchrun whose ranks fork after the imports where there is no GPU. Its runs are every trainer test's
(conftest.train_command), and the SIGTERM resume tests hold a run of forked ranks bit for bit equal to one of ranks
started as new Pythons (TRAIN_FORK_RANKS=0, as on GPUs)."""

import importlib
import importlib.util
import json
import signal
import subprocess
import sys

import pytest
from conftest import REPO, trainer_env

from workflow_scripts.train import ranks, train
from workflow_scripts.train.parallel import STRATEGIES


def test_ranks_fork_without_gpus_and_start_as_new_pythons_with_them_or_when_asked(monkeypatch, tmp_path):
    monkeypatch.setattr(ranks, "GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    monkeypatch.delenv("TRAIN_FORK_RANKS", raising=False)
    assert ranks.forks_ranks()
    monkeypatch.setenv("TRAIN_FORK_RANKS", "0")
    assert not ranks.forks_ranks()
    monkeypatch.setenv("TRAIN_FORK_RANKS", "1")
    (tmp_path / "nvidiactl").touch()  # a GPU node: torchrun unchanged
    assert not ranks.forks_ranks()


def train_args(config: dict, base) -> list[str]:
    return ["--config", json.dumps(config), "--data", "d.parquet", "--base-model", str(base), "--log-dir", "l",
            "--checkpoint-root", "c", "--state", "s.json"]  # fmt: skip


def test_the_preloaded_modules_follow_the_run(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    plain = ranks.modules_for("x/train.py", train_args({"strategy": "ddp"}, base))
    assert plain == [*ranks.RANK_IMPORTS, "transformers.models.qwen3.modeling_qwen3"]
    zero_lora = ranks.modules_for("x/train.py", train_args({"strategy": "deepspeed", "peft": "lora"}, base))
    assert set(zero_lora) - set(plain) == {*STRATEGIES["deepspeed"].rank_imports, "peft"}
    # a hub id (no folder) or arguments the trainer refuses: the model's class or everything after the common list
    # is left to the ranks, which say what is wrong
    assert ranks.modules_for("x/train.py", train_args({}, "acme/model")) == list(ranks.RANK_IMPORTS)
    assert ranks.modules_for("x/train.py", ["--config", "{not json"]) == list(ranks.RANK_IMPORTS)
    assert ranks.modules_for("x/train.py", ["--config", "[1]"]) == list(ranks.RANK_IMPORTS)
    # another script's ranks (the environment check's benchmark): torchrun's own torch
    assert ranks.modules_for("x/environment.py", train_args({}, base)) == []


@pytest.mark.parametrize("name", [*ranks.RANK_IMPORTS, *(n for s in STRATEGIES.values() for n in s.rank_imports)])
def test_every_preloaded_name_is_a_module_or_a_modules_function(name):
    module, _, function = name.partition(":")
    assert importlib.util.find_spec(module) is not None, name
    if function:
        assert callable(getattr(importlib.import_module(module), function)), name


def test_a_preload_that_fails_is_left_to_the_rank():
    ranks.preload(["no_such_module_anywhere", "json:no_such_function", "json"])  # no exception


def test_a_forked_rank_starts_with_a_new_pythons_signal_handlers():
    def agents(signum, frame):  # torchrun's agent raises its SignalException
        raise RuntimeError(signum)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        for sig in saved:
            signal.signal(sig, agents)
        ranks.fresh_signal_handlers()
        assert [signal.getsignal(s) for s in saved] == [signal.SIG_DFL, signal.default_int_handler, signal.SIG_DFL,
                                                        signal.SIG_DFL]  # fmt: skip
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_the_intra_op_threads_follow_omp_num_threads(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        train.intra_op_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: left as it is
        train.intra_op_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_forked_rank_rebuilds_the_thread_pool_before_its_threads_ask_for_it():
    """A fork of a process that set torch's thread count, then 8 threads converting tensors as transformers 5 loads a
    checkpoint: with fresh_thread_pool first, none of 40 forks fails. Without it 7 and 8 of 40 stopped with "Invalid
    thread pool!" on the development machine, as one of CI's sharded-load ranks did."""
    cmd = [sys.executable, str(REPO / "tests" / "fork_thread_pool_check.py"), "40", "fresh"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["0"], proc.stdout
