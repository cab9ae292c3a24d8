rule data_report:
    input:
        manifest=MANIFEST,
        tokenized=expand(TOKENIZED, shard=[*NODES, "eval"]),
        stats=expand(TOKEN_STATS, shard=[*NODES, "eval"]),
        decontamination=DECONTAMINATION,
    output:
        json=DATA_REPORT,  # the report shows DATA_PAGE
        plot=report(DATA_PLOT, caption="../report/data.rst", category="Data"),
    log:
        f"{LOGS}/data_report.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("data/data_report.py"),
    shell:
        "python {params.script:q} --manifest {input.manifest} --tokenized {input.tokenized}"
        " --decontamination {input.decontamination} --json {output.json} --plot {output.plot} > {log} 2>&1"
