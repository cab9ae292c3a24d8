rule split_dataset:
    input:
        data=DATA_FILES,
        tools=DATA_TOOLS,
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
        script=script_path("data/split.py"),
        config=SPLIT_CONFIG,
        tokenizer=SPLIT_TOKENIZER,
        # not an output (Snakemake deletes a failed job's): the rejects of a split that stops for them
        kept_rejects=f"{LOGS}/split_dataset.rejects.jsonl",
    shell:
        "python {params.script:q} --config {params.config:q} {params.tokenizer}"
        " --splits {output.splits} --eval {output.eval} --rejects {output.rejects}"
        " --manifest {output.manifest} --kept-rejects {params.kept_rejects:q} > {log} 2>&1"
