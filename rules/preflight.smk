localrules:
    plan_training,


rule plan_training:
    input:
        # `env`: the GPUs check_environment measured on the training partition, where training.gpu_memory_gb
        # is unset (their memory is the plan's); a set one leaves the plan independent of the environment check
        unpack(measured_gpu_input),
        model=BASE_RECORD_INPUT,  # a hub model's fetch record: a refetch re-plans
    output:
        plan=PLAN,
        table=PLAN_TABLE,  # the report shows PLAN_PAGE
    log:
        f"{VLOGS}/plan_training.log",
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("plan/preflight.py"),
        model=model_shape,
        config=plan_json,
        # the training job's host memory, untracked: a profile's TRAIN_MEM_MB (raised after an out-of-memory
        # failure, or a cluster after a workstation) re-plans nothing; a finished plan is checked against it at
        # parse time (check_host_memory)
        host_memory=Untracked(cli_args(host_memory_mb=train_mem_mb())),
        environment=environment_args,
    shell:
        "python {params.script:q} --model {params.model:q} --config {params.config:q} {params.host_memory}"
        " {params.environment} --output {output.plan} --table {output.table} > {log} 2>&1"
