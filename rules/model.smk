rule build_demo_model:
    input:
        data=DATA_FILES,
    output:
        model=directory(DEMO_MODEL),
    log:
        f"{LOGS}/build_demo_model.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("model/demo_model.py"),
        config=DEMO_MODEL_CONFIG,
        args=DEMO_MODEL_ARGS,
    shell:
        "python {params.script:q} --config {params.config:q} {params.args} --output {output.model} > {log} 2>&1"
