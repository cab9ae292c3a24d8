rule check_environment:
    output:
        report(
            ENV_CHECK,
            caption="../report/environment.rst",
            category="Environment",
        ),
    log:
        f"{LOGS}/check_environment.log",
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("environment.py"),
        strategy=config["training"]["strategy"],
        peft=config["training"]["peft"],
        procs=config["training"]["procs_per_node"],
        precision=config["training"]["precision"],
    shell:
        "python {params.script} --strategy {params.strategy} --peft {params.peft}"
        " --procs-per-node {params.procs} --precision {params.precision}"
        " --output {output} > {log} 2>&1"
