"""watchdog.exit_watchdog: a rank that hangs after training ended says where, with every thread's stack, and ends
itself: 0 once everything is on disk (the final barrier passed), else 1."""

import subprocess
import sys
import time

import pytest
from conftest import REPO

HANGS = """
import sys, threading, time
sys.path.insert(0, {repo!r})
from workflow_scripts.train.watchdog import exit_watchdog

def stuck_in_teardown():
    time.sleep(600)

on_disk = exit_watchdog(1.0)
if {passed}:
    on_disk.set()
threading.Thread(target=stuck_in_teardown, name="teardown").start()  # not a daemon: exit waits for it
"""


@pytest.mark.parametrize(("passed", "code", "where"), [(True, 0, "everything is on disk"), (False, 1, "before")])
def test_a_rank_hanging_after_training_prints_its_threads_and_ends(passed, code, where):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HANGS.format(repo=str(REPO), passed=passed)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == code, proc.stderr[-3000:]
    assert time.monotonic() - start < 60  # not the 600 s its thread sleeps
    first = proc.stderr.splitlines()[0]
    assert first.startswith("train: rank 0 still running 1 s after training ended") and where in first, first
    assert f"then exit {code}" in first
    assert "in stuck_in_teardown" in proc.stderr  # the hanging thread's stack, by function


def test_a_rank_that_ends_is_not_held_by_its_watchdog():
    script = HANGS.replace("threading.Thread(", "(lambda **_: None)(").replace(").start()", ")")
    script = script.replace("exit_watchdog(1.0)", "exit_watchdog(30.0)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script.format(repo=str(REPO), passed=True)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert time.monotonic() - start < 25  # the timer is a daemon: exit does not wait for it
