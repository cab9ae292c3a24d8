rule decontaminate:
    input:
        shards=expand(SPLIT, shard=NODES),
        eval=EVAL_SPLIT,
        task_files=EVAL_TASK_FILES,
    output:
        report=DECONTAMINATION,
        clean=expand(DECONTAMINATED, shard=NODES) if DROP_CONTAMINATED else [],
        rejects=CONTAMINATED if DROP_CONTAMINATED else [],
    log:
        f"{LOGS}/decontaminate.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("evals/decontaminate.py"),
        config=DECONTAMINATE_CONFIG,
        drop=lambda wildcards, output: (
            f"--clean {' '.join(map(shlex.quote, output.clean))} --rejects {shlex.quote(output.rejects)}"
            if DROP_CONTAMINATED
            else ""
        ),
    shell:
        "python {params.script:q} --config {params.config:q} --shards {input.shards}"
        " --eval {input.eval} --output {output.report} {params.drop} > {log} 2>&1"
