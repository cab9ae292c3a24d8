"""The suite's process environment, set as pytest starts (conftest imports it before any test runs): what every
test and every command a test starts inherits; and TEST_TIMELINE's hooks."""

import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "tests" / "site"
# bytecode written, whatever the environment says (PYTHONDONTWRITEBYTECODE, as in some containers): the suite's
# Pythons and forks then compile the checkout's modules and the tests' assertion rewrites once, not each time
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# the scripts' package, for every command the tests start (the Snakefile sets it for its jobs), and tests/site: its
# sitecustomize forks the workflow jobs from a Python that imported torch and transformers (site/job_zygote.py)
# (once: a pytest-xdist worker, which inherits the variable, imports this file again; the Snakefile's jobs get it
# deduplicated (pipeline_io.module_env), and a test's own command must have the same, the zygotes' key)
_paths = [str(REPO), str(SITE), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, _paths)))
# What libraries put in os.environ as they are imported (lm_eval, sklearn and threadpoolctl, DeepSpeed), set up
# front: a worker's environment, which its commands inherit, then does not change with what its tests have imported,
# and the jobs of a run keep one zygote key (a new key is a new zygote)
for _name, _value in (("HF_XET_HIGH_PERFORMANCE", "1"), ("KMP_DUPLICATE_LIB_OK", "True"),
                      ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")):  # fmt: skip
    os.environ.setdefault(_name, _value)
# the job zygotes' folder: one for the suite, made by pytest's main process (pytest-xdist's workers inherit it), so a
# key's zygote serves every worker's jobs
_inherited = os.environ.get("PYTEST_XDIST_WORKER") and "JOB_ZYGOTES" in os.environ
if os.environ.get("FORK_JOBS", "1") != "0" and not _inherited:
    os.environ["JOB_ZYGOTES"] = tempfile.mkdtemp(prefix="job-zygotes-")
    (Path(os.environ["JOB_ZYGOTES"]) / "owner").write_text(str(os.getpid()))  # they end when this process has
    atexit.register(shutil.rmtree, os.environ["JOB_ZYGOTES"], True)
# DeepSpeed's CPU ops (cpu_adam, built the first time a test offloads) compiled without debug info: the same code
os.environ.setdefault("CXX", str(REPO / "tests" / "site" / "g++-without-debug-info"))

# TEST_TIMELINE=<file>: a line per test start and end (time, worker, id), to attribute a suite's processes to its
# tests (docs/benchmarks/test-suite.md)
TIMELINE = os.environ.get("TEST_TIMELINE")


def pytest_runtest_logstart(nodeid, location):
    timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    timeline("end", nodeid)


def timeline(event: str, nodeid: str) -> None:
    if TIMELINE:
        with open(TIMELINE, "a") as f:
            f.write(f"{time.time():.1f} {event} {os.environ.get('PYTEST_XDIST_WORKER', 'gw')} {nodeid}\n")
