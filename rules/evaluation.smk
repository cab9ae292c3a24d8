rule evaluate_model:
    input:
        model=get_model,
        eval=TOKENIZED.format(shard="eval"),
    output:
        result=EVAL_RESULT,
    log:
        f"{VLOGS}/evaluate_model/{{model}}.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("evaluation.py"),
        model=get_model,
        metrics=METRICS,
        batch_size=config["eval"]["batch_size"],
        max_new_tokens=config["eval"]["max_new_tokens"],
        max_samples=config["eval"]["max_samples"],
    shell:
        "python {params.script} --model {params.model} --name {wildcards.model}"
        " --eval {input.eval} --metrics {params.metrics} --batch-size {params.batch_size}"
        " --max-new-tokens {params.max_new_tokens} --max-samples {params.max_samples}"
        " --output {output.result} > {log} 2>&1"
