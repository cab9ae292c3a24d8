rule summarize:
    input:
        # `preference`: each model's held-out preference accuracy, with training.objective dpo only
        unpack(preference_input),
        results=expand(EVAL_RESULT, model=MODELS, allow_missing=True),
        metrics=expand(TRAIN_METRICS, node=TRAINED, allow_missing=True),
        models=expand(MODEL_DIR, model=TRAINED, allow_missing=True),
        decontamination=DECONTAMINATION,
        eval_split=EVAL_SPLIT,
    output:
        summary=SUMMARY,
        tasks=TASKS,
        tasks_plot=report(
            TASKS_PLOT,
            caption="../report/tasks.rst",
            category="Evaluation",
            subcategory="2. Per task",
        ),
        curves=report(
            LOSS_CURVES,
            caption="../report/loss_curves.rst",
            category="Training",
        ),
        throughput=report(
            THROUGHPUT,
            caption="../report/throughput.rst",
            category="Training",
        ),
        leaderboard_text=LEADERBOARD_TEXT,
        leaderboard=report(
            LEADERBOARD,
            caption="../report/leaderboard.rst",
            category="Evaluation",
            subcategory="1. Best model",
        ),
        categories=report(
            CATEGORIES,
            caption="../report/categories.rst",
            category="Evaluation",
        ),
        samples=SAMPLES,
        consolidation=CONSOLIDATION,
    log:
        f"{VLOGS}/summarize.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report/summarize.py"),
        # the tracker runs of the trained models (their trackers.json) get the eval summary and the leaderboard
        # and with training.objective dpo, --preference's files (summary_tail_args)
        trackers=summary_tail_args,
    shell:
        "python {params.script:q} --results {input.results} --metrics {input.metrics}"
        " --summary {output.summary} --tasks {output.tasks} --tasks-plot {output.tasks_plot}"
        " --curves {output.curves} --throughput {output.throughput}"
        " --categories {output.categories}"
        " --samples {output.samples} --leaderboard {output.leaderboard}"
        " --leaderboard-text {output.leaderboard_text}"
        " --models {input.models} --consolidation {output.consolidation}"
        " --decontamination {input.decontamination} --eval-split {input.eval_split}"
        " --trackers {params.trackers} > {log} 2>&1"
