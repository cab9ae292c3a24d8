# Only with `grid:` (Snakefile): the base model is evaluated once, in results/<run>/eval/, each variant's
# summary gets a copy of that result, and compare_grid puts every variant's models beside it.


use rule evaluate_model as evaluate_base with:
    output:
        result=BASE_EVAL,
        lm_eval=BASE_LM_EVAL,
    log:
        f"{LOGS}/evaluate_model/{{model}}.log",
    wildcard_constraints:
        model="base",


localrules:
    copy_base_eval,


# a variant's eval/base.json is the shared one, so its summary and leaderboard compare against base
ruleorder: copy_base_eval > evaluate_model


rule copy_base_eval:
    input:
        result=BASE_EVAL,
        lm_eval=BASE_LM_EVAL,
    output:
        result=EVAL_RESULT,
        lm_eval=LM_EVAL_RESULT,
    log:
        f"{VLOGS}/copy_base_eval/{{model}}.log",
    wildcard_constraints:
        model="base",
    conda:
        "../envs/eval.yaml"
    shell:
        "(cp {input.result} {output.result} && cp {input.lm_eval} {output.lm_eval}) > {log} 2>&1"


rule compare_grid:
    input:
        base=BASE_EVAL.format(model="base"),
        results=expand(EVAL_RESULT, variant=VARIANTS, model=[*TRAINED, *SOUPS]),
    output:
        table=GRID_TABLE,  # the report shows GRID_PAGE (rules/report_pages.smk)
        plot=report(GRID_PLOT, caption="../report/grid.rst", category="Grid"),
    log:
        f"{LOGS}/compare_grid.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("report/grid.py"),
        config=GRID_CONFIG,
    shell:
        "python {params.script:q} --config {params.config:q} --base {input.base} --results {input.results}"
        " --table {output.table} --plot {output.plot} > {log} 2>&1"
