rule data_report:
    input:
        manifest=f"{R}/data/manifest.json",
        tokenized=expand(f"{R}/data/tokenized/{{shard}}.parquet", shard=[*NODES, "eval"]),
        stats=expand(f"{R}/data/tokenized/{{shard}}.json", shard=[*NODES, "eval"]),
    output:
        json=report(f"{R}/data/report.json", caption="../report/data.rst", category="Data"),
        plot=report(f"{R}/data/overview.png", caption="../report/data.rst", category="Data"),
    log:
        f"{LOGS}/data_report.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("data_report.py"),
    shell:
        "python {params.script} --manifest {input.manifest} --tokenized {input.tokenized}"
        " --json {output.json} --plot {output.plot} > {log} 2>&1"
