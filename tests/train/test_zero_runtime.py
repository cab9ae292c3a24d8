"""DeepSpeed imported without its autotuner's mlflow, and without building the CPU shared-memory op training never
uses (parallel/zero_runtime.py). In a fresh interpreter each: what a rank imports is per process."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

from workflow_scripts.train.parallel.zero_runtime import SHM_COMM_OP


def fresh(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_deepspeed_imports_without_mlflow_and_the_cpu_shm_op_is_neither_built_nor_loaded():
    pytest.importorskip("mlflow")  # what it hides must be there to hide (make install-trackers)
    seen = fresh(
        "import json, sys\n"
        "from workflow_scripts.train.parallel.zero_runtime import import_deepspeed, prepare_deepspeed\n"
        "ds = import_deepspeed()\n"
        "from deepspeed.autotuning import autotuner\n"
        "hidden = 'mlflow' not in sys.modules\n"
        "prepare_deepspeed()\n"
        "from deepspeed.comm.torch import build_shm_op\n"
        "import deepspeed.ops, mlflow\n"  # a tracker's import afterwards: the real package
        "print(json.dumps({'hidden': hidden, 'has_mlflow': autotuner.has_mlflow, 'same': ds is import_deepspeed(),"
        f" 'mlflow': hasattr(mlflow, 'start_run'), 'shm_op': build_shm_op(),"
        f" 'shm_compatible': deepspeed.ops.__compatible_ops__['{SHM_COMM_OP}']}}))"
    )
    assert seen == {"hidden": True, "has_mlflow": False, "same": True, "mlflow": True, "shm_op": None,
                    "shm_compatible": False}  # fmt: skip


def test_an_mlflow_imported_first_stays():
    pytest.importorskip("mlflow")
    seen = fresh(
        "import json, sys, mlflow\n"
        "from workflow_scripts.train.parallel.zero_runtime import import_deepspeed\n"
        "import_deepspeed()\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(json.dumps({'kept': sys.modules['mlflow'] is mlflow, 'has_mlflow': autotuner.has_mlflow}))"
    )
    assert seen == {"kept": True, "has_mlflow": True}
