"""core/wildcards.py: a constraint's short regex matches exactly the names it is made of."""

import random
import re

from workflow_scripts.core.wildcards import number_range, one_of


def test_number_range_matches_exactly_its_numbers():
    for lo, hi in [(0, 0), (0, 9), (0, 10), (3, 17), (0, 255), (7, 1000), (99, 101), (120, 2047), (1000, 1999)]:
        pattern = re.compile(number_range(lo, hi))
        for x in range(0, 2200):
            assert bool(pattern.fullmatch(str(x))) == (lo <= x <= hi), (lo, hi, x)
        assert not any(pattern.fullmatch(s) for s in ("00", "01", "007", "", "1a")), (lo, hi)


def test_one_of_matches_the_names_and_nothing_else():
    nodes = [f"node{i}" for i in range(256)]
    assert one_of(["base", *nodes, "soup_uniform"]) == (
        "base|node(?:[0-9]|[1-9][0-9]|1[0-9][0-9]|2[0-4][0-9]|25[0-5])|soup_uniform"
    )
    assert one_of([]) == "(?!)" and one_of(["a.b"]) == r"a\.b"
    universe = ["base", "joint", "node", "node00", "node01", "eval", "eval_pairs", "a.b", "axb", "lr-1e-05_r-8"]
    universe += [f"node{i}" for i in range(1100)] + [f"v{i}" for i in range(30)]
    rng = random.Random(0)
    for trial in range(200):
        run = [f"node{i}" for i in range(rng.randint(0, 600) * (trial % 2))]  # a run of nodes, every other trial
        names = rng.sample(universe, rng.randint(0, 40)) + run
        pattern = re.compile(f"(?:{one_of(names)})")
        assert {u for u in universe if pattern.fullmatch(u)} == set(names), names
