rule split_dataset:
    input:
        data=DATA_FILES,
        tokenizer=BASE_MODEL_INPUT,
    output:
        splits=expand(SPLIT, shard=NODES),
        eval=EVAL_SPLIT,
        rejects=REJECTS,
        manifest=MANIFEST,
    log:
        f"{LOGS}/split_dataset.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("split.py"),
        config=SPLIT_CONFIG,
        tokenizer=TOKENIZER,
    shell:
        "python {params.script:q} --config {params.config:q} --tokenizer {params.tokenizer:q}"
        " --splits {output.splits} --eval {output.eval} --rejects {output.rejects}"
        " --manifest {output.manifest} > {log} 2>&1"
