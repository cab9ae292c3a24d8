# The report's pages: each table, JSON or text output rendered as an HTML page beside it (report_page.py), which
# the report shows in place (it offers a CSV, JSON or TXT only as a download). Local: a page takes a moment.
# compare_grid's page is in rules/grid.smk (a grid only). Each names its page and log by PAGES (rules/common.smk): the
# same paths, with the run as a wildcard held to the config's run, so that `snakemake --list-target-rules` (the
# rules without a wildcard) leaves them out: a page is never a target of its own.


localrules:
    render_summary_page,
    render_leaderboard_page,
    render_tasks_page,
    render_samples_page,
    render_consolidation_page,
    render_plan_page,
    render_provenance_page,
    render_environment_page,
    render_data_page,


rule render_summary_page:
    input:
        SUMMARY,
    output:
        report(
            PAGES["SUMMARY_PAGE"],
            caption="../report/summary.rst",
            category="Evaluation",
            subcategory="1. Best model",
        ),
    log:
        f"{PAGES['VLOGS']}/render_page/summary.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="eval/summary.csv: every model on the held-out set, with 95% intervals",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


# the leaderboard's text with the key plots: the report's first page shows this page's body (report/workflow.rst)
rule render_leaderboard_page:
    input:
        text=LEADERBOARD_TEXT,
        plots=[LEADERBOARD, LOSS_CURVES, TASKS_PLOT],
    output:
        report(
            PAGES["LEADERBOARD_PAGE"],
            caption="../report/leaderboard_text.rst",
            category="Evaluation",
            subcategory="1. Best model",
        ),
    log:
        f"{PAGES['VLOGS']}/render_page/leaderboard.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="The best model per metric (eval/leaderboard.txt) and the key plots",
    shell:
        "python {params.script:q} --input {input.text:q} --images {input.plots} --output {output:q}"
        " --title {params.title:q} > {log} 2>&1"


rule render_tasks_page:
    input:
        TASKS,
    output:
        report(
            PAGES["TASKS_PAGE"],
            caption="../report/tasks_table.rst",
            category="Evaluation",
            subcategory="2. Per task",
        ),
    log:
        f"{PAGES['VLOGS']}/render_page/tasks.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="eval/tasks.csv: every model x task x metric",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


rule render_samples_page:
    input:
        SAMPLES,
    output:
        report(
            PAGES["SAMPLES_PAGE"],
            caption="../report/samples.rst",
            category="Evaluation",
        ),
    log:
        f"{PAGES['VLOGS']}/render_page/samples.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="eval/samples.csv: held-out prompts, references and answers",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


rule render_consolidation_page:
    input:
        CONSOLIDATION,
    output:
        report(
            PAGES["CONSOLIDATION_PAGE"],
            caption="../report/consolidation.rst",
            category="Training",
        ),
    log:
        f"{PAGES['VLOGS']}/render_page/consolidation.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="eval/consolidation.csv: each trained model's consolidation",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


rule render_plan_page:
    input:
        PLAN_TABLE,
    output:
        report(
            PAGES["PLAN_PAGE"],
            caption="../report/plan.rst",
            category="Plan",
        ),
    log:
        f"{PAGES['VLOGS']}/render_page/plan.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="plan/memory.csv: memory per GPU and host RAM, planned",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


rule render_provenance_page:
    input:
        PROVENANCE,
    output:
        report(
            PAGES["PROVENANCE_PAGE"],
            caption="../report/provenance.rst",
            category="Provenance",
        ),
    log:
        f"{PAGES['VLOGS']}/render_page/provenance.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="provenance.json: what produced these models",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


rule render_environment_page:
    input:
        ENV_CHECK,
    output:
        report(
            PAGES["ENV_PAGE"],
            caption="../report/environment.rst",
            category="Environment",
        ),
    log:
        f"{PAGES['LOGS']}/render_page/environment.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="env/check.json: software, hardware and a quick benchmark",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"


rule render_data_page:
    input:
        DATA_REPORT,
    output:
        report(
            PAGES["DATA_PAGE"],
            caption="../report/data.rst",
            category="Data",
        ),
    log:
        f"{PAGES['LOGS']}/render_page/data.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report_page.py"),
        title="data/report.json: what the data stages did",
    shell:
        "python {params.script:q} --input {input:q} --output {output:q} --title {params.title:q} > {log} 2>&1"
