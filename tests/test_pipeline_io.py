"""pipeline_io's progress lines: rate, ETA and cadence, with a fake clock."""

import pytest


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def progress(**kwargs):
    from pipeline_io import Progress

    clock, lines = Clock(), []
    return Progress("split", emit=lines.append, clock=clock, **kwargs), clock, lines


def test_a_line_every_tenth_of_the_total_with_rate_and_eta():
    bar, clock, lines = progress(total=1000, every=60, least=2)
    clock.now += 10
    bar.update(50)  # 5%: nothing yet
    assert lines == []
    clock.now += 10
    bar.update(150)  # 20% after 20 s: 10 rows/s, 800 left
    assert lines == ["split: 200/1,000 rows (20%), 10 rows/s, ETA 1m20s, elapsed 20s"]
    clock.now += 1
    bar.update(100)  # 30%, but 1 s after the last line: not yet
    clock.now += 1
    bar.update(1)  # 2 s after: the 30% line
    assert len(lines) == 2 and lines[1].startswith("split: 301/1,000 rows (30%)")
    clock.now += 78
    bar.done()
    assert lines[-1] == "split: done, 301/1,000 rows (30%), 3 rows/s, elapsed 1m40s"


def test_a_line_every_so_many_seconds_without_a_total_and_other_counts():
    bar, clock, lines = progress(every=30, unit="rows")
    for _ in range(10):
        clock.now += 10
        bar.update(100, tokens=4000)
    assert len(lines) == 3  # at 30, 60, 90 s; never per update
    assert lines[0] == "split: 300 rows, 10 rows/s, 12,000 tokens (400 tokens/s), elapsed 30s"
    assert "ETA" not in lines[0] and "%" not in lines[0]


def test_an_estimated_total_is_marked_and_dropped_at_the_end():
    bar, clock, lines = progress(total=100_000, exact=False, every=30)
    clock.now += 30
    bar.update(25_000)
    assert lines == ["split: 25,000/~100,000 rows (25%), 833 rows/s, ETA 1m30s, elapsed 30s"]
    clock.now += 100
    bar.update(80_000)  # more than estimated: no ETA
    assert "ETA" not in lines[-1] and "(105%)" in lines[-1]
    bar.done()
    assert lines[-1] == "split: done, 105,000 rows, 808 rows/s, elapsed 2m10s"


@pytest.mark.parametrize("seconds,text", [(0.4, "0s"), (59.6, "1m00s"), (61, "1m01s"), (7260, "2h01m")])
def test_duration(seconds, text):
    from pipeline_io import duration

    assert duration(seconds) == text


def test_the_interpreters_folder_goes_first_on_path_when_it_holds_torchrun(tmp_path):
    from pipeline_io import interpreter_first_on_path

    venv, other = tmp_path / "venv" / "bin", tmp_path / "other"
    venv.mkdir(parents=True)
    (venv / "torchrun").touch()
    env = {"PATH": f"{other}:/usr/bin"}
    interpreter_first_on_path(env, str(venv / "python"))
    assert env["PATH"] == f"{venv}:{other}:/usr/bin"
    interpreter_first_on_path(env, str(venv / "python"))  # once only
    assert env["PATH"].count(str(venv)) == 1
    # an interpreter without the training stack (a system Snakemake) leaves an activated env first
    env = {"PATH": f"{other}:/usr/bin"}
    interpreter_first_on_path(env, str(other / "python3"))
    assert env["PATH"] == f"{other}:/usr/bin"
