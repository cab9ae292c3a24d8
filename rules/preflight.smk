localrules:
    plan_training,


rule plan_training:
    input:
        model=BASE_RECORD_INPUT,  # a hub model's fetch record: a refetch re-plans
    output:
        plan=PLAN,
        table=PLAN_TABLE,  # the report shows PLAN_PAGE
    log:
        f"{VLOGS}/plan_training.log",
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("preflight.py"),
        model=model_shape,
        config=plan_json,
        # the training job's host memory (a new TRAIN_MEM_MB re-plans, and training after it: ancient(PLAN)
        # would spare the retraining, but Snakemake 9.27 then drops a not-yet-trained train_node from the DAG)
        host_memory=cli_args(host_memory_mb=train_mem_mb()),
    shell:
        "python {params.script:q} --model {params.model:q} --config {params.config:q} {params.host_memory}"
        " --output {output.plan} --table {output.table} > {log} 2>&1"
