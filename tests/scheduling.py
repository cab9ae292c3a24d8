"""How `pytest -n N --dist loadgroup` (make test) shares the suite between its workers: by group, longest first.

A worker takes one group at a time: a test file (its module fixtures are made once), but the files whose tests take a
throwaway SLURM cluster are one group, CLUSTERS, so that no two clusters start side by side. (xdist's own xdist_group
marks do not group under pytest 9, which ignores the node id xdist rewrites: the scheduler is ours.)

The groups go out longest first (the classic longest-processing-time order): a long end-to-end file taken last keeps
one worker busy minutes after the other has finished. Each group's seconds are those of the last run that wrote
group_times.json (`make test-times`: `pytest --write-group-times`); a group the file does not know (a new test file)
counts a second a test, so it goes out among the short ones. A stale file changes the order, never what runs.
"""

import json
from collections import OrderedDict, defaultdict
from pathlib import Path

import pytest

CLUSTERS = "slurm-clusters"
CLUSTER_FILES = {"tests/train/test_joint.py", "tests/workflow/test_quickstart.py", "tests/workflow/test_slurm.py"}
GROUP_TIMES = Path(__file__).with_name("group_times.json")


def run_group(nodeid: str) -> str:
    """The group of the test ``nodeid`` (rootdir-relative) under --dist loadgroup."""
    path = nodeid.split("::", 1)[0]
    return CLUSTERS if path in CLUSTER_FILES else path


def group_order(groups: dict[str, dict | list], seconds: dict[str, float]) -> list[str]:
    """``groups`` (group -> its node ids) longest first: by ``seconds`` where known, else a second a test; ties in
    collection order."""
    expected = {group: seconds.get(group, float(len(ids))) for group, ids in groups.items()}
    return sorted(groups, key=lambda group: -expected[group])


def read_group_times(path: Path = GROUP_TIMES) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no file, or not one this wrote: every group by its count of tests


def pytest_addoption(parser):
    parser.addoption("--write-group-times", action="store_true",
                     help=f"write each group's seconds (setup + call + teardown) to {GROUP_TIMES.name}, "
                     "the order make test's workers take them in")  # fmt: skip


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's scope scheduling over run_group's groups, in group_order."""

        def _split_scope(self, nodeid: str) -> str:
            return run_group(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "ordered", False):  # the first assignment: the queue is complete, in xdist's order
                units = self.workqueue
                self.workqueue = OrderedDict((g, units[g]) for g in group_order(units, read_group_times()))
                self.ordered = True
            super()._assign_work_unit(node)

    return ByGroup(config, log)


class GroupTimes:
    """On the controller (or a run without workers): each report's seconds summed by group, written at the end."""

    def __init__(self, path: Path):
        self.path, self.seconds = path, defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[run_group(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session):
        if self.seconds:
            times = dict(sorted(((g, round(s, 1)) for g, s in self.seconds.items()), key=lambda kv: -kv[1]))
            self.path.write_text(json.dumps(times, indent=1) + "\n")


def pytest_configure(config):
    if config.getoption("write_group_times", False) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(GroupTimes(GROUP_TIMES), "group-times")
