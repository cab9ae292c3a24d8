rule evaluate_model:
    input:
        model=get_model,
        eval=TOKENIZED.format(shard="eval"),
        task_files=EVAL_TASK_FILES,
    output:
        result=EVAL_RESULT,
        lm_eval=LM_EVAL_RESULT,
    log:
        f"{VLOGS}/evaluate_model/{{model}}.log",
    conda:
        EVAL_ENV
    params:
        python=EVAL_PYTHON,
        script=script_path("evals/evaluation.py"),
        model=get_model,
        config=EVAL_CONFIG,
    shell:
        "{params.python:q} {params.script:q} --model {params.model:q} --name {wildcards.model}"
        " --eval {input.eval} --config {params.config:q}"
        " --output {output.result} --lm-eval-output {output.lm_eval} > {log} 2>&1"
