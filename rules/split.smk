rule split_dataset:
    input:
        data=DATA_FILES,
        tokenizer=SPLIT_TOKENIZER_INPUT,
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
        tokenizer=SPLIT_TOKENIZER,
    shell:
        "python {params.script:q} --config {params.config:q} {params.tokenizer}"
        " --splits {output.splits} --eval {output.eval} --rejects {output.rejects}"
        " --manifest {output.manifest} > {log} 2>&1"
