"""The workflow's scripts, one package per stage. Rules run the entry modules by path (rules/common.smk,
script_path); by hand they run as modules from the checkout: ``python -m workflow_scripts.data.split --help``.

Floors, lowest first: a module imports from its own package or from a lower floor, never from a higher one, and
no module imports an entry script (tests/core/test_architecture.py holds all of this).
"""

FLOORS = ("core", "data", "model", "train", "plan", "evals", "export", "report", "ops")
