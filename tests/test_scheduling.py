"""make test's scheduling of groups (tests/scheduling.py): longest first, unknown groups by their count of tests."""

from scheduling import CLUSTER_FILES, CLUSTERS, GroupTimes, group_order, read_group_times, run_group


def test_groups_go_longest_first_and_an_unknown_group_counts_a_second_a_test():
    groups = {"a": ["a::1"], "b": ["b::1", "b::2", "b::3"], "c": ["c::1"], "new": ["new::1", "new::2"]}
    assert group_order(groups, {"a": 10.0, "b": 1.0, "c": 300.0}) == ["c", "a", "new", "b"]
    assert group_order(groups, {}) == ["b", "new", "a", "c"]  # no times: by count of tests, ties as collected


def test_the_cluster_files_are_one_group():
    assert {run_group(f"{path}::test_x[1]") for path in CLUSTER_FILES} == {CLUSTERS}
    assert run_group("tests/core/test_io.py::test_x") == "tests/core/test_io.py"


def test_times_written_by_group_read_back(tmp_path):
    class Report:
        def __init__(self, nodeid, duration):
            self.nodeid, self.duration = nodeid, duration

    times = GroupTimes(tmp_path / "times.json")
    for nodeid, seconds in [("tests/a.py::x", 1.25), ("tests/a.py::y", 2.0), (f"{sorted(CLUSTER_FILES)[0]}::z", 9.0)]:
        times.pytest_runtest_logreport(Report(nodeid, seconds))
    times.pytest_sessionfinish(None)
    assert read_group_times(tmp_path / "times.json") == {CLUSTERS: 9.0, "tests/a.py": 3.2}
    (tmp_path / "times.json").write_text("[1, 2]")
    assert read_group_times(tmp_path / "times.json") == {}
    assert read_group_times(tmp_path / "none.json") == {}
