"""The tests' Snakemake polls the throwaway SLURM cluster every second; the tests' workflow jobs are forked from a
Python that imported torch once (job_zygote.py). tests/suite_env.py puts this folder on every test command's PYTHONPATH.

Why: snakemake-executor-plugin-slurm waits 10 s longer before each status check that finds no job finished (up
to 180 s; no setting changes the step), so on the test cluster a job of a minute was seen finished up to ~40 s
late, every stage of a run through SLURM: minutes of a test suite spent waiting. Here the interval stays at the
profile's slurm-init-seconds-before-status-checks (1 s in profiles/slurm-test). squeue on the test cluster takes
milliseconds; what is polled, and how a state is read, stay the plugin's.

Only the plugin's module is touched, when something imports it (Snakemake's main process); every other Python
process of a job (the jobstep, torchrun, the ranks) pays one finder on sys.meta_path that never matches twice.
"""

import sys

PLUGIN = "snakemake_executor_plugin_slurm"


def _capped(executor_class) -> None:
    """The status-check interval of ``executor_class`` held at its init seconds."""
    prop = executor_class.next_seconds_between_status_checks

    def setter(self, value):
        first = getattr(self.workflow.executor_settings, "init_seconds_before_status_checks", None)
        prop.fset(self, value if first is None else min(value, first))

    executor_class.next_seconds_between_status_checks = property(prop.fget, setter)


class _PluginFinder:  # a meta path finder (importlib.abc's class is not imported: ~50 ms in every Python here)
    def find_spec(self, name, path, target=None):
        if name != PLUGIN:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_cap(module):
            exec_module(module)
            _capped(module.Executor)

        spec.loader.exec_module = exec_and_cap
        return spec


sys.meta_path.insert(0, _PluginFinder())

# The tests' workflow jobs forked from a Python that imported torch and transformers once (job_zygote.py says why
# and how); nothing happens unless JOB_ZYGOTES names a folder (conftest.tool_env).
if __import__("os").environ.get("JOB_ZYGOTES"):
    import job_zygote

    job_zygote.delegate()
