"""evals: evaluate_model through lm-eval-harness (evaluation), the held-out set's tasks (heldout), the metrics
registry (metrics: name, per-example function, corpus aggregation, direction; heldout, intervals, the summary and
the grid all read it), bootstrap intervals, eval.tasks loaded offline (tasks, task_data, task_index), and
decontaminate.

A new held-out metric is one entry in metrics.py's registry and its function (metrics.py's docstring says how).
"""
