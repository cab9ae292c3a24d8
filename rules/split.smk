rule split_dataset:
    input:
        data=config["data"]["path"],
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
        format=config["data"]["format"],
        columns=json.dumps(config["data"]["columns"]),
        nodes=config["nodes"],
        eval_fraction=config["data"]["eval_fraction"],
        seed=config["data"]["seed"],
        max_reject=config["data"]["max_reject_fraction"],
    shell:
        "python {params.script} --data {input.data} --format {params.format}"
        " --columns {params.columns:q} --nodes {params.nodes}"
        " --eval-fraction {params.eval_fraction} --seed {params.seed}"
        " --max-reject-fraction {params.max_reject}"
        " --splits {output.splits} --eval {output.eval} --rejects {output.rejects}"
        " --manifest {output.manifest} > {log} 2>&1"
