rule split_dataset:
    input:
        data=data_inputs(),
        tokenizer=base_model_input(),
    output:
        splits=expand(f"{R}/data/splits/{{node}}.parquet", node=NODES),
        eval=f"{R}/data/eval.parquet",
        rejects=f"{R}/data/rejects.parquet",
        manifest=f"{R}/data/manifest.json",
    log:
        f"{LOGS}/split_dataset.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("split.py"),
        args=split_args,
    shell:
        "python {params.script} {params.args}"
        " --splits {output.splits} --eval {output.eval} --rejects {output.rejects}"
        " --manifest {output.manifest} > {log} 2>&1"
