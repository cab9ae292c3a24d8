"""eval.tasks as lm-eval Task objects, loaded offline: the extra tasks of evaluate_model, and the benchmarks
decontaminate compares the training data against (both read them from here).
"""

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.evals.heldout import leaf_tasks
from workflow_scripts.evals.task_data import check_local_splits, data_override, missing_split, task_sources
from workflow_scripts.evals.task_index import lm_eval_task_folders


def extra_tasks(names: list[str], task_data: list[str]):
    """eval.tasks as lm-eval Task objects, loaded offline now, and their TaskManager: an unknown task, or one
    whose data is not available offline, stops with one line naming it."""
    from lm_eval.tasks import TaskManager

    if not names:
        return [], TaskManager(include_defaults=False)  # else simple_evaluate indexes lm-eval's own tasks
    include, files = task_sources(task_data)
    # lm-eval's own 14,000 task YAMLs take 5-10 s to index: its tasks by their YAMLs' folders (task_index's
    # cached index), all of them only for a group or tag of its own
    manager = TaskManager(include_path=include, include_defaults=False) if include else None
    if missing := set(names) - set(manager.all_tasks if manager else ()):
        folders = lm_eval_task_folders(missing)
        manager = TaskManager(include_path=include + folders, include_defaults=False) if folders else None
    if manager is None or not set(names) <= set(manager.all_tasks):
        manager = TaskManager(include_path=include or None)
    loaded = []
    for name in names:
        if (entry := manager._entry(name)) is None:  # noqa: SLF001 (the registered config, to override its data)
            raise UserError(f"eval.tasks: {name} is no lm-eval task (nor one of eval.task_data's task YAMLs)")
        try:
            overrides = data_override(entry, files, include)
            built = manager._factory.build(entry, overrides=overrides, registry=manager._index)  # noqa: SLF001
        except Exception as e:  # datasets' offline and missing-file errors, whatever their class
            local = files.get(name)
            if isinstance(e, KeyError) and isinstance(local, dict) and e.args and e.args[0] not in local:
                raise missing_split(name, e.args[0], local) from None  # a split the task reads, not in its folder
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UserError(f"eval.tasks: {name}: its data is not available offline ({reason}); "
                            "point eval.task_data at local files") from None  # fmt: skip
        for task in leaf_tasks(built):
            check_local_splits(task, files)
        loaded += built if isinstance(built, list) else [built]
    return loaded, manager
