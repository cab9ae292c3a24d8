"""Shared fixtures: the demo model and tokenized shards built once, a Snakemake runner, the trainer's
command line, one local end-to-end run, and the throwaway SLURM clusters (one host, two hosts)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from scheduling import (  # noqa: F401 (the scheduler's hooks, registered with this conftest)
    CLUSTERS,
    pytest_addoption,
    pytest_configure,
    pytest_xdist_make_scheduler,
    run_group,
)
from snakemake_fork import ForkedSnakemake
from suite_env import (  # noqa: F401 (the timeline's hooks, registered with this conftest)
    REPO,
    SITE,
    pytest_runtest_logfinish,
    pytest_runtest_logstart,
)

BIN = Path(sys.executable).parent
DEMO_CSV = REPO / "resources" / "demo" / "instructions.csv"
FORKED_SNAKEMAKE = ForkedSnakemake(BIN / "python")


def tool_env() -> dict:
    """The environment of the tests' commands: the venv NOT on PATH (Snakemake is started as .venv/bin/snakemake
    and must find the venv's python and torchrun itself, as a user's unactivated `.venv/bin/snakemake` does), no hub
    access. The tests name the venv's executables by their full paths (BIN)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != BIN)
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return env


def rule_env() -> dict:
    """The environment of a rule's shell command: tool_env with the venv first on PATH, as Snakemake puts
    the folder of its own interpreter (rules/common.smk), for tests that run a rule's command without it."""
    env = tool_env()
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    return env


def run_main(main, argv: list[str]) -> subprocess.CompletedProcess:
    """A script's ``main(argv)`` in this process, as the CompletedProcess its command line would give: the exit
    code of its SystemExit (a UserError: 2, through pipeline_io.cli), else 0, and what it printed. A new process
    would import torch and transformers again: seconds on 2 cores, for a test of what the script says."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def tiny_config(run: str, strategy: str = "ddp", **training) -> dict:
    """A config that runs every stage in about a minute on 2 cores."""
    return {
        "run": run,
        "nodes": 2,
        "data": {"path": str(DEMO_CSV), "max_seq_len": 128},
        "model": {"name_or_path": "demo"},
        "training": {
            "strategy": strategy,
            "zero_stage": 2,
            "procs_per_node": 2,
            "precision": "fp32",
            "lr": 3e-3,
            "micro_batch_size": 2,  # packed bins of 128 tokens, about 8 examples
            "max_steps": 12,
            "log_every": 4,
            "checkpoint_every": 8,
        }
        | training,
        "eval": {"batch_size": 32, "max_new_tokens": 8, "max_samples": 48},
    }


def snakemake_cmd(workdir: Path, config: dict, *args: str) -> list[str]:
    """The command line running the repo's Snakefile in ``workdir``, ``config`` written to workdir/config.yaml."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    return [
        str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(workdir),
        "--configfile", str(cfg), "--cores", "2", *args,
    ]  # fmt: skip


def job_logs(workdir: Path) -> str:
    """The tails of the rules' logs and of the sbatch logs (SLURM runs), for failure messages: the last written last
    (a failed job's, which a report showing only the head and the tail of a long output keeps)."""
    paths = [*(workdir / "logs").rglob("*.log"), *(workdir / ".snakemake" / "slurm_logs").rglob("*.log")]
    paths.sort(key=lambda p: (p.stat().st_mtime, str(p)))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in paths)


def status(workdir: Path, run: str, env: dict | None = None) -> str:
    """What `make status RUN=<run>` prints for ``workdir`` (plain text, as when not on a terminal)."""
    cmd = [
        str(BIN / "python"),
        "-m",
        "workflow_scripts.ops.status",
        "--run",
        run,
        "-d",
        str(workdir),
        "--plain",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or tool_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def run_snakemake(
    cmd: list[str], env: dict | None = None, cwd: Path | None = None, timeout: float = 1200
) -> subprocess.CompletedProcess:
    """``cmd`` (a `snakemake` command line) as subprocess.run(capture_output=True, text=True) runs it, forked from a
    Python that imported Snakemake once (snakemake_fork.py) where its environment lets it."""
    env, cwd = env or tool_env(), cwd or Path.cwd()
    if FORKED_SNAKEMAKE.forkable(env):
        return FORKED_SNAKEMAKE.run(cmd, env, cwd, timeout=timeout)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def snakemake(
    workdir: Path, config: dict, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the repo's Snakefile in ``workdir`` with ``config`` written to workdir/config.yaml."""
    proc = run_snakemake(snakemake_cmd(workdir, config, *args), env)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{job_logs(workdir)}")
    return proc


def planned_jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts from a dry-run's 'Job stats' table."""
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    lines = out.split("Job stats:")[1].splitlines()
    counts = {}
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit() or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


def trainer_args(tmp: Path, assets: dict, config: dict, shards: int = 1) -> list[str]:
    """train.py and its arguments: ``config`` (JSON) over ``assets``' node0 shard (given ``shards`` times),
    logs and train_state.json in tmp/train, checkpoints in tmp/ckpt. Keys ``config`` leaves out take the
    schema's defaults, as in the workflow, but for the precision: fp32 unless the test says otherwise. Assets with
    a ``reference`` (pairs' reference_logps file) give it too, which training.dpo.reference cached reads."""
    log_dir = tmp / "train"
    config = {"precision": "fp32"} | config
    return [
        str(REPO / "workflow_scripts" / "train" / "train.py"), "--config", json.dumps(config),
        "--data", *[str(assets["node0"])] * shards, "--packing", *[str(assets["packing"])] * shards,
        "--base-model", str(assets["base"]), "--log-dir", str(log_dir), "--checkpoint-root", str(tmp / "ckpt"),
        "--state", str(log_dir / "train_state.json"),
        *(["--eval-data", str(assets["eval"])] if config.get("eval_every") else []),
        *(["--reference-logps", *[str(assets["reference"])] * shards] if "reference" in assets else []),
    ]  # fmt: skip


def ranks_command(procs: int = 2) -> list[str]:
    """torchrun on this machine as train_node starts it (ranks.py: the ranks forked after the imports, no GPU here)."""
    ranks = str(REPO / "workflow_scripts/train/ranks.py")
    return [sys.executable, ranks, "--standalone", "--nproc_per_node", str(procs)]


def check_ranks_command(config: dict, procs: int = 2) -> list[str]:
    """ranks_command for a test's own rank script (tests/*_check.py) on the tiny Qwen3: the launcher imports first
    what the trainer's ranks would for ``config``'s strategy and PEFT (ranks.py preloads that for train.py only),
    so the forked ranks do not import it again."""
    from workflow_scripts.train.parallel import STRATEGIES
    from workflow_scripts.train.ranks import RANK_IMPORTS

    modules = [*RANK_IMPORTS, *STRATEGIES[config.get("strategy", "ddp")].rank_imports]
    modules += ["transformers.models.qwen3.modeling_qwen3"] + (["peft"] if config.get("peft") == "lora" else [])
    return [sys.executable, str(SITE / "check_ranks.py"), ",".join(modules), *ranks_command(procs)[2:]]


def train_command(tmp: Path, assets: dict, config: dict, procs: int = 2) -> list[str]:
    """torchrun (ranks.py) starting ``procs`` ranks of trainer_args on this machine."""
    return [*ranks_command(procs), *trainer_args(tmp, assets, config)]


# In the environment of a trainer whose ranks a test finds by their command line or parent (training_ranks, pgrep),
# or signals as SLURM does (every process of the job step): its launcher is not forked from a job zygote
# (site/job_zygote.py), whose forks are the zygote's children, with its command line.
OWN_LAUNCHER = {"FORK_LAUNCHERS": "0"}


def training_ranks(workdir) -> list[int]:
    """pids of the trainer's ranks (not torchrun itself) running in ``workdir``: those torchrun started as a new
    Python (LOCAL_RANK in their environment at exec), and those ranks.py forked (its children with its command line).
    The trainer's environment has OWN_LAUNCHER."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or Path(proc / "cwd").resolve() != Path(workdir).resolve():
                continue
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if any(arg.endswith(b"train.py") for arg in cmdline.split(b"\0")):
            found[int(proc.name)] = (cmdline, parent, any(v.startswith(b"LOCAL_RANK=") for v in environ))
    return [
        pid for pid, (cmdline, parent, exec_rank) in found.items()
        if exec_rank or (parent in found and found[parent][0] == cmdline)
    ]  # fmt: skip


def consolidate(state, output, *options) -> subprocess.CompletedProcess:
    """export/consolidate.py on a training state (train_state.json) into ``output``."""
    script = REPO / "workflow_scripts/export/consolidate.py"
    cmd = [sys.executable, str(script), "--state", str(state), "--output", str(output), *options]
    return subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), timeout=600)


def trainer_env() -> dict:
    """tool_env with one thread per rank (2 ranks on 2 cores)."""
    return tool_env() | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_trainer(
    tmp: Path, assets: dict, config: dict, procs: int = 2, env: dict | None = None
) -> subprocess.CompletedProcess:
    """train_command to the end (``env``: variables added); fails the test with the end of its stderr if it exits
    non-zero."""
    cmd = train_command(tmp, assets, config, procs)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env() | (env or {}), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def start_trainer(tmp: Path, assets: dict, config: dict, procs: int = 2, env: dict | None = None) -> subprocess.Popen:
    """train_command in the background, in a session of its own (to signal the whole job step as SLURM does;
    ``env``: variables added)."""
    cmd = train_command(tmp, assets, config, procs)
    return subprocess.Popen(cmd, env=trainer_env() | (env or {}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def wait_for(predicate, timeout=300) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def logged_losses(tmp: Path) -> list[tuple[int, float]]:
    """(step, loss) of each line of a trainer's tmp/train/metrics.jsonl."""
    lines = (tmp / "train" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def final_weights(tmp: Path, strategy: str) -> dict:
    """The weights of a trainer's last checkpoint (train_state.json's), as one state dict whatever the strategy."""
    import torch

    state = json.loads((tmp / "train" / "train_state.json").read_text())
    folder = state["checkpoint"]
    if strategy == "ddp":
        return torch.load(f"{folder}/state.pt", weights_only=True)["model"]
    if strategy == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(Path(folder).parent), tag=Path(folder).name)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(f"{folder}/dcp", f"{folder}/full.pt")
    return torch.load(f"{folder}/full.pt", weights_only=False)["model"]


def sigterm_then_rerun_equals_uninterrupted_run(tmp: Path, assets: dict, cfg: dict, strategy: str) -> None:
    """The preemption check: ``cfg`` trained to its end in tmp/a; in tmp/b SIGTERM to the whole job step (as SLURM
    sends it) once a checkpoint of step 4 is complete, the ranks checkpoint and exit 75, the rerun resumes at the
    step they stopped at (not from 0) and logs every step's loss once, bit for bit as tmp/a's, and ends at tmp/a's
    weights exactly. ``cfg`` checkpoints every 4 steps and runs at least 8. tmp/a's ranks are new Pythons, tmp/b's
    forked (ranks.py)."""
    import signal

    import torch

    a, b = tmp / "a", tmp / "b"
    # tmp/a's ranks start as new Pythons, as torchrun starts them where there are GPUs (ranks.py): tmp/b's forked ranks
    # match them bit for bit
    run_trainer(a, assets, cfg, env={"TRAIN_FORK_RANKS": "0"})
    proc = start_trainer(b, assets, cfg)
    assert wait_for(lambda: any((b / "ckpt").glob("*/step-4/COMPLETE")))
    os.killpg(proc.pid, signal.SIGTERM)  # as SLURM does: the whole job step
    _, err = proc.communicate(timeout=300)
    # the workers exit 75; torchrun turns a signal into 1, and the rule maps its marker back to 75
    assert proc.returncode != 0 and "exiting 75" in err, err[-3000:]
    assert json.loads((b / "train" / "preempted.json").read_text())["signal"] == "SIGTERM"
    stopped = max(int(p.parent.name.split("-")[1]) for p in (b / "ckpt").glob("*/step-*/COMPLETE"))
    assert 4 <= stopped < cfg["max_steps"]

    resumed = run_trainer(b, assets, cfg)
    assert f"at step {stopped}" in resumed.stderr  # resumed, not restarted
    assert logged_losses(b) == logged_losses(a)  # every step once, bit for bit
    wa, wb = final_weights(a, strategy), final_weights(b, strategy)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def split_files(tmp: Path, data, nodes: int = 2, **options) -> dict:
    """Run split.py's run_split on ``data`` into ``tmp``; returns the result and output paths. ``options``: the
    SplitConfig fields (``eval_data`` is data.eval_path), ``tokenizer`` and ``min_examples_per_shard``."""
    from workflow_scripts.core.settings import SplitConfig
    from workflow_scripts.data.split import run_split

    options = {"eval_fraction": 0.1, "max_reject_fraction": 1.0} | options
    tokenizer = options.pop("tokenizer", None)
    least = options.pop("min_examples_per_shard", 0)  # many tests split a handful of rows; the guard's tests set it
    kept_rejects = options.pop("kept_rejects", None)
    options["eval_path"] = options.pop("eval_data", None)
    if isinstance(options.get("columns"), str):
        options["columns"] = json.loads(options["columns"])
    cfg = SplitConfig.build({"path": str(data), "nodes": nodes} | options)
    paths = {"splits": [tmp / f"node{i}.parquet" for i in range(nodes)], "eval": tmp / "eval.parquet",
             "rejects": tmp / "rejects.parquet"}  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    result = run_split(cfg, paths["splits"], paths["eval"], paths["rejects"], tokenizer, least, kept_rejects)
    return result | paths


def tokenize_config(**values) -> str:
    """tokenization.py's --config: ``values`` by TokenizeConfig field, the rest the schema's defaults but the
    cache, which is off unless ``cache_dir`` is given (the schema's default is the workflow's folder)."""
    return json.dumps({"cache_dir": ""} | values)


# Test tiers (markers in pyproject.toml): make test-fast leaves out e2e, slurm and torchrun. A test that
# takes one of these fixtures is in that tier whatever else it does; collection fails if it is not marked so.
FIXTURE_TIERS = {"ddp_run": "e2e", "slurm_cluster": "slurm", "two_hosts": "slurm"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for fixture, marker in FIXTURE_TIERS.items():
            if fixture in fixtures and not item.get_closest_marker(marker):
                raise pytest.UsageError(f"{item.nodeid} takes the {fixture} fixture: mark it @pytest.mark.{marker}")
        if fixtures & {"slurm_cluster", "two_hosts"} and run_group(item.nodeid) != CLUSTERS:
            raise pytest.UsageError(f"{item.nodeid} takes a SLURM cluster: add its file to CLUSTER_FILES")


@pytest.fixture(scope="session")
def tiny_dry_run(tmp_path_factory) -> subprocess.CompletedProcess:
    """`snakemake -n -p` of tiny_config("t") (per node), run once for the tests that only read its plan: each
    dry run is a Snakemake start and a parse of the workflow (seconds)."""
    return snakemake(tmp_path_factory.mktemp("tiny_dry_run"), tiny_config("t"), "-n", "-p")


# the grid of grid_dry_run: two learning rates
TINY_GRID = {"training.lr": [1.0e-3, 2.0e-3]}


@pytest.fixture(scope="session")
def grid_dry_run(tmp_path_factory) -> subprocess.CompletedProcess:
    """`snakemake -n -p` of tiny_config("t") with the grid TINY_GRID, run once for the tests that only read its plan."""
    return snakemake(tmp_path_factory.mktemp("grid_dry_run"), tiny_config("t") | {"grid": TINY_GRID}, "-n", "-p")


@pytest.fixture(scope="session")
def joint_dry_run(tmp_path_factory) -> subprocess.CompletedProcess:
    """`snakemake -n -p` of tiny_config("t", mode="joint"), run once for the tests that only read its plan."""
    return snakemake(tmp_path_factory.mktemp("joint_dry_run"), tiny_config("t", mode="joint"), "-n", "-p")


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """The demo base model, one node's tokenized shard and the tokenized eval set."""
    from workflow_scripts.data.packing import write_packing
    from workflow_scripts.data.tokenization import tokenize_shard
    from workflow_scripts.model.demo_model import build_model, texts_from, train_tokenizer

    root = tmp_path_factory.mktemp("assets")
    tokenizer = train_tokenizer(texts_from(str(DEMO_CSV)), 1024)
    model = build_model(tokenizer, 128, seed=0)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    out = split_files(root / "split", DEMO_CSV)
    lengths, _ = tokenize_shard(tokenizer, out["splits"][0], root / "node0.parquet", 128, "truncate")
    write_packing(lengths, 128, root / "node0.packing.parquet")
    tokenize_shard(tokenizer, out["eval"], root / "eval.parquet", 128, "truncate")
    return {
        "base": root / "base",
        "node0": root / "node0.parquet",
        "packing": root / "node0.packing.parquet",
        "eval": root / "eval.parquet",
        "root": root,
    }


def check_outputs(root, nodes=("node0", "node1"), soups=False, shards=("node0", "node1")):
    """What every finished tiny_config run has: summary, logged steps, models that beat base, data report."""
    import pandas as pd

    summary = pd.read_csv(root / "eval" / "summary.csv")
    assert summary["model"].tolist() == ["base", *nodes, *(["soup_uniform", "soup_greedy"] if soups else [])]
    assert set(summary.columns) >= {"model", "eval_loss", "perplexity", "exact_match"}
    tasks = pd.read_csv(root / "eval" / "tasks.csv")  # base, nodes, soups; the held-out set first
    assert list(dict.fromkeys(tasks["model"])) == summary["model"].tolist() and tasks["task"].iloc[0] == "heldout"
    assert (root / "eval" / "tasks.png").stat().st_size > 10_000
    base_loss = summary.set_index("model").loc["base", "eval_loss"]
    for node in nodes:
        metrics = [json.loads(x) for x in (root / "train" / node / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [4, 8, 12]
        assert {"step", "loss", "lr"} <= set(metrics[0])
        assert summary.set_index("model").loc[node, "eval_loss"] < base_loss
        model_dir = root / "models" / node
        assert (model_dir / "config.json").exists() and list(model_dir.glob("*.safetensors"))
        assert (model_dir / "tokenizer.json").exists()
        assert "library_name: transformers" in (model_dir / "README.md").read_text()  # the model card
    manifest = json.loads((root / "data" / "manifest.json").read_text())
    rows = sum(n["rows"] for n in manifest["nodes"]) + manifest["eval"]["rows"] + manifest["rejects"]["rows"]
    assert rows == manifest["rows_in"]
    data_report = json.loads((root / "data" / "report.json").read_text())
    assert set(data_report["shards"]) == {*shards, "eval"}
    assert (root / "data" / "overview.png").stat().st_size > 10_000
    env = json.loads((root / "env" / "check.json").read_text())
    assert env["ok"]
    # the benchmark ran with the training's ranks
    assert [m["rank"] for m in env["benchmark"]["matmul"]] == [0, 1]
    assert env["benchmark"]["allreduce"]["ranks"] == 2 and env["benchmark"]["allreduce"]["busbw_gb_s"] > 0
    assert (root / "eval" / "loss_curves.png").stat().st_size > 10_000
    consolidation = pd.read_csv(root / "eval" / "consolidation.csv")
    assert consolidation["model"].tolist() == list(nodes) and (consolidation["max_logit_diff"] <= 1e-5).all()
    assert {"peak_rss_mb_training_side_model", "peak_rss_mb_write", "peak_rss_mb_reload_check"} <= set(consolidation)


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """One local run of tiny_config("t") (DDP), shared by the workflow tests and the SLURM comparison. Under
    pytest-xdist the run is made once, by the first worker that needs it (the others wait on its lock), in the
    workers' common temp folder, and each worker gets its own copy (copy_of_run: as finished as the run), so a
    test that changes its run in place changes only its worker's."""
    config = tiny_config("t")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        workdir = tmp_path_factory.mktemp("ddp")
        snakemake(workdir, config)
        return workdir, config
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "ddp-shared"
    with FileLock(f"{shared}.lock"):
        if not (shared / "finished").exists():
            shutil.rmtree(shared, ignore_errors=True)
            snakemake(shared / "work", config)
            (shared / "finished").write_text("")
    return copy_of_run(shared / "work", tmp_path_factory.mktemp("ddp") / "work"), config


def copy_of_run(workdir: Path, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a finished run's ``workdir`` at ``dest`` (cp -a: the times and Snakemake's records kept, so the
    copy is as finished as the run), without the folders ``drop`` of its results (results/<run>/<name>): the
    tests that only need the stages before training start from the shared ddp_run instead of running them."""
    subprocess.run(["cp", "-a", str(workdir), str(dest)], check=True)
    for name in drop:
        for path in (dest / "results").glob(f"*/{name}"):
            shutil.rmtree(path)
    return dest


def throwaway_cluster(tmp_path_factory, name: str, unavailable_reason, start):
    """The body of a cluster fixture: skipped with ``unavailable_reason()``'s reason, if any; else the
    cluster ``start`` starts in a temp dir ``name``, stopped at the end."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = start(tmp_path_factory.mktemp(name))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """munged + slurmctld + slurmd on this machine (tests/slurm_cluster.py); skipped without SLURM."""
    from slurm_cluster import start_cluster, unavailable_reason

    yield from throwaway_cluster(tmp_path_factory, "slurm-cluster", unavailable_reason, start_cluster)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """munged + slurmctld here, one slurmd in each of two network namespaces (tests/two_host_cluster.py);
    skipped without the binaries."""
    from two_host_cluster import start_two_host_cluster, two_host_unavailable_reason

    yield from throwaway_cluster(tmp_path_factory, "two-hosts", two_host_unavailable_reason, start_two_host_cluster)


# Snakemake through profiles/slurm, with the overlay for the throwaway clusters
PROFILES = ("--profile", str(REPO / "profiles" / "slurm"), "--profile", str(REPO / "profiles" / "slurm-test"))
SUBMITTED = re.compile(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: .*/rule_(\w+?)/")


def submissions(output: str) -> list[tuple[str, str]]:
    """(SLURM job id, rule) for each job Snakemake submitted, from its log."""
    return SUBMITTED.findall(output)


# sitecustomize.py there: the SLURM plugin's status checks every second (the file says why)
POLL_EVERY_SECOND = Path(__file__).resolve().parent / "site"


def slurm_env(cluster) -> dict:
    """The tests' environment for Snakemake, pointed at a throwaway cluster and its partition, polling it every
    second (POLL_EVERY_SECOND on PYTHONPATH)."""
    env = cluster.client_env(tool_env()) | {"SLURM_PARTITION": cluster.partition}
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    if str(POLL_EVERY_SECOND) not in paths:  # (it is, as conftest set it: the command's Snakemake can be forked)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(POLL_EVERY_SECOND), *paths) if p)
    return env


def bpe_tokenizer(
    corpus,
    special: list[str],
    chat_template: str | None = None,
    bos: str | None = None,
    vocab_size: int = 600,
    added: tuple[str, ...] = (),
    **tokens,
):
    """A byte-level BPE trained on ``corpus`` with a model family's special tokens (no download) and its
    ``added`` tokens that are not special (Qwen3's <think>, </think>); with ``bos``, a post-processor that
    puts it before any text encoded with special tokens, as Llama 3's tokenizer.json does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if bos:
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]),
            ]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, bos_token=bos, **tokens)


def trained_runs(ex: dict) -> list[list[int]]:
    """The labelled ids, one list per contiguous run; checks labels equal input_ids where set."""
    runs, previous = [], -100
    for x, y in zip(ex["input_ids"], ex["labels"], strict=True):
        if y != -100:
            assert y == x
            if previous == -100:
                runs.append([])
            runs[-1].append(y)
        previous = y
    return runs
