"""tests/site/g++-without-debug-info, the tests' CXX for DeepSpeed's JIT-built ops: the compiler's arguments less
exactly ``-g``, each passed on whole."""

import os
import subprocess

from conftest import REPO

WRAPPER = REPO / "tests" / "site" / "g++-without-debug-info"


def test_the_wrapper_drops_only_dash_g_and_keeps_every_other_argument_whole(tmp_path):
    fake = tmp_path / "c++"  # the wrapper's compiler, found on PATH: prints the arguments it got, one a line
    fake.write_text('#!/bin/sh\nfor a; do echo "[$a]"; done\n')
    fake.chmod(0o755)
    args = ["-O3", "-g", "-std=c++20", "-g3", "-I/a path/with spaces", "-DX=1", "-c", "x.cpp", "-o", "x.o", "-g"]
    env = os.environ | {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([WRAPPER, *args], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [f"[{a}]" for a in args if a != "-g"]
    assert os.access(WRAPPER, os.X_OK)  # executable in a fresh clone: git keeps the mode
