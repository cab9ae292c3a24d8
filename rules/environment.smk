rule check_environment:
    output:
        ENV_CHECK,  # the report shows ENV_PAGE
    log:
        f"{LOGS}/check_environment.log",
    conda:
        "../envs/train.yaml"
    resources:
        # the training job's GPUs (training.procs_per_node): it measures them before the plan
        gpu=GPUS_PER_NODE,
        tasks_per_gpu=0,  # one task: no --ntasks-per-gpu
    params:
        script=script_path("ops/environment.py"),
        config=ENV_CONFIG,
    shell:
        "python {params.script:q} --config {params.config:q} --output {output} > {log} 2>&1"
