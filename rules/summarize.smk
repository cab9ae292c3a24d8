rule summarize:
    input:
        results=expand(f"{R}/eval/{{model}}.json", model=MODELS),
        metrics=expand(f"{R}/train/{{node}}/metrics.jsonl", node=TRAINED),
        models=expand(f"{R}/models/{{node}}", node=TRAINED),
    output:
        summary=report(
            f"{R}/eval/summary.csv",
            caption="../report/summary.rst",
            category="Evaluation",
        ),
        curves=report(
            f"{R}/eval/loss_curves.png",
            caption="../report/loss_curves.rst",
            category="Training",
        ),
        throughput=report(
            f"{R}/eval/throughput.png",
            caption="../report/throughput.rst",
            category="Training",
        ),
        leaderboard_text=report(
            f"{R}/eval/leaderboard.txt",
            caption="../report/leaderboard_text.rst",
            category="Evaluation",
            subcategory="1. Best model",
        ),
        leaderboard=report(
            f"{R}/eval/leaderboard.png",
            caption="../report/leaderboard.rst",
            category="Evaluation",
            subcategory="1. Best model",
        ),
        categories=report(
            f"{R}/eval/categories.png",
            caption="../report/categories.rst",
            category="Evaluation",
        ),
        samples=report(
            f"{R}/eval/samples.csv",
            caption="../report/samples.rst",
            category="Evaluation",
        ),
        consolidation=report(
            f"{R}/eval/consolidation.csv",
            caption="../report/consolidation.rst",
            category="Training",
        ),
    log:
        f"{LOGS}/summarize.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("summarize.py"),
    shell:
        "python {params.script} --results {input.results} --metrics {input.metrics}"
        " --summary {output.summary} --curves {output.curves} --throughput {output.throughput}"
        " --categories {output.categories}"
        " --samples {output.samples} --leaderboard {output.leaderboard}"
        " --leaderboard-text {output.leaderboard_text}"
        " --models {input.models} --consolidation {output.consolidation} > {log} 2>&1"
